"""How far a bf16 run's loss may be from the fp64 single process's (chapter 15, issue 38): a bound derived
from bf16's unit roundoff ``u = 2^-8``, evaluated on the fp64 single process, never on the run it bounds.

The bf16 run (``precision="bf16"``: bf16 parameters and activations, fp32 masters stepped by AdamW in fp32,
gradients reduced in fp32) and the fp64 process start from the same parameters and see the same batches. At
step ``t`` their losses differ for two reasons, which add to first order:

1. **The forward of step t rounds.** A value ``x`` stored in bf16 is ``x(1 + e)`` with ``|e| <= u`` (round to
   nearest). To first order the loss moves by ``sum_x e_x · x · dL/dx`` over every rounded value, so by at
   most ``u · sum_x |x · dL/dx|``. The rounded values counted are the parameters forward reads (their bf16
   copies: ``|theta ⊙ g|``) and every module's output (each layer's result is stored in bf16: linears, norms,
   embeddings, attention, experts, blocks). Worst case over the signs of the errors: :func:`forward_term`.
2. **The parameters have drifted.** The masters took AdamW steps from gradients computed in bf16. Whatever the
   gradients' error, AdamW's step on a coordinate is at most ``lr · U_k`` (Cauchy-Schwarz on the
   bias-corrected moments: ``|m̂_k| <= U_k sqrt(v̂_k)`` with ``U_k = sqrt(sum_j w_kj^2 / v_kj)``, ``w`` and
   ``v`` the moments' weights of the gradient of step ``j``; ``U_1 = 1``: :func:`adam_step_bound`), so two
   runs' steps on one coordinate differ by at most ``2 lr U_k`` at step ``k``, and their parameters after
   ``t`` steps by at most ``D_t = 2 lr sum_{k<=t} U_k`` (the differences of one coordinate's steps may all
   have one sign). Summed in the worst case over 646,272 coordinates this is vacuous (``||g||_1 · 2 lr`` is
   about 15 here). The rounding errors that cause it have no preferred sign, so the bound takes the drifts of
   different coordinates as independent and of mean zero: each, bounded by ``D_t``, has a standard deviation
   of at most ``D_t``, so the loss's change ``g_t · δtheta_t`` has one of at most ``||g_t||_2 · D_t``, and
   the bound allows ``SIGMAS = 3`` of them (a number fixed before measuring: by Chebyshev's inequality a gap
   beyond it has probability at most 1/9 a step whatever the distribution, about 0.3% for a sum of so many
   independent terms, which is close to normal): :func:`drift_term`. Feedback (a drifted parameter changing
   later gradients) is inside it, since the cap on AdamW's step holds whatever the gradient.

Assumptions, stated: first order in ``u`` and in the drift (``D_t`` is 0.18 after 9 steps of ``lr = 1e-2``;
the curvature term is left out); the fp32 arithmetic of the
masters, the reductions and the loss is exact at this scale (``2^-24``); AdamW's ``eps`` only shrinks its
steps and decoupled weight decay shrinks the drift (by ``1 - lr·wd`` a step); rounding errors of different
coordinates independent (item 2 only). What item 1 leaves out: intermediates inside a module that are stored
in bf16 too (attention's scores and probabilities, the MLP's activation), which reach the module's output
through its own rounding; their roundings are not counted one by one.

Measured on the 5D run (10 steps; the test prints them): the bound is 0.06-0.5 a step, the largest gap 0.02,
at the first step after the first update (AdamW's first step is ``lr · sign(g)``: a coordinate whose gradient
is smaller than its bf16 error moves the other way).
"""

from __future__ import annotations

import math

import torch

UNIT_ROUNDOFF = 2.0 ** -8  # bf16: 8 significant bits (7 stored), round to nearest
SIGMAS = 3


def adam_step_bound(step: int, beta1: float = 0.9, beta2: float = 0.999) -> float:
    """``U_k``: the largest ``|m̂_k| / sqrt(v̂_k)`` AdamW can take at its step ``k`` (from 1), whatever the
    gradients: ``sqrt(sum_j w_j^2 / v_j)`` with ``w_j = (1-beta1) beta1^(k-j) / (1-beta1^k)`` and
    ``v_j = (1-beta2) beta2^(k-j) / (1-beta2^k)``."""
    if step < 1:
        raise ValueError(f"step={step}: AdamW's steps count from 1")
    total = 0.0
    for j in range(1, step + 1):
        w = (1 - beta1) * beta1 ** (step - j) / (1 - beta1 ** step)
        v = (1 - beta2) * beta2 ** (step - j) / (1 - beta2 ** step)
        total += w * w / v
    return math.sqrt(total)


def forward_term(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, u: float = UNIT_ROUNDOFF):
    """``u · (|theta ⊙ g|_1 + sum over module outputs |y ⊙ dL/dy|_1)`` at ``model``'s parameters, with the
    gradient ``g``; returns it, the loss, and ``||g||_2``. Leaves the gradients in the parameters."""
    outputs = []

    def keep(module, args, out):
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.retain_grad()
            outputs.append(out)
    hooks = [m.register_forward_hook(keep) for m in model.modules() if m is not model]
    try:
        loss = model(x, y)[1]
    finally:
        for h in hooks:
            h.remove()
    loss.backward()
    params = [p for p in model.parameters() if p.grad is not None]
    sensitivity = sum(float((p.detach() * p.grad).abs().sum()) for p in params)
    sensitivity += sum(float((o.detach() * o.grad).abs().sum()) for o in outputs if o.grad is not None)
    grad_norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in params))
    return u * sensitivity, float(loss.detach()), grad_norm


def drift_term(step: int, grad_norm: float, lr: float, sigmas: float = SIGMAS) -> float:
    """``sigmas · ||g_t||_2 · D_t`` with ``D_t = 2 lr sum_{k<=t} U_k``: the loss's change at step ``t`` (from
    0) from the masters' drift over the ``t`` updates before it (0 at step 0)."""
    return sigmas * grad_norm * 2 * lr * sum(adam_step_bound(k) for k in range(1, step + 1))


def bounds(model: torch.nn.Module, batches, lr: float) -> list[dict]:
    """The bound at every step of the fp64 single process ``model`` (an fp64 model; trained here with
    ``torch.optim.AdamW`` at ``lr``, its defaults, as ``capstone.reference_run`` trains it): per step the
    loss, the forward and drift terms and their sum."""
    if any(p.dtype != torch.float64 for p in model.parameters()):
        raise ValueError("the bound is evaluated on the fp64 single process: pass an fp64 model")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    out = []
    for t, (x, y) in enumerate(batches):
        forward, loss, grad_norm = forward_term(model, x, y)
        drift = drift_term(t, grad_norm, lr)
        out.append({"loss": loss, "forward": forward, "drift": drift, "bound": forward + drift})
        optimizer.step()
        optimizer.zero_grad()
    return out


__all__ = ["UNIT_ROUNDOFF", "SIGMAS", "adam_step_bound", "forward_term", "drift_term", "bounds"]
