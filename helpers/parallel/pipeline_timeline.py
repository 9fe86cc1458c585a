"""What a pipeline rank records (chapter 06): one :class:`Event` per action it ran, with the bytes of
activations its blocks still had saved for backward, which :class:`SavedActivations` measures from autograd's
saved tensors; a :class:`Timeline` is the executor's recorder of both
(:func:`helpers.parallel.pipeline_parallel.run_schedule` returns its events).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import NamedTuple

from torch.autograd.graph import saved_tensors_hooks

from helpers.cost.pipeline_schedules import Action


class Event(NamedTuple):
    """One action as a rank ran it: when it began waiting for its input, when it started computing, when the
    computation ended and when the action ended (later if it was padded to a fixed duration), on
    ``time.perf_counter``, the machine's monotonic clock, the same in every process; and the bytes of
    activations the rank's transformer blocks still had saved for backward afterwards, measured by
    :class:`SavedActivations` (``None`` where the timeline did not measure them)."""

    kind: str
    chunk: int
    micro_batch: int
    waited: float
    start: float
    computed: float
    end: float
    saved_bytes: int | None


class _Saved:
    """What autograd keeps in place of one saved tensor while a :class:`SavedActivations` watches: it lives
    exactly as long as autograd keeps the tensor for backward."""

    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor, meter, key):
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self):
        self.meter._release(self.key)


class SavedActivations:
    """The bytes of the tensors that autograd keeps saved for backward inside the transformer blocks of
    ``chunks``, live: while a block runs its forward, a ``saved_tensors_hooks`` pack hook wraps every tensor
    autograd saves in a holder that autograd keeps instead of the tensor and drops when it frees it. Each
    storage counts once; the parameters (``F.linear`` saves the weight) are left out, since they are not
    activations."""

    def __init__(self, chunks):
        self.parameters = [p for c in chunks for p in c.parameters()]
        self.params = {p.untyped_storage().data_ptr() for p in self.parameters}
        self.live: dict[int, list] = {}  # storage pointer: [bytes, holders]
        self.bytes = 0
        self._contexts: list = []
        self._handles = [h for c in chunks for block in c.blocks
                         for h in (block.register_forward_pre_hook(self._enter),
                                   block.register_forward_hook(self._exit))]

    def _enter(self, module, args):
        # the parameters' storages as they are now: ZeRO-3 frees a block's after its forward and allocates
        # them afresh at each gather (its hook runs before this one), which a set made once would miss
        self.params = {p.untyped_storage().data_ptr() for p in self.parameters}
        self._contexts.append(saved_tensors_hooks(self._pack, self._unpack))
        self._contexts[-1].__enter__()

    def _exit(self, module, args, output):
        self._contexts.pop().__exit__(None, None, None)

    def _pack(self, tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() in self.params:
            return tensor
        entry = self.live.setdefault(storage.data_ptr(), [storage.nbytes(), 0])
        self.bytes += entry[0] if entry[1] == 0 else 0
        entry[1] += 1
        # detached: a saved output would hold its own node
        return _Saved(tensor.detach(), self, storage.data_ptr())

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _Saved) else packed

    def _release(self, key) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.bytes -= entry[0]
            del self.live[key]

    def close(self) -> None:
        for h in self._handles:
            h.remove()


class Timeline:
    """A rank's :class:`Event` s: the times around each action's computation, padded by a sleep to the
    stage's fixed time for its kind where ``seconds`` gives one, and, with ``record_saved``, the bytes saved
    after it."""

    def __init__(self, chunks, seconds: dict, record_saved: bool = True):
        self.saved = SavedActivations(chunks) if record_saved else None
        self.seconds, self.events = seconds, []
        self.waited = time.perf_counter()

    @contextmanager
    def computing(self, kind: str):
        self.start = time.perf_counter()
        yield
        self.computed = time.perf_counter()
        if self.seconds.get(kind):
            time.sleep(max(0.0, self.start + self.seconds[kind] - self.computed))
        self.end = time.perf_counter()

    def record(self, a: Action) -> None:
        self.events.append(Event(a.kind, a.chunk, a.micro_batch, self.waited, self.start, self.computed,
                                 self.end, None if self.saved is None else self.saved.bytes))
        self.waited = time.perf_counter()  # the next action starts waiting for its input

    def close(self) -> None:
        if self.saved is not None:
            self.saved.close()
