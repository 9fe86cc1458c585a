"""Expert parallelism: dispatch and combine (chapter 08).

Expert parallelism splits the experts of a :class:`helpers.parallel.moe.MoELayer` over ``ep`` ranks that hold
different tokens: each rank routes its own tokens, sends every token to the rank of its expert by an
all-to-all with uneven splits (the split sizes are exchanged first, :func:`exchange_counts`), computes its
experts, and sends the results back by the reverse all-to-all (:class:`ExpertParallelMoE`). :class:`_AllToAll`
is the autograd Function whose backward is the reverse all-to-all (GShard, Lepikhin et al. 2021). Each rank's
tokens are one GShard segment, so the single-process layer reproduces the ranks' routing with
``segments=ep``.

:func:`from_reference` builds one rank's expert-parallel copy of a :class:`helpers.parallel.moe.MoEGPT`, and
:func:`finish_gradients` averages the non-expert gradients over the ranks, as DDP does. For the checks:
:func:`dispatch_arrivals` says which tokens a single-process routing sends to a rank, in dispatch's order, and
:func:`identify_rows` which token each row that arrived is; :func:`expert_shards` and :func:`unshard_experts`
go between the reference's state and the ranks'.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from helpers import layout_rules
from helpers.parallel.data_parallel import bucketed_average
from helpers.parallel.ledger import LEDGER
from helpers.parallel.moe import MoEConfig, MoEGPT, MoELayer, sort_by_expert


def check_layout(cfg: MoEConfig, ep: int) -> None:
    """Raise a ValueError naming the broken constraint if ``cfg``'s experts cannot be split over ``ep``
    ranks."""
    layout_rules.expert_parallel(ep, cfg.n_experts)


# ---------------------------------------------------------------------------------------------------------
# The all-to-all
# ---------------------------------------------------------------------------------------------------------


def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group, label: str) -> torch.Tensor:
    """``send[j]`` rows of ``x`` to rank ``j``, ``recv[j]`` rows from rank ``j``, in rank order; booked."""
    x = x.contiguous()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    LEDGER.record_all_to_all(label, x, send, recv, group)
    dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """An all-to-all with uneven splits; its backward is the reverse all-to-all, the split sizes swapped
    (GShard, Lepikhin et al. 2021): each row's gradient goes back to the rank the row came from."""

    @staticmethod
    def forward(ctx, x, send, recv, group, label):
        ctx.send, ctx.recv, ctx.group, ctx.label = send, recv, group, label
        return _all_to_all(x, send, recv, group, label)

    @staticmethod
    def backward(ctx, grad):
        back = _all_to_all(grad, ctx.recv, ctx.send, ctx.group, ctx.label + " (backward)")
        return back, None, None, None, None


def all_to_all(x, send: list[int], recv: list[int], group=None, label: str = "all_to_all") -> torch.Tensor:
    return _AllToAll.apply(x, send, recv, group, label)


def exchange_counts(per_expert: torch.Tensor, group=None) -> torch.Tensor:
    """Send each rank how many rows it will get for each of its experts; return ``(ep, local experts)``: rows
    that will arrive from each rank for each local expert. The all-to-all of rows needs these split sizes
    first."""
    ep = dist.get_world_size(group)
    received = torch.empty_like(per_expert)
    LEDGER.record_all_to_all("moe_counts", per_expert.view(ep, -1), [1] * ep, [1] * ep, group)
    dist.all_to_all_single(received, per_expert, group=group)
    return received.view(ep, -1)


# ---------------------------------------------------------------------------------------------------------
# The expert-parallel layer
# ---------------------------------------------------------------------------------------------------------


class ExpertParallelMoE(MoELayer):
    """Rank ``rank``'s part of a :class:`MoELayer` over ``ep`` ranks: the whole router, experts
    ``rank·E/ep … (rank+1)·E/ep``, and this rank's own tokens (one GShard segment)."""

    def __init__(self, cfg: MoEConfig, rank: int, ep: int, group=None, grouped: bool = True):
        check_layout(cfg, ep)
        super().__init__(cfg, segments=1, grouped=grouped, n_local=cfg.n_experts // ep)
        self.rank, self.ep, self.group = rank, ep, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        routing = self.route(tokens)
        token, expert, gate = sort_by_expert(routing)
        per_expert = torch.bincount(expert, minlength=self.cfg.n_experts)
        from_ranks = exchange_counts(per_expert, self.group)  # (source rank, local expert)
        send = per_expert.view(self.ep, -1).sum(-1).tolist()
        recv = from_ranks.sum(-1).tolist()
        arrived = all_to_all(tokens[token], send, recv, self.group, "moe_dispatch")
        # arrived rows are ordered by source rank, then expert: regroup them by expert for the matmuls
        n_local = from_ranks.shape[1]
        local_expert = torch.arange(n_local).repeat(self.ep).repeat_interleave(from_ranks.reshape(-1))
        order = torch.argsort(local_expert, stable=True)
        rows = self.compute_experts(arrived[order], from_ranks.sum(0).tolist())
        back = all_to_all(rows[torch.argsort(order)], recv, send, self.group, "moe_combine")
        out = torch.zeros_like(tokens).index_add(0, token, back * gate.unsqueeze(-1).to(back.dtype))
        self.record([routing])
        # what the checks compare with the single process: the split sizes this rank gave dispatch, the
        # counts the count exchange delivered, and the rows dispatch's all_to_all_single delivered
        self.stats.update(send=torch.tensor(send), from_ranks=from_ranks, arrived=arrived.detach(),
                          received=from_ranks.sum(0))
        return out.view_as(x)

    def global_load(self) -> torch.Tensor:
        load = self.stats["chosen"].sum(0).clone()
        LEDGER.record("all_reduce", load, self.group)
        dist.all_reduce(load, group=self.group)  # integers: exact
        return load

    @classmethod
    def from_layer(cls, layer: MoELayer, rank: int, ep: int, group=None, grouped: bool | None = None):
        """This rank's copy of a single-process layer: its router and bias, and its slice of the experts."""
        part = cls(layer.cfg, rank, ep, group, layer.grouped if grouped is None else grouped)
        part = part.to(layer.router.weight.dtype)
        n = layer.cfg.n_experts // ep
        with torch.no_grad():
            part.router.weight.copy_(layer.router.weight)
            part.expert_bias.copy_(layer.expert_bias)
            for name in ("up_proj", "down_proj"):
                mine = getattr(layer.experts, name).weight[rank * n:(rank + 1) * n]
                getattr(part.experts, name).weight.copy_(mine)
        return part


# ---------------------------------------------------------------------------------------------------------
# What dispatch must deliver, worked out in one process
# ---------------------------------------------------------------------------------------------------------


def dispatch_arrivals(expert: torch.Tensor, kept: torch.Tensor, n_experts: int, rank: int) -> torch.Tensor:
    """The tokens whose rows a single-process routing sends to ``rank``'s experts, in the order dispatch
    delivers them: by source rank, then expert, then token.

    ``expert`` and ``kept`` are a :class:`MoELayer`'s ``stats`` of the same name, ``(ep, tokens, top_k)``,
    one segment per rank; a token is named by its place in the whole batch, ``segment · tokens + token``.
    """
    ep, tokens, _ = expert.shape
    n = n_experts // ep
    arrivals = []
    for source in range(ep):
        for e in range(rank * n, (rank + 1) * n):
            chose = ((expert[source] == e) & kept[source]).any(-1)
            arrivals.append(torch.nonzero(chose).flatten() + source * tokens)
    return torch.cat(arrivals)


def identify_rows(rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Which of ``tokens`` (a whole batch, one row each) each of ``rows`` is a copy of, bit for bit; -1 for a
    row that is a copy of none or of several. An all-to-all copies rows, so every row it delivered is
    found."""
    same = (rows.unsqueeze(1) == tokens.unsqueeze(0)).all(-1)
    found = same.int().argmax(-1)
    return torch.where(same.sum(-1) == 1, found, -1)


# ---------------------------------------------------------------------------------------------------------
# The whole model, expert-parallel
# ---------------------------------------------------------------------------------------------------------


def from_reference(reference: MoEGPT, rank: int, ep: int, group=None, grouped: bool | None = None) -> MoEGPT:
    """Rank ``rank``'s expert-parallel copy of ``reference``: everything replicated but the experts."""
    check_layout(reference.cfg, ep)
    model = MoEGPT(reference.cfg).to(reference.tok_emb.weight.dtype)
    model.load_state_dict(reference.state_dict())
    for block, ref_block in zip(model.blocks, reference.blocks):
        block.mlp = ExpertParallelMoE.from_layer(ref_block.mlp, rank, ep, group, grouped)
    return model


def is_expert(name: str) -> bool:
    return ".experts." in name


def finish_gradients(model: nn.Module, group=None) -> None:
    """After backward on every rank: the replicated (non-expert) gradients are averaged over the ranks in one
    all-reduce, as DDP does. An expert's gradient already sums every rank's tokens, brought by the backward
    all-to-all, so it is only divided by the number of ranks: each rank's loss is its own tokens' mean."""
    world_size = dist.get_world_size(group)
    dense = [p for name, p in model.named_parameters() if not is_expert(name)]
    bucketed_average([dense], group)
    for name, p in model.named_parameters():
        if is_expert(name):
            p.grad /= world_size


def expert_shards(params: dict, cfg: MoEConfig, rank: int, ep: int) -> dict:
    """This rank's part of a full (reference) state: the experts' slice, everything else whole."""
    n = cfg.n_experts // ep
    return {name: t[rank * n:(rank + 1) * n] if is_expert(name) else t for name, t in params.items()}


def unshard_experts(per_rank: list[dict]) -> dict:
    """Every rank's state put back under the reference's names: the experts' slices concatenated in rank
    order; the replicated tensors taken from rank 0."""
    return {name: torch.cat([s[name] for s in per_rank]) if is_expert(name) else t
            for name, t in per_rank[0].items()}
