"""What ``make bench``'s rows (issue 26) need besides the timing, on every rank: :func:`model_state_bytes` is
what a side holds on its fullest rank; :func:`batch_rows` is this rank's rows of a step's global batch. A
pair is timed by :func:`helpers.timing.alternate` (chapter 04 times with it too); the rows themselves are
:mod:`helpers.tools.bench_rows`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from helpers.data import get_batch, make_tokens, rank_rows
from helpers.timing import slowest


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
    return int(slowest([float(total)])[0])


def batch_rows(batch: int, seq_len: int, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the global batch of ``step``."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    x, y = get_batch(make_tokens(), step, batch, seq_len)
    return rank_rows(x, rank, world_size), rank_rows(y, rank, world_size)
