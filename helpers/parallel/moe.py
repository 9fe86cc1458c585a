"""The mixture-of-experts layer (chapter 08).

A MoE layer replaces a transformer block's MLP with ``n_experts`` MLPs and a router that sends each token to
``top_k`` of them (Shazeer et al. 2017; GShard, Lepikhin et al. 2021; Switch, Fedus et al. 2022):

- :func:`route`: a softmax router, top-k choice, gates renormalised over the chosen experts (as Mixtral), and
  a capacity per expert beyond which token assignments are dropped (:func:`within_capacity`);
- the auxiliary losses: :func:`load_balancing_loss` (Switch's ``E·Σ f_i·P_i``, 1 at perfect balance) and
  :func:`router_z_loss` (ST-MoE); and DeepSeek-V3's auxiliary-loss-free balancing, a per-expert bias used
  only to choose experts, nudged after each step by :func:`update_expert_bias`;
- the experts: one weight tensor per projection with a leading expert dimension, computed on tokens sorted
  by expert, either by a loop over experts (:func:`experts_loop`) or one grouped matmul
  (:func:`experts_grouped`), the results weighted back into the tokens' places by :func:`combine`.

Capacity is GShard's: per expert and per *segment*, a slice of the batch routed on its own (GShard's "group").
:class:`MoELayer` routes the batch in ``segments`` equal, consecutive slices, so with ``segments=ep`` one
process drops exactly the tokens that ``ep`` ranks of expert parallelism drop, each routing its own tokens
(:mod:`helpers.parallel.expert_parallel`, the dispatch and combine). :class:`MoEGPT` is the book's GPT with
MoE layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from helpers.model import GPT, GPTConfig, init_weights


@dataclass(frozen=True)
class MoEConfig(GPTConfig):
    n_experts: int = 8
    top_k: int = 2
    capacity_factor: float | None = None  # None: no expert drops a token
    aux_loss_coef: float = 0.01  # Switch's alpha
    z_loss_coef: float = 0.001  # ST-MoE's router z-loss coefficient
    moe_every: int = 1  # a MoE layer in every moe_every-th block (GShard's every other layer: 2)

    def __post_init__(self):
        super().__post_init__()
        if not 1 <= self.moe_every <= self.n_layers:
            raise ValueError(f"moe_every={self.moe_every} must be in 1..n_layers={self.n_layers}")
        if self.n_experts < 1:
            raise ValueError(f"n_experts must be positive, got {self.n_experts}")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be in 1..n_experts={self.n_experts}")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be positive (or None for no limit), "
                             f"got {self.capacity_factor}")

    def is_moe(self, layer: int) -> bool:
        """Whether block ``layer`` holds a MoE layer: the last of every ``moe_every`` (all, by default;
        with 2, blocks 1, 3, 5, ... as GShard's every other layer)."""
        return layer % self.moe_every == self.moe_every - 1


# ---------------------------------------------------------------------------------------------------------
# Routing
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Routing:
    """Where each of a segment's tokens goes: ``(tokens, top_k)`` experts, gates and kept flags."""

    logits: torch.Tensor  # (tokens, n_experts)
    probs: torch.Tensor  # softmax of the logits
    expert: torch.Tensor  # the chosen experts, best first
    gate: torch.Tensor  # their weights in the output
    kept: torch.Tensor  # False where the expert was full: that assignment is dropped


def expert_capacity(tokens: int, cfg: MoEConfig) -> int | None:
    """GShard's capacity of one expert for a segment of ``tokens``: ``ceil(factor · tokens · k / E)``."""
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


def route(logits: torch.Tensor, top_k: int, capacity: int | None = None,
          bias: torch.Tensor | None = None) -> Routing:
    """Top-k softmax routing. ``bias`` (DeepSeek-V3) shifts the scores that choose the experts, never the
    gates."""
    probs = logits.to(torch.promote_types(logits.dtype, torch.float32)).softmax(dim=-1)
    choice = probs if bias is None else probs + bias
    expert = choice.topk(top_k, dim=-1).indices
    gate = probs.gather(-1, expert)
    gate = gate / gate.sum(dim=-1, keepdim=True)
    return Routing(logits, probs, expert, gate, within_capacity(expert, logits.shape[-1], capacity))


def load_balancing_loss(probs: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's auxiliary loss (Fedus et al. 2022, eq. 4), for top-k: ``E · Σ_i f_i · P_i``.

    ``f_i`` is the fraction of the segment's assignments that chose expert ``i`` (not differentiable), ``P_i``
    the mean router probability of ``i``. With both uniform, ``1/E`` each, the loss is exactly 1.
    """
    n_experts = probs.shape[-1]
    f = torch.bincount(expert.reshape(-1), minlength=n_experts).to(probs.dtype) / expert.numel()
    return n_experts * (f * probs.mean(dim=0)).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss (Zoph et al. 2022, eq. 5): the mean squared log-sum-exp of the router logits."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.logsumexp(logits, dim=-1).square().mean()


def sort_by_expert(routing: Routing) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kept assignments as ``(token, expert, gate)``, sorted by expert (tokens in order within one)."""
    tokens, k = routing.expert.shape
    token = torch.arange(tokens, device=routing.expert.device).unsqueeze(1).expand(tokens, k)[routing.kept]
    expert, gate = routing.expert[routing.kept], routing.gate[routing.kept]
    order = torch.argsort(expert, stable=True)
    return token[order], expert[order], gate[order]


def combine(rows: torch.Tensor, token: torch.Tensor, gate: torch.Tensor, tokens: torch.Tensor):
    """Each token's output: its kept assignments' rows weighted by their gates, summed in its place."""
    return torch.zeros_like(tokens).index_add(0, token, rows * gate.unsqueeze(-1).to(rows.dtype))


# ---------------------------------------------------------------------------------------------------------
# The experts
# ---------------------------------------------------------------------------------------------------------


class GroupedLinear(nn.Module):
    """``n`` linear layers without bias in one ``(n, out, in)`` weight, each laid out as ``nn.Linear``'s."""

    def __init__(self, n: int, in_features: int, out_features: int, device=None):
        super().__init__()
        # device=None is nn.Linear's default (the CPU): the model is moved to the run's device whole
        self.weight = nn.Parameter(torch.empty(n, out_features, in_features, device=device))


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
    """The same in two grouped matmuls: ``torch._grouped_mm`` multiplies each slice of rows ending at
    ``offs[e]`` by expert ``e``'s matrix. On CPU it takes float32, bfloat16 and float16, not float64."""
    if rows.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"torch._grouped_mm takes float32, bfloat16 or float16 rows, not {rows.dtype}: "
                         f"use the loop over experts (grouped=False)")
    offs = torch.tensor(counts, device=rows.device).cumsum(0).to(torch.int32)
    hidden = F.gelu(torch._grouped_mm(rows, experts.up_proj.weight.transpose(1, 2), offs=offs))
    return torch._grouped_mm(hidden, experts.down_proj.weight.transpose(1, 2), offs=offs)


# ---------------------------------------------------------------------------------------------------------
# The MoE layer, in one process
# ---------------------------------------------------------------------------------------------------------


class MoELayer(nn.Module):
    """A MoE feed-forward layer over all ``n_experts`` experts, in one process.

    The tokens are routed in ``segments`` equal, consecutive segments (GShard's groups: with expert
    parallelism, one per rank), each with its own expert capacity and auxiliary losses; the layer's losses
    are the means over the segments. A segment is routed, sorted by expert, computed (:meth:`compute_experts`,
    which expert parallelism overrides) and combined. After a forward, ``aux_loss``, ``z_loss`` and ``stats``
    hold what the step needs.
    """

    def __init__(self, cfg: MoEConfig, segments: int = 1, grouped: bool = True, n_local: int | None = None):
        super().__init__()
        self.cfg, self.segments, self.grouped = cfg, segments, grouped
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = Experts(cfg.n_experts if n_local is None else n_local, cfg.d_model, cfg.d_ff)
        # used to choose experts only
        self.register_buffer("expert_bias", torch.zeros(cfg.n_experts, device=self.router.weight.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        if tokens.shape[0] % self.segments:
            raise ValueError(f"segments={self.segments} must divide the {tokens.shape[0]} tokens "
                             f"of the batch")
        outs, routings = zip(*(self.segment_forward(segment) for segment in tokens.chunk(self.segments)))
        self.record(routings)
        return torch.cat(outs).view_as(x)

    def segment_forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, Routing]:
        """One segment's tokens: route them, sort the kept assignments by expert, compute, combine."""
        routing = self.route(tokens)
        token, expert, gate = sort_by_expert(routing)
        counts = torch.bincount(expert, minlength=self.cfg.n_experts).tolist()
        rows = self.compute_experts(tokens[token], counts)
        return combine(rows, token, gate, tokens), routing

    def route(self, tokens: torch.Tensor) -> Routing:
        bias = self.expert_bias.to(torch.promote_types(tokens.dtype, torch.float32))
        return route(self.router(tokens), self.cfg.top_k, expert_capacity(tokens.shape[0], self.cfg), bias)

    def compute_experts(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows sorted by expert, ``counts[e]`` of them for expert ``e``, each through its expert."""
        return (experts_grouped if self.grouped else experts_loop)(rows, counts, self.experts)

    def record(self, routings) -> None:
        """Each segment's auxiliary losses (the layer's are their means) and counts, kept for checks and
        balancing."""
        self.aux_per_segment = torch.stack([load_balancing_loss(r.probs, r.expert) for r in routings])
        self.z_per_segment = torch.stack([router_z_loss(r.logits) for r in routings])
        self.aux_loss, self.z_loss = self.aux_per_segment.mean(), self.z_per_segment.mean()
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
# The book's GPT with MoE layers
# ---------------------------------------------------------------------------------------------------------


class MoEGPT(GPT):
    """:class:`helpers.model.GPT` with a :class:`MoELayer` in place of the MLP of every block
    ``cfg.is_moe`` names (every block by default; with ``moe_every=2`` every other one).

    ``forward`` is :meth:`GPT.forward`; its loss is the language model's (``lm_loss``) plus ``aux_loss_coef``
    and ``z_loss_coef`` times the layers' load-balancing and z-losses (a stage without a head: activations).
    """

    def __init__(self, cfg: MoEConfig, seed: int = 0, segments: int = 1, grouped: bool = True):
        super().__init__(cfg, seed)
        for i, block in enumerate(self.blocks):
            if cfg.is_moe(i):
                block.mlp = MoELayer(cfg, segments, grouped)
        init_weights(self, seed)  # again, over the MoE layers: experts' down_proj scaled as GPT-2's

    def moe_layers(self) -> list[MoELayer]:
        """The MoE layers this model (or pipeline chunk of one) holds, in order."""
        return [block.mlp for block in self.blocks if isinstance(block.mlp, MoELayer)]

    def forward(self, idx, targets=None, positions=None, loss_fn=None):
        out = super().forward(idx, targets, positions, loss_fn)
        if targets is None or self.lm_head is None:
            return out
        logits, self.lm_loss = out
        aux = sum(layer.aux_loss for layer in self.moe_layers())
        z = sum(layer.z_loss for layer in self.moe_layers())
        return logits, self.lm_loss + self.cfg.aux_loss_coef * aux + self.cfg.z_loss_coef * z


@torch.no_grad()
def update_expert_bias(model: MoEGPT, rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing (Liu et al. 2024, section 2.1.2): after each step, every
    expert's bias moves by ``rate`` towards balance, ``b_i += rate · sign(mean load - load_i)``."""
    for layer in model.moe_layers():
        load = layer.global_load().to(layer.expert_bias.dtype)
        layer.expert_bias += rate * torch.sign(load.mean() - load)
