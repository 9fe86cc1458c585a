"""μP (Yang et al. 2022) and its coordinate check (chapter 13): hyperparameters tuned on a narrow model that
still hold on a wide one.

:func:`to_mup` makes the book's GPT μP for Adam through its seams (the attention core scales the logits by
``1/d``, the loss divides the output logits by the width ratio) and re-scales its hidden matrices;
:func:`coordinate_check` records, step by step, the average size of each layer's output (the ``mup``
package's check), which stays put as the width grows under μP and drifts under the standard
parametrisation.
"""

from __future__ import annotations

import math

import torch

from helpers.model import GPT, causal_attention, cross_entropy
from helpers.reference import train_steps

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
