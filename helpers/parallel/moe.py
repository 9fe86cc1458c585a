"""Mixture of experts and expert parallelism from scratch (chapter 08).

A MoE layer replaces a transformer block's MLP with ``n_experts`` MLPs and a router that sends each token to
``top_k`` of them (Shazeer et al. 2017; GShard, Lepikhin et al. 2021; Switch, Fedus et al. 2022):

- :func:`route`: a softmax router, top-k choice, gates renormalised over the chosen experts (as Mixtral), and
  a capacity per expert beyond which token assignments are dropped (:func:`within_capacity`);
- the auxiliary losses: :func:`load_balancing_loss` (Switch's ``E·Σ f_i·P_i``, 1 at perfect balance) and
  :func:`router_z_loss` (ST-MoE); and DeepSeek-V3's auxiliary-loss-free balancing, a per-expert bias used only
  to choose experts, nudged after each step by :func:`update_expert_bias`;
- the experts: one weight tensor per projection with a leading expert dimension, computed on tokens sorted by
  expert, either by a loop over experts (:func:`experts_loop`) or one grouped matmul (:func:`experts_grouped`).

Expert parallelism splits the experts over ``ep`` ranks that hold different tokens: each rank routes its own
tokens, sends every token to the rank of its expert by an all-to-all with uneven splits (the split sizes are
exchanged first), computes its experts, and sends the results back by the reverse all-to-all
(:class:`ExpertParallelMoE`); :class:`_AllToAll` is the autograd Function whose backward is the reverse
all-to-all. Capacity is GShard's: per expert and per *group*, a group being one rank's tokens, so the
single-process :class:`MoELayer` reproduces it with ``groups=ep``. :class:`MoEGPT` is the book's GPT with MoE
layers; :func:`from_reference` builds one rank's expert-parallel copy of it, and :func:`finish_gradients`
averages the non-expert gradients over the ranks, as DDP does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from helpers import layout_rules
from helpers.parallel.data_parallel import bucketed_average
from helpers.parallel.ledger import LEDGER
from helpers.model import GPT, GPTConfig, init_weights


@dataclass(frozen=True)
class MoEConfig(GPTConfig):
    n_experts: int = 8
    top_k: int = 2
    capacity_factor: float | None = None  # None: no expert drops a token
    aux_loss_coef: float = 0.01  # Switch's alpha
    z_loss_coef: float = 0.001  # ST-MoE's router z-loss coefficient

    def __post_init__(self):
        super().__post_init__()
        if self.n_experts < 1:
            raise ValueError(f"n_experts must be positive, got {self.n_experts}")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be in 1..n_experts={self.n_experts}")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be positive (or None for no limit), got {self.capacity_factor}")


def check_layout(cfg: MoEConfig, ep: int) -> None:
    """Raise a ValueError naming the broken constraint if ``cfg``'s experts cannot be split over ``ep`` ranks."""
    layout_rules.expert_parallel(ep, cfg.n_experts)


# ---------------------------------------------------------------------------------------------------------
# Routing
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Routing:
    """Where each of a group's tokens goes: ``(tokens, top_k)`` experts, gates and kept flags."""

    logits: torch.Tensor  # (tokens, n_experts)
    probs: torch.Tensor  # softmax of the logits
    expert: torch.Tensor  # the chosen experts, best first
    gate: torch.Tensor  # their weights in the output
    kept: torch.Tensor  # False where the expert was full: that assignment is dropped


def expert_capacity(tokens: int, cfg: MoEConfig) -> int | None:
    """GShard's capacity of one expert for a group of ``tokens``: ``ceil(factor · tokens · k / E)``."""
    if cfg.capacity_factor is None:
        return None
    return math.ceil(cfg.capacity_factor * tokens * cfg.top_k / cfg.n_experts)


def within_capacity(expert: torch.Tensor, n_experts: int, capacity: int | None) -> torch.Tensor:
    """Which assignments fit: each expert takes the first ``capacity`` in line, every token's first choice
    queued before any second choice (GShard, Lepikhin et al. 2021, algorithm 1), tokens in order."""
    if capacity is None:
        return torch.ones_like(expert, dtype=torch.bool)
    tokens, k = expert.shape
    queue = F.one_hot(expert.t().reshape(-1), n_experts)  # slot 0 of every token, then slot 1, ...
    place = (queue.cumsum(0) * queue).sum(-1) - 1  # the assignment's place in its expert's queue
    return (place < capacity).view(k, tokens).t()


def route(logits: torch.Tensor, top_k: int, capacity: int | None = None, bias: torch.Tensor | None = None) -> Routing:
    """Top-k softmax routing. ``bias`` (DeepSeek-V3) shifts the scores that choose the experts, never the gates."""
    probs = logits.to(torch.promote_types(logits.dtype, torch.float32)).softmax(dim=-1)
    choice = probs if bias is None else probs + bias
    expert = choice.topk(top_k, dim=-1).indices
    gate = probs.gather(-1, expert)
    gate = gate / gate.sum(dim=-1, keepdim=True)
    return Routing(logits, probs, expert, gate, within_capacity(expert, logits.shape[-1], capacity))


def load_balancing_loss(probs: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's auxiliary loss (Fedus et al. 2022, eq. 4), for top-k: ``E · Σ_i f_i · P_i``.

    ``f_i`` is the fraction of the group's assignments that chose expert ``i`` (not differentiable), ``P_i`` the
    mean router probability of ``i``. With both uniform, ``1/E`` each, the loss is exactly 1.
    """
    n_experts = probs.shape[-1]
    f = torch.bincount(expert.reshape(-1), minlength=n_experts).to(probs.dtype) / expert.numel()
    return n_experts * (f * probs.mean(dim=0)).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss (Zoph et al. 2022, eq. 5): the mean squared log-sum-exp of the router logits."""
    return torch.logsumexp(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1).square().mean()


def sort_by_expert(routing: Routing) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kept assignments as ``(token, expert, gate)``, sorted by expert (tokens in order within one)."""
    tokens, k = routing.expert.shape
    token = torch.arange(tokens).unsqueeze(1).expand(tokens, k)[routing.kept]
    expert, gate = routing.expert[routing.kept], routing.gate[routing.kept]
    order = torch.argsort(expert, stable=True)
    return token[order], expert[order], gate[order]


# ---------------------------------------------------------------------------------------------------------
# The experts
# ---------------------------------------------------------------------------------------------------------


class GroupedLinear(nn.Module):
    """``n`` linear layers without bias in one ``(n, out, in)`` weight, each stored as ``nn.Linear`` stores it."""

    def __init__(self, n: int, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n, out_features, in_features))
        self.weight.expert_parallel = True  # its gradient is not all-reduced over the ranks (finish_gradients)


class Experts(nn.Module):
    """``n`` GELU MLPs ``down(gelu(up(x)))``, the book's MLP once per expert."""

    def __init__(self, n: int, d_model: int, d_ff: int):
        super().__init__()
        self.up_proj = GroupedLinear(n, d_model, d_ff)
        self.down_proj = GroupedLinear(n, d_ff, d_model)


def experts_loop(rows: torch.Tensor, counts: list[int], experts: Experts) -> torch.Tensor:
    """Rows sorted by expert, ``counts[e]`` of them for expert ``e``: one pair of matmuls per expert."""
    out = [F.linear(F.gelu(F.linear(x, up)), down)
           for x, up, down in zip(rows.split(counts), experts.up_proj.weight, experts.down_proj.weight)]
    return torch.cat(out)


def experts_grouped(rows: torch.Tensor, counts: list[int], experts: Experts) -> torch.Tensor:
    """The same in two grouped matmuls: ``torch._grouped_mm`` multiplies each slice of rows ending at ``offs[e]``
    by expert ``e``'s matrix. On CPU it takes float32, bfloat16 and float16, not float64."""
    if rows.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"torch._grouped_mm takes float32, bfloat16 or float16 rows, not {rows.dtype}: "
                         f"use the loop over experts (grouped=False)")
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    hidden = F.gelu(torch._grouped_mm(rows, experts.up_proj.weight.transpose(1, 2), offs=offs))
    return torch._grouped_mm(hidden, experts.down_proj.weight.transpose(1, 2), offs=offs)


# ---------------------------------------------------------------------------------------------------------
# The MoE layer, in one process
# ---------------------------------------------------------------------------------------------------------


class MoELayer(nn.Module):
    """A MoE feed-forward layer over all ``n_experts`` experts, in one process.

    The tokens are routed in ``groups`` equal, consecutive groups (GShard's groups: with expert parallelism,
    one per rank), each with its own expert capacity and auxiliary losses; the layer's losses are the means
    over the groups. After a forward, ``aux_loss``, ``z_loss`` and ``stats`` hold what the step needs.
    """

    def __init__(self, cfg: MoEConfig, groups: int = 1, grouped: bool = True, n_local: int | None = None):
        super().__init__()
        self.cfg, self.groups, self.grouped = cfg, groups, grouped
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = Experts(cfg.n_experts if n_local is None else n_local, cfg.d_model, cfg.d_ff)
        self.register_buffer("expert_bias", torch.zeros(cfg.n_experts))  # used to choose experts only

    def route(self, tokens: torch.Tensor) -> Routing:
        bias = self.expert_bias.to(torch.promote_types(tokens.dtype, torch.float32))
        return route(self.router(tokens), self.cfg.top_k, expert_capacity(tokens.shape[0], self.cfg), bias)

    def compute_experts(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return (experts_grouped if self.grouped else experts_loop)(rows, counts, self.experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        if tokens.shape[0] % self.groups:
            raise ValueError(f"groups={self.groups} must divide the {tokens.shape[0]} tokens of the batch")
        outs, routings = [], []
        for group in tokens.chunk(self.groups):
            routing = self.route(group)
            token, expert, gate = sort_by_expert(routing)
            counts = torch.bincount(expert, minlength=self.cfg.n_experts).tolist()
            rows = self.compute_experts(group[token], counts)
            outs.append(torch.zeros_like(group).index_add(0, token, rows * gate.unsqueeze(-1).to(rows.dtype)))
            routings.append(routing)
        self.record(routings)
        return torch.cat(outs).view_as(x)

    def record(self, routings: list[Routing]) -> None:
        """Each group's auxiliary losses (the layer's are their means) and counts, kept for checks and balancing."""
        self.aux_per_group = torch.stack([load_balancing_loss(r.probs, r.expert) for r in routings])
        self.z_per_group = torch.stack([router_z_loss(r.logits) for r in routings])
        self.aux_loss, self.z_loss = self.aux_per_group.mean(), self.z_per_group.mean()
        E = self.cfg.n_experts
        self.stats = {
            "chosen": torch.stack([torch.bincount(r.expert.reshape(-1), minlength=E) for r in routings]),
            "kept": torch.stack([torch.bincount(r.expert[r.kept], minlength=E) for r in routings]),
            "expert": torch.stack([r.expert for r in routings]),
            "kept_mask": torch.stack([r.kept for r in routings]),
        }
        self.stats["dropped"] = self.stats["chosen"].sum(-1) - self.stats["kept"].sum(-1)

    def global_load(self) -> torch.Tensor:
        """Assignments each expert was chosen for in the last forward, over the whole batch."""
        return self.stats["chosen"].sum(0)


# ---------------------------------------------------------------------------------------------------------
# Expert parallelism: the all-to-all and the layer
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
        return _all_to_all(grad, ctx.recv, ctx.send, ctx.group, ctx.label + " (backward)"), None, None, None, None


def all_to_all(x, send: list[int], recv: list[int], group=None, label: str = "all_to_all") -> torch.Tensor:
    return _AllToAll.apply(x, send, recv, group, label)


def exchange_counts(per_expert: torch.Tensor, group=None) -> torch.Tensor:
    """Send each rank how many rows it will get for each of its experts; return ``(ep, local experts)``: rows
    that will arrive from each rank for each local expert. The all-to-all of rows needs these split sizes first."""
    ep = dist.get_world_size(group)
    received = torch.empty_like(per_expert)
    LEDGER.record_all_to_all("moe_counts", per_expert.view(ep, -1), [1] * ep, [1] * ep, group)
    dist.all_to_all_single(received, per_expert, group=group)
    return received.view(ep, -1)


class ExpertParallelMoE(MoELayer):
    """Rank ``rank``'s part of a :class:`MoELayer` over ``ep`` ranks: the whole router, experts
    ``rank·E/ep … (rank+1)·E/ep``, and this rank's own tokens (one GShard group)."""

    def __init__(self, cfg: MoEConfig, rank: int, ep: int, group=None, grouped: bool = True):
        check_layout(cfg, ep)
        super().__init__(cfg, groups=1, grouped=grouped, n_local=cfg.n_experts // ep)
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
        local_expert = torch.arange(from_ranks.shape[1]).repeat(self.ep).repeat_interleave(from_ranks.reshape(-1))
        order = torch.argsort(local_expert, stable=True)
        rows = self.compute_experts(arrived[order], from_ranks.sum(0).tolist())
        back = all_to_all(rows[torch.argsort(order)], recv, send, self.group, "moe_combine")
        out = torch.zeros_like(tokens).index_add(0, token, back * gate.unsqueeze(-1).to(back.dtype))
        self.record([routing])
        # what the checks compare with the single process: the split sizes this rank gave dispatch, the counts
        # the count exchange delivered, and the rows dispatch's all_to_all_single delivered
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
                getattr(part.experts, name).weight.copy_(getattr(layer.experts, name).weight[rank * n:(rank + 1) * n])
        return part


def dispatch_arrivals(expert: torch.Tensor, kept: torch.Tensor, n_experts: int, rank: int) -> torch.Tensor:
    """The tokens whose rows a single-process routing sends to ``rank``'s experts, in the order dispatch
    delivers them: by source rank, then expert, then token.

    ``expert`` and ``kept`` are a :class:`MoELayer`'s ``stats`` of the same name, ``(ep, tokens, top_k)``, one
    routing group per rank; a token is named by its place in the whole batch, ``group · tokens + token``.
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
    row that is a copy of none or of several. An all-to-all copies rows, so every row it delivered is found."""
    same = (rows.unsqueeze(1) == tokens.unsqueeze(0)).all(-1)
    found = same.int().argmax(-1)
    return torch.where(same.sum(-1) == 1, found, -1)


# ---------------------------------------------------------------------------------------------------------
# The book's GPT with MoE layers
# ---------------------------------------------------------------------------------------------------------


class MoEGPT(GPT):
    """:class:`helpers.model.GPT` with a :class:`MoELayer` in place of every block's MLP.

    ``forward(idx, targets)`` returns the logits and the training loss: the cross-entropy (kept as ``lm_loss``)
    plus ``aux_loss_coef`` times the load-balancing losses and ``z_loss_coef`` times the z-losses of all layers.
    """

    def __init__(self, cfg: MoEConfig, seed: int = 0, groups: int = 1, grouped: bool = True):
        super().__init__(cfg, seed)
        for block in self.blocks:
            block.mlp = MoELayer(cfg, groups, grouped)
        init_weights(self, seed)  # again, over the MoE layers' parameters: experts' down_proj scaled as GPT-2's

    def moe_layers(self) -> list[MoELayer]:
        return [block.mlp for block in self.blocks]

    def forward(self, idx, targets=None):
        out = super().forward(idx, targets)
        if targets is None:
            return out
        logits, self.lm_loss = out
        aux = sum(layer.aux_loss for layer in self.moe_layers())
        z = sum(layer.z_loss for layer in self.moe_layers())
        return logits, self.lm_loss + self.cfg.aux_loss_coef * aux + self.cfg.z_loss_coef * z


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


@torch.no_grad()
def update_expert_bias(model: MoEGPT, rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing (Liu et al. 2024, section 2.1.2): after each step, every
    expert's bias moves by ``rate`` towards balance, ``b_i += rate · sign(mean load - load_i)``."""
    for layer in model.moe_layers():
        load = layer.global_load().to(layer.expert_bias.dtype)
        layer.expert_bias += rate * torch.sign(load.mean() - load)


def expert_shards(params: dict, cfg: MoEConfig, rank: int, ep: int) -> dict:
    """This rank's part of a full (reference) state: the experts' slice, everything else whole."""
    n = cfg.n_experts // ep
    return {name: t[rank * n:(rank + 1) * n] if is_expert(name) else t for name, t in params.items()}


def unshard_experts(per_rank: list[dict]) -> dict:
    """Every rank's state put back under the reference's names: the experts' slices concatenated in rank
    order; the replicated tensors taken from rank 0."""
    return {name: torch.cat([s[name] for s in per_rank]) if is_expert(name) else t
            for name, t in per_rank[0].items()}
