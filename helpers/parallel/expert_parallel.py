"""Expert parallelism: dispatch and combine (chapter 08).

Expert parallelism splits the experts of a :class:`helpers.parallel.moe.MoELayer` over the ``ep`` ranks of a
group (rank and ``ep`` are the group's), which hold different tokens: each rank routes its own tokens, sends
every token to the rank of its expert by an all-to-all with uneven splits (the split sizes are exchanged
first, :func:`split_sizes`), computes its experts, and sends the results back by the reverse all-to-all
(:meth:`ExpertParallelMoE.compute_experts`), all through :mod:`helpers.parallel.comms`. :class:`_AllToAll` is
the autograd Function whose backward is the reverse all-to-all (GShard, Lepikhin et al. 2021). Each rank's
tokens are one GShard segment, so the single-process layer reproduces the ranks' routing with ``segments=ep``.

:func:`parallelize` swaps each block's MoE layer of a model for this rank's expert-parallel part, in place;
:func:`from_reference` does it on a copy, and :func:`finish_gradients` averages the non-expert gradients over
the ranks, as DDP does. For the checks: :func:`dispatch_arrivals` says which tokens a single-process routing
sends to a rank, in dispatch's order, and :func:`identify_rows` which token each row that arrived is;
:func:`expert_shards` and :func:`unshard_experts` go between the reference's state and the ranks'.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from helpers import layout_rules
from helpers.dist import device
from helpers.parallel import comms
from helpers.parallel.data_parallel import bucketed_average
from helpers.parallel.moe import MoEConfig, MoEGPT, MoELayer


def check_layout(cfg: MoEConfig, ep: int) -> None:
    """Raise a ValueError naming the broken constraint if ``cfg``'s experts cannot be split over ``ep``
    ranks."""
    layout_rules.expert_parallel(ep, cfg.n_experts)


# ---------------------------------------------------------------------------------------------------------
# The all-to-all
# ---------------------------------------------------------------------------------------------------------


class _AllToAll(torch.autograd.Function):
    """An all-to-all with uneven splits; its backward is the reverse all-to-all, the split sizes swapped
    (GShard, Lepikhin et al. 2021): each row's gradient goes back to the rank the row came from."""

    @staticmethod
    def forward(ctx, x, send, recv, group, label):
        ctx.send, ctx.recv, ctx.group, ctx.label = send, recv, group, label
        return comms.all_to_all(x, group, send_splits=send, recv_splits=recv, label=label)

    @staticmethod
    def backward(ctx, grad):
        return comms.all_to_all(grad, ctx.group, send_splits=ctx.recv, recv_splits=ctx.send,
                                label=ctx.label + " (backward)"), None, None, None, None


def split_sizes(counts: list[int], group=None):
    """Dispatch's split sizes (rows to each rank, rows from each) and ``from_ranks``, the rows arriving per
    (source rank, local expert): each rank tells every other how many rows go to each of its experts."""
    ep = dist.get_world_size(group)
    per_expert = torch.tensor(counts, device=device()).view(ep, -1)  # rows to (destination rank, its expert)
    from_ranks = comms.all_to_all(per_expert, group, label="moe_counts")
    return per_expert.sum(-1).tolist(), from_ranks.sum(-1).tolist(), from_ranks


def by_local_expert(from_ranks: torch.Tensor) -> torch.Tensor:
    """The order that regroups the rows that arrived (by source rank, then expert) by expert alone."""
    ep, n_local = from_ranks.shape
    local_expert = torch.arange(n_local, device=from_ranks.device).repeat(ep)
    local_expert = local_expert.repeat_interleave(from_ranks.reshape(-1))
    return torch.argsort(local_expert, stable=True)


# ---------------------------------------------------------------------------------------------------------
# The expert-parallel layer
# ---------------------------------------------------------------------------------------------------------


class ExpertParallelMoE(MoELayer):
    """This rank's part of a :class:`MoELayer` over the ``ep`` ranks of ``group``: the whole router, experts
    ``rank·E/ep … (rank+1)·E/ep`` (``rank`` in the group), and this rank's own tokens (one GShard segment)."""

    def __init__(self, cfg: MoEConfig, group=None, grouped: bool = True):
        ep = dist.get_world_size(group)
        check_layout(cfg, ep)
        super().__init__(cfg, segments=1, grouped=grouped, n_local=cfg.n_experts // ep)
        self.group = group

    def compute_experts(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows sorted by expert to their experts' ranks (dispatch), through the experts there, and back in
        the order they left (combine)."""
        send, recv, from_ranks = split_sizes(counts, self.group)
        arrived = _AllToAll.apply(rows, send, recv, self.group, "moe_dispatch")
        order = by_local_expert(from_ranks)
        out = super().compute_experts(arrived[order], from_ranks.sum(0).tolist())
        self.dispatched = dict(send=torch.tensor(send, device=rows.device), from_ranks=from_ranks,
                               arrived=arrived.detach())
        return _AllToAll.apply(out[torch.argsort(order)], recv, send, self.group, "moe_combine")

    def record(self, routings) -> None:
        # and for the checks: the split sizes given to dispatch, the counts received, the rows that arrived
        super().record(routings)
        self.stats.update(self.dispatched)

    def global_load(self) -> torch.Tensor:
        return comms.all_reduce(self.stats["chosen"].sum(0), self.group)  # integers: exact

    @classmethod
    def from_layer(cls, layer: MoELayer, group=None, grouped: bool | None = None):
        """This rank's copy of a single-process layer: its router and bias, and its slice of the experts."""
        grouped = layer.grouped if grouped is None else grouped
        part = cls(layer.cfg, group, grouped).to(layer.router.weight.dtype)
        rank, n = dist.get_rank(group), part.experts.up_proj.weight.shape[0]
        with torch.no_grad():
            part.router.weight.copy_(layer.router.weight)
            part.expert_bias.copy_(layer.expert_bias)
            for name in ("up_proj", "down_proj"):
                mine = getattr(layer.experts, name).weight[rank * n:(rank + 1) * n]
                getattr(part.experts, name).weight.copy_(mine)
        mine = dict(part.named_parameters())
        for name, p in layer.named_parameters():  # tensor parallelism's mark: the layer saw this rank's
            if getattr(p, "sequence_parallel", False):  # slice of the sequence, its gradients summed over tp
                mine[name].sequence_parallel = True
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


def parallelize(model: nn.Module, group=None, grouped: bool | None = None) -> nn.Module:
    """Make ``model`` (a GPT or a pipeline stage of one) expert-parallel over ``group`` in place: each block's
    :class:`MoELayer` becomes this rank's :class:`ExpertParallelMoE`. A dense model, or one already
    expert-parallel, is refused; a chunk of a MoE GPT without a MoE block is left as it is."""
    layers = [block for block in model.blocks if type(block.mlp) is MoELayer]
    if any(isinstance(block.mlp, ExpertParallelMoE) for block in model.blocks):
        raise ValueError("expert_parallel.parallelize: the model is expert-parallel already")
    if not layers and not isinstance(model, MoEGPT):  # a MoE GPT's pipeline chunk may hold dense blocks only
        raise ValueError("expert_parallel.parallelize needs blocks whose mlp is a single-process MoELayer "
                         "(not a dense MLP, and not expert-parallel already)")
    for block in layers:
        block.mlp = ExpertParallelMoE.from_layer(block.mlp, group, grouped)
    return model


def from_reference(reference: MoEGPT, group=None, grouped: bool | None = None) -> MoEGPT:
    """This rank's expert-parallel copy of ``reference`` (left as it is): everything replicated but the
    experts."""
    model = MoEGPT(reference.cfg, grouped=reference.moe_layers()[0].grouped).to(reference.ln_f.weight.dtype)
    model.load_state_dict(reference.state_dict())
    return parallelize(model, group, grouped)


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
