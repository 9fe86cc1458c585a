"""ZeRO-1, -2 and -3 from scratch (chapter 04), with FSDP2's layout: every parameter sharded along dim 0.

Each rank owns rows ``[r*k, (r+1)*k)`` of every parameter, with ``k = ceil(rows / N)`` (the last shards are
padded with zero rows, as FSDP2 pads), and keeps AdamW's state for those rows only (Rajbhandari et al. 2020):

- ZeRO-1 (:class:`ShardedAdamW`, ``stage=1``): backward leaves every full gradient in place; ``step()``
  reduce-scatters each one, so a rank receives the average of its own rows, updates them, and all-gathers the
  updated parameters;
- ZeRO-2 (``stage=2``): the same, but each gradient is reduce-scattered from a hook the moment backward has
  produced it, added to the rank's gradient shard, and the full gradient is freed at once;
- ZeRO-3 (:class:`Zero3`): the full parameters are not kept either. A block's parameters are all-gathered just
  before its forward and freed after it, gathered again just before its backward, and their gradients are
  reduce-scattered as they appear; the parameters outside the blocks (embeddings, final norm) are gathered
  for the whole step, as FSDP's root module is. Freeing resizes the parameter's storage to zero bytes and
  gathering resizes it back and writes into it, as FSDP does: the transposed views of the weights that
  autograd saves in forward share that storage, so they are freed with it and backward reads what was
  gathered again.

Every collective goes through :mod:`helpers.parallel.comms`, booked once in the chapter 02 ledger.
:class:`LiveMemory` measures what a rank holds from the storages alive at each moment (parameters, gradients,
optimizer state and every tensor autograd saved for backward); which collectives really ran, chapter 04 reads
from :class:`helpers.measure.TorchCollectives`, a dispatch mode that sees every one.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from helpers.parallel import comms


def shard_rows(n_rows: int, world_size: int) -> int:
    """Rows of each rank's shard: ceil(n_rows / world_size)."""
    return -(-n_rows // world_size)


def shard_of(full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's dim-0 shard of ``full``, zero-padded to ``shard_rows`` rows."""
    k = shard_rows(full.shape[0], world_size)
    shard = full.new_zeros((k, *full.shape[1:]))
    rows = full[rank * k:(rank + 1) * k]
    shard[:rows.shape[0]] = rows
    return shard


def all_gather_rows(shard: torch.Tensor, n_rows: int, group=None) -> torch.Tensor:
    """The full tensor from every rank's shard (the padding rows dropped)."""
    return comms.all_gather(shard, 0, group)[:n_rows]


def reduce_scatter_rows(full: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's rows of the average of ``full`` over the ranks (padded with zero rows to ``N·k``)."""
    return comms.reduce_scatter(full, 0, group, pad=True).div_(dist.get_world_size(group))


def accumulate(shard: torch.Tensor, reduced: torch.Tensor) -> None:
    """Add a reduced gradient to the shard's: micro-batches of one step sum, as full gradients do."""
    if shard.grad is None:
        shard.grad = reduced
    else:
        shard.grad += reduced


# --------------------------------------------------------------------------------------------- measuring


def storage_bytes(t: torch.Tensor | None) -> tuple[int, int]:
    """``(address, bytes)`` of the storage under ``t``: views of one storage give the same pair."""
    if t is None:
        return 0, 0
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


class LiveMemory:
    """The bytes a rank really holds, read from the storages alive at each sample.

    It looks at the model's parameters and their gradients, the optimizer's parameters (the shards) with
    their gradients and state, and every tensor autograd saved for backward while :meth:`saving` was active
    (a saved-tensor hook keeps a weak reference to each, so a saved tensor counts exactly as long as autograd
    keeps it). A storage reached twice, such as a weight and the transposed view of it that ``F.linear``
    saves, counts once. A saved tensor whose storage was a parameter's when it was saved counts as
    parameters, wherever the parameter's data went since; every other saved tensor is an activation.
    Temporaries inside a call (a collective's padded copy) are not alive at any sample and are not seen.
    """

    KINDS = ("parameters", "gradients", "optimizer states", "activations")

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer
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
        seen, held = set(), dict.fromkeys(self.KINDS, 0)
        for kind, t in reached:
            address, nbytes = storage_bytes(t)
            if nbytes and address not in seen:
                seen.add(address)
                held[kind] += nbytes
        return held

    def sample(self, *what) -> None:
        """Record what is held now; ``what`` says when (``"gathered", "block 0"``)."""
        self.events.append((what, self.held()))

    def peak(self, kinds=("parameters", "gradients", "optimizer states")) -> tuple[tuple, dict]:
        """The sample holding the most bytes of ``kinds`` (the model states, by default)."""
        return max(self.events, key=lambda event: sum(event[1][k] for k in kinds))


# --------------------------------------------------------------------------------------------- ZeRO-1 and -2


class ShardedAdamW:
    """ZeRO-1 (``stage=1``) or ZeRO-2 (``stage=2``): AdamW on this rank's rows of every parameter.

    The shards are the optimizer's own copy of the parameters (its "master weights"); the model keeps full
    parameters for forward and backward.
    """

    def __init__(self, model: torch.nn.Module, stage: int, group=None, **adamw):
        if stage not in (1, 2):
            raise ValueError(f"ShardedAdamW implements ZeRO stages 1 and 2, not {stage}")
        self.stage, self.group = stage, group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.params = list(model.parameters())
        self.names = {p: name for name, p in model.named_parameters()}
        self.shards = [torch.nn.Parameter(shard_of(p.detach(), self.rank, self.world_size))
                       for p in self.params]
        self.shard_of_param = dict(zip(self.params, self.shards))
        self.optimizer = torch.optim.AdamW(self.shards, **adamw)
        self.memory = LiveMemory(model, self.optimizer)
        if stage == 2:
            for p in self.params:
                p.register_post_accumulate_grad_hook(self._reduce_now)

    def _reduce_now(self, p: torch.nn.Parameter) -> None:
        """ZeRO-2: keep only this rank's rows of the gradient, from the moment backward produces it."""
        accumulate(self.shard_of_param[p], reduce_scatter_rows(p.grad, self.group))
        self.memory.sample("reduced", self.names[p])  # the full gradient and its shard both still held
        p.grad = None

    def step(self) -> None:
        if self.stage == 1:
            for p, shard in zip(self.params, self.shards):
                shard.grad = reduce_scatter_rows(p.grad, self.group)  # p.grad already sums the micro-batches
        self.memory.sample("before the update")
        self.optimizer.step()
        for p, shard in zip(self.params, self.shards):
            p.data.copy_(all_gather_rows(shard.detach(), p.shape[0], self.group))
        self.memory.sample("after the update")

    def zero_grad(self) -> None:
        for p in self.params + self.shards:
            p.grad = None


# --------------------------------------------------------------------------------------------- ZeRO-3


class Zero3:
    """ZeRO-3: parameters, gradients and optimizer states all sharded; blocks gathered only while in use.

    Each parameter keeps one storage for its full rows (padded to ``N·k``), which is zero bytes while the
    parameter is sharded. ``reshard_after_forward=False`` keeps each block's gathered parameters from its
    forward to its backward (FSDP's switch between ZeRO-3 and ZeRO-2 behaviour for parameters): one all-gather
    fewer per block, at the cost of holding every block's full parameters at the peak. ``prefetch=True``
    issues the all-gather of the next block (the previous one, in backward) asynchronously as soon as a block
    is gathered, so that it can travel while the block computes; it costs one more block's parameters at the
    peak.
    """

    def __init__(self, model: torch.nn.Module, units: list[torch.nn.Module], group=None,
                 reshard_after_forward: bool = True, prefetch: bool = False, **adamw):
        self.group, self.reshard_after_forward, self.prefetch = group, reshard_after_forward, prefetch
        rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.params = list(model.parameters())
        self.names = {p: name for name, p in model.named_parameters()}
        in_units = {p for unit in units for p in unit.parameters()}
        # unit 0, the root: what no block holds (embeddings, final norm)
        self.units = [[p for p in self.params if p not in in_units]] + [list(u.parameters()) for u in units]
        self.unit_names = ["root"] + [f"block {i}" for i in range(len(units))]
        self.unit_of = {p: i for i, unit in enumerate(self.units) for p in unit}
        self.rows = {p: p.shape[0] for p in self.params}
        self.shards = {p: torch.nn.Parameter(shard_of(p.detach(), rank, self.world_size))
                       for p in self.params}
        self.unsharded = {p: self._own_storage(p) for p in self.params}
        self.optimizer = torch.optim.AdamW(list(self.shards.values()), **adamw)
        self.memory = LiveMemory(model, self.optimizer)
        self.waiting = [0] * len(self.units)  # per unit: the gradients its backward has still to produce
        self.in_flight: dict[int, list] = {}  # per unit: its prefetched all-gathers
        for i in range(len(self.units)):
            self._free(i)
        self._register_hooks(model, units)

    def _own_storage(self, p: torch.nn.Parameter) -> torch.Tensor:
        """The parameter's padded full rows (``N·k``), in a storage the parameter becomes a view of."""
        full = p.detach().new_zeros((self.shards[p].shape[0] * self.world_size, *p.shape[1:]))
        p.data = full[:p.shape[0]]
        return full

    def _register_hooks(self, model: torch.nn.Module, units: list[torch.nn.Module]) -> None:
        """Gather the root before the model's forward; gather each block before its forward and again before
        its backward, free it after its forward; reduce-scatter each gradient the moment it is accumulated."""
        last = len(units)
        model.register_forward_pre_hook(lambda *_: self._gather(0, then=1))
        for i, unit in enumerate(units, start=1):
            unit.register_forward_pre_hook(lambda *_, i=i: self._gather(i, then=i + 1 if i < last else None))
            unit.register_forward_hook(lambda *_, i=i: self._free(i) if self.reshard_after_forward else None)
            unit.register_full_backward_pre_hook(
                lambda *_, i=i: self._gather(i, then=i - 1 if i > 1 else None))
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._reduce_now)

    def _gathered(self, i: int) -> bool:
        return all(p.untyped_storage().nbytes() for p in self.units[i])

    def _start_gather(self, i: int, async_op: bool) -> list:
        """Give unit ``i``'s parameters their storage back and all-gather the shards straight into it."""
        gathers = []
        for p in self.units[i]:
            full = self.unsharded[p]
            p.untyped_storage().resize_(full.numel() * full.element_size())
            shard = self.shards[p].detach()
            gathers.append(comms.all_gather(shard, 0, self.group, out=full, async_op=async_op))
        return gathers

    def _gather(self, i: int, then: int | None = None) -> None:
        """Make unit ``i``'s full parameters available; with prefetching, start gathering unit ``then``."""
        if i in self.in_flight:  # prefetched: wait for it
            for pending in self.in_flight.pop(i):
                pending.wait()
        elif not self._gathered(i):
            self._start_gather(i, async_op=False)
        else:
            return  # still gathered
        self.waiting[i] = len(self.units[i])
        self.memory.sample("gathered", self.unit_names[i])
        if self.prefetch and then is not None:
            self._prefetch(then)

    def _prefetch(self, i: int) -> None:
        """Issue unit ``i``'s all-gather now, asynchronously: it travels while the current unit computes."""
        if not self._gathered(i):
            self.in_flight[i] = self._start_gather(i, async_op=True)
            self.memory.sample("prefetch issued", self.unit_names[i])

    def _free(self, i: int) -> None:
        """Unit ``i``'s full parameters go: their storage, and with it every view autograd saved, to 0
        bytes."""
        for p in self.units[i]:
            p.untyped_storage().resize_(0)
        self.memory.sample("freed", self.unit_names[i])

    def _reduce_now(self, p: torch.nn.Parameter) -> None:
        """This rank's rows of the averaged gradient, added to its shard's; the unit's last one frees it."""
        accumulate(self.shards[p], reduce_scatter_rows(p.grad, self.group))
        self.memory.sample("reduced", self.names[p])  # the full gradient and its shard both still held
        p.grad = None
        i = self.unit_of[p]
        self.waiting[i] -= 1
        if self.waiting[i] == 0:  # the unit's backward is done: its full parameters can go
            self._free(i)

    def step(self) -> None:
        self.memory.sample("before the update")
        self.optimizer.step()
        self.memory.sample("after the update")

    def zero_grad(self) -> None:
        for shard in self.shards.values():
            shard.grad = None

    def full_parameters(self) -> dict[torch.nn.Parameter, torch.Tensor]:
        """Every parameter gathered (for checking; a collective, so every rank must call it)."""
        return {p: all_gather_rows(self.shards[p].detach(), self.rows[p], self.group).view(p.shape)
                for p in self.params}
