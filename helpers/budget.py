"""The memory budget and the time model of one training step, per rank (chapter 01).

Give it a model shape, a batch, a parallel layout, a precision recipe and an activation model; it returns what
one rank holds (parameters, gradients, optimizer state, activations, in bytes), the FLOPs of a step, the bytes
each kind of parallelism sends per step, and, given a cluster, the time of a step and its MFU.

Sources of the formulas, each cited where it is used:
- memory of mixed-precision Adam and the ZeRO stages: Rajbhandari et al. 2020 (ZeRO), section 3 and 5;
- activations per layer, with tensor and sequence parallelism and recomputation: Korthikanti et al. 2022;
- FLOPs: 2 FLOPs per multiply-add of every matmul, backward twice the forward (Kaplan et al. 2020 give the
  resulting 6·N·tokens), plus the attention matmuls (Narayanan et al. 2021);
- bytes of ring collectives: a ring all-reduce sends 2(n-1)/n of the buffer from each rank, an all-gather or a
  reduce-scatter (n-1)/n (Patarasuk and Yuan 2009);
- time: the alpha-beta model, latency alpha per message plus bytes over bandwidth (Hockney 1994).

Everything is counted in bytes and FLOPs as exact integers where the inputs allow, so the book's checks against
published tables, against autograd and against PyTorch's FLOP counter can be exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .ledger import cost_terms


# --------------------------------------------------------------------------------------------- the inputs

@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer, in the same vocabulary as :class:`helpers.model.GPTConfig`."""

    name: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_ff: int                      # the MLP's hidden size (each expert's, for a MoE layer)
    vocab_size: int
    gated: bool = True             # SwiGLU (three matrices) or a plain GELU MLP (two)
    tie_embeddings: bool = False
    norm: str = "rmsnorm"          # "rmsnorm" (a scale) or "layernorm" (a scale and a bias)
    linear_bias: bool = False      # biases in every linear layer (GPT-2 has them, Llama does not)
    learned_positions: int = 0     # rows of a learned position embedding (0: rotary, no parameters)
    n_experts: int = 0             # 0: dense; otherwise routed experts in every MoE layer
    top_k: int = 0
    n_dense_layers: int = 0        # leading layers that keep a dense MLP in a MoE model
    source: str = ""

    def __post_init__(self):
        for f in ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "vocab_size"):
            if getattr(self, f) < 1:
                raise ValueError(f"{self.name}: {f} must be positive, got {getattr(self, f)}")
        if self.d_model % self.n_heads:
            raise ValueError(f"{self.name}: n_heads={self.n_heads} must divide d_model={self.d_model}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"{self.name}: n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")
        if self.norm not in ("rmsnorm", "layernorm"):
            raise ValueError(f"{self.name}: norm must be 'rmsnorm' or 'layernorm', got {self.norm!r}")
        if self.n_experts and not 0 < self.top_k <= self.n_experts:
            raise ValueError(f"{self.name}: top_k={self.top_k} must be in 1..n_experts={self.n_experts}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.n_dense_layers if self.n_experts else 0

    @classmethod
    def from_gpt(cls, cfg, name: str = "the book's GPT") -> "ModelShape":
        """The shape of :class:`helpers.model.GPT` built from ``cfg``."""
        return cls(name=name, n_layers=cfg.n_layers, d_model=cfg.d_model, n_heads=cfg.n_heads,
                   n_kv_heads=cfg.n_kv_heads, d_ff=cfg.d_ff, vocab_size=cfg.vocab_size, gated=cfg.gated,
                   tie_embeddings=cfg.tie_embeddings, norm="layernorm", learned_positions=cfg.seq_len)


@dataclass(frozen=True)
class Batch:
    seq_len: int
    micro_batch: int
    global_batch: int  # sequences per optimizer step, over all data-parallel ranks


@dataclass(frozen=True)
class Layout:
    """How the world is split. ``zero`` is the ZeRO stage over the data-parallel (x context-parallel) group."""

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
            if getattr(self, f) < 1:
                raise ValueError(f"{f} must be at least 1, got {getattr(self, f)}")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero must be a ZeRO stage 0, 1, 2 or 3, got {self.zero}")
        if self.sp and self.tp == 1:
            raise ValueError("sequence parallelism shards along the tensor-parallel group: it needs tp > 1")
        if self.vpp > 1 and self.pp == 1:
            raise ValueError("virtual pipeline stages (vpp > 1) need pipeline parallelism (pp > 1)")
        if self.schedule not in ("1f1b", "gpipe"):
            raise ValueError(f"schedule must be '1f1b' or 'gpipe', got {self.schedule!r}")
        if (self.dp * self.cp) % self.ep:
            raise ValueError(f"ep={self.ep} must divide dp*cp={self.dp * self.cp}: experts are sharded "
                             f"inside the data-parallel group")

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

    @property
    def k(self) -> int:
        """ZeRO's K: optimizer-state bytes per parameter (master copy + moments)."""
        return self.master_bytes + self.optim_bytes


FP32 = Precision("fp32", 4, 4, 0, 8, 4)
BF16 = Precision("bf16, fp32 master weights", 2, 2, 4, 8, 2)
BF16_FP32_GRADS = Precision("bf16, fp32 master weights and fp32 gradient accumulation", 2, 4, 4, 8, 2)
FP8 = Precision("fp8 compute, bf16 weights, fp32 master weights", 2, 2, 4, 8, 2, fp8=True)


@dataclass(frozen=True)
class ActivationModel:
    """What a transformer layer saves for backward, following the accounting of Korthikanti et al. 2022.

    ``norm_stat_bytes`` is what a norm saves per token besides its input (LayerNorm's mean and 1/std in fp32:
    8; RMSNorm's 1/rms: 4; the paper ignores them: 0). ``attention`` is "materialized" (the softmax
    probabilities, a*s*s per sequence, are stored) or "flash" (only a log-sum-exp per query row, in fp32).
    ``kv_expanded``: the grouped K/V heads are repeated to all query heads before attention, and the repeated
    copies are what is saved. ``recompute`` is "none", "selective" (the attention core is recomputed) or "full"
    (only each layer's input is kept).
    """

    dropout: bool = False
    attention: str = "flash"
    kv_expanded: bool = False
    norm_stat_bytes: int = 4
    recompute: str = "none"

    def __post_init__(self):
        if self.attention not in ("flash", "materialized"):
            raise ValueError(f"attention must be 'flash' or 'materialized', got {self.attention!r}")
        if self.recompute not in ("none", "selective", "full"):
            raise ValueError(f"recompute must be 'none', 'selective' or 'full', got {self.recompute!r}")


KORTHIKANTI = ActivationModel(dropout=True, attention="materialized", kv_expanded=False, norm_stat_bytes=0)


@dataclass(frozen=True)
class Cluster:
    """Hardware for the time model. Bandwidths are per GPU, in bytes per second, as nccl-tests' bus bandwidth."""

    name: str
    gpus_per_node: int
    peak_flops: float          # dense FLOP/s of one GPU at the compute precision
    intra_bw: float            # within a node (NVLink)
    inter_bw: float            # between nodes (InfiniBand / RoCE)
    intra_alpha: float = 5e-6  # latency of one message within a node, seconds
    inter_alpha: float = 10e-6
    efficiency: float = 0.5    # fraction of peak the matmuls achieve


# --------------------------------------------------------------------------------------------- validation

def validate(model: ModelShape, batch: Batch, layout: Layout, world_size: int | None = None) -> None:
    """Raise ValueError naming the broken constraint, if the layout cannot run this model and batch."""
    L = layout
    if world_size is not None and world_size != L.world_size:
        raise ValueError(f"world size {world_size} != dp*tp*pp*cp = {L.dp}*{L.tp}*{L.pp}*{L.cp} = {L.world_size}")
    if model.n_heads % L.tp:
        raise ValueError(f"tp={L.tp} must divide the attention heads of {model.name} ({model.n_heads})")
    if model.n_kv_heads % L.tp:
        raise ValueError(f"tp={L.tp} must divide the KV heads of {model.name} ({model.n_kv_heads}); "
                         f"replicating KV heads is not modelled")
    if model.d_ff % L.tp:
        raise ValueError(f"tp={L.tp} must divide the MLP hidden size of {model.name} ({model.d_ff})")
    if model.vocab_size % L.tp:
        raise ValueError(f"tp={L.tp} must divide the vocabulary of {model.name} ({model.vocab_size}); "
                         f"pad it to a multiple of tp")
    if model.n_layers < L.pp * L.vpp:
        raise ValueError(f"pp*vpp={L.pp}*{L.vpp} model chunks need at least as many layers; {model.name} has "
                         f"{model.n_layers}")
    if batch.seq_len % L.cp:
        raise ValueError(f"cp={L.cp} must divide the sequence length ({batch.seq_len})")
    if L.sp and batch.seq_len // L.cp % L.tp:
        raise ValueError(f"sequence parallelism needs tp={L.tp} to divide the per-rank sequence "
                         f"({batch.seq_len // L.cp} tokens)")
    if L.ep > 1 and not model.n_experts:
        raise ValueError(f"ep={L.ep} > 1 but {model.name} has no experts")
    if model.n_experts and model.n_experts % L.ep:
        raise ValueError(f"ep={L.ep} must divide the experts of {model.name} ({model.n_experts})")
    if batch.global_batch % (L.dp * batch.micro_batch):
        raise ValueError(f"the global batch ({batch.global_batch}) must be a multiple of "
                         f"dp*micro_batch = {L.dp}*{batch.micro_batch}")
    m = batch.global_batch // (L.dp * batch.micro_batch)
    if L.vpp > 1 and m % L.pp:
        raise ValueError(f"interleaved 1F1B needs the micro-batches per step ({m}) to be a multiple of pp={L.pp}")


# --------------------------------------------------------------------------------------------- parameters

@dataclass
class ParamCount:
    """Parameters of the model by where they live (each a count, not bytes)."""

    embedding: int       # token embedding (+ learned positions)
    head: int            # LM head (0 when tied) + final norm
    attention: int       # all layers
    mlp_dense: int       # all dense MLPs
    experts: int         # all routed experts, every MoE layer
    router: int
    norms: int           # the two norms of every layer

    @property
    def total(self) -> int:
        return self.embedding + self.head + self.attention + self.mlp_dense + self.experts + self.router + self.norms


def _norm_params(model: ModelShape) -> int:
    return model.d_model * (2 if model.norm == "layernorm" else 1)


def _mlp_params(model: ModelShape, d_ff: int) -> int:
    mats = 3 if model.gated else 2
    bias = (mats - 1) * d_ff + model.d_model if model.linear_bias else 0
    return mats * model.d_model * d_ff + bias


def _attention_params(model: ModelShape) -> int:
    q = model.n_heads * model.head_dim
    kv = model.n_kv_heads * model.head_dim
    weights = model.d_model * (q + 2 * kv) + q * model.d_model
    bias = (q + 2 * kv + model.d_model) if model.linear_bias else 0
    return weights + bias


def count_params(model: ModelShape) -> ParamCount:
    """Every parameter of the model, by part."""
    d, V = model.d_model, model.vocab_size
    n_dense = model.n_layers - model.n_moe_layers
    return ParamCount(
        embedding=V * d + model.learned_positions * d,
        head=(0 if model.tie_embeddings else V * d) + _norm_params(model),
        attention=model.n_layers * _attention_params(model),
        mlp_dense=n_dense * _mlp_params(model, model.d_ff),
        experts=model.n_moe_layers * model.n_experts * _mlp_params(model, model.d_ff),
        router=model.n_moe_layers * model.n_experts * d,
        norms=model.n_layers * 2 * _norm_params(model),
    )


def active_params(model: ModelShape) -> int:
    """Parameters one token passes through: the top-k experts of each MoE layer instead of all of them."""
    p = count_params(model)
    if not model.n_experts:
        return p.total
    return p.total - p.experts + model.n_moe_layers * model.top_k * _mlp_params(model, model.d_ff)


def matmul_params(model: ModelShape, active: bool = True) -> int:
    """Weights that take part in a matmul per token (no embedding lookup, norms or biases): the N of 6*N*T."""
    d, q, kv = model.d_model, model.n_heads * model.head_dim, model.n_kv_heads * model.head_dim
    mats = 3 if model.gated else 2
    attn = d * (q + 2 * kv) + q * d
    mlp = mats * d * model.d_ff
    n_dense = model.n_layers - model.n_moe_layers
    experts_per_token = model.top_k if active else model.n_experts
    return (model.n_layers * attn + n_dense * mlp
            + model.n_moe_layers * (experts_per_token * mlp + model.n_experts * d)
            + model.vocab_size * d)


# --------------------------------------------------------------------------------------------- FLOPs

def attention_flops_forward(model: ModelShape, batch_tokens: int, seq_len: int) -> int:
    """QK^T and PV of every layer, forward: 2 matmuls of 2*s*d_head FLOPs per query per head."""
    return model.n_layers * 4 * batch_tokens * seq_len * model.n_heads * model.head_dim


def step_flops(model: ModelShape, batch: Batch, recompute: str = "none") -> dict:
    """FLOPs of one optimizer step over the whole job (all ranks), split into matmuls and attention.

    Forward is 2 FLOPs per weight per token; backward computes two matmuls for each forward one (gradient of
    the input and of the weight), so a training step is 3x the forward: 6*N*tokens. Full recomputation runs the
    transformer layers' forward once more (4x for them), not the LM head's: each layer's checkpoint ends at its
    output, and the head's forward is kept (Narayanan et al. 2021, eq. 3: 96Bslh^2 for the layers, 6BshV for
    the head). Selective recomputation repeats the attention core only.
    """
    tokens = batch.global_batch * batch.seq_len
    linear_fwd = 2 * matmul_params(model) * tokens
    layers_fwd = linear_fwd - 2 * model.vocab_size * model.d_model * tokens  # without the LM head
    attn_fwd = attention_flops_forward(model, tokens, batch.seq_len)
    extra_linear = layers_fwd if recompute == "full" else 0
    extra_attn = attn_fwd if recompute in ("full", "selective") else 0
    return {"linear": 3 * linear_fwd + extra_linear, "attention": 3 * attn_fwd + extra_attn,
            "model": 3 * (linear_fwd + attn_fwd),  # what MFU counts: no recomputation
            "total": 3 * (linear_fwd + attn_fwd) + extra_linear + extra_attn}


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
    kv = h if act.kv_expanded else model.n_kv_heads * model.head_dim
    f = model.d_ff * (model.top_k if moe else 1)  # the MLP width one token passes through
    # Outside the tensor-parallel region: the two norms' inputs and statistics, the inputs of the two
    # column-parallel layers (QKV and the MLP's first), and the two dropout masks (one byte each).
    outside = 2 * sbh * e + 2 * s * b * act.norm_stat_bytes + 2 * sbh * lin + (2 * sbh if act.dropout else 0)
    # Inside it, split over tp: Q, K and V, the input of the output projection, the MLP's hidden activations
    # (GELU's input and output; or SwiGLU's gate, silu(gate), up and their product: silu saves its input, the
    # product saves both factors, the down projection its input).
    inside = (sbh + 2 * s * b * kv) * e + sbh * lin
    inside += s * b * f * (3 * e + lin) if model.gated else s * b * f * (e + lin)
    if act.attention == "materialized":
        if act.recompute != "selective":  # selective recomputation redoes softmax(QK^T)V in backward
            # the softmax probabilities; with dropout also its one-byte mask and its output
            inside += model.n_heads * s * seq_len * b * (e + (1 + e if act.dropout else 0))
    else:
        inside += model.n_heads * s * b * 4  # flash attention keeps one fp32 log-sum-exp per query row
    return outside // outside_divisor + inside // tp


# --------------------------------------------------------------------------------------------- the budget

@dataclass(frozen=True)
class DPTransfer:
    """Data-parallel collectives issued together, ``times`` per step, and the compute they may hide behind.

    ``behind`` is "backward" (the backward of one micro-batch: the gradients it reduces are final only once the
    micro-batch that produced them has passed), "forward" (ZeRO-3's prefetched gather before a micro-batch's
    forward) or "" (nothing: the parameters' all-gather after the optimizer step).
    """

    kind: str          # "dp" or "dp (experts)": the group, for its link
    nbytes: float      # per occurrence
    messages: int      # sequential message steps per occurrence
    times: int         # occurrences per step
    behind: str


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


def stage_layers(n_layers: int, pp: int) -> list[range]:
    """The layers of each pipeline stage: as even as possible, the first stages taking one more if needed."""
    base, extra = divmod(n_layers, pp)
    bounds = [0]
    for stage in range(pp):
        bounds.append(bounds[-1] + base + (1 if stage < extra else 0))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def _moe_layers_in(model: ModelShape, layers: range) -> int:
    return sum(1 for i in layers if i >= model.n_layers - model.n_moe_layers)


def _stage_params(model: ModelShape, layout: Layout) -> list[tuple[int, int]]:
    """(dense, expert) parameter counts each pipeline stage holds on one tensor/expert-parallel rank."""
    t, ep, pp = layout.tp, layout.ep, layout.pp
    attn_layer = _attention_params(model)
    mlp_layer = _mlp_params(model, model.d_ff)
    norm = _norm_params(model)
    stages = []
    for stage, layers in enumerate(stage_layers(model.n_layers, pp)):
        moe_layers = _moe_layers_in(model, layers)
        dense_layers = len(layers) - moe_layers
        layers_per_stage = len(layers)
        dense = layers_per_stage * (attn_layer // t + 2 * norm) + dense_layers * (mlp_layer // t)
        dense += moe_layers * model.n_experts * model.d_model  # routers, replicated
        expert = moe_layers * (model.n_experts // ep) * (mlp_layer // t)
        if stage == 0:
            dense += model.vocab_size * model.d_model // t + model.learned_positions * model.d_model
        if stage == pp - 1:
            dense += norm
            if not model.tie_embeddings or pp > 1:  # a tied head on another stage keeps its own copy
                dense += model.vocab_size * model.d_model // t
        stages.append((dense, expert))
    return stages


def model_state_bytes(n_params: int, dp: int, zero: int, precision: Precision) -> tuple[int, int, int]:
    """Bytes of (parameters, gradients, optimizer states) one data-parallel rank keeps for ``n_params``.

    ZeRO (Rajbhandari et al. 2020, section 5) shards over the ``dp`` ranks the optimizer states from stage 1,
    the gradients too from stage 2, and the parameters too from stage 3; a rank keeps ceil(n/dp) of each.
    """
    shard = -(-n_params // dp)
    return (precision.param_bytes * (shard if zero >= 3 else n_params),
            precision.grad_bytes * (shard if zero >= 2 else n_params),
            precision.k * (shard if zero >= 1 else n_params))


def micro_batches_in_flight(schedule: str, pp: int, vpp: int, m: int, stage: int) -> float:
    """How many micro-batches' worth of its activations pipeline stage ``stage`` holds at its peak.

    GPipe keeps all ``m``; 1F1B keeps ``pp - stage`` (Narayanan et al. 2021). Interleaved 1F1B keeps
    ``2(pp-1-stage) + (vpp-1)·pp + 1`` chunks, each ``1/vpp`` of the stage; on the first stage that is
    ``pp + (pp-1)/vpp``, Korthikanti et al. (2022), eq. 5. Chapter 06 measures these peaks on every rank.
    """
    if schedule == "gpipe":
        return m
    if vpp == 1:
        return min(pp - stage, m)
    return min(2 * (pp - 1 - stage) + (vpp - 1) * pp + 1, vpp * m) / vpp


def budget(model: ModelShape, batch: Batch, layout: Layout, precision: Precision = BF16,
           act: ActivationModel = ActivationModel(), world_size: int | None = None,
           stage: int | None = None) -> Budget:
    """The budget of one rank of pipeline stage ``stage``; by default of the stage that needs the most memory."""
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
        n_moe = _moe_layers_in(model, ranges[index])
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
    b.sent, b.messages, b.dp_transfers = _traffic(model, batch, L, P, act, dense, expert, m)
    return b


# --------------------------------------------------------------------------------------------- traffic

def ring_all_reduce_bytes(n_bytes: int, n: int) -> float:
    """Bytes one rank sends in a ring all-reduce of ``n_bytes`` over ``n`` ranks: 2(n-1)/n of the buffer."""
    return cost_terms("ring_all_reduce", n)[1] * n_bytes


def ring_all_gather_bytes(n_bytes: int, n: int) -> float:
    """All-gather (or reduce-scatter) of an ``n_bytes`` result: (n-1)/n of it, per rank."""
    return cost_terms("ring_all_gather", n)[1] * n_bytes


def _traffic(model, batch, L: Layout, P: Precision, act: ActivationModel, dense: int, expert: int, m: int):
    """Bytes each parallelism sends from one rank per optimizer step, its sequential message steps, and when the
    data-parallel part of it runs (:class:`DPTransfer`)."""
    sent, steps, transfers = {}, {}, []
    D, De = L.dp * L.cp, L.dp * L.cp // L.ep
    # Data parallel (dense over dp*cp, experts over dp*cp/ep). Unsharded gradients accumulate over the m
    # micro-batches and are reduced once; sharded ones (ZeRO-2, ZeRO-3) keep only this rank's shard, so every
    # micro-batch's gradient is reduce-scattered before the next overwrites the unsharded buffer; ZeRO-3 also
    # gathers the parameters for every micro-batch's forward and again for its backward.
    for label, count, group in (("dp", dense, D), ("dp (experts)", expert, De)):
        if group == 1 or count == 0:
            continue
        g, p = count * P.grad_bytes, count * P.param_bytes
        rs, ag, n = ring_all_gather_bytes(g, group), ring_all_gather_bytes(p, group), group - 1
        if L.zero == 0:
            plan = [(ring_all_reduce_bytes(g, group), 2 * n, 1, "backward")]
        elif L.zero == 1:
            plan = [(rs, n, 1, "backward"), (ag, n, 1, "")]
        elif L.zero == 2:
            plan = [(rs, n, m, "backward"), (ag, n, 1, "")]
        else:
            plan = [(ag, n, m, "forward"), (ag + rs, 2 * n, m, "backward")]
        transfers += [DPTransfer(label, nbytes, k, times, behind) for nbytes, k, times, behind in plan]
        sent[label] = sum(nbytes * times for nbytes, _, times, _ in plan)
        steps[label] = sum(k * times for _, k, times, _ in plan)
    s_rank = batch.seq_len // L.cp
    x = batch.micro_batch * s_rank * model.d_model * P.act_bytes  # one activation tensor of a micro-batch
    stage = max(stage_layers(model.n_layers, L.pp), key=len)  # the busiest stage
    layers = len(stage)
    if L.tp > 1:
        # Two all-reduces per layer forward and two backward (Megatron's f and g); with sequence parallelism
        # each becomes an all-gather and a reduce-scatter (the same bytes), and backward gathers the inputs of
        # the two column-parallel layers again, half an all-reduce each: the activation accounting of
        # Korthikanti et al. 2022 keeps only this rank's slice of them, as Megatron does. A fully recomputed
        # forward repeats the forward's two. The vocabulary-parallel embedding (forward) sits on the first
        # stage, the LM head's input (backward, re-gathered with SP) on the last: with pp > 1 the model charges
        # the busiest stage's layers and the costlier end, the head.
        all_reduce = ring_all_reduce_bytes(x, L.tp)  # = an all-gather + a reduce-scatter of x
        regather = ring_all_gather_bytes(x, L.tp) if L.sp else 0
        n_layer = 4 + (2 if act.recompute == "full" else 0)  # all-reduces, or all-gather/reduce-scatter pairs
        embedding, head = all_reduce, all_reduce + regather
        sent["tp"] = m * (layers * (n_layer * all_reduce + 2 * regather) + head + (embedding if L.pp == 1 else 0))
        pairs = layers * n_layer + (2 if L.pp == 1 else 1)
        steps["tp"] = m * (2 * pairs + ((2 * layers + 1) if L.sp else 0)) * (L.tp - 1)
    if L.pp > 1:
        boundary = x // (L.tp if L.sp else 1)
        sent["pp"] = 2 * L.vpp * m * boundary  # an interior stage: activations forward, gradients back
        steps["pp"] = 2 * L.vpp * m
    if L.cp > 1:
        kv = 2 * batch.micro_batch * s_rank * model.n_kv_heads * model.head_dim * P.act_bytes // L.tp
        sent["cp"] = m * layers * 3 * (L.cp - 1) * kv  # ring: K,V forward; K,V and dK,dV backward
        steps["cp"] = m * layers * 3 * (L.cp - 1)
    if L.ep > 1 and model.n_experts:
        moe_layers = _moe_layers_in(model, stage)
        tokens = batch.micro_batch * s_rank // (L.tp if L.sp else 1)
        routed = tokens * model.top_k * model.d_model * P.act_bytes
        sent["ep"] = m * moe_layers * 4 * (L.ep - 1) * routed / L.ep  # dispatch, combine; twice in backward
        steps["ep"] = m * moe_layers * 4 * (L.ep - 1)
    return sent, steps, transfers


# --------------------------------------------------------------------------------------------- time

@dataclass
class StepTime:
    compute_s: float
    comm_s: dict
    exposed_comm_s: float
    bubble_s: float
    step_s: float
    mfu: float


def _group_bandwidth(kind: str, L: Layout, cluster: Cluster) -> tuple[float, float]:
    """(bandwidth, alpha) of a group: within a node if its ranks fit in one (tp innermost, then cp, dp, pp)."""
    span = {"tp": L.tp, "cp": L.tp * L.cp, "ep": L.tp * L.cp * L.ep, "dp": L.tp * L.cp * L.dp,
            "dp (experts)": L.tp * L.cp * L.dp,
            "pp": 2 * L.tp * L.cp * L.dp}[kind]  # pp: two neighbouring stages
    if span <= cluster.gpus_per_node:
        return cluster.intra_bw, cluster.intra_alpha
    return cluster.inter_bw, cluster.inter_alpha


def step_time(b: Budget, cluster: Cluster, overlap: bool = True) -> StepTime:
    """The alpha-beta time of one step: compute at ``efficiency * peak``, each group's traffic at its link.

    With ``overlap``, data-parallel traffic hides only behind compute that runs while it is in flight
    (:class:`DPTransfer`): a gradient reduction behind the backward of the micro-batch whose gradients it
    reduces, so a reduction once per step hides behind the last micro-batch's backward alone, 2/3 of
    compute/m (on the first pipeline stage, whose last backward ends the step: later stages could also hide
    it behind their cooldown, but the step waits for the first); ZeRO-3's gathers behind the micro-batch they
    serve; the parameters' all-gather after the optimizer step behind nothing. Tensor-, context- and
    expert-parallel traffic sits on the critical path. The pipeline bubble adds (pp-1)/(vpp*m) of the
    compute (Narayanan et al. 2021).
    """
    L, m = b.layout, b.micro_batches
    rate = cluster.peak_flops * cluster.efficiency
    compute = b.flops["total"] / L.world_size / rate
    forward = b.flops["model"] / 3 / L.world_size / rate / m  # one micro-batch's forward, without recomputation
    window = {"forward": forward, "backward": compute / m - forward, "": 0.0}
    comm = {}
    for kind, n_bytes in b.sent.items():
        bw, alpha = _group_bandwidth(kind, L, cluster)
        comm[kind] = n_bytes / bw + b.messages[kind] * alpha
    dp_comm = sum(v for k, v in comm.items() if k.startswith("dp"))
    other = sum(v for k, v in comm.items() if not k.startswith("dp"))
    if overlap:  # the transfers that share a window (the dense and the expert groups') run in it together
        shared = {}
        for x in b.dp_transfers:
            bw, alpha = _group_bandwidth(x.kind, L, cluster)
            shared[x.behind, x.times] = shared.get((x.behind, x.times), 0.0) + x.nbytes / bw + x.messages * alpha
        dp_exposed = sum(times * max(0.0, seconds - window[behind]) for (behind, times), seconds in shared.items())
    else:
        dp_exposed = dp_comm
    exposed = other + dp_exposed
    bubble = compute * (L.pp - 1) / (L.vpp * m) if L.pp > 1 else 0.0
    step = compute + bubble + exposed
    mfu = b.flops["model"] / (step * L.world_size * cluster.peak_flops)
    return StepTime(compute, comm, exposed, bubble, step, mfu)


# --------------------------------------------------------------------------------------------- presets

GPT2_SMALL = ModelShape("GPT-2 small", n_layers=12, d_model=768, n_heads=12, n_kv_heads=12, d_ff=3072,
                        vocab_size=50257, gated=False, tie_embeddings=True, norm="layernorm", linear_bias=True,
                        learned_positions=1024, source="Radford et al. 2019 (the 124M release)")
LLAMA3_8B = ModelShape("Llama-3 8B", n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336,
                       vocab_size=128256, source="Llama Team 2024, table 3")
LLAMA3_70B = ModelShape("Llama-3 70B", n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, d_ff=28672,
                        vocab_size=128256, source="Llama Team 2024, table 3")
LLAMA3_405B = ModelShape("Llama-3 405B", n_layers=126, d_model=16384, n_heads=128, n_kv_heads=8, d_ff=53248,
                         vocab_size=128256, source="Llama Team 2024, table 3")
MIXTRAL_8X7B = ModelShape("Mixtral 8x7B", n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336,
                          vocab_size=32000, n_experts=8, top_k=2, source="Jiang et al. 2024")
PRESETS = [GPT2_SMALL, LLAMA3_8B, LLAMA3_70B, LLAMA3_405B, MIXTRAL_8X7B]

# The sizes these models are known by (total, active parameters): names round, so they agree with an exact
# count to about 1%.
NOMINAL_PARAMS = {"GPT-2 small": (124e6, 124e6), "Llama-3 8B": (8e9, 8e9), "Llama-3 70B": (70e9, 70e9),
                  "Llama-3 405B": (405e9, 405e9), "Mixtral 8x7B": (47e9, 13e9)}

H100 = Cluster("8x H100 SXM per node, NVLink 4 and 8x400 Gb/s InfiniBand", gpus_per_node=8,
               peak_flops=989e12, intra_bw=360e9, inter_bw=45e9)
