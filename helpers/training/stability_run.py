"""A training run with chapter 13's fixes, recorded step by step (chapter 13).

:func:`train` runs the book's loop (:func:`helpers.reference.train_steps`) on the GPT made stable by
:func:`helpers.training.stability.stabilize`, with the fixes a :class:`Fixes` names (warm-up, global-norm
clipping, Adam's betas and epsilon, QK-norm, soft-caps, z-loss, QK-clip, skipping a step whose loss or
gradient norm is an outlier, as OLMo-core does) and records, step by step, what :class:`Record` lists: the
statistics that show a loss spike's cause.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from helpers.model import GPT, cross_entropy
from helpers.reference import train_steps
from helpers.training.stability import qk_clip_, stabilize


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
    h = torch.tensor(history, dtype=torch.float64, device="cpu")  # a few floats, read back as Python numbers
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
        sizes = [torch.tensor(float(p.numel()), device=p.device) for p in self.params]
        self.count = by_layer(self.names, sizes)
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
