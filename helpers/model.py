"""The book's small GPT (chapter 01): the single-process reference that every chapter shards.

A decoder-only transformer in plain PyTorch, in the shape vocabulary of chapter 01's calculator
(``n_layers``, ``d_model``, ``n_heads``, ``n_kv_heads``, ``d_ff``, ``vocab_size``, ``seq_len``):

- token and learned position embeddings; pre-norm blocks ``x + attn(ln1(x))``, ``x + mlp(ln2(x))``; a final
  LayerNorm and an LM head, tied to the token embedding or not;
- or, with :meth:`GPTConfig.llama_style`, the blocks of Llama (Touvron et al. 2023): RMSNorm (Zhang and
  Sennrich 2019), rotary position embeddings on the queries and keys instead of learned positions (RoPE, Su et
  al. 2021, in the "rotate half" layout of GPT-NeoX and Hugging Face's Llama), the gated SwiGLU MLP
  (Shazeer 2020) and untied embeddings;
- attention with grouped KV heads (GQA, Ainslie et al. 2023): ``n_kv_heads`` key/value heads, each shared by
  ``n_heads / n_kv_heads`` query heads; ``n_kv_heads == n_heads`` is ordinary multi-head attention;
- an MLP ``down(gelu(up(x)))``, or the gated ``down(silu(gate(x)) * up(x))`` of Llama when ``gated=True``;
- no biases in the linear layers (as in Llama), so tensor parallelism has no bias to special-case.

Weights are drawn from a generator seeded by ``seed`` alone: the same seed gives the same model on every rank
and in the kernel, whatever else used the global random state before.

The model has seams, so that each parallelism is a transformation of this one model rather than a copy of it
(as torchtitan's ``parallelize`` and picotron's ``apply_tensor_parallel`` are):

- the attention *core* (``Attention.core``, causal SDPA by default) takes ``q, k, v`` as (batch, heads, time,
  head_dim) and can be replaced (ring attention, Ulysses); head counts are read from the projections' outputs,
  so a layer holding some of the heads runs the same forward;
- ``Attention.project`` and ``MLP.project`` are the input projections; tensor parallelism swaps the layers
  they call for one column-parallel layer that returns them all (``qkv_proj``, ``gate_up_proj``), and the
  module, its constructor's attributes and its forward stay the reference's;
- positions and the loss are inputs of :meth:`GPT.forward` (a context-parallel rank passes its positions,
  tensor parallelism sets a vocabulary-parallel ``loss_fn``);
- the blocks are named by their index in the whole model (:class:`Blocks`), so a pipeline stage that keeps
  some of them, and no embedding or no head (``None``), keeps the reference's names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 64
    seq_len: int = 32
    n_layers: int = 2
    d_model: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    d_ff: int = 256
    gated: bool = False
    tie_embeddings: bool = True
    norm_eps: float = 1e-5
    norm: str = "layernorm"  # or "rmsnorm"
    rope_theta: float | None = None  # rotary positions with this base; None: learned position embeddings

    @classmethod
    def llama_style(cls, **changes) -> "GPTConfig":
        """Llama's block: RMSNorm, rotary positions (base 10,000), SwiGLU, untied embeddings; GQA as given."""
        return cls(**{"norm": "rmsnorm", "rope_theta": 10000.0, "gated": True, "tie_embeddings": False,
                      **changes})

    def __post_init__(self):
        for field in ("vocab_size", "seq_len", "n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff"):
            if getattr(self, field) < 1:
                raise ValueError(f"GPTConfig.{field} must be positive, got {getattr(self, field)}")
        if self.d_model % self.n_heads:
            raise ValueError(f"n_heads={self.n_heads} must divide d_model={self.d_model}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads} "
                             f"(each KV head serves the same number of query heads)")
        if self.norm not in ("layernorm", "rmsnorm"):
            raise ValueError(f"norm={self.norm!r} is not one of 'layernorm', 'rmsnorm'")
        if self.rope_theta is not None and self.head_dim % 2:
            raise ValueError(f"rotary positions turn pairs of features: head_dim={self.head_dim} is odd")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def rotary_tables(positions: torch.Tensor, head_dim: int, theta: float, dtype=torch.float32):
    """RoPE's cosines and sines at ``positions``, (time, head_dim) each: feature pair ``(j, j + head_dim/2)``
    turns by ``position · theta^(-2j/head_dim)`` (Su et al. 2021). Computed in fp64, then cast."""
    features = torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device)
    inv_freq = theta ** (-features / head_dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, rope) -> torch.Tensor:
    """``x`` (batch, heads, time, head_dim) rotated by the tables ``rope = (cos, sin)`` of its positions."""
    cos, sin = rope
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal scaled dot-product attention; each of ``k.shape[1]`` KV heads serves ``n_rep`` query heads."""
    n_rep = q.shape[1] // k.shape[1]  # query heads per KV head
    k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    """Self-attention over ``n_heads`` query heads and ``n_kv_heads`` key/value heads; ``core`` attends."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int,
                 rope_theta: float | None = None):
        super().__init__()
        if n_heads % n_kv_heads:
            raise ValueError(f"n_kv_heads={n_kv_heads} must divide n_heads={n_heads}")
        self.head_dim, self.rope_theta = head_dim, rope_theta
        self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * head_dim, d_model, bias=False)
        self.qkv_proj = None  # one layer giving Q, K and V, when a parallelism swaps it in for the three
        self.core = causal_attention

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.qkv_proj is not None:
            return self.qkv_proj(x)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(self, x: torch.Tensor, rope=None) -> torch.Tensor:
        """``rope``: the rotary tables of the positions ``x`` holds (by default ``0 … time-1``)."""
        # (batch, time, heads * head_dim) -> (batch, heads, time, head_dim): as many heads as the weights give
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)).transpose(1, 2) for t in self.project(x))
        if self.rope_theta is not None:  # rotated before the core: a ring passes rotated keys around
            if rope is None:
                positions = torch.arange(q.shape[2], device=q.device)
                rope = rotary_tables(positions, self.head_dim, self.rope_theta, q.dtype)
            q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        y = self.core(q, k, v)
        return self.o_proj(y.transpose(1, 2).flatten(2))


class MLP(nn.Module):
    """``down(gelu(up(x)))``, or with ``gated`` Llama's ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, d_model: int, d_ff: int, gated: bool):
        super().__init__()
        self.gated = gated
        self.up_proj = nn.Linear(d_model, d_ff, bias=False)
        self.gate_proj = nn.Linear(d_model, d_ff, bias=False) if gated else None
        self.down_proj = nn.Linear(d_ff, d_model, bias=False)
        self.gate_up_proj = None  # one layer giving gate and up, when a parallelism swaps it in for the two

    def project(self, x: torch.Tensor):
        """The hidden layer's inputs: ``(gate, up)`` if gated, else ``up``."""
        if self.gate_up_proj is not None:
            return self.gate_up_proj(x)
        return (self.gate_proj(x), self.up_proj(x)) if self.gated else self.up_proj(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.project(x)
        return self.down_proj(F.silu(h[0]) * h[1] if self.gated else F.gelu(h))


def norm(cfg: GPTConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = norm(cfg)
        self.attn = Attention(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.rope_theta)
        self.ln2 = norm(cfg)
        self.mlp = MLP(cfg.d_model, cfg.d_ff, cfg.gated)

    def forward(self, x: torch.Tensor, rope=None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), rope)
        return x + self.mlp(self.ln2(x))


class Blocks(nn.ModuleDict):
    """The transformer blocks, named ``"0"``, ``"1"``, … by their index in the whole model (torchtitan's
    layout): a pipeline stage that deletes the others keeps the reference's parameter names. Indexing takes
    the layer's number; iterating gives the blocks in order."""

    def __getitem__(self, layer) -> nn.Module:
        return super().__getitem__(str(layer))

    def __iter__(self):
        return iter(self.values())


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model) if cfg.rope_theta is None else None
        self.blocks = Blocks({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.ln_f = norm(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.loss_fn = cross_entropy
        init_weights(self, seed)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, loss_fn=None):
        """Logits for ``idx`` (batch, time); with ``targets``, also the loss (``loss_fn``, by default the
        model's ``loss_fn``: the mean next-token cross-entropy).

        ``positions`` are the global positions of ``idx``'s columns (by default ``0 … time-1``; a rank holding
        part of the sequence passes its own): the learned embedding's rows, or the rotary tables every block
        shares. A model without ``tok_emb`` (a pipeline stage after the first) takes activations for ``idx``;
        one without ``lm_head`` (before the last) returns activations.
        """
        if positions is None:
            positions = torch.arange(idx.shape[1], device=idx.device)
        if positions.numel() and int(positions.max()) >= self.cfg.seq_len:
            raise ValueError(f"position {int(positions.max())} is past seq_len={self.cfg.seq_len}")
        x = idx if self.tok_emb is None else self.tok_emb(idx)
        if self.pos_emb is not None and self.tok_emb is not None:
            x = x + self.pos_emb(positions)
        rope = None
        if self.cfg.rope_theta is not None:  # computed once, shared by every block
            rope = rotary_tables(positions, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)
        for block in self.blocks:
            x = block(x, rope)
        if self.lm_head is None:
            return x
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return logits, (loss_fn or self.loss_fn)(logits, targets)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position of the batch, in at least fp32 (fp64 stays fp64)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@torch.no_grad()
def init_weights(model: GPT, seed: int) -> None:
    """GPT-2's initialisation (Radford et al. 2019): N(0, 0.02), residual outputs scaled by 1/sqrt(2L)."""
    gen = torch.Generator().manual_seed(seed)
    residual_std = 0.02 / math.sqrt(2 * model.cfg.n_layers)
    for name, p in model.named_parameters():  # a tied weight is listed once
        if name.endswith(("ln1.weight", "ln2.weight", "ln_f.weight")):
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.zero_()
        else:
            std = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
            p.copy_(torch.randn(p.shape, generator=gen) * std)
