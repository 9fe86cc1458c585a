"""AdamW and Muon from scratch, in the order of operations of PyTorch's own (chapter 12).

- :class:`AdamW` (Loshchilov & Hutter 2019): Adam's two moments, bias-corrected, and a weight decay decoupled
  from the gradient (the parameter shrinks by ``lr * weight_decay`` before the Adam step). Its arithmetic is
  done in the order of ``torch.optim.AdamW``'s single-tensor path, so the two agree bit for bit.
- Muon (Jordan et al. 2024): Nesterov momentum (:func:`muon_update`), then the quintic Newton-Schulz iteration
  (:func:`newton_schulz`) that maps the momentum matrix to a nearby matrix with singular values close to 1,
  scaled by a factor of the matrix's shape (:func:`adjusted_lr`: Jordan's ``sqrt(max(1, rows/cols))``, or
  Moonlight's ``0.2 * sqrt(max(rows, cols))`` that makes the update's RMS match AdamW's, Liu et al. 2025).
  :class:`Muon` takes only matrices; :func:`muon_params` splits a GPT into the hidden matrices (for Muon)
  and the rest (embeddings, output head, norms, biases: for AdamW); :class:`MuonWithAdamW` steps both.

Like ``torch.optim.Muon``, Newton-Schulz runs in bf16 by default (``dtype``), and the update is added to the
parameter in the parameter's dtype.
"""

from __future__ import annotations

import math

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Jordan et al. 2024: the quintic's (a, b, c)


def newton_schulz(G: torch.Tensor, steps: int = 5, coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
                  eps: float = 1e-7, *, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``steps`` quintic Newton-Schulz iterations on the matrix ``G``, computed in ``dtype``.

    ``X = G / ||G||_F`` (so every singular value is at most 1), taken as ``G^T`` when ``G`` has more rows
    than columns (the Gram matrix ``X X^T`` is then the smaller one), and each step is
    ``X <- a X + (b A + c A^2) X`` with ``A = X X^T``: a polynomial ``a s + b s^3 + c s^5`` applied to every
    singular value ``s``, which pushes all of them towards 1 while keeping the singular vectors.
    """
    if G.ndim != 2:
        raise ValueError(f"Newton-Schulz orthogonalises a matrix: got a tensor of shape {tuple(G.shape)} "
                         f"({G.ndim}-D); give a {G.ndim}-D parameter to AdamW instead")
    a, b, c = coefficients
    X = G.to(dtype)
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    X = X / X.norm().clamp(min=eps)
    for _ in range(steps):
        A = X @ X.T
        B = torch.addmm(A, A, A, beta=b, alpha=c)  # b A + c A A, one fused call as in torch.optim.Muon
        X = torch.addmm(X, B, X, beta=a)           # a X + B X
    return X.T if tall else X


def muon_update(grad: torch.Tensor, momentum_buffer: torch.Tensor, momentum: float = 0.95,
                nesterov: bool = True, *, steps: int = 5,
                coefficients: tuple[float, float, float] = NS_COEFFICIENTS, eps: float = 1e-7,
                dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Muon's orthogonalised update for one matrix; ``momentum_buffer`` is updated in place.

    The buffer is an exponential average of the gradients, ``buf <- momentum buf + (1 - momentum) grad``;
    Nesterov looks one step ahead, ``grad + momentum (buf - grad)``. (Jordan's form ``buf <- momentum buf +
    grad`` differs by the factor ``1 - momentum``, which the normalisation in :func:`newton_schulz` removes.)
    """
    momentum_buffer.lerp_(grad, 1 - momentum)
    update = grad.lerp(momentum_buffer, momentum) if nesterov else momentum_buffer
    return newton_schulz(update, steps, coefficients, eps, dtype=dtype)


def adjusted_lr(lr: float, shape, mode: str | None = "original") -> float:
    """The learning rate for a matrix of ``shape`` (rows A, columns B), as ``torch.optim.Muon``'s
    ``adjust_lr_fn``: ``"original"`` (or None) ``lr sqrt(max(1, A/B))`` (Jordan et al. 2024);
    ``"match_rms_adamw"`` ``lr 0.2 sqrt(max(A, B))`` (Liu et al. 2025: an orthogonal update has RMS
    ``1/sqrt(max(A, B))``, so the update's RMS becomes 0.2, AdamW's typical one)."""
    A, B = shape[:2]
    if mode is None or mode == "original":
        return lr * math.sqrt(max(1, A / B))
    if mode == "match_rms_adamw":
        return lr * (0.2 * math.sqrt(max(A, B)))
    raise ValueError(f"adjusted_lr: mode={mode!r} is not one of 'original', 'match_rms_adamw'")


class AdamW(torch.optim.Optimizer):
    """AdamW from scratch: per parameter two states, the first moment ``m`` and the second ``v``."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2):
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= beta < 1 for beta in betas):
            raise ValueError(f"AdamW: lr={lr}, eps={eps}, weight_decay={weight_decay} must be >= 0 and "
                             f"betas={betas} in [0, 1)")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(step=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
                state["step"] += 1
                t, m, v, g = state["step"], state["m"], state["v"], p.grad
                p.mul_(1 - lr * wd)                       # decoupled weight decay: not part of the gradient
                m.lerp_(g, 1 - beta1)                     # m <- beta1 m + (1 - beta1) g
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)  # v <- beta2 v + (1 - beta2) g^2
                # p <- p - lr m_hat / (sqrt(v_hat) + eps), m_hat = m / (1-beta1^t), v_hat = v / (1-beta2^t);
                # the corrections are folded into a scalar step size and the denominator, as torch does
                step_size = lr / (1 - beta1 ** t)
                denom = (v.sqrt() / (1 - beta2 ** t) ** 0.5).add_(eps)
                p.addcdiv_(m, denom, value=-step_size)
        return loss


class Muon(torch.optim.Optimizer):
    """Muon from scratch, for 2-D parameters only; the arguments and defaults of ``torch.optim.Muon``."""

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
                 eps: float = 1e-7, ns_steps: int = 5, adjust_lr_fn: str | None = None,
                 dtype: torch.dtype = torch.bfloat16):
        adjusted_lr(lr, (1, 1), adjust_lr_fn)  # refuses an unknown mode now, not at the first step
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                                      ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps,
                                      adjust_lr_fn=adjust_lr_fn, dtype=dtype))
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"Muon takes matrices only: a parameter of shape {tuple(p.shape)} "
                                     f"({p.ndim}-D); give it to AdamW (muon_params splits a model)")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else closure()
        for group in self.param_groups:
            lr = group["lr"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                update = muon_update(p.grad, state["momentum_buffer"], group["momentum"], group["nesterov"],
                                     steps=group["ns_steps"], coefficients=group["ns_coefficients"],
                                     eps=group["eps"], dtype=group["dtype"])
                p.mul_(1 - lr * group["weight_decay"])  # decoupled, at the unscaled lr (as torch does)
                p.add_(update, alpha=-adjusted_lr(lr, p.shape, group["adjust_lr_fn"]))
        return loss


def muon_params(model: torch.nn.Module) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """``(matrices, rest)``: the hidden layers' 2-D weights for Muon; everything else for AdamW (the token
    and position embeddings, the output head, whether tied or not, norms' weights, biases)."""
    matrices, rest = [], []
    for name, p in model.named_parameters():  # a tied weight is listed once, as tok_emb.weight
        outside = name.split(".")[0] in ("tok_emb", "pos_emb", "lm_head")
        (matrices if p.ndim == 2 and not outside else rest).append(p)
    return matrices, rest


class MuonWithAdamW:
    """The two optimizers of a Muon run as one (``step``, ``zero_grad``): Muon on the hidden matrices,
    AdamW on the rest."""

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer):
        self.optimizers = (muon, adamw)

    def step(self):
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True):
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)


__all__ = ["NS_COEFFICIENTS", "newton_schulz", "muon_update", "adjusted_lr", "AdamW", "Muon", "muon_params",
           "MuonWithAdamW"]
