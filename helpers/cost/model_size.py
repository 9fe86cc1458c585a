"""The size of a model: its shape, its parameters and the FLOPs of a training step (chapter 01).

The first of the three parts of chapter 01's calculator: :mod:`helpers.cost.memory_budget` adds what one rank
keeps, :mod:`helpers.cost.time_model` what a step sends and how long it takes. Counted as exact integers, so
that chapter 01 can check them against the book's GPT, against published sizes and against PyTorch's FLOP
counter.

- FLOPs: 2 FLOPs per multiply-add of every matmul, backward twice the forward (Kaplan et al. 2020 give the
  resulting 6·N·tokens), plus the attention matmuls (Narayanan et al. 2021).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass


# --------------------------------------------------------------------------------------------- the inputs

def whole_number(field: str, value, least: int) -> None:
    """Raise ValueError naming ``field`` unless ``value`` is an integer of at least ``least``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise ValueError(f"{field} must be a whole number of at least {least}, got {value!r}")


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
    route_nodes: int = 0           # node-limited routing: a token's experts on at most this many nodes

    def __post_init__(self):
        for f in ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "vocab_size"):
            whole_number(f"{self.name}: {f}", getattr(self, f), least=1)
        for f in ("n_experts", "top_k", "n_dense_layers", "learned_positions", "route_nodes"):
            whole_number(f"{self.name}: {f}", getattr(self, f), least=0)
        if self.n_dense_layers > self.n_layers:
            raise ValueError(f"{self.name}: n_dense_layers={self.n_dense_layers} must be at most "
                             f"n_layers={self.n_layers}")
        if self.n_dense_layers and not self.n_experts:
            raise ValueError(f"{self.name}: n_dense_layers={self.n_dense_layers} needs n_experts > 0 (a "
                             f"dense model has only dense layers)")
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

    def moe_layers_in(self, layers: range) -> int:
        """How many of ``layers`` are MoE layers (the dense ones come first)."""
        first = self.n_layers - self.n_moe_layers
        if isinstance(layers, range) and layers.step == 1:  # a pipeline stage: counted without a loop
            return max(0, layers.stop - max(layers.start, first))
        return sum(1 for i in layers if i >= first)

    @classmethod
    def from_gpt(cls, cfg, name: str = "the book's GPT") -> "ModelShape":
        """The shape of :class:`helpers.model.GPT` built from ``cfg``."""
        return cls(name=name, n_layers=cfg.n_layers, d_model=cfg.d_model, n_heads=cfg.n_heads,
                   n_kv_heads=cfg.n_kv_heads, d_ff=cfg.d_ff, vocab_size=cfg.vocab_size, gated=cfg.gated,
                   tie_embeddings=cfg.tie_embeddings, norm=cfg.norm,
                   learned_positions=cfg.seq_len if cfg.rope_theta is None else 0)


@dataclass(frozen=True)
class Batch:
    seq_len: int
    micro_batch: int
    global_batch: int  # sequences per optimizer step, over all data-parallel ranks

    def __post_init__(self):
        for f in ("seq_len", "micro_batch", "global_batch"):
            whole_number(f"Batch: {f}", getattr(self, f), least=1)


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
        return (self.embedding + self.head + self.attention + self.mlp_dense + self.experts + self.router
                + self.norms)


def _norm_params(model: ModelShape) -> int:
    return model.d_model * (2 if model.norm == "layernorm" else 1)


def _mlp_params(model: ModelShape, d_ff: int) -> int:
    mats = 3 if model.gated else 2
    bias = (mats - 1) * d_ff + model.d_model if model.linear_bias else 0
    return mats * model.d_model * d_ff + bias


def kv_heads_per_rank(n_kv_heads: int, tp: int) -> int:
    """KV heads one of ``tp`` tensor-parallel ranks holds: ``n_kv_heads / tp``, or one when ``tp`` exceeds
    ``n_kv_heads`` (a multiple of it): each KV head is then replicated on the ``tp / n_kv_heads`` ranks whose
    query heads read it, as vLLM does (Megatron-LM copies no weights: up to core v0.15 it refuses such a
    ``tp``; from v0.16 it all-gathers the QKV activations instead)."""
    return max(n_kv_heads // tp, 1)


def _attention_params(model: ModelShape, tp: int = 1) -> int:
    """One layer's attention parameters on one of ``tp`` tensor-parallel ranks (all of them: ``tp=1``)."""
    q = model.n_heads * model.head_dim // tp
    kv = kv_heads_per_rank(model.n_kv_heads, tp) * model.head_dim
    weights = model.d_model * (q + 2 * kv) + q * model.d_model
    bias = (q + 2 * kv + model.d_model // tp) if model.linear_bias else 0
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
    the input and of the weight), so a training step is 3x the forward: 6*N*tokens. Full recomputation runs
    the transformer layers' forward once more (4x for them), not the LM head's: each layer's checkpoint ends
    at its output, and the head's forward is kept (Narayanan et al. 2021, eq. 3: 96Bslh^2 for the layers,
    6BshV for the head). Selective recomputation repeats the attention core only.
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


# --------------------------------------------------------------------------------------------- presets

GPT2_SMALL = ModelShape("GPT-2 small", n_layers=12, d_model=768, n_heads=12, n_kv_heads=12, d_ff=3072,
                        vocab_size=50257, gated=False, tie_embeddings=True, norm="layernorm",
                        linear_bias=True, learned_positions=1024,
                        source="Radford et al. 2019 (the 124M release)")
LLAMA3_8B = ModelShape("Llama-3 8B", n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336,
                       vocab_size=128256, source="Llama Team 2024, table 3")
LLAMA3_70B = ModelShape("Llama-3 70B", n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, d_ff=28672,
                        vocab_size=128256, source="Llama Team 2024, table 3")
LLAMA3_405B = ModelShape("Llama-3 405B", n_layers=126, d_model=16384, n_heads=128, n_kv_heads=8, d_ff=53248,
                         vocab_size=128256, source="Llama Team 2024, table 3")
MIXTRAL_8X7B = ModelShape("Mixtral 8x7B", n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336,
                          vocab_size=32000, n_experts=8, top_k=2, source="Jiang et al. 2024")
PRESETS = [GPT2_SMALL, LLAMA3_8B, LLAMA3_70B, LLAMA3_405B, MIXTRAL_8X7B]

# DeepSeek-V3's sizes in this vocabulary (61 layers, the first 3 dense, 256 routed experts of width 2048,
# top 8; DeepSeek-AI 2024, section 4.2) with three simplifications the calculator's shape forces: its
# multi-head latent attention counted as multi-head attention of the same width (4·d² weights a layer), its
# one shared expert and the dense layers' wider MLP (18432) left out. Its total stays within 1% of the
# published 671B; its active parameters (35B) fall 5% short of the published 37B: not in PRESETS, whose
# actives must agree to 1%.
DEEPSEEK_V3_LIKE = ModelShape("DeepSeek-V3-like MoE", n_layers=61, d_model=7168, n_heads=128, n_kv_heads=128,
                              d_ff=2048, vocab_size=129280, n_experts=256, top_k=8, n_dense_layers=3,
                              source="DeepSeek-AI 2024, section 4.2 (MLA as MHA, no shared expert)",
                              route_nodes=4)  # each token sent to at most 4 nodes (ibid., section 3.2.2)

# The sizes these models are known by (total, active parameters): names round, so they agree with an exact
# count to about 1%.
NOMINAL_PARAMS = {"GPT-2 small": (124e6, 124e6), "Llama-3 8B": (8e9, 8e9), "Llama-3 70B": (70e9, 70e9),
                  "Llama-3 405B": (405e9, 405e9), "Mixtral 8x7B": (47e9, 13e9),
                  "DeepSeek-V3-like MoE": (671e9, 37e9)}
