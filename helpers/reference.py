"""The training loop and the state vocabulary every chapter uses (chapter 03): one loop for the single
process and for the ranks.

- :func:`train_steps` runs AdamW over a list of batches; what one step computes (a forward and backward, a
  pipeline schedule, a gradient all-reduce after backward) is the ``step`` passed in, so the kernel's
  single-process reference and every rank run the same loop.
- :func:`named_params` and :func:`named_grads` are "the model's parameters (gradients) as a dict", detached
  copies; a DTensor (FSDP2, ``tensor.parallel``) is gathered whole with ``full_tensor()`` (a collective: every
  rank of its mesh must call it) or, with ``full=False``, given as this rank's local shard.
- :func:`batches` is the data of ``steps`` steps, as :func:`helpers.data.get_batch` cuts it.
"""

from __future__ import annotations

import torch
from torch import nn

from helpers.data import get_batch


def _plain(t: torch.Tensor, full: bool) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.full_tensor() if full else t.to_local()
    return t.detach().clone()


def named_params(model: nn.Module, *, full: bool = True) -> dict[str, torch.Tensor]:
    """Every parameter of ``model`` by name, detached and copied."""
    return {name: _plain(p, full) for name, p in model.named_parameters()}


def named_grads(model: nn.Module, *, full: bool = True) -> dict[str, torch.Tensor]:
    """Every parameter's gradient by name, detached and copied; a parameter without one raises, naming it."""
    missing = [name for name, p in model.named_parameters() if p.grad is None]
    if missing:
        raise ValueError(f"no gradient for {', '.join(missing[:3])}{' …' if len(missing) > 3 else ''}: "
                         f"run backward first (or this rank does not use them)")
    return {name: _plain(p.grad, full) for name, p in model.named_parameters()}


def batches(tokens: torch.Tensor, steps: int, rows: int, seq_len: int) -> list:
    """``(inputs, targets)`` of steps ``0 … steps-1``: ``rows`` sequences each."""
    return [get_batch(tokens, step, rows, seq_len) for step in range(steps)]


def _forward_backward(model: nn.Module):
    def step(xs, ys):
        loss = model(xs, ys)[1]
        loss.backward()
        return loss
    return step


def train_steps(model: nn.Module | None, data, *, lr: float | None = None, step=None, params=None,
                optimizer: torch.optim.Optimizer | None = None) -> list[float | None]:
    """One optimizer step per ``(inputs, targets)`` of ``data``; the losses, as floats.

    ``step(inputs, targets)`` computes the gradients and returns the loss (``None`` on a rank that has none,
    a pipeline stage before the last); by default the model's own forward and backward. The optimizer is AdamW
    at ``lr`` over ``params`` (by default the model's), unless one is given.
    """
    step = step or _forward_backward(model)
    if (optimizer is None) == (lr is None):
        raise ValueError("give train_steps either lr (for AdamW) or an optimizer, not both")
    if optimizer is None:
        optimizer = torch.optim.AdamW(model.parameters() if params is None else params, lr=lr)
    losses = []
    for xs, ys in data:
        loss = step(xs, ys)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(None if loss is None else float(torch.as_tensor(loss).detach()))
    return losses


__all__ = ["named_params", "named_grads", "batches", "train_steps"]
