"""What one rank of the capstone holds under ZeRO-3 after the measured step's backward (chapter 15).

Under ``zero=3`` the composition turns chapter 04's per-unit meters off, so ``capstone.train`` measures
nothing. :func:`live_memory` is chapter 04's :class:`~helpers.measure.LiveMemory` over the rank's chunks and
every optimizer of :class:`~helpers.parallel.composition.ChunksZero3` (each chunk's AdamW over its shards, and
the experts' plain AdamW), read from the storages alive when :meth:`~helpers.measure.LiveMemory.held` is
called; ``capstone.train`` calls it where it calls ZeRO-1's meter, after backward and before the step.

:func:`predicted` says what that should be, by LiveMemory's kinds, from the model's shapes
(:func:`helpers.training.capstone_bytes.chunk_params`): chapter 01's calculator with ``zero=3`` for the rank's
stage (:func:`calculator`), plus the differences it does not model, each named and computed from shapes
(:func:`differences`):

- where the layers are: the calculator's stage holds contiguous layers with its dense layers first and its
  experts split over tp; the rank holds its interleaved chunks, each MoE layer's experts whole;
- the shards are the optimizer's parameters, so LiveMemory counts them as optimizer states, not parameters;
- each chunk's root (embeddings, final norm and head) stays gathered for the whole step, its rows padded to
  the group (ZeRO-3's ``ceil(rows/N)`` per rank), while every block is freed after its backward;
- the reduce-scatter waits for the step, so the full gradient of every dense parameter is held until then
  (the calculator's ZeRO-3 keeps a shard of it);
- the padding rows of every shard, with both of AdamW's moments;
- AdamW's step counter, one 0-d tensor (the default dtype) per parameter it updates.
"""

from __future__ import annotations

import math

import torch

from helpers.cost import memory_budget
from helpers.measure import LiveMemory
from helpers.parallel import composition
from helpers.training import capstone
from helpers.training.capstone_bytes import chunk_params, rank_chunks

KINDS = ("parameters", "gradients", "optimizer states")


class _Optimizers:
    """Several optimizers seen as one by :class:`LiveMemory`: their parameter groups and their state, read
    when asked (the state appears at the first step)."""

    def __init__(self, optimizers):
        self.optimizers = optimizers

    @property
    def param_groups(self):
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self):
        return {p: s for o in self.optimizers for p, s in o.state.items()}


def live_memory(chunks: dict, opt) -> LiveMemory:
    """Chapter 04's meter over a rank's chunks and its :class:`composition.ChunksZero3` optimizer."""
    if not isinstance(opt, composition.ChunksZero3):
        raise ValueError(f"live_memory measures ZeRO-3's ChunksZero3, not {type(opt).__name__}: ZeRO-1 and "
                         f"plain AdamW have their own meter (capstone.train)")
    optimizers = [z.optimizer for z in opt.zeros] + ([opt.experts] if opt.experts else [])
    return LiveMemory(composition.holder(chunks), _Optimizers(optimizers))


def _shapes(run: capstone.Run, where: dict) -> dict:
    """The sums the predictions need, over the rank's chunks: dense numbers (``dense``), experts'
    (``experts``), the dense shards with their padding rows (``shards``), the roots' gathered rows
    (``roots``: ``N`` shards each), and the parameters of each kind (``n_dense``, ``n_experts``)."""
    n = run.dp * run.cp
    out = dict.fromkeys(("dense", "experts", "shards", "roots", "n_dense", "n_experts"), 0)
    for c in rank_chunks(run, where["pp"]):
        for p in chunk_params(run, c):
            if p.expert:
                out["experts"] += p.numel
                out["n_experts"] += 1
                continue
            shard = -(-p.shape[0] // n) * math.prod(p.shape[1:])
            out["dense"] += p.numel
            out["n_dense"] += 1
            out["shards"] += shard
            out["roots"] += n * shard if p.unit == "root" else 0
    return out


def _sizes(run: capstone.Run) -> tuple[int, int]:
    """Bytes of one number in the run's precision, and of AdamW's step counter (the default dtype)."""
    return torch.empty((), dtype=run.dtype).element_size(), torch.empty(()).element_size()


def predicted(run: capstone.Run, where: dict) -> dict[str, int]:
    """What LiveMemory should read on the rank at ``where`` after the measured step's backward, by kind."""
    _check(run)
    e, counter = _sizes(run)
    s = _shapes(run, where)
    counters = counter * (s["n_dense"] + s["n_experts"])
    if run.zero == 0:  # DDP: every parameter whole, its gradient, AdamW's two moments
        whole = s["dense"] + s["experts"]
        return {"parameters": e * whole, "gradients": e * whole, "optimizer states": 2 * e * whole + counters}
    return {"parameters": e * (s["roots"] + s["experts"]),
            "gradients": e * (s["dense"] + s["experts"]),
            "optimizer states": 3 * e * s["shards"] + 2 * e * s["experts"] + counters}


def calculator(run: capstone.Run, where: dict) -> memory_budget.Budget:
    """Chapter 01's budget of the rank's stage, with the run's ZeRO stage (no master copy: AdamW's two
    moments in the run's precision), and LayerNorm's statistics in the run's precision."""
    _check(run)
    e, _ = _sizes(run)
    precision = memory_budget.Precision(run.precision, e, e, 0, 2 * e, e)
    act = memory_budget.ActivationModel(norm_stat_bytes=2 * e)
    return memory_budget.budget(capstone.model_shape(run), run.batch(), run.layout(), precision, act=act,
                                stage=where["pp"], traffic=False)


def differences(run: capstone.Run, where: dict) -> list[tuple[str, str, int]]:
    """``(kind, why, bytes)``: what :func:`predicted` adds to :func:`calculator`'s figures, each named. The
    calculator plus these is the prediction, or this raises (a difference left unnamed)."""
    _check(run)
    e, counter = _sizes(run)
    s, b, n = _shapes(run, where), calculator(run, where), run.dp * run.cp
    dense_calc, experts_calc = _calculator_counts(run, where)
    shard_calc, shard = -(-dense_calc // n), -(-s["dense"] // n)
    placed = e * (s["experts"] - experts_calc)
    placed += e * (shard - shard_calc if run.zero == 3 else s["dense"] - dense_calc)
    out = [(kind, "layers placed by the interleaved schedule, experts whole over tp", k * placed)
           for kind, k in zip(KINDS, (1, 1, 2))]
    if run.zero == 3:
        out += [("parameters", "the shards are the optimizer's parameters: LiveMemory counts them there",
                 -e * shard),
                ("optimizer states", "the shards themselves", e * shard),
                ("parameters", "each chunk's root gathered for the step, rows padded", e * s["roots"]),
                ("gradients", "the reduce-scatter waits for the step: full dense gradients, not a shard",
                 e * (s["dense"] - shard)),
                ("optimizer states", "padding rows of the shards, with AdamW's two moments",
                 3 * e * (s["shards"] - shard))]
    out.append(("optimizer states", "AdamW's step counters, one per parameter",
                counter * (s["n_dense"] + s["n_experts"])))
    total = {k: getattr(b, a) for k, a in zip(KINDS, ("param_bytes", "grad_bytes", "optimizer_bytes"))}
    for kind, _, nbytes in out:
        total[kind] += nbytes
    if total != predicted(run, where):  # the two roads must meet: else a difference is missing
        raise RuntimeError(f"the calculator plus its named differences {total} is not the prediction "
                           f"{predicted(run, where)}")
    return out


def _calculator_counts(run: capstone.Run, where: dict) -> tuple[int, int]:
    """The calculator's (dense, expert) parameter counts of the rank's stage (``memory_budget``'s own)."""
    return memory_budget._stage_params(capstone.model_shape(run), run.layout())[where["pp"]]


def _check(run: capstone.Run) -> None:
    if run.zero not in (0, 3) or run.optimizer != "adamw" or run.dp * run.cp == 1:
        raise ValueError(f"zero={run.zero}, optimizer={run.optimizer!r}, dp*cp={run.dp * run.cp}: these "
                         f"predictions are DDP's (zero=0) or ZeRO-3's, with AdamW over a data-parallel group "
                         f"of 2 ranks or more")


__all__ = ["KINDS", "live_memory", "predicted", "calculator", "differences"]
