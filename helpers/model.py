"""The book's small GPT (chapter 01): the single-process reference that every chapter shards.

A decoder-only transformer in plain PyTorch, in the shape vocabulary of chapter 01's calculator
(``n_layers``, ``d_model``, ``n_heads``, ``n_kv_heads``, ``d_ff``, ``vocab_size``, ``seq_len``):

- token and learned position embeddings; pre-norm blocks ``x + attn(ln1(x))``, ``x + mlp(ln2(x))``; a final
  LayerNorm and an LM head, tied to the token embedding or not;
- attention with grouped KV heads (GQA, Ainslie et al. 2023): ``n_kv_heads`` key/value heads, each shared by
  ``n_heads / n_kv_heads`` query heads; ``n_kv_heads == n_heads`` is ordinary multi-head attention;
- an MLP ``down(gelu(up(x)))``, or the gated ``down(silu(gate(x)) * up(x))`` of Llama when ``gated=True``;
- no biases in the linear layers (as in Llama), so tensor parallelism has no bias to special-case.

Weights are drawn from a generator seeded by ``seed`` alone: the same seed gives the same model on every rank
and in the kernel, whatever else used the global random state before.
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

    def __post_init__(self):
        for field in ("vocab_size", "seq_len", "n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff"):
            if getattr(self, field) < 1:
                raise ValueError(f"GPTConfig.{field} must be positive, got {getattr(self, field)}")
        if self.d_model % self.n_heads:
            raise ValueError(f"n_heads={self.n_heads} must divide d_model={self.d_model}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads} "
                             f"(each KV head serves the same number of query heads)")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


class Attention(nn.Module):
    """Causal self-attention over ``n_heads`` query heads and ``n_kv_heads`` key/value heads."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int):
        super().__init__()
        if n_heads % n_kv_heads:
            raise ValueError(f"n_kv_heads={n_kv_heads} must divide n_heads={n_heads}")
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * head_dim, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        n_rep = self.n_heads // self.n_kv_heads  # query heads per KV head
        k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, d_model: int, d_ff: int, gated: bool):
        super().__init__()
        self.gated = gated
        self.up_proj = nn.Linear(d_model, d_ff, bias=False)
        self.gate_proj = nn.Linear(d_model, d_ff, bias=False) if gated else None
        self.down_proj = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(F.gelu(self.up_proj(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
        self.ln2 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = MLP(cfg.d_model, cfg.d_ff, cfg.gated)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        init_weights(self, seed)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, pos_offset: int = 0):
        """Logits for ``idx`` (batch, time); with ``targets``, also the mean next-token cross-entropy.

        ``pos_offset`` is the global position of ``idx[:, 0]`` (a rank holding a later slice of the
        sequence passes its start).
        """
        t = idx.shape[1]
        if pos_offset + t > self.cfg.seq_len:
            raise ValueError(f"positions {pos_offset}..{pos_offset + t - 1} exceed "
                             f"seq_len={self.cfg.seq_len}")
        pos = torch.arange(pos_offset, pos_offset + t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return logits, cross_entropy(logits, targets)


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
