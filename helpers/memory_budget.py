"""The memory budget of one rank: parameters, gradients, optimizer states, activations, in bytes (chapter 01).

The second of the three parts of chapter 01's calculator. Give :func:`budget` a model shape and a batch
(:mod:`helpers.model_size`), a parallel layout, a precision recipe and an activation model; it returns what
one rank of the busiest pipeline stage holds, the FLOPs of a step, and the bytes each kind of parallelism
sends (from the traffic formulas of :mod:`helpers.time_model`, which also gives the time of the step).


Sources of the formulas, each cited where it is used:
- memory of mixed-precision Adam and the ZeRO stages: Rajbhandari et al. 2020 (ZeRO), sections 3 and 5;
- activations per layer, with tensor and sequence parallelism and recomputation: Korthikanti et al. 2022.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from helpers import layout_rules, time_model
from helpers.model_size import (Batch, ModelShape, _attention_params, _mlp_params, _norm_params,
                                kv_heads_per_rank, step_flops, whole_number)
from helpers.parallel.pipeline_schedules import micro_batches_in_flight, stage_layers


@dataclass(frozen=True)
class Layout:
    """How the world is split. ``zero`` is the ZeRO stage over the data-parallel (× context-parallel)
    ranks."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    vpp: int = 1                 # virtual pipeline stages per rank (interleaved 1F1B)
    zero: int = 0
    sp: bool = False             # sequence parallelism (needs tp > 1)
    schedule: str = "1f1b"       # "1f1b" or "gpipe"; vpp > 1 means interleaved 1F1B

    def __post_init__(self):
        for f in ("dp", "tp", "pp", "cp", "ep", "vpp"):
            whole_number(f"Layout: {f}", getattr(self, f), least=1)
        layout_rules.zero_stage(self.zero)
        layout_rules.sequence_parallel(self.sp, self.tp)
        layout_rules.virtual_stages(self.vpp, self.pp)
        if self.schedule not in ("1f1b", "gpipe"):
            raise ValueError(f"schedule must be '1f1b' or 'gpipe', got {self.schedule!r}")
        layout_rules.experts_folded(self.ep, self.dp, self.cp)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each copy a rank keeps, and per activation element."""

    name: str
    param_bytes: int    # the copy forward and backward read
    grad_bytes: int     # the gradient accumulated over micro-batches
    master_bytes: int   # an fp32 master copy kept by the optimizer (0: the params are the master)
    optim_bytes: int    # Adam's two moments
    act_bytes: int      # one stored activation element
    fp8: bool = False   # matmuls in FP8 (inputs of linear layers stored in one byte)
    gather_bytes: int | None = None  # per parameter in ZeRO-3's all-gathers (None: param_bytes)

    def __post_init__(self):
        if self.gather_bytes is None:  # the gathers carry the copy forward and backward read
            object.__setattr__(self, "gather_bytes", self.param_bytes)
        for f in ("param_bytes", "grad_bytes", "act_bytes", "gather_bytes"):
            whole_number(f"Precision {self.name!r}: {f}", getattr(self, f), least=1)
        for f in ("master_bytes", "optim_bytes"):
            whole_number(f"Precision {self.name!r}: {f}", getattr(self, f), least=0)

    @property
    def k(self) -> int:
        """ZeRO's K: optimizer-state bytes per parameter (master copy + moments)."""
        return self.master_bytes + self.optim_bytes


FP32 = Precision("fp32", 4, 4, 0, 8, 4)
BF16 = Precision("bf16, fp32 master weights", 2, 2, 4, 8, 2)
BF16_FP32_GRADS = Precision("bf16, fp32 master weights and fp32 gradient accumulation", 2, 4, 4, 8, 2)
FP8 = Precision("fp8 compute, bf16 weights, fp32 master weights", 2, 2, 4, 8, 2, fp8=True)
# torchao's float8 FSDP: ZeRO-3 casts each bf16 shard to fp8 and all-gathers one byte per parameter (the
# per-tensor scales, agreed by an all-reduce of the amax, are a few bytes a tensor: left out)
FP8_GATHER = Precision("fp8 compute and fp8 parameter all-gathers, bf16 weights, fp32 master weights",
                       2, 2, 4, 8, 2, fp8=True, gather_bytes=1)


@dataclass(frozen=True)
class ActivationModel:
    """What a transformer layer saves for backward, following the accounting of Korthikanti et al. 2022.

    ``norm_stat_bytes`` is what a norm saves per token besides its input (LayerNorm's mean and 1/std in fp32:
    8; RMSNorm's 1/rms: 4; the paper ignores them: 0). ``attention`` is "materialized" (the softmax
    probabilities, a*s*s per sequence, are stored) or "flash" (only a log-sum-exp per query row, in fp32).
    ``kv_expanded``: the grouped K/V heads are repeated to all query heads before attention, and the repeated
    copies are what is saved. ``norm_keeps_normalized``: each norm also keeps its normalized input
    ``x / rms(x)`` (which its weight's gradient reads) as a tensor of its own, as PyTorch's unfused RMSNorm
    does; a fused norm recomputes it from the input and the statistics. ``recompute`` is "none", "selective"
    (the attention core, from its inputs Q, K and V, is recomputed: neither the probabilities nor a
    log-sum-exp are kept) or "full" (only each layer's input is kept).
    """

    dropout: bool = False
    attention: str = "flash"
    kv_expanded: bool = False
    norm_stat_bytes: int = 4
    recompute: str = "none"
    norm_keeps_normalized: bool = False

    def __post_init__(self):
        if self.attention not in ("flash", "materialized"):
            raise ValueError(f"attention must be 'flash' or 'materialized', got {self.attention!r}")
        if self.recompute not in ("none", "selective", "full"):
            raise ValueError(f"recompute must be 'none', 'selective' or 'full', got {self.recompute!r}")
        whole_number("ActivationModel: norm_stat_bytes", self.norm_stat_bytes, least=0)


KORTHIKANTI = ActivationModel(dropout=True, attention="materialized", kv_expanded=False, norm_stat_bytes=0)


# --------------------------------------------------------------------------------------------- validation

def validate(model: ModelShape, batch: Batch, layout: Layout, world_size: int | None = None) -> None:
    """Raise ValueError naming the broken constraint, if the layout cannot run this model and batch."""
    L = layout
    if world_size is not None:
        layout_rules.mesh(world_size, L.dp, L.tp, L.pp, L.cp)
    layout_rules.pipeline_parallel(L.pp * L.vpp, model.n_layers, of=model.name, pp=L.pp, vpp=L.vpp)
    layout_rules.context_parallel(L.cp, batch.seq_len)
    layout_rules.tensor_parallel(L.tp, model.n_heads, model.n_kv_heads, model.d_ff, model.vocab_size,
                                 seq_len=batch.seq_len // L.cp if L.sp else None, of=model.name)
    if L.ep > 1 and not model.n_experts:
        raise ValueError(f"ep={L.ep} > 1 but {model.name} has no experts")
    if model.n_experts:
        layout_rules.expert_parallel(L.ep, model.n_experts, of=model.name)
    if batch.global_batch % (L.dp * batch.micro_batch):
        raise ValueError(f"the global batch ({batch.global_batch}) must be a multiple of "
                         f"dp*micro_batch = {L.dp}*{batch.micro_batch}")
    m = batch.global_batch // (L.dp * batch.micro_batch)
    if L.vpp > 1 and m % L.pp:
        raise ValueError(f"interleaved 1F1B needs the micro-batches per step ({m}) to be a multiple of "
                         f"pp={L.pp}")


# --------------------------------------------------------------------------------------------- activations

def layer_activation_bytes(model: ModelShape, seq_len: int, micro_batch: int, act: ActivationModel,
                           precision: Precision = BF16, tp: int = 1, sp: bool = False, cp: int = 1,
                           moe: bool = False) -> int:
    """Bytes one transformer layer saves for backward, on one rank, for one micro-batch.

    The itemisation follows Korthikanti et al. 2022, section 4.1: each tensor a layer keeps is listed with
    the factor that divides it under tensor parallelism (``tp``), sequence parallelism (``sp``: the tensors
    outside the tensor-parallel region are split too) and context parallelism (``cp``: each rank keeps its
    ``seq_len / cp`` queries, and attends to all ``seq_len`` keys).
    """
    s, b, h, e = seq_len // cp, micro_batch, model.d_model, precision.act_bytes
    sbh = s * b * h
    outside_divisor = tp if sp else 1
    if act.recompute == "full":
        return sbh * e // outside_divisor  # only the layer's input
    lin = 1 if precision.fp8 else e  # a saved input of a linear layer (FP8 recipes keep it in one byte)
    # K and V on one rank: repeated to its n_heads/tp query heads, or its own KV heads (one, replicated, when
    # tp exceeds n_kv_heads): not divided by tp below
    kv = h // tp if act.kv_expanded else kv_heads_per_rank(model.n_kv_heads, tp) * model.head_dim
    f = model.d_ff * (model.top_k if moe else 1)  # the MLP width one token passes through
    # Outside the tensor-parallel region: the two norms' inputs and statistics, the inputs of the two
    # column-parallel layers (QKV and the MLP's first), and the two dropout masks (one byte each).
    outside = 2 * sbh * e + 2 * s * b * act.norm_stat_bytes + 2 * sbh * lin + (2 * sbh if act.dropout else 0)
    if act.norm_keeps_normalized:
        outside += 2 * sbh * e
    # Inside it, split over tp: Q, K and V, the input of the output projection, the MLP's hidden activations
    # (GELU's input and output; or SwiGLU's gate, silu(gate), up and their product: silu saves its input, the
    # product saves both factors, the down projection its input).
    inside = sbh * e + sbh * lin
    inside += s * b * f * (3 * e + lin) if model.gated else s * b * f * (e + lin)
    if act.attention == "materialized":
        if act.recompute != "selective":  # selective recomputation redoes softmax(QK^T)V in backward
            # the softmax probabilities; with dropout also its one-byte mask and its output
            inside += model.n_heads * s * seq_len * b * (e + (1 + e if act.dropout else 0))
    elif act.recompute != "selective":
        inside += model.n_heads * s * b * 4  # flash attention keeps one fp32 log-sum-exp per query row
    return outside // outside_divisor + inside // tp + 2 * s * b * kv * e


# --------------------------------------------------------------------------------------------- the budget

@dataclass
class Budget:
    """One rank's share of a training step. Bytes unless named otherwise; the worst pipeline stage."""

    model: ModelShape
    batch: Batch
    layout: Layout
    precision: Precision
    activations_model: ActivationModel
    params_on_rank: int            # parameter count this rank holds before ZeRO sharding
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    micro_batches: int
    flops: dict
    sent: dict = field(default_factory=dict)    # bytes this rank sends per step, by parallelism
    messages: dict = field(default_factory=dict)  # sequential message steps per step, by parallelism
    dp_transfers: list = field(default_factory=list)  # when data-parallel traffic runs: DPTransfer each

    @property
    def state_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + self.activation_bytes

    def breakdown(self) -> dict:
        return {"parameters": self.param_bytes, "gradients": self.grad_bytes,
                "optimizer states": self.optimizer_bytes, "activations": self.activation_bytes}


def _stage_params(model: ModelShape, layout: Layout) -> list[tuple[int, int]]:
    """(dense, expert) parameter counts each pipeline stage holds on one tensor/expert-parallel rank."""
    tp, ep, pp = layout.tp, layout.ep, layout.pp
    attn_layer = _attention_params(model, tp)  # on one rank: KV heads replicated when tp > n_kv_heads
    mlp_layer = _mlp_params(model, model.d_ff)
    norm = _norm_params(model)
    stages = []
    for stage, layers in enumerate(stage_layers(model.n_layers, pp)):
        moe_layers = model.moe_layers_in(layers)
        dense_layers = len(layers) - moe_layers
        layers_per_stage = len(layers)
        dense = layers_per_stage * (attn_layer + 2 * norm) + dense_layers * (mlp_layer // tp)
        dense += moe_layers * model.n_experts * model.d_model  # routers, replicated
        expert = moe_layers * (model.n_experts // ep) * (mlp_layer // tp)
        if stage == 0:
            dense += model.vocab_size * model.d_model // tp + model.learned_positions * model.d_model
        if stage == pp - 1:
            dense += norm
            if not model.tie_embeddings or pp > 1:  # a tied head on another stage keeps its own copy
                dense += model.vocab_size * model.d_model // tp
        stages.append((dense, expert))
    return stages


# What a running framework holds beyond the tensors the budget counts: the CUDA context and the kernels'
# workspaces, the communication library's buffers (NCCL_BUFFSIZE, 4 MiB per channel and peer by default;
# NVIDIA's NCCL environment documentation) and what PyTorch's caching allocator cannot reuse (fragmentation,
# PyTorch's CUDA semantics notes). An assumption of a few GB, the order PyTorch's memory snapshot shows:
# a layout fits when its budget plus this allowance is at most the GPU's memory.
FRAMEWORK_ALLOWANCE = 2e9


def fits(b: "Budget", memory: float, allowance: float = FRAMEWORK_ALLOWANCE) -> bool:
    """Whether budget ``b`` and the framework allowance fit in ``memory`` bytes."""
    return b.total_bytes + allowance <= memory


def model_state_bytes(n_params: int, dp: int, zero: int, precision: Precision) -> tuple[int, int, int]:
    """Bytes of (parameters, gradients, optimizer states) one data-parallel rank keeps for ``n_params``.

    ZeRO (Rajbhandari et al. 2020, section 5) shards over the ``dp`` ranks the optimizer states from stage 1,
    the gradients too from stage 2, and the parameters too from stage 3; a rank keeps ceil(n/dp) of each.
    """
    shard = -(-n_params // dp)
    return (precision.param_bytes * (shard if zero >= 3 else n_params),
            precision.grad_bytes * (shard if zero >= 2 else n_params),
            precision.k * (shard if zero >= 1 else n_params))


def budget(model: ModelShape, batch: Batch, layout: Layout, precision: Precision = BF16,
           act: ActivationModel = ActivationModel(), world_size: int | None = None,
           stage: int | None = None, traffic: bool = True) -> Budget:
    """The budget of one rank of pipeline stage ``stage``; by default of the stage that needs the most
    memory. ``traffic=False`` leaves out what it sends (a layout search asks first whether a layout fits)."""
    validate(model, batch, layout, world_size)
    L, P = layout, precision
    m = batch.global_batch // (L.dp * batch.micro_batch)
    dense_dp = L.dp * L.cp                       # the group that shards and reduces dense parameters
    expert_dp = L.dp * L.cp // L.ep              # ... and expert parameters

    # activations of one layer, dense or MoE, for one micro-batch on this rank
    dense_layer = layer_activation_bytes(model, batch.seq_len, batch.micro_batch, act, P, L.tp, L.sp, L.cp)
    moe_layer = layer_activation_bytes(model, batch.seq_len, batch.micro_batch, act, P, L.tp, L.sp, L.cp,
                                       moe=True)
    worst = None
    if stage is not None and not 0 <= stage < L.pp:
        raise ValueError(f"stage {stage} does not exist with pp={L.pp}")
    ranges = stage_layers(model.n_layers, L.pp)
    for index, (dense, expert) in enumerate(_stage_params(model, L)):
        n_moe = model.moe_layers_in(ranges[index])
        acts = (len(ranges[index]) - n_moe) * dense_layer + n_moe * moe_layer
        acts = int(acts * micro_batches_in_flight(L.schedule, L.pp, L.vpp, m, index))
        state = [a + b for a, b in zip(model_state_bytes(dense, dense_dp, L.zero, P),
                                        model_state_bytes(expert, expert_dp, L.zero, P))]
        candidate = (sum(state) + acts, dense, expert, state, acts)
        if stage == index or (stage is None and (worst is None or candidate[0] > worst[0])):
            worst = candidate
    _, dense, expert, (params, grads, optim), acts = worst
    b = Budget(model, batch, L, P, act, dense + expert, params, grads, optim, acts, m,
               step_flops(model, batch, act.recompute))
    if traffic:
        b.sent, b.messages, b.dp_transfers = time_model.traffic(model, batch, L, P, act, dense, expert, m)
    return b
