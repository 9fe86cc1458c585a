"""Measure what a computation really holds and does, to set against the calculator of chapter 01.

- :func:`saved_tensors` records every tensor autograd keeps for backward (``saved_tensors_hooks``), once per
  storage, leaving out the parameters (they are counted as parameters, not activations);
- :func:`optimizer_state_bytes` sums the tensors an optimizer keeps in its state;
- :func:`count_flops` counts matmul FLOPs with PyTorch's ``FlopCounterMode``;
- :class:`TorchCollectives` records every ``torch.distributed`` operation that ran, as the dispatcher sees it:
  the witness, independent of the ledger's bookings, of which collectives a chapter's code really called;
- :class:`LiveMemory` (chapter 04) reads the bytes a rank really holds from the storages alive at each
  sample, by kind: parameters, gradients, optimizer states, activations; :func:`storage_bytes` is one
  tensor's storage.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (what it really holds); any other tensor itself."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def saved_tensors(fn, module: torch.nn.Module | None = None) -> dict[int, tuple[int, tuple, torch.dtype]]:
    """Run ``fn()``; every distinct storage autograd saved: ``{storage pointer: (bytes, shape, dtype)}``.

    A DTensor counts as the shard this rank holds.
    """
    params = set() if module is None else {_local(p).untyped_storage().data_ptr()
                                           for p in module.parameters()}
    saved = {}

    def pack(t):
        storage = _local(t).untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = (storage.nbytes(), tuple(t.shape), t.dtype)
        # not t itself: a saved output refers to its own graph node, which would then never be freed
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return saved


def attention_backend(materialized: bool):
    """PyTorch's math attention (softmax probabilities materialized) or its default fused kernel."""
    return sdpa_kernel(SDPBackend.MATH) if materialized else contextlib.nullcontext()


def saved_bytes_per_layer(cfg, micro_batch: int, seq_len: int, materialized: bool = False) -> int:
    """Bytes one transformer layer of the book's GPT saves: a 2-layer model's minus a 1-layer model's."""
    from dataclasses import replace

    from helpers.model import GPT

    totals = []
    for n_layers in (1, 2):
        model = GPT(replace(cfg, n_layers=n_layers), seed=0)
        gen = torch.Generator().manual_seed(0)
        idx = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len), generator=gen)
        with attention_backend(materialized):
            saved = saved_tensors(lambda: model(idx, idx), model)
        totals.append(sum(b for b, _, _ in saved.values()))
    return totals[1] - totals[0]


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimizer's state (moments, step counters)."""
    return tensor_bytes(v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v))


def matmul_flop_rate(n: int = 512, repeats: int = 20) -> float:
    """FLOP/s of this process on an n x n fp32 matmul: the best of ``repeats`` timings."""
    import time

    a, b = torch.randn(n, n), torch.randn(n, n)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - started)
    return 2 * n**3 / best


def count_flops(fn, materialized_attention: bool = True) -> dict[str, int]:
    """Matmul FLOPs of ``fn()`` by operator, as ``FlopCounterMode`` counts them.

    The counter has no formula for the CPU's fused attention kernel, so by default attention runs as PyTorch's
    math implementation, whose batched matmuls it does count.
    """
    counter = FlopCounterMode(display=False)
    with attention_backend(materialized_attention), counter:
        fn()
    return {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}


class TorchCollectives(TorchDispatchMode):
    """Every ``torch.distributed`` operation run inside the ``with`` block, as PyTorch's dispatcher sees it.

    A booking in the ledger says what the book's code meant to call; this sees what ran, however it was called
    (``dist.all_to_all_single``, an imported name, a library). ``calls`` holds one ``(operation, group ranks,
    elements of each tensor argument, element size)`` per call, in order: ``("alltoall_base_", (0, 1, 2, 3),
    (4096, 4096), 8)`` is an ``all_to_all_single`` of 4,096 fp64 numbers over four ranks.
    """

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, tuple[int, ...], tuple[int, ...], int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import torch.distributed as dist

        if func.namespace == "c10d":
            flat = [a for arg in args for a in (arg if isinstance(arg, (list, tuple)) else [arg])]
            tensors = [a for a in flat if isinstance(a, torch.Tensor)]
            groups = [dist.ProcessGroup.unbox(a) for a in flat if isinstance(a, torch.ScriptObject)
                      and a._type().qualified_name().endswith("ProcessGroup")]
            ranks = tuple(dist.get_process_group_ranks(groups[0])) if groups else ()
            self.calls.append((func.overloadpacket.__name__, ranks, tuple(t.numel() for t in tensors),
                               tensors[0].element_size() if tensors else 0))
        return func(*args, **(kwargs or {}))


def storage_bytes(t: torch.Tensor | None) -> tuple[int, int]:
    """``(address, bytes)`` of the storage under ``t``: views of one storage give the same pair."""
    if t is None:
        return 0, 0
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


class LiveMemory:
    """The bytes a rank really holds, read from the storages alive at each sample.

    It looks at the model's parameters and their gradients, the optimizer's parameters (the shards) with their
    gradients and state, every tensor autograd saved for backward while :meth:`saving` was active (a saved-
    tensor hook keeps a weak reference to each, so a saved tensor counts exactly as long as autograd keeps
    it), and what ``in_flight()`` returns: the buffers of collectives still running (a prefetched all-gather's
    output, counted as parameters). A storage reached twice, such as a weight and the transposed view of it
    that ``F.linear`` saves, or shards that are views of one flat buffer, counts once. A saved tensor whose
    storage was a parameter's when it was saved counts as parameters, wherever the parameter's data went
    since; every other saved tensor is an activation. Temporaries inside a call (a collective's packed copy)
    are not alive at any sample and are not seen.
    """

    KINDS = ("parameters", "gradients", "optimizer states", "activations")

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, in_flight=None):
        self.model, self.optimizer = model, optimizer
        self.in_flight = in_flight or list
        self.recording = True  # False turns the samples off: make bench times the algorithm, not the meter
        self.saved: list[tuple[weakref.ref, str]] = []
        self.events: list[tuple[tuple, dict]] = []

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        params = {storage_bytes(p)[0] for p in self.model.parameters()}
        self.saved.append((weakref.ref(t), "parameters" if storage_bytes(t)[0] in params else "activations"))
        return t

    def saving(self):
        """A context for forward: autograd's saved tensors become visible to the samples."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def held(self) -> dict:
        """Bytes of every distinct live storage, by kind."""
        self.saved = [(ref, kind) for ref, kind in self.saved if ref() is not None]
        reached = []
        for p in self.model.parameters():
            reached += [("parameters", p), ("gradients", p.grad)]
        for group in self.optimizer.param_groups:
            for shard in group["params"]:
                reached += [("optimizer states", shard), ("gradients", shard.grad)]
                reached += [("optimizer states", v) for v in self.optimizer.state.get(shard, {}).values()]
        reached += [(kind, ref()) for ref, kind in self.saved]
        reached += [("parameters", t) for t in self.in_flight()]
        seen, held = set(), dict.fromkeys(self.KINDS, 0)
        for kind, t in reached:
            address, nbytes = storage_bytes(t)
            if nbytes and address not in seen:
                seen.add(address)
                held[kind] += nbytes
        return held

    def sample(self, *what) -> None:
        """Record what is held now; ``what`` says when (``"gathered", "block 0"``)."""
        if self.recording:
            self.events.append((what, self.held()))

    def peak(self, kinds=("parameters", "gradients", "optimizer states")) -> tuple[tuple, dict]:
        """The sample holding the most bytes of ``kinds`` (the model states, by default)."""
        return max(self.events, key=lambda event: sum(event[1][k] for k in kinds))
