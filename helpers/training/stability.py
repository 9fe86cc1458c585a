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

:func:`train` runs the book's loop (:func:`helpers.reference.train_steps`) with the fixes a :class:`Fixes`
names (warm-up, global-norm clipping, Adam's betas and epsilon, skipping a step whose gradient norm is an
outlier) and records, step by step, what :class:`Record` lists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from helpers.model import GPT, causal_attention, cross_entropy
from helpers.reference import train_steps

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

    def __init__(self, head_dim: int, qk_norm: bool = False, cap: float | None = None):
        super().__init__()
        self.cap, self.max_logit, self.max_logit_seen, self.entropy = cap, None, None, None
        self.q_norm = nn.Parameter(torch.ones(head_dim)) if qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(head_dim)) if qk_norm else None

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
        block.attn.core = StabilityCore(block.attn.head_dim, qk_norm, attention_cap)
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


# ---------------------------------------------------------------------------------------------------------
# A run, recorded
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fixes:
    """What a run changes; every field at its default gives the unprotected run (torch's AdamW defaults)."""

    lr: float = 3e-2
    warmup: int = 0                       # linear warm-up over this many steps
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    clip: float | None = None             # global gradient-norm clipping at this norm
    z_coefficient: float = 0.0            # PaLM: 1e-4
    qk_norm: bool = False
    attention_cap: float | None = None    # Gemma 2: 50
    output_cap: float | None = None       # Gemma 2: 30
    qk_clip: float | None = None          # Kimi K2: tau = 100
    skip_sigmas: float | None = None      # OLMo-core: skip a step whose loss or gradient norm is 6 sigma out


def warmup_lr(step: int, lr: float, warmup: int) -> float:
    """Linear warm-up: ``lr * (step + 1) / warmup`` for the first ``warmup`` steps, then ``lr``."""
    return lr * min(1.0, (step + 1) / warmup) if warmup else lr


def above(value: float, history: list[float], sigmas: float) -> bool:
    """OLMo-core's test: ``value - mean(history) > sigmas * std(history)`` (the sample std). One-sided: a
    value that falls far below the mean is not an outlier; a history without spread makes any rise one."""
    h = torch.tensor(history, dtype=torch.float64)
    return value - float(h.mean()) > sigmas * float(h.std())


def is_outlier(loss: list[float], grad_norm: list[float], sigmas: float, window: int = 128) -> bool:
    """OLMo-core's skip rule (``SkipStepOptimizer.get_step_factor``, as of v2.5.0): the last step's loss or
    gradient norm lies more than ``sigmas`` standard deviations *above* the mean of the (up to) ``window``
    steps before it, judged once ``max(2, window // 2)`` values are known, the last one included (outliers
    stay in the history)."""
    if len(loss) < max(2, window // 2):
        return False
    return (above(loss[-1], loss[-window - 1:-1], sigmas)
            or above(grad_norm[-1], grad_norm[-window - 1:-1], sigmas))


def layer_of(name: str) -> str:
    """The layer a parameter's statistics are reported under: ``embeddings``, ``block i`` or ``head``."""
    if name.startswith("blocks."):
        return f"block {name.split('.')[1]}"
    return "embeddings" if name.startswith(("tok_emb", "pos_emb")) else "head"


def by_layer(names: list[str], squares: list[torch.Tensor]) -> dict[str, float]:
    """Per-tensor sums of squares (``squares``, one 0-d tensor each, in the order of ``names``) added up by
    layer (:func:`layer_of`): each layer's squared norm."""
    sums: dict[str, list] = {}
    for name, sq in zip(names, squares):
        sums.setdefault(layer_of(name), []).append(sq)
    return {layer: float(torch.stack(s).sum()) for layer, s in sums.items()}


def squared_norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's squared norm, in one call over the list."""
    return [n * n for n in torch._foreach_norm(tensors)]


@dataclass
class Record:
    """What a run records, one entry per step."""

    loss: list = field(default_factory=list)             # the batch's cross-entropy, before the step
    grad_norm: list = field(default_factory=list)        # the global gradient norm, before clipping
    grad_norm_after: list = field(default_factory=list)  # the same, measured on the gradients after clipping
    layer_grad_norm: list = field(default_factory=list)  # {layer: gradient norm}
    update_ratio: list = field(default_factory=list)     # {layer: ||W_after - W_before|| / ||W_before||}
    max_logit: list = field(default_factory=list)        # (layers, heads): each head's largest logit
    max_logit_seen: list = field(default_factory=list)   # the same after the soft-cap: what softmax sees
    entropy: list = field(default_factory=list)          # (layers, heads): mean attention entropy
    log_z: list = field(default_factory=list)            # mean over the batch's tokens
    max_output_logit: list = field(default_factory=list)  # largest |logit| the loss sees (after its cap)
    adam_scale: list = field(default_factory=list)       # {layer: sqrt(mean v_hat)}, Adam's gradient scale
    skipped: list = field(default_factory=list)          # steps whose update was skipped


class GuardedAdamW:
    """``torch.optim.AdamW`` with the schedule, the skip rule and QK-clip of ``fixes`` around its step, and
    the statistics of the update; ``step`` and ``zero_grad`` as :func:`helpers.reference.train_steps` calls
    them."""

    def __init__(self, model: GPT, fixes: Fixes, record: Record):
        self.model, self.fixes, self.rec, self.t = model, fixes, record, 0
        self.names, self.params = map(list, zip(*model.named_parameters()))
        self.count = by_layer(self.names, [torch.tensor(float(p.numel())) for p in self.params])
        self.adamw = torch.optim.AdamW(self.params, lr=fixes.lr, betas=fixes.betas, eps=fixes.eps,
                                       weight_decay=0.0, fused=True)  # one kernel for all tensors

    @torch.no_grad()
    def step(self):
        t, self.t, rec, fixes = self.t, self.t + 1, self.rec, self.fixes
        if fixes.skip_sigmas and is_outlier(rec.loss, rec.grad_norm, fixes.skip_sigmas):
            rec.skipped.append(t)
            rec.update_ratio.append(dict.fromkeys(rec.update_ratio[-1], 0.0))
            rec.adam_scale.append(rec.adam_scale[-1])
            return
        for group in self.adamw.param_groups:
            group["lr"] = warmup_lr(t, fixes.lr, fixes.warmup)
        before = [p.clone() for p in self.params]
        self.adamw.step()
        if fixes.qk_clip:
            for block, max_logit in zip(self.model.blocks, rec.max_logit[-1]):
                qk_clip_(block.attn, max_logit, fixes.qk_clip)
        moved = by_layer(self.names, squared_norms(torch._foreach_sub(self.params, before)))
        size = by_layer(self.names, squared_norms(before))
        rec.update_ratio.append({k: math.sqrt(moved[k] / size[k]) for k in moved})
        correction = 1 - fixes.betas[1] ** self.t  # every tensor has taken self.t steps
        v_sums = torch._foreach_norm([self.adamw.state[p]["exp_avg_sq"] for p in self.params], 1)  # v >= 0
        rec.adam_scale.append({k: math.sqrt(v / correction / self.count[k])
                               for k, v in by_layer(self.names, v_sums).items()})

    def zero_grad(self):
        self.adamw.zero_grad()


def forward_backward(model: GPT, fixes: Fixes, rec: Record):
    """One step's forward and backward, recorded (and the gradients clipped if ``fixes.clip``)."""
    def step(x, y):
        logits, loss = model(x, y)
        loss.backward()
        cores, loss_fn = [block.attn.core for block in model.blocks], model.loss_fn
        rec.loss.append(float(cross_entropy(logits.detach(), y)))
        rec.max_logit.append(torch.stack([core.max_logit for core in cores]))
        rec.max_logit_seen.append(torch.stack([core.max_logit_seen for core in cores]))
        rec.entropy.append(torch.stack([core.entropy for core in cores]))
        rec.log_z.append(float(loss_fn.log_z.mean()))
        rec.max_output_logit.append(loss_fn.max_logit)
        names, grads = zip(*((n, p.grad) for n, p in model.named_parameters()))
        squares = by_layer(names, squared_norms(list(grads)))
        rec.layer_grad_norm.append({k: math.sqrt(v) for k, v in squares.items()})
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), fixes.clip or math.inf)
        rec.grad_norm.append(float(norm))
        rec.grad_norm_after.append(math.sqrt(sum(float(n) for n in squared_norms(list(grads)))))
        return loss
    return step


def train(cfg, data, fixes: Fixes = Fixes(), seed: int = 0) -> tuple[GPT, Record]:
    """The GPT of ``cfg`` (seed ``seed``) trained on the batches ``data`` under ``fixes``, and its record."""
    model = stabilize(GPT(cfg, seed=seed), qk_norm=fixes.qk_norm, attention_cap=fixes.attention_cap,
                      z_coefficient=fixes.z_coefficient, output_cap=fixes.output_cap)
    rec = Record()
    optimizer = GuardedAdamW(model, fixes, rec)
    train_steps(None, data, step=forward_backward(model, fixes, rec), optimizer=optimizer)
    return model, rec


@torch.no_grad()
def held_out_loss(model: GPT, batches) -> float:
    """The mean cross-entropy over ``batches`` (no z-loss, no cap): what the model predicts."""
    return sum(float(cross_entropy(model(x), y)) for x, y in batches) / len(batches)


# ---------------------------------------------------------------------------------------------------------
# muP (Yang et al. 2022): the coordinate check
# ---------------------------------------------------------------------------------------------------------

HIDDEN = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def is_hidden(name: str) -> bool:
    """A hidden matrix: both its dimensions grow with the width (not the embeddings, not the head)."""
    parts = name.split(".")
    return parts[0] == "blocks" and parts[-1] == "weight" and parts[-2] in HIDDEN


def to_mup(model: GPT, base_width: int, lr: float) -> list[dict]:
    """Make ``model`` muP for Adam relative to ``base_width`` (in place; identical to the standard model at
    the base width): hidden matrices re-scaled to std ``* sqrt(base / width)`` (variance ~ 1/fan_in);
    attention logits ``q k^T / d`` (scaled to equal ``1/sqrt(d)`` at the base head size, through the core);
    output logits divided by ``width / base`` (through the loss). Returns AdamW's parameter groups: the
    hidden matrices at ``lr * base / width``, the rest at ``lr``."""
    ratio = model.cfg.d_model / base_width
    base_head_dim = model.cfg.head_dim / ratio

    def core(q, k, v):  # q k^T sqrt(d_base) / d = (q sqrt(d_base / d)) k^T / sqrt(d)
        return causal_attention(q * math.sqrt(base_head_dim / q.shape[-1]), k, v)

    def loss_fn(logits, targets):
        return cross_entropy(logits / ratio, targets)

    for block in model.blocks:
        block.attn.core = core
    model.loss_fn = loss_fn
    hidden = [p for n, p in model.named_parameters() if is_hidden(n)]
    with torch.no_grad():
        for p in hidden:
            p.mul_(ratio ** -0.5)
    rest = [p for n, p in model.named_parameters() if not is_hidden(n)]
    return [{"params": hidden, "lr": lr / ratio}, {"params": rest, "lr": lr}]


def coordinate_sizes(model: GPT, x: torch.Tensor, output_multiplier: float = 1.0) -> dict[str, float]:
    """The coordinate check's ``l1 = mean |x|`` (Yang et al.'s ``mup`` package) of the embedding, each
    block's output and the output logits (times ``output_multiplier``, as the loss sees them)."""
    sizes, hooks = {}, []
    for i, block in enumerate(model.blocks):
        hooks.append(block.register_forward_hook(
            lambda module, args, out, i=i: sizes.__setitem__(f"block {i}", float(out.abs().mean()))))
    hooks.append(model.tok_emb.register_forward_hook(
        lambda module, args, out: sizes.__setitem__("embedding", float(out.abs().mean()))))
    with torch.no_grad():
        sizes["logits"] = float((model(x) * output_multiplier).abs().mean())
    for hook in hooks:
        hook.remove()
    return sizes


def coordinate_check(cfg, data, lr: float, mup_base: int | None = None) -> list[dict[str, float]]:
    """:func:`coordinate_sizes` on the first batch before each of ``len(data)`` AdamW steps, the GPT of
    ``cfg`` standard (``mup_base=None``: one learning rate, GPT-2's init) or muP relative to ``mup_base``."""
    model = GPT(cfg, seed=0)
    groups = to_mup(model, mup_base, lr) if mup_base else [{"params": list(model.parameters()), "lr": lr}]
    multiplier = mup_base / cfg.d_model if mup_base else 1.0
    optimizer = torch.optim.AdamW(groups, weight_decay=0.0)
    sizes = []

    def step(x, y):
        sizes.append(coordinate_sizes(model, data[0][0], multiplier))
        loss = model(x, y)[1]
        loss.backward()
        return loss
    train_steps(None, data, step=step, optimizer=optimizer)
    sizes.append(coordinate_sizes(model, data[0][0], multiplier))
    return sizes
