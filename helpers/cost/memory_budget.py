"""The memory budget of one rank: parameters, gradients, optimizer states, activations, in bytes (chapter 01).

The second of the three parts of chapter 01's calculator. Give :func:`budget` a model shape and a batch
(:mod:`helpers.cost.model_size`), a parallel layout, a precision recipe and an activation model
(:mod:`helpers.cost.budget_types`); it returns what one rank of the busiest pipeline stage holds, the FLOPs of
a step, and the bytes each kind of parallelism sends (from the traffic formulas of
:mod:`helpers.cost.time_model`, which also gives the time of the step).


Sources of the formulas, each cited where it is used:
- memory of mixed-precision Adam and the ZeRO stages: Rajbhandari et al. 2020 (ZeRO), sections 3 and 5;
- activations per layer, with tensor and sequence parallelism and recomputation: Korthikanti et al. 2022.
"""

from __future__ import annotations

from helpers import layout_rules
from helpers.cost import time_model
from helpers.cost.budget_types import ActivationModel, Budget, Layout, Precision
from helpers.cost.model_size import (Batch, ModelShape, _attention_params, _mlp_params, _norm_params,
                                     kv_heads_per_rank, step_flops)
from helpers.cost.pipeline_schedules import micro_batches_in_flight, stage_layers


FP32 = Precision("fp32", 4, 4, 0, 8, 4)
BF16 = Precision("bf16, fp32 master weights", 2, 2, 4, 8, 2)
BF16_FP32_GRADS = Precision("bf16, fp32 master weights and fp32 gradient accumulation", 2, 4, 4, 8, 2)
FP8 = Precision("fp8 compute, bf16 weights, fp32 master weights", 2, 2, 4, 8, 2, fp8=True)
# torchao's float8 FSDP: ZeRO-3 casts each bf16 shard to fp8 and all-gathers one byte per parameter (the
# per-tensor scales, agreed by an all-reduce of the amax, are a few bytes a tensor: left out)
FP8_GATHER = Precision("fp8 compute and fp8 parameter all-gathers, bf16 weights, fp32 master weights",
                       2, 2, 4, 8, 2, fp8=True, gather_bytes=1)


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
                                 seq_len=batch.seq_len // L.cp if L.sequence_parallel else None,
                                 of=model.name)
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
                           precision: Precision = BF16, tp: int = 1, sequence_parallel: bool = False,
                           cp: int = 1, moe: bool = False) -> int:
    """Bytes one transformer layer saves for backward, on one rank, for one micro-batch.

    The itemisation follows Korthikanti et al. 2022, section 4.1: each tensor a layer keeps is listed with
    the factor that divides it under tensor parallelism (``tp``), sequence parallelism
    (``sequence_parallel``: the tensors outside the tensor-parallel region are split too) and context
    parallelism (``cp``: each rank keeps its ``seq_len / cp`` queries, and attends to all ``seq_len`` keys).
    """
    s, b, h, e = seq_len // cp, micro_batch, model.d_model, precision.act_bytes
    sbh = s * b * h
    outside_divisor = tp if sequence_parallel else 1
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


def fits(b: Budget, memory: float, allowance: float = FRAMEWORK_ALLOWANCE) -> bool:
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
    dense_layer, moe_layer = (layer_activation_bytes(model, batch.seq_len, batch.micro_batch, act, P, L.tp,
                                                     L.sequence_parallel, L.cp, moe=moe)
                              for moe in (False, True))
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
