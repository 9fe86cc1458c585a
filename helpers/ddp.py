"""Data parallelism from scratch (chapter 03): every rank holds the whole model and its own slice of the batch.

After backward each rank holds the gradient of *its* loss; averaging the gradients over the ranks gives the
gradient of the mean loss over the global batch, so every rank takes the same optimizer step. Four versions,
each a step towards PyTorch's ``DistributedDataParallel`` (Li et al. 2020):

- :func:`average_gradients`: one all-reduce per parameter, after backward;
- :func:`bucketed_average`: gradients packed into buckets of at most ``cap_bytes``, one all-reduce each;
- :class:`OverlappedDDP`: each bucket's all-reduce launched from autograd hooks as soon as its last gradient
  is accumulated, so communication runs while backward computes the remaining gradients;
- :meth:`OverlappedDDP.no_sync`: gradient accumulation, communicating only on the last micro-step.

Every collective is booked in the chapter 02 ledger (:data:`helpers.ledger.LEDGER`).
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

from .ledger import LEDGER


def average_gradients(model: torch.nn.Module, group=None) -> None:
    """Naive data parallelism: all-reduce every gradient, one collective per parameter, and divide by N."""
    world_size = dist.get_world_size(group)
    for p in model.parameters():
        LEDGER.record("all_reduce", p.grad, group)
        dist.all_reduce(p.grad, group=group)
        p.grad /= world_size


def build_buckets(params: list[torch.nn.Parameter], cap_bytes: int) -> list[list[torch.nn.Parameter]]:
    """Group parameters into buckets of at most ``cap_bytes`` of gradient each.

    Parameters are taken in *reverse* order of registration, which is roughly the order backward produces
    their gradients (the last layer first), so the first bucket is ready first. A parameter larger than the
    cap gets a bucket of its own.
    """
    buckets, current, size = [], [], 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if current and size + nbytes > cap_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def _flatten(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.reshape(-1) for g in grads])


def _unflatten_into(flat: torch.Tensor, params: list[torch.nn.Parameter]) -> None:
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
        offset += n


def bucketed_average(buckets: list[list[torch.nn.Parameter]], group=None) -> None:
    """After backward: one all-reduce per bucket, over a flat copy of the bucket's gradients."""
    world_size = dist.get_world_size(group)
    for bucket in buckets:
        flat = _flatten([p.grad for p in bucket])
        LEDGER.record("all_reduce", flat, group)
        dist.all_reduce(flat, group=group)
        flat /= world_size
        _unflatten_into(flat, bucket)


class OverlappedDDP:
    """Bucketed all-reduces launched from autograd hooks, overlapping the rest of backward.

    ``register_post_accumulate_grad_hook`` runs a hook once a parameter's gradient for this backward pass is
    complete in ``.grad``. When the last parameter of a bucket reports, the bucket is flattened, divided by N
    (before the sum, as PyTorch's default hook does) and all-reduced asynchronously; :meth:`finish` waits for
    every bucket and copies the averages back. ``events`` records, per rank, when each gradient became ready
    and when each bucket was launched and completed, for the timeline.
    """

    def __init__(self, model: torch.nn.Module, cap_bytes: int, group=None):
        self.model, self.group = model, group
        self.world_size = dist.get_world_size(group)
        self.buckets = build_buckets(list(model.parameters()), cap_bytes)
        self.bucket_of = {p: i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.require_sync = True
        self.events: list[tuple[float, str, int]] = []  # (time, what, bucket)
        self._reset()
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in model.parameters()]

    def _reset(self) -> None:
        self.waiting = [len(bucket) for bucket in self.buckets]
        self.in_flight: list[tuple[int, torch.Tensor, dist.Work, torch.futures.Future]] = []

    def _grad_ready(self, p: torch.nn.Parameter) -> None:
        i = self.bucket_of[p]
        self.events.append((time.perf_counter(), "grad ready", i))
        if not self.require_sync:
            return
        self.waiting[i] -= 1
        if self.waiting[i] == 0:
            self._launch(i)

    def _launch(self, i: int) -> None:
        flat = _flatten([p.grad for p in self.buckets[i]])
        flat /= self.world_size
        LEDGER.record("all_reduce", flat, self.group)
        self.events.append((time.perf_counter(), "launch", i))
        work = dist.all_reduce(flat, group=self.group, async_op=True)
        stamped = work.get_future().then(lambda _: self.events.append((time.perf_counter(), "done", i)))
        self.in_flight.append((i, flat, work, stamped))

    def finish(self) -> None:
        """Wait for every bucket and write the averaged gradients back into ``.grad``."""
        if self.require_sync and any(self.waiting):
            missing = [i for i, n in enumerate(self.waiting) if n]
            raise RuntimeError(f"buckets {missing} never became ready: a parameter got no gradient")
        for i, flat, work, stamped in self.in_flight:
            work.wait()
            stamped.wait()  # the completion time is recorded too
            _unflatten_into(flat, self.buckets[i])
        self._reset()

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally: the micro-steps inside communicate nothing."""
        self.require_sync = False
        try:
            yield
        finally:
            self.require_sync = True

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
