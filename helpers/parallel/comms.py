"""The collectives later chapters call (chapter 02): every ``torch.distributed`` call booked once.

Chapter 02 builds collectives from point-to-point messages; that is the lesson, and it stays there. Every
later chapter calls ``torch.distributed``'s own through this module, so that each call is written into
:data:`helpers.parallel.ledger.LEDGER` exactly once, from the tensor that goes on the wire:

- :func:`all_reduce`, in place; :func:`all_gather` and :func:`reduce_scatter` along any dimension (a
  reduce-scatter can pad a dimension the ranks do not divide); :func:`all_to_all` with split sizes, booked
  under a label of the caller's choice — these are *booked* (the formula's bytes for the buffer passed);
- :func:`send`, :func:`recv` and :func:`send_recv`, tagged point-to-point messages, each *counted* as one
  message of its bytes, with the peer in the group's numbering.

Every call takes ``group`` (ranks are always numbered within it) and ``async_op``: with it the call returns a
:class:`Pending` whose ``wait()`` returns the result. ``wire_dtype`` sends another dtype than the tensor's: a
reduction in bf16 of fp32 gradients (cast, reduce, cast back), or an fp8 tensor sent as its ``uint8`` bytes,
which gloo can move but not add. The booking is of the tensor on the wire, so its bytes are the wire's.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from helpers.dist import collective_timeout
from helpers.parallel.ledger import LEDGER

_FP8 = tuple(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu")
             if hasattr(torch, name))
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _op(name: str):
    if name not in _OPS:
        raise ValueError(f"op={name!r} is not one of {', '.join(map(repr, _OPS))}")
    return _OPS[name]


class Pending:
    """A collective in flight: ``wait()`` waits for it and returns its result."""

    def __init__(self, works, finish, what: str, timeout_s: float | None = None):
        # a synchronous torch call returns None for its work: there is nothing to wait for
        self.works = [work for work in works if work is not None]
        self.finish, self.what, self.timeout_s = finish, what, timeout_s
        self.result = None
        self.done = False

    def wait(self) -> torch.Tensor:
        if not self.done:  # a gloo work waited for a second time waits for a message that never comes
            try:
                for work in self.works:
                    if self.timeout_s is None:
                        work.wait()
                    else:
                        work.wait(timeout=timedelta(seconds=self.timeout_s))
            except RuntimeError as err:
                raise RuntimeError(f"rank {dist.get_rank()}: {self.what} did not complete: {err}") from None
            self.works, self.done = [], True
            self.result = self.finish()
        return self.result


def _done(works, finish, what: str, async_op: bool, timeout_s: float | None = None):
    pending = Pending(works if isinstance(works, list) else [works], finish, what, timeout_s)
    return pending if async_op else pending.wait()


def _on_wire(x: torch.Tensor, wire_dtype, reduces: bool) -> torch.Tensor:
    """``x`` as it is sent: cast to ``wire_dtype``, and an fp8 tensor viewed as its bytes."""
    if wire_dtype is not None and wire_dtype != x.dtype:
        x = x.to(wire_dtype)
    if x.dtype in _FP8:
        if reduces:
            raise ValueError(f"{x.dtype} is not reduced on the wire here (gloo adds no fp8; NCCL does from "
                             f"2.24, which the book does not rely on): reduce in bf16 or fp32 and cast after")
        x = x.view(torch.uint8)
    return x.contiguous()


def _off_wire(wire: torch.Tensor, dtype, wire_dtype) -> torch.Tensor:
    """What arrived, as ``dtype``: bytes sent for an fp8 tensor are reinterpreted, never converted."""
    sent = wire_dtype or dtype  # the dtype _on_wire viewed as bytes
    if wire.dtype == torch.uint8 and sent in _FP8:
        wire = wire.view(sent)
    return wire.to(dtype)


# ---------------------------------------------------------------------------------------------------------
# Collectives, booked
# ---------------------------------------------------------------------------------------------------------


def all_reduce(x: torch.Tensor, group=None, *, op: str = "sum", async_op: bool = False, wire_dtype=None):
    """Reduce ``x`` over the group's ranks, in place (``op``: ``"sum"``, ``"max"`` or ``"min"``)."""
    reduce_op = _op(op)
    wire = _on_wire(x, wire_dtype, reduces=True)  # x itself, unless cast or made contiguous
    LEDGER.record("all_reduce", wire, group)
    work = dist.all_reduce(wire, op=reduce_op, group=group, async_op=async_op)

    def finish():
        if wire is not x:
            x.copy_(wire)
        return x
    return _done(work, finish, f"all_reduce of {tuple(x.shape)}", async_op)


def all_gather(x: torch.Tensor, dim: int = 0, group=None, *, out: torch.Tensor | None = None,
               async_op: bool = False, wire_dtype=None):
    """Every rank's ``x`` concatenated along ``dim``, in rank order. ``out`` (gathering along dim 0 only)
    receives the result in place, as FSDP gathers into a parameter's own storage."""
    world_size = dist.get_world_size(group)
    moved = _on_wire(x.movedim(dim, 0), wire_dtype, reduces=False)
    shape = (world_size * moved.shape[0], *moved.shape[1:])
    direct = out is not None and dim == 0 and wire_dtype in (None, x.dtype) and out.is_contiguous()
    gathered = out if direct else moved.new_empty(shape)
    LEDGER.record("all_gather", gathered, group)
    work = dist.all_gather_single(gathered, moved, group=group, async_op=async_op)

    def finish():
        if direct:
            return out
        result = _off_wire(gathered, x.dtype, wire_dtype).movedim(0, dim)
        return result if out is None else out.copy_(result)
    return _done(work, finish, f"all_gather of {tuple(x.shape)} along dim {dim}", async_op)


def reduce_scatter(x: torch.Tensor, dim: int = 0, group=None, *, pad: bool = False, op: str = "sum",
                   async_op: bool = False, wire_dtype=None):
    """The reduction over the group's ranks of ``x``, of which this rank keeps its slice along ``dim``.

    ``dim`` must divide by the group's size, or with ``pad`` it is padded with zeros to the next multiple (the
    last ranks' slices then end in padding, as ZeRO's flat shards do)."""
    reduce_op = _op(op)
    world_size = dist.get_world_size(group)
    moved = x.movedim(dim, 0)
    rows = moved.shape[0]
    if rows % world_size:
        if not pad:
            raise ValueError(f"a reduce-scatter over {world_size} ranks needs dim {dim} ({rows}) to divide "
                             f"by {world_size} (or pad=True)")
        padded = moved.new_zeros((-(-rows // world_size) * world_size, *moved.shape[1:]))
        padded[:rows] = moved
        moved = padded
    wire = _on_wire(moved, wire_dtype, reduces=True)
    out = wire.new_empty((wire.shape[0] // world_size, *wire.shape[1:]))
    LEDGER.record("reduce_scatter", wire, group)
    work = dist.reduce_scatter_single(out, wire, op=reduce_op, group=group, async_op=async_op)
    return _done(work, lambda: _off_wire(out, x.dtype, wire_dtype).movedim(0, dim),
                 f"reduce_scatter of {tuple(x.shape)} along dim {dim}", async_op)


def all_to_all(x: torch.Tensor, group=None, *, send_splits: list[int] | None = None,
               recv_splits: list[int] | None = None, label: str = "all_to_all", async_op: bool = False,
               wire_dtype=None):
    """``send_splits[j]`` rows (dim 0) of ``x`` to rank ``j``, ``recv_splits[j]`` rows from rank ``j``, in
    rank order; even splits when they are not given. Booked under ``label``: the rows that leave this rank."""
    world_size = dist.get_world_size(group)
    if send_splits is None:
        if x.shape[0] % world_size:
            raise ValueError(f"an even all-to-all over {world_size} ranks needs dim 0 ({x.shape[0]}) to "
                             f"divide by {world_size}")
        send_splits = [x.shape[0] // world_size] * world_size
    recv_splits = send_splits if recv_splits is None else recv_splits
    wire = _on_wire(x, wire_dtype, reduces=False)
    out = wire.new_empty((sum(recv_splits), *wire.shape[1:]))
    LEDGER.record_all_to_all(label, wire, send_splits, recv_splits, group)
    work = dist.all_to_all_single(out, wire, output_split_sizes=list(recv_splits),
                                  input_split_sizes=list(send_splits), group=group, async_op=async_op)
    return _done(work, lambda: _off_wire(out, x.dtype, wire_dtype), f"{label} of {tuple(x.shape)}", async_op)


# ---------------------------------------------------------------------------------------------------------
# Point-to-point messages, counted
# ---------------------------------------------------------------------------------------------------------


def _global(rank: int, group) -> int:
    """The global rank of rank ``rank`` of ``group``: what ``isend`` and ``irecv`` are given."""
    return rank if group is None else dist.get_global_rank(group, rank)


def _count(t: torch.Tensor, direction: str, peer: int, group, label: str, phase: str, step: int) -> None:
    LEDGER.count(t, direction, peer, group, collective=label, phase=phase, step=step)


def send(x: torch.Tensor, dst: int, group=None, *, tag: int = 0, label: str = "p2p", phase: str = "p2p",
         step: int = 0) -> Pending:
    """Post ``x`` to rank ``dst`` of ``group`` (asynchronous; wait on the result before changing ``x``)."""
    x = x.detach().contiguous()
    _count(x, "send", dst, group, label, phase, step)
    work = dist.isend(x, _global(dst, group), group=group, tag=tag)
    return Pending([work], lambda: x, f"{label} {phase} step {step}: the send to rank {dst}",
                   collective_timeout())


def recv(like: torch.Tensor, src: int, group=None, *, tag: int = 0, label: str = "p2p", phase: str = "p2p",
         step: int = 0, async_op: bool = False, timeout_s: float | None = None):
    """A tensor shaped as ``like`` from rank ``src`` of ``group``, with this ``tag``; a wait longer than
    ``timeout_s`` (default: the group's) raises, naming the peer."""
    buf = torch.empty_like(like, memory_format=torch.contiguous_format)
    _count(buf, "recv", src, group, label, phase, step)
    work = dist.irecv(buf, _global(src, group), group=group, tag=tag)
    what = f"{label} {phase} step {step}: the receive from rank {src} (nothing arrived)"
    return _done(work, lambda: buf, what, async_op, timeout_s or collective_timeout())


def send_recv(x: torch.Tensor, dst: int, src: int, group=None, *, tag: int = 0, label: str = "p2p",
              phase: str = "p2p", step: int = 0, async_op: bool = False):
    """Send ``x`` to ``dst`` and receive a tensor like it from ``src``, both posted at once (a ring step)."""
    x = x.detach().contiguous()
    buf = torch.empty_like(x)
    _count(x, "send", dst, group, label, phase, step)
    _count(buf, "recv", src, group, label, phase, step)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, _global(dst, group), group=group, tag=tag),
                                    dist.P2POp(dist.irecv, buf, _global(src, group), group=group, tag=tag)])
    return _done(works, lambda: buf, f"{label} {phase} step {step}: the exchange (send to {dst}, receive "
                 f"from {src})", async_op, collective_timeout())


__all__ = ["Pending", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send", "recv", "send_recv"]
