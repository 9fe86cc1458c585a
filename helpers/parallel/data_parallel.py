"""Data parallelism from scratch (chapter 03): every rank holds the whole model and its own rows of the batch.

After backward each rank holds the gradient of *its* loss; averaging the gradients over the ranks gives the
gradient of the mean loss over the global batch, so every rank takes the same optimizer step. Four versions,
each a step towards PyTorch's ``DistributedDataParallel`` (Li et al. 2020):

- :func:`average_gradients`: one all-reduce per parameter, after backward;
- :func:`bucketed_average`: gradients packed into buckets of at most ``cap_bytes``, one all-reduce each;
- :class:`OverlappedDDP`: each bucket's all-reduce launched from autograd hooks as soon as its last gradient
  is accumulated, so communication runs while backward computes the remaining gradients;
- :meth:`OverlappedDDP.no_sync`: gradient accumulation, communicating only on the last micro-step.

Every ``torch.distributed.all_reduce`` is *booked* in the chapter 02 ledger
(:data:`helpers.parallel.ledger.LEDGER`): the booking proves the group and the buffer it was given, not the
bytes that moved. Given the book's own ring all-reduce (``OverlappedDDP(..., all_reduce=ring_all_reduce)``),
every message is *counted* instead.

:class:`CommunicationWatch` and :func:`check_communication` check the communication pattern from outside the
code under test: the watch's own gradient hooks and a wrapper around ``torch.distributed.all_reduce`` record,
in order, when each gradient was ready and when each all-reduce was called, and the check asks for buckets
within the cap that start before backward's last gradient. Only the order of events is used, never a time.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

from helpers.checks import check_equal
from helpers.parallel.ledger import LEDGER


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

    ``all_reduce`` replaces ``torch.distributed.all_reduce`` with a function ``all_reduce(tensor, group=...)``
    that returns the sum, such as the book's ``ring_all_reduce`` (chapter 02): it runs to completion inside
    the hook, and the ledger counts each of its messages.
    """

    def __init__(self, model: torch.nn.Module, cap_bytes: int, group=None, all_reduce=None):
        self.model, self.group, self.all_reduce = model, group, all_reduce
        self.world_size = dist.get_world_size(group)
        self.buckets = build_buckets(list(model.parameters()), cap_bytes)
        self.bucket_of = {p: i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.require_sync = True
        self.events: list[tuple[float, str, int]] = []  # (time, what, bucket)
        self._reset()
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in model.parameters()]

    def _reset(self) -> None:
        self.waiting = [len(bucket) for bucket in self.buckets]
        self.in_flight: list[tuple[int, torch.Tensor, dist.Work | None, torch.futures.Future]] = []

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
        self.events.append((time.perf_counter(), "launch", i))
        if self.all_reduce is None:
            LEDGER.record("all_reduce", flat, self.group)
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            future = work.get_future()
        else:  # synchronous: it returns the sum, every message counted by the ledger on the way
            work, future = None, torch.futures.Future()
            flat.copy_(self.all_reduce(flat, group=self.group))
            future.set_result(None)
        stamped = future.then(lambda _: self.events.append((time.perf_counter(), "done", i)))
        self.in_flight.append((i, flat, work, stamped))

    def finish(self) -> None:
        """Wait for every bucket and write the averaged gradients back into ``.grad``."""
        if self.require_sync and any(self.waiting):
            missing = [i for i, n in enumerate(self.waiting) if n]
            raise RuntimeError(f"buckets {missing} never became ready: a parameter got no gradient")
        for i, flat, work, stamped in self.in_flight:
            if work is not None:
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


class CommunicationWatch:
    """The order of events in a data-parallel step, recorded from outside the code under test.

    Create it on the model *before* the DDP under test: hooks on one tensor run in the order they were
    registered, so on every parameter the watch hears of the gradient before the DDP does. Inside
    ``with watch:``, ``torch.distributed.all_reduce`` is wrapped too. ``events`` then lists, in the order they
    happened on this rank, ``("grad", name, nbytes)`` when a parameter's gradient was accumulated and
    ``("all_reduce", numel, nbytes)`` when an all-reduce was called on a buffer. The hooks go at the end of
    the ``with`` block.
    """

    def __init__(self, model: torch.nn.Module):
        self.events: list[tuple[str, object, int]] = []
        self.param_bytes = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad(n))
                       for n, p in model.named_parameters()]
        self._all_reduce = None

    def _grad(self, name: str):
        return lambda p: self.events.append(("grad", name, p.numel() * p.element_size()))

    def __enter__(self):
        original = self._all_reduce = dist.all_reduce

        def all_reduce(tensor, *args, **kwargs):
            self.events.append(("all_reduce", tensor.numel(), tensor.numel() * tensor.element_size()))
            return original(tensor, *args, **kwargs)

        dist.all_reduce = all_reduce
        return self

    def __exit__(self, *exc) -> None:
        dist.all_reduce = self._all_reduce
        for hook in self._hooks:
            hook.remove()

    def all_reduce_bytes(self) -> list[int]:
        """The bytes of each all-reduce's buffer, in call order."""
        return [nbytes for kind, _, nbytes in self.events if kind == "all_reduce"]

    def launched_before_last_gradient(self) -> int:
        """How many all-reduces were called before the last gradient of backward was ready."""
        last = max((i for i, (kind, _, _) in enumerate(self.events) if kind == "grad"), default=-1)
        return sum(1 for kind, _, _ in self.events[:last] if kind == "all_reduce")


def check_communication(label: str, watch: CommunicationWatch, cap_bytes: int) -> None:
    """Bucketed, overlapped data parallelism, judged by the order of what ``watch`` saw on this rank.

    - the all-reduced buffers add up to the gradients' bytes: every gradient is sent once;
    - no buffer is over ``cap_bytes``, unless it is one parameter larger than the cap (it must go alone);
    - the buckets are full: no two consecutive all-reduces would have fitted under the cap together;
    - every all-reduce but the last is called before backward's last gradient: the last bucket to fill can
      only start once that gradient exists, every other one while backward is still running.
    """
    sizes = watch.all_reduce_bytes()
    lone = {n for n in watch.param_bytes.values() if n > cap_bytes}
    check_equal(f"{label}: bytes all-reduced = gradient bytes (each gradient once)", sum(sizes),
                sum(watch.param_bytes.values()), quiet=True)
    check_equal(f"{label}: buckets over the {cap_bytes:,}-byte cap", [f"{n:,} bytes" for n in sizes
                                                                     if n > cap_bytes and n not in lone], [],
                quiet=True)
    check_equal(f"{label}: consecutive buckets that would fit under the cap as one",
                [f"{a:,} + {b:,} bytes" for a, b in zip(sizes, sizes[1:]) if a + b <= cap_bytes], [],
                quiet=True)
    check_equal(f"{label}: all-reduces called before backward's last gradient, of {len(sizes)}",
                watch.launched_before_last_gradient(), max(0, len(sizes) - 1), quiet=True)
