"""How ``make bench`` times a pair (issue 26), on every rank: :func:`alternate` runs a warm-up of each side,
then ``ours, theirs, ours, theirs, …``, every run started together on every rank (a barrier, outside the timed
region), and gives each run the slowest rank's seconds; :func:`model_state_bytes` is what a side holds on its
fullest rank; :func:`batch_rows` is this rank's rows of a step's global batch. The rows themselves are
:mod:`helpers.tools.bench_rows`.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from helpers.data import get_batch, make_tokens, rank_rows
from helpers.parallel.ledger import LEDGER


def _slowest(times: list[float]) -> list[float]:
    """Each run's time on the slowest rank: one all-reduce for the whole list, after the runs."""
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _timed(fn) -> float:
    dist.barrier()  # every rank starts the run together; the barrier itself is not timed
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def alternate(ours, theirs, *, warmup: int = 1, repeats: int | None = None, budget_s: float = 6.0,
              min_repeats: int = 5, max_repeats: int = 25) -> tuple[list[float], list[float]]:
    """``warmup`` runs of each, then ``ours, theirs, ours, …``: the slowest rank's seconds of each timed run.

    Without ``repeats``, as many pairs as fill ``budget_s`` at the warm-up's pace, within
    ``[min_repeats, max_repeats]`` (decided from the slowest rank's warm-up, so every rank runs as many).
    """
    warm = 0.0
    for _ in range(warmup):
        warm = _timed(ours) + _timed(theirs)
    if repeats is None:
        pace = _slowest([warm])[0]
        repeats = max(min_repeats, min(max_repeats, int(budget_s / max(pace, 1e-6))))
    ours_s, theirs_s = [], []
    for _ in range(repeats):
        ours_s.append(_timed(ours))
        theirs_s.append(_timed(theirs))
    both = _slowest(ours_s + theirs_s)
    LEDGER.clear()  # what the runs counted and booked (chapter 02's ledger), no longer needed
    return both[:repeats], both[repeats:]


def model_state_bytes(model: torch.nn.Module, optimizer) -> int:
    """Bytes of the distinct storages of this rank's parameters, gradients and optimizer parameters and state
    (a DTensor counts its local shard), on the fullest rank."""
    from torch.distributed.tensor import DTensor

    from helpers.measure import storage_bytes

    tensors = [t for p in model.parameters() for t in (p, p.grad)]
    for group in optimizer.param_groups:
        for p in group["params"]:
            tensors += [p, p.grad, *optimizer.state.get(p, {}).values()]
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, DTensor):
            t = t.to_local()
        if isinstance(t, torch.Tensor):
            address, nbytes = storage_bytes(t)
            if nbytes and address not in seen:
                seen.add(address)
                total += nbytes
    return int(_slowest([float(total)])[0])


def batch_rows(batch: int, seq_len: int, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the global batch of ``step``."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    x, y = get_batch(make_tokens(), step, batch, seq_len)
    return rank_rows(x, rank, world_size), rank_rows(y, rank, world_size)
