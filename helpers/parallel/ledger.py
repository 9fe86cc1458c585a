"""The byte ledger (chapter 02): the messages the book's collectives sent, and the torch collectives booked.

Every point-to-point message of the book's from-scratch collectives goes through :meth:`Ledger.exchange`,
which posts the sends and receives with ``batch_isend_irecv`` and writes one :class:`Message` per send and
per receive into the process's ledger, :data:`LEDGER`. The bytes a rank sent and received are therefore
*counted* by the code that moved them, and :func:`helpers.cost.collective_costs.expected_bytes` gives
what the algorithm's formula says they should be, exactly, uneven chunks included.

A chapter that calls ``torch.distributed``'s own collectives, whose messages nobody here can see, *books* each
call with :meth:`Ledger.record`. A booking proves what the call was given: the collective's name, the group
(its size and global ranks), and the buffer (its number of elements, dtype and element size), all taken from
the objects passed. Its bytes are the formula's for that collective (marked ``counted=False``): they say what
a ring or tree would move, never what gloo or NCCL moved, so a booking's bytes must never be checked against
the formula that produced them. :meth:`Ledger.booked` lists the bookings; ``totals(..., counted=True)`` adds
up counted messages only. Code that moves a message itself, outside :meth:`exchange` (the tagged sends and
receives of :mod:`helpers.parallel.comms`), counts it with :meth:`Ledger.count`. What each collective costs in
time is :mod:`helpers.cost.collective_costs`.

    from helpers.parallel.ledger import LEDGER
    LEDGER.record("all_reduce", grads)                 # book a torch collective a chapter called
    LEDGER.booked("all_reduce")[0].numel               # what the booking proves: the buffer it was given
    sent, received = LEDGER.totals("ring_all_reduce", counted=True)  # bytes the book's ring really moved
    LEDGER.by_group()                                  # {global ranks of a group: (sent, received)}
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

from helpers.cost.collective_costs import all_to_all_bytes, expected_bytes


@dataclass(frozen=True)
class Message:
    """One entry of the ledger: bytes this rank sent to, or received from, ``peer``.

    A counted message (``counted=True``, from :meth:`Ledger.exchange`) is one tensor that really moved. A
    booked one (from :meth:`Ledger.record`) is half of a torch collective's booking: its ``nbytes`` is the
    formula's, while ``numel``, ``dtype``, ``element_size`` and ``group_ranks`` describe the buffer and the
    group the collective was really called with.
    """

    collective: str  # the outermost collective running (``ring_all_reduce``)
    phase: str  # the innermost one (``ring_reduce_scatter`` inside an all-reduce)
    step: int  # the how-manieth exchange of this rank within the collective, from 0
    direction: str  # "send" or "recv"
    peer: int  # the other rank, in the group's numbering (-1 for a booked torch collective)
    nbytes: int
    chunk: int | None = None  # which chunk of the buffer moved, where the collective says
    counted: bool = True  # False: booked from the formula by record(), not counted message by message
    numel: int | None = None  # elements of the tensor sent or received (booked: of the buffer passed)
    dtype: str | None = None  # its dtype, as ``str(tensor.dtype)``
    element_size: int | None = None  # bytes per element
    group_ranks: tuple[int, ...] | None = None  # global ranks of the group, in the group's order
    # when it was written, on ``time.perf_counter`` (the clock of the pipeline's events, the same in every
    # process of the machine): a booked collective is written as it is called, a counted message as posted
    at: float = field(default_factory=time.perf_counter, compare=False)


class Ledger:
    """The messages this process sent and received, with the collective each belongs to."""

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self._stack: list[str] = []
        self._step = 0

    @contextlib.contextmanager
    def collective(self, name: str):
        """Label the messages exchanged inside the block; nested labels become the ``phase``."""
        if not self._stack:
            self._step = 0
        self._stack.append(name)
        try:
            yield
        finally:
            self._stack.pop()

    def exchange(self, send=None, dst: int | None = None, recv=None, src: int | None = None, *,
                 group=None, send_chunk: int | None = None, recv_chunk: int | None = None) -> None:
        """Send ``send`` to rank ``dst`` and receive into ``recv`` from rank ``src``, both at once; wait.

        Ranks are numbered within ``group``. Posting both before waiting for either is what keeps a ring
        from deadlocking: every rank sends to its right while it receives from its left. Each message is
        written into the ledger; a wait that outlives the group's timeout raises, naming the peers.
        """
        import torch.distributed as dist

        ops = []
        if send is not None:
            ops.append(dist.P2POp(dist.isend, send, _global(dst, group), group=group))
        if recv is not None:
            ops.append(dist.P2POp(dist.irecv, recv, _global(src, group), group=group))
        name = self._stack[0] if self._stack else "p2p"
        phase = self._stack[-1] if self._stack else "p2p"
        step = self._step
        self._step += 1
        if send is not None:
            self.count(send, "send", dst, group, collective=name, phase=phase, step=step, chunk=send_chunk)
        if recv is not None:
            self.count(recv, "recv", src, group, collective=name, phase=phase, step=step, chunk=recv_chunk)
        try:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        except RuntimeError as err:
            rank = dist.get_rank(group)
            raise RuntimeError(f"rank {rank}, {phase} step {step}: the exchange (send to {dst}, receive "
                               f"from {src}) did not complete: {err}") from None

    def count(self, tensor, direction: str, peer: int, group=None, *, collective: str = "p2p",
              phase: str | None = None, step: int = 0, chunk: int | None = None) -> None:
        """Count one message: ``tensor``, sent to (``direction="send"``) or received from (``"recv"``) rank
        ``peer`` of ``group``, its bytes those of the tensor that moves. ``phase`` defaults to ``collective``.
        """
        if direction not in ("send", "recv"):
            raise ValueError(f"direction={direction!r} is not 'send' or 'recv'")
        phase = collective if phase is None else phase
        self.messages.append(Message(collective, phase, step, direction, peer, _nbytes(tensor), chunk,
                                     **_described(tensor), group_ranks=_group_ranks(group)))

    def record(self, collective: str, tensor, group=None, *, root: int = 0) -> None:
        """Book a ``torch.distributed`` collective called on ``tensor`` (its full buffer) over ``group``.

        What the booking proves comes from the objects passed: the name, the group's global ranks, and the
        buffer's number of elements, dtype and element size. The bytes booked are the formula's
        (:func:`~helpers.cost.collective_costs.expected_bytes`) for the bandwidth-optimal algorithm of
        that name, marked ``counted=False``:
        what a ring (or tree, for broadcast and reduce) would move, not a count of what did.
        """
        import torch.distributed as dist

        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        sent, received = expected_bytes(collective, tensor.numel(), world_size, rank,
                                        element_size=tensor.element_size(), root=root)
        booked = dict(_described(tensor), group_ranks=_group_ranks(group), counted=False)
        self.messages.append(Message(collective, collective, 0, "send", -1, sent, **booked))
        self.messages.append(Message(collective, collective, 0, "recv", -1, received, **booked))

    def record_all_to_all(self, label: str, tensor, input_split_sizes, output_split_sizes,
                          group=None) -> None:
        """Book an ``all_to_all_single`` with uneven splits under ``label``: the rows it sends to other
        ranks.

        ``tensor`` is the input (rows along dim 0); split ``j`` of it goes to rank ``j`` and this rank's own
        split stays, so its bytes are not counted
        (:func:`~helpers.cost.collective_costs.all_to_all_bytes`).
        """
        import torch.distributed as dist

        rank = dist.get_rank(group)
        row = tensor[0].numel() if tensor.shape[0] else tensor.numel()
        sent, received = all_to_all_bytes(input_split_sizes, output_split_sizes, rank,
                                          row_bytes=row * tensor.element_size())
        booked = dict(_described(tensor), group_ranks=_group_ranks(group), counted=False)
        self.messages.append(Message(label, label, 0, "send", -1, sent, **booked))
        self.messages.append(Message(label, label, 0, "recv", -1, received, **booked))

    def totals(self, collective: str | None = None, *, counted: bool | None = None) -> tuple[int, int]:
        """Bytes sent and bytes received by this rank, in one collective or in all of them.

        ``counted=True`` adds up only messages counted by :meth:`exchange`, ``counted=False`` only bookings;
        by default both.
        """
        def kept(m, direction):
            return (m.direction == direction and collective in (None, m.collective)
                    and counted in (None, m.counted))

        sent = sum(m.nbytes for m in self.messages if kept(m, "send"))
        received = sum(m.nbytes for m in self.messages if kept(m, "recv"))
        return sent, received

    def by_group(self, *, counted: bool | None = None) -> dict[tuple[int, ...], tuple[int, int]]:
        """Bytes this rank sent and received over each process group, keyed by the group's global ranks
        (sorted), over every collective: which group a message ran on is how chapter 10 splits the traffic
        by mesh dimension. ``counted`` as in :meth:`totals`."""
        out: dict[tuple[int, ...], tuple[int, int]] = {}
        for m in self.messages:
            if counted in (None, m.counted) and m.group_ranks is not None:
                key = tuple(sorted(m.group_ranks))
                sent, received = out.get(key, (0, 0))
                sending = m.direction == "send"
                out[key] = (sent + m.nbytes * sending, received + m.nbytes * (not sending))
        return out

    def booked(self, collective: str | None = None) -> list[Message]:
        """The torch collectives booked by :meth:`record` (one entry per call, in call order)."""
        return [m for m in self.messages
                if not m.counted and m.direction == "send" and collective in (None, m.collective)]

    def clear(self, collective: str | None = None) -> None:
        """Forget every message, or only those of one collective."""
        keep = [] if collective is None else [m for m in self.messages if m.collective != collective]
        self.messages[:] = keep


LEDGER = Ledger()
"""This process's ledger: the from-scratch collectives write into it."""


def _global(rank: int, group) -> int:
    import torch.distributed as dist

    return rank if group is None else dist.get_global_rank(group, rank)


def _nbytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _described(tensor) -> dict:
    return {"numel": tensor.numel(), "dtype": str(tensor.dtype), "element_size": tensor.element_size()}


def _group_ranks(group) -> tuple[int, ...]:
    import torch.distributed as dist

    return tuple(dist.get_process_group_ranks(dist.group.WORLD if group is None else group))


__all__ = ["LEDGER", "Ledger", "Message"]
