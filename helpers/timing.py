"""Timing two implementations against each other on every rank, the way chapter 04 and ``make bench`` do.

:func:`alternate` runs a warm-up of each side, then ``ours, theirs, ours, theirs, …``, every run started
together on every rank (a barrier, outside the timed region), and gives each run the slowest rank's seconds
(:func:`slowest`); :func:`compare` turns the paired runs into medians, interquartile ranges and the ratio of
the pairs, with the verdict "no measurable difference" when the middle half of the ratios contains 1.
Nothing here asserts a time: the numbers depend on the machine and its load.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist

from helpers import dist as book_dist
from helpers.parallel.ledger import LEDGER

NO_DIFFERENCE = "no measurable difference"


def slowest(times: list[float]) -> list[float]:
    """Each run's time on the slowest rank: one all-reduce for the whole list, after the runs."""
    t = torch.tensor(times, dtype=torch.float64, device=book_dist.device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def timed(fn) -> float:
    """Seconds this rank takes to run ``fn()``, started together with every other rank."""
    dist.barrier()  # every rank starts the run together; the barrier itself is not timed
    started = time.perf_counter()
    fn()
    if dist.get_backend() == "nccl":
        torch.cuda.synchronize()  # the GPU's work is done, not only queued
    return time.perf_counter() - started


def alternate(ours, theirs, *, warmup: int = 1, repeats: int | None = None, budget_s: float = 6.0,
              min_repeats: int = 5, max_repeats: int = 25) -> tuple[list[float], list[float]]:
    """``warmup`` runs of each, then ``ours, theirs, ours, …``: the slowest rank's seconds of each timed run.

    Without ``repeats``, as many pairs as fill ``budget_s`` at the warm-up's pace, within
    ``[min_repeats, max_repeats]`` (decided from the slowest rank's warm-up, so every rank runs as many).
    """
    warm = 0.0
    for _ in range(warmup):
        warm = timed(ours) + timed(theirs)
    if repeats is None:
        pace = slowest([warm])[0]
        repeats = max(min_repeats, min(max_repeats, int(budget_s / max(pace, 1e-6))))
    ours_s, theirs_s = [], []
    for _ in range(repeats):
        ours_s.append(timed(ours))
        theirs_s.append(timed(theirs))
    both = slowest(ours_s + theirs_s)
    LEDGER.clear()  # what the runs counted and booked (chapter 02's ledger), no longer needed
    return both[:repeats], both[repeats:]


def compare(ours: list[float], theirs: list[float]) -> dict:
    """Medians and IQRs of two sides' run times (seconds, in pairs: run i of each ran one after the other),
    and the ratio ours/theirs: the median of the pairs' ratios, with their quartiles, and the verdict."""
    o, t = np.asarray(ours, dtype=float), np.asarray(theirs, dtype=float)
    if o.shape != t.shape or not o.size:
        raise ValueError(f"paired runs needed: {o.size} of ours against {t.size} of theirs")
    (o25, o50, o75), (t25, t50, t75) = np.percentile(o, [25, 50, 75]), np.percentile(t, [25, 50, 75])
    q25, ratio, q75 = np.percentile(o / t, [25, 50, 75])
    if q25 <= 1 <= q75:  # the middle half of the pairs has ours both faster and slower
        verdict = NO_DIFFERENCE
    else:
        verdict = f"ours {ratio:.2f}x the time" if ratio > 1 else f"ours {1 / ratio:.2f}x as fast"
    return {"runs": int(o.size), "ours_ms": o50 * 1e3, "ours_iqr_ms": (o75 - o25) * 1e3,
            "theirs_ms": t50 * 1e3, "theirs_iqr_ms": (t75 - t25) * 1e3, "ratio": float(ratio),
            "ratio_q25": float(q25), "ratio_q75": float(q75), "verdict": verdict}
