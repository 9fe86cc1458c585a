"""Data parallelism from scratch (chapter 03): every rank holds the whole model and its own rows of the batch.

After backward each rank holds the gradient of *its* loss; averaging the gradients over the ranks gives the
gradient of the mean loss over the global batch, so every rank takes the same optimizer step. Four versions,
each a step towards PyTorch's ``DistributedDataParallel`` (Li et al. 2020):

- :func:`average_gradients`: one all-reduce per parameter, after backward;
- :func:`bucketed_average`: gradients packed into buckets of at most ``cap_bytes``, one all-reduce each;
- :class:`OverlappedDDP`: each bucket's all-reduce launched from autograd hooks as soon as its last gradient
  is accumulated, so communication runs while backward computes the remaining gradients;
- :meth:`OverlappedDDP.no_sync`: gradient accumulation, communicating only on the last micro-step.

Every all-reduce goes through :func:`helpers.parallel.comms.all_reduce`, *booked* in the chapter 02 ledger
(:data:`helpers.parallel.ledger.LEDGER`): the booking proves the group and the buffer it was given, not the
bytes that moved. Given the book's own ring all-reduce (``OverlappedDDP(..., all_reduce=ring_all_reduce)``),
every message is *counted* instead.

:class:`CommunicationWatch` and :func:`check_communication` check the communication pattern from outside the
code under test: the watch's own gradient hooks record when each gradient was ready, and a dispatch mode
(:class:`helpers.measure.TorchCollectives`) every ``torch.distributed`` operation that ran,
however it was called; the check asks for buckets within the cap that start before backward's last gradient.
Only the order of events is used, never a time.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

from helpers.checks import check_equal
from helpers.parallel import comms
from helpers.measure import TorchCollectives


def average_gradients(model: torch.nn.Module, group=None) -> None:
    """Naive data parallelism: all-reduce every gradient, one collective per parameter, and divide by N."""
    world_size = dist.get_world_size(group)
    for p in model.parameters():
        comms.all_reduce(p.grad, group)
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


def _flat_views(bucket: list[torch.nn.Parameter]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One zeroed buffer for the bucket's gradients, and a view of it shaped like each parameter."""
    flat = torch.zeros(sum(p.numel() for p in bucket), dtype=bucket[0].dtype, device=bucket[0].device)
    return flat, [v.view_as(p) for v, p in zip(flat.split([p.numel() for p in bucket]), bucket)]


def bucketed_average(buckets: list[list[torch.nn.Parameter]], group=None) -> None:
    """After backward: one all-reduce per bucket, over a flat copy of the bucket's gradients."""
    world_size = dist.get_world_size(group)
    for bucket in buckets:
        flat = _flatten([p.grad for p in bucket])
        comms.all_reduce(flat, group)
        flat /= world_size
        _unflatten_into(flat, bucket)


class BucketTimeline:
    """When, on this rank, each gradient became ready and each bucket's all-reduce was launched and completed:
    ``events`` lists ``(time, what, bucket)``, for chapter 03's figure (no check reads a time)."""

    def __init__(self):
        self.events: list[tuple[float, str, int]] = []

    def stamp(self, what: str, i: int) -> None:
        self.events.append((time.perf_counter(), what, i))

    def launched(self, i: int, pending: comms.Pending) -> comms.Pending:
        """Stamp bucket ``i``'s launch now, its completion from a callback on the collective's future; the
        result's ``wait()`` waits for that stamp too."""
        self.stamp("launch", i)
        if not pending.works:  # nothing in flight: the ring ran to completion inside the call
            self.stamp("done", i)
        stamps = [work.get_future().then(lambda _: self.stamp("done", i)) for work in pending.works]
        return comms.Pending(stamps, pending.wait, pending.what)


class OverlappedDDP:
    """Bucketed all-reduces launched from autograd hooks, overlapping the rest of backward.

    ``register_post_accumulate_grad_hook`` runs a hook once a parameter's gradient for this backward pass is
    complete in ``.grad``. When the last parameter of a bucket reports, the bucket is divided by N (before
    the sum, as PyTorch's default hook does) and all-reduced asynchronously; :meth:`finish` waits for every
    bucket. Each bucket is one flat buffer, and its parameters' ``.grad`` are views of it (PyTorch's
    ``gradient_as_bucket_view``): backward accumulates straight into the buffer and the all-reduce averages
    it in place, so nothing is flattened or copied back. A gradient that is not such a view (at the first
    step, or after ``zero_grad(set_to_none=True)``) is copied in once and replaced by its view.
    ``timeline`` (a :class:`BucketTimeline`) records, per rank, when each gradient became ready and when
    each bucket was launched and completed, for the figure.

    ``all_reduce`` replaces ``torch.distributed.all_reduce`` with a function ``all_reduce(tensor, group=...)``
    that returns the sum, such as the book's ``ring_all_reduce`` (chapter 02): it runs to completion inside
    the hook, and the ledger counts each of its messages. ``buckets`` (lists of the model's parameters)
    replaces :func:`build_buckets`'s.
    """

    def __init__(self, model: torch.nn.Module, cap_bytes: int, group=None, all_reduce=None, buckets=None):
        self.model, self.group, self.all_reduce = model, group, all_reduce
        self.world_size = dist.get_world_size(group)
        self.buckets = buckets or build_buckets(list(model.parameters()), cap_bytes)
        self.bucket_of = {p: i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.flat = [_flat_views(bucket) for bucket in self.buckets]  # per bucket: (buffer, its views)
        self.require_sync = True
        self.timeline = BucketTimeline()
        self._reset()
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def _reset(self) -> None:
        self.waiting = [len(bucket) for bucket in self.buckets]  # per bucket: the gradients still to come
        self.in_flight: list[tuple[int, comms.Pending]] = []

    def _grad_ready(self, p: torch.nn.Parameter) -> None:
        """One more gradient of its bucket is complete; the bucket's last one launches the bucket."""
        i = self.bucket_of[p]
        self.timeline.stamp("grad ready", i)
        if not self.require_sync:
            return
        self.waiting[i] -= 1
        if self.waiting[i] == 0:
            self._launch(i)

    def _launch(self, i: int) -> None:
        """Divide bucket ``i``'s buffer by N, and start its all-reduce, in place, without waiting for it."""
        flat, views = self.flat[i]
        for p, view in zip(self.buckets[i], views):
            if p.grad.data_ptr() != view.data_ptr():  # not yet (or no longer) a view of the buffer
                view.copy_(p.grad)
                p.grad = view
        flat.div_(self.world_size)
        if self.all_reduce is None:
            pending = comms.all_reduce(flat, self.group, async_op=True)
        else:  # the book's ring runs to completion here, every message counted by the ledger
            total = self.all_reduce(flat, group=self.group)
            pending = comms.Pending([], lambda: flat.copy_(total), f"the ring all-reduce of bucket {i}")
        self.in_flight.append((i, self.timeline.launched(i, pending)))

    def finish(self) -> None:
        """Wait for every bucket: then every ``.grad``, a view of its bucket, holds the average."""
        if self.require_sync and any(self.waiting):
            missing = [i for i, n in enumerate(self.waiting) if n]
            raise RuntimeError(f"buckets {missing} never became ready: a parameter got no gradient")
        for _, pending in self.in_flight:
            pending.wait()
        self._reset()

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally: the micro-steps inside communicate nothing."""
        self.require_sync = False
        try:
            yield
        finally:
            self.require_sync = True


class CommunicationWatch(TorchCollectives):
    """The order of events in a data-parallel step, recorded from outside the code under test.

    Create it on the model *before* the DDP under test: hooks on one tensor run in the order they were
    registered, so on every parameter the watch hears of the gradient before the DDP does. Inside
    ``with watch:`` it is a :class:`~helpers.measure.TorchCollectives`: ``calls`` records
    every ``torch.distributed`` operation that runs, however it was called, in order; ``grads`` lists ``(name,
    nbytes, calls)`` for each gradient accumulated, ``calls`` being how many operations had run by then. The
    hooks go at the end of the ``with`` block.
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.grads: list[tuple[str, int, int]] = []
        self.param_bytes = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad(n))
                       for n, p in model.named_parameters()]

    def _grad(self, name: str):
        return lambda p: self.grads.append((name, p.numel() * p.element_size(), len(self.calls)))

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        for hook in self._hooks:
            hook.remove()

    def all_reduce_bytes(self, calls: int | None = None) -> list[int]:
        """The bytes of each all-reduce's buffer, in call order (among the first ``calls`` operations)."""
        return [sum(numels) * size for op, _, numels, size in self.calls[:calls] if op == "allreduce_"]

    def launched_before_last_gradient(self) -> int:
        """How many all-reduces were called before the last gradient of backward was ready."""
        return len(self.all_reduce_bytes(self.grads[-1][2] if self.grads else 0))


def check_communication(label: str, watch: CommunicationWatch, cap_bytes: int,
                        overlapped: bool = True) -> None:
    """Bucketed data parallelism, judged by the order of what ``watch`` saw on this rank.

    - the all-reduced buffers add up to the gradients' bytes: every gradient is sent once;
    - no buffer is over ``cap_bytes``, unless it is one parameter larger than the cap (it must go alone);
    - the buckets are full: no two consecutive all-reduces would have fitted under the cap together;
    - ``overlapped``: every all-reduce but the last is called before backward's last gradient (the last bucket
      to fill can only start once that gradient exists, every other one while backward is still running);
      not ``overlapped`` (all-reduces after backward, by design): none is called before that gradient.
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
                watch.launched_before_last_gradient(), max(0, len(sizes) - 1) if overlapped else 0,
                quiet=True)
