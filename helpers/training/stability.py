"""Training stability (chapter 13): the statistics that show a loss spike's cause, and the fixes large runs
use.

Every fix is a transformation of the one GPT of :mod:`helpers.model` through its seams, never a copy of it:

- the attention core (``Attention.core``) becomes a :class:`StabilityCore`, which computes the logits
  ``q k^T / sqrt(d)`` itself, records the largest logit of each head (what QK-clip and the figures read), and
  optionally normalises queries and keys first (QK-norm, Dehghani et al. 2023) or soft-caps the logits
  (Gemma 2: ``c tanh(x / c)`` with ``c = 50``);
- the loss seam (``GPT.loss_fn``) becomes :func:`stable_loss`: the output logits optionally soft-capped
  (Gemma 2: ``c = 30``), cross-entropy plus PaLM's z-loss ``1e-4 log^2 Z``, and ``log Z`` recorded;
- after the optimizer's step, :func:`qk_clip_` rescales ``W_q`` and ``W_k`` of a head whose largest logit
  passed ``tau`` (Kimi K2's QK-clip; for a KV head shared by ``n_rep`` query heads, Megatron-LM's rule: the
  largest logit among them).

QK-norm here sits *after* the rotary embedding: the attention's forward
(:meth:`helpers.model.Attention.forward`) rotates ``q`` and ``k`` before it calls the core, so the core
normalises rotated vectors; torchtitan's Qwen3 normalises each head *before* rotating it. A rotation keeps a
vector's length, so the two orders agree wherever the two features it turns together (``j`` and
``j + head_dim/2``) have the same gain, as at initialisation, and differ once the learned gains do.

The recorded training run that uses these fixes is :mod:`helpers.training.stability_run`; μP's coordinate
check is :mod:`helpers.training.mup`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from helpers.model import GPT, cross_entropy

# ---------------------------------------------------------------------------------------------------------
# The formulas
# ---------------------------------------------------------------------------------------------------------


def attention_logits(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``q k^T / sqrt(d)`` for every query and key head pair (keys repeated for grouped heads), the future
    masked with ``-inf``: (batch, heads, time, time)."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    future = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
    return s.masked_fill(future, float("-inf"))


def max_logit_per_head(s: torch.Tensor) -> torch.Tensor:
    """Each head's largest logit over the batch, queries and (visible) keys: Kimi K2's ``S_max^h``."""
    return s.detach().amax(dim=(0, 2, 3))


def attention_entropy(s: torch.Tensor) -> torch.Tensor:
    """Each head's attention entropy ``-sum_j p_j log p_j`` (in nats), averaged over the batch and the
    queries: ``log(visible keys)`` for uniform attention, 0 when every query attends to one key."""
    return torch.special.entr(torch.softmax(s.detach(), dim=-1)).sum(-1).mean(dim=(0, 2))


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """Gemma 2's soft-capping ``cap * tanh(x / cap)``: about ``x`` for ``|x| << cap``, never past ``cap``."""
    return cap * torch.tanh(x / cap)


def log_z(logits: torch.Tensor) -> torch.Tensor:
    """``log Z = log sum_i exp(logit_i)`` for each token: the softmax's normaliser, in fp32 at least."""
    return torch.logsumexp(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)


def z_loss(logits: torch.Tensor, coefficient: float = 1e-4,
           counted: torch.Tensor | None = None) -> torch.Tensor:
    """PaLM's auxiliary loss ``coefficient * log^2 Z``, averaged over the tokens: it pulls ``log Z`` to 0.
    ``counted`` (booleans, the logits' shape without the vocabulary): the tokens the loss counts, as the
    cross-entropy does those whose target is not -100; none counted gives 0."""
    squares = log_z(logits).pow(2)
    if counted is None:
        return coefficient * squares.mean()
    return coefficient * squares[counted].sum() / counted.sum().clamp(min=1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last dimension (a head's features, for QK-norm)."""
    return F.rms_norm(x, x.shape[-1:], weight, eps)


def qk_clip_factor(max_logit: torch.Tensor, tau: float = 100.0) -> torch.Tensor:
    """Kimi K2's ``gamma = min(1, tau / S_max)``: the factor that brings a head's largest logit back to tau
    (1 where ``S_max <= tau``, a negative ``S_max`` included)."""
    return torch.where(max_logit > tau, tau / max_logit, torch.ones_like(max_logit))


# ---------------------------------------------------------------------------------------------------------
# The seams: the attention core and the loss
# ---------------------------------------------------------------------------------------------------------


class StabilityCore(nn.Module):
    """Causal attention that computes its logits, records each head's largest (``max_logit``, detached) and
    its entropy, and optionally applies QK-norm (an RMSNorm over each head's features of ``q`` and of ``k``,
    with learned gains) or soft-caps the logits at ``cap``. ``max_logit`` is measured after QK-norm and before
    the cap (the logit the weights produce), ``max_logit_seen`` after the cap (what the softmax sees)."""

    def __init__(self, head_dim: int, qk_norm: bool = False, cap: float | None = None, device=None):
        super().__init__()
        self.cap, self.max_logit, self.max_logit_seen, self.entropy = cap, None, None, None
        self.q_norm = nn.Parameter(torch.ones(head_dim, device=device)) if qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(head_dim, device=device)) if qk_norm else None

    def forward(self, q, k, v):
        if self.q_norm is not None:
            q, k = rms_norm(q, self.q_norm), rms_norm(k, self.k_norm)
        s = attention_logits(q, k)
        self.max_logit = max_logit_per_head(s)
        if self.cap is not None:
            s = soft_cap(s, self.cap)
        self.max_logit_seen = max_logit_per_head(s) if self.cap is not None else self.max_logit
        self.entropy = attention_entropy(s)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        return torch.softmax(s, dim=-1) @ v


class StableLoss:
    """The loss seam: cross-entropy of the logits, soft-capped at ``cap`` if given, plus the z-loss with
    ``z_coefficient``; keeps the last batch's ``log Z`` per token and its largest ``|logit|`` (detached, of
    the logits the softmax sees: after the cap)."""

    def __init__(self, z_coefficient: float = 0.0, cap: float | None = None):
        self.z_coefficient, self.cap, self.log_z, self.max_logit = z_coefficient, cap, None, None

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.cap is not None:
            logits = soft_cap(logits, self.cap)
        self.log_z, self.max_logit = log_z(logits.detach()), float(logits.detach().abs().max())
        loss = cross_entropy(logits, targets)
        counted = targets != -100  # the cross-entropy's ignore_index: no z-loss where it counts no loss
        return loss + z_loss(logits, self.z_coefficient, counted) if self.z_coefficient else loss


def stabilize(model: GPT, *, qk_norm: bool = False, attention_cap: float | None = None,
              z_coefficient: float = 0.0, output_cap: float | None = None) -> GPT:
    """Set ``model``'s attention cores and loss to the chapter's (in place): every fix off records only."""
    for block in model.blocks:
        device = next(block.parameters()).device  # the gains live beside the block's weights
        block.attn.core = StabilityCore(block.attn.head_dim, qk_norm, attention_cap, device)
    model.loss_fn = StableLoss(z_coefficient, output_cap)
    return model


@torch.no_grad()
def qk_clip_(attn: nn.Module, max_logit: torch.Tensor, tau: float = 100.0) -> torch.Tensor:
    """QK-clip one attention layer in place; returns the factor ``gamma`` of each query head.

    Kimi K2 (multi-head attention): a head ``h`` with ``S_max^h > tau`` has ``W_q^h`` and ``W_k^h`` each
    multiplied by ``sqrt(gamma_h)``, ``gamma_h = tau / S_max^h``, so its logits, bilinear in the two, shrink
    by ``gamma_h``. A key head shared by ``n_rep`` query heads (GQA) takes Megatron-LM's rule: the largest
    logit among those query heads decides one ``gamma`` for the key head and all of them.
    """
    n_kv = attn.k_proj.weight.shape[0] // attn.head_dim
    n_rep = max_logit.numel() // n_kv
    gamma = qk_clip_factor(max_logit.view(n_kv, n_rep).amax(dim=1), tau)  # one per key head
    d = attn.head_dim
    attn.q_proj.weight.view(n_kv, n_rep * d, -1).mul_(gamma.sqrt().view(n_kv, 1, 1))
    attn.k_proj.weight.view(n_kv, d, -1).mul_(gamma.sqrt().view(n_kv, 1, 1))
    return gamma.repeat_interleave(n_rep)
