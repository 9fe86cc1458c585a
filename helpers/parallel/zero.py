"""ZeRO-1, -2 and -3 from scratch (chapter 04), with FSDP2's layout: every parameter sharded along dim 0.

Each rank owns rows ``[r*k, (r+1)*k)`` of every parameter, with ``k = ceil(rows / N)`` (the last shards are
padded with zero rows, as FSDP2 pads), and keeps AdamW's state for those rows only (Rajbhandari et al. 2020).
The parameters travel in groups, one collective per group, as FSDP2 moves a unit and DeepSpeed a bucket: a
group's shards live side by side in one flat buffer (each shard a ``Parameter`` that is a view of its piece),
which is the all-gather's input as it stands; the all-gather's output is copied out into each parameter
(:func:`unpack_rows`), and a group's gradients are copied into one buffer laid out rank by rank
(:func:`pack_rows`) for one reduce-scatter (:func:`reduce_scatter_flat`):

- ZeRO-1 (:class:`ShardedAdamW`, ``stage=1``): backward leaves every full gradient in place; ``step()``
  reduce-scatters them, one collective per bucket (chapter 03's buckets, one for the book's models), so a
  rank receives the average of its own rows, updates them, and all-gathers each bucket's updated parameters;
- ZeRO-2 (``stage=2``): the same, but a bucket is reduce-scattered from a hook the moment backward has
  produced its last gradient, added to the rank's gradient shards, and its full gradients are freed at once;
- ZeRO-3 (:class:`Zero3`): the full parameters are not kept either. A block's parameters are all-gathered just
  before its forward and freed after it, gathered again just before its backward, and reduce-scattered once
  its backward has produced them all; the parameters outside the blocks (embeddings, final norm) are gathered
  for the whole step, as FSDP's root module is. Freeing resizes the parameter's storage to zero bytes and
  gathering resizes it back and copies into it, as FSDP does: the transposed views of the weights that
  autograd saves in forward share that storage, so they are freed with it and backward reads what was
  gathered again. :class:`Zero3ReduceAtStep` (chapter 10's composition) keeps the full gradients to the step
  and reduce-scatters them there, after the tensor-parallel and pipeline reductions.

Every collective goes through :mod:`helpers.parallel.comms`, booked once in the chapter 02 ledger.
:class:`helpers.measure.LiveMemory` measures what a rank holds from the storages alive at each moment
(parameters, gradients, optimizer state, every tensor autograd saved for backward and the all-gathers in
flight); which collectives really ran, chapter 04 reads from :class:`helpers.measure.TorchCollectives`, a
dispatch mode that sees every one.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from helpers.dist import device
from helpers.measure import LiveMemory
from helpers.parallel import comms
from helpers.parallel.data_parallel import build_buckets

CAP_BYTES = 25 * 2**20  # ShardedAdamW's bucket cap by default: DDP's (bucket_cap_mb=25)


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


# --------------------------------------------------------------------------------------------- one buffer


def shard_shape(p: torch.Tensor, world_size: int) -> torch.Size:
    return torch.Size((shard_rows(p.shape[0], world_size), *p.shape[1:]))


def split_views(flat: torch.Tensor, shapes) -> list[torch.Tensor]:
    """``flat`` cut into consecutive pieces of ``shapes``: views, nothing copied."""
    pieces = flat.split([math.prod(shape) for shape in shapes])
    return [piece.view(shape) for piece, shape in zip(pieces, shapes)]


def flat_shards(params: list[torch.Tensor], rank: int, world_size: int):
    """This rank's shard of each of ``params`` side by side in one flat buffer, and each shard as a
    ``Parameter`` that is a view of its piece. The buffer is the group's all-gather input as it stands, and
    the optimizer updating the shards writes into it: FSDP2 copies the shards in before each all-gather."""
    dtypes = sorted({str(p.dtype) for p in params})
    if len(dtypes) > 1:
        raise ValueError(f"one flat buffer holds one dtype; these parameters have {', '.join(dtypes)}")
    shards = [shard_of(p.detach(), rank, world_size).reshape(-1) for p in params]
    flat = torch.cat(shards) if shards else torch.empty(0, device=device())
    views = split_views(flat, [shard_shape(p, world_size) for p in params])
    return flat, [torch.nn.Parameter(view) for view in views]


def pack_rows(tensors: list[torch.Tensor], world_size: int) -> torch.Tensor:
    """The copy-in (FSDP2's ``torch._chunk_cat``): each tensor zero-padded to ``N·k`` rows and cut into ``N``
    blocks of ``k`` rows; row ``r`` of the ``(N, S)`` result holds block ``r`` of every tensor, side by side,
    which is rank ``r``'s shards laid out as :func:`flat_shards` lays them."""
    return torch._chunk_cat(tensors, 0, world_size)


def reduce_scatter_flat(grads: list[torch.Tensor], group=None) -> torch.Tensor:
    """This rank's rows of the average over the ranks of every gradient in ``grads``, side by side, from one
    reduce-scatter of the packed buffer: rank ``r`` receives the sum of row ``r``, its rows of all of them."""
    world_size = dist.get_world_size(group)
    return comms.reduce_scatter(pack_rows(grads, world_size).view(-1), 0, group).div_(world_size)


def unpack_rows(gathered: torch.Tensor, fulls: list[torch.Tensor], world_size: int) -> None:
    """The copy-out (FSDP2's ``split_with_sizes_copy``), in one call: ``gathered``, every rank's flat shard
    rank after rank, viewed as ``(N, S)``, into each full tensor padded to ``N·k`` rows, whose rank-``r``
    block of ``k`` rows is its piece of row ``r``."""
    torch.split_with_sizes_copy(gathered.view(world_size, -1), [f.numel() // world_size for f in fulls],
                                dim=1, out=[f.view(world_size, -1) for f in fulls])


def accumulate_flat(shards: list[torch.Tensor], reduced: torch.Tensor) -> None:
    """:func:`accumulate` for a group: each shard's gradient gets its piece of ``reduced``. After
    ``zero_grad`` the pieces become the gradients (views of one storage, nothing copied); later micro-batches
    add to them."""
    for shard, view in zip(shards, split_views(reduced, [s.shape for s in shards])):
        accumulate(shard, view)


# --------------------------------------------------------------------------------------------- ZeRO-1 and -2


class ShardedAdamW:
    """ZeRO-1 (``stage=1``) or ZeRO-2 (``stage=2``): AdamW on this rank's rows of every parameter.

    The shards are the optimizer's own copy of the parameters (its "master weights"); the model keeps full
    parameters for forward and backward. The parameters travel in chapter 03's buckets (``cap_bytes`` of
    gradient each, in backward's order): one reduce-scatter and one all-gather per bucket and step.
    """

    def __init__(self, model: torch.nn.Module, stage: int, group=None, *, cap_bytes: int = CAP_BYTES,
                 **adamw):
        if stage not in (1, 2):
            raise ValueError(f"ShardedAdamW implements ZeRO stages 1 and 2, not {stage}")
        self.stage, self.group = stage, group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.params = list(model.parameters())
        self.names = {p: name for name, p in model.named_parameters()}
        self.buckets = build_buckets(self.params, cap_bytes)
        self.flats, shards = [], {}
        for bucket in self.buckets:
            flat, bucket_shards = flat_shards(bucket, self.rank, self.world_size)
            self.flats.append(flat)
            shards.update(zip(bucket, bucket_shards))
        self.shards = [shards[p] for p in self.params]
        self.shard_of_param = dict(zip(self.params, self.shards))
        self.optimizer = torch.optim.AdamW(self.shards, **adamw)
        self.memory = LiveMemory(model, self.optimizer)
        if stage == 2:
            self.bucket_of = {p: b for b, bucket in enumerate(self.buckets) for p in bucket}
            self.waiting = [len(bucket) for bucket in self.buckets]  # per bucket: gradients still to come
            for p in self.params:
                p.register_post_accumulate_grad_hook(self._ready)

    def _reduce(self, b: int) -> None:
        """Bucket ``b``'s gradients, one reduce-scatter: this rank's rows of their average, to its shards."""
        bucket = self.buckets[b]
        accumulate_flat([self.shard_of_param[p] for p in bucket],
                        reduce_scatter_flat([p.grad for p in bucket], self.group))

    def _ready(self, p: torch.nn.Parameter) -> None:
        """ZeRO-2: once backward has produced a bucket's last gradient, keep only this rank's rows of them."""
        b = self.bucket_of[p]
        self.waiting[b] -= 1
        if self.waiting[b] == 0:
            self.waiting[b] = len(self.buckets[b])
            self._reduce(b)
            self.memory.sample("reduced", f"bucket {b}")  # the full gradients and their shards both held
            for q in self.buckets[b]:
                q.grad = None

    def step(self) -> None:
        missing = [self.names[p] for p in self.params  # in ZeRO-2 a reduce-scattered gradient is gone
                   if p.grad is None and (self.stage == 1 or self.shard_of_param[p].grad is None)]
        if missing:
            raise ValueError(f"ZeRO-{self.stage}: backward left no gradient for {', '.join(missing)}, so "
                             f"their buckets cannot be reduce-scattered")
        if self.stage == 1:
            for b in range(len(self.buckets)):
                for p in self.buckets[b]:  # p.grad already sums the micro-batches: the shards start afresh
                    self.shard_of_param[p].grad = None
                self._reduce(b)
        self.memory.sample("before the update")
        self.optimizer.step()
        if self.stage == 1:  # the rows' averaged gradients were for this update only: the next step makes
            for shard in self.shards:  # them again from the full gradients, so keeping them buys nothing
                shard.grad = None
        for bucket, flat in zip(self.buckets, self.flats):
            gathered = comms.all_gather(flat, 0, self.group).view(self.world_size, -1)
            # the copy-out: the model's parameters are not padded, so each takes its rows from every rank's
            # piece, the padding rows dropped
            pieces = gathered.split([self.shard_of_param[p].numel() for p in bucket], dim=1)
            for p, piece in zip(bucket, pieces):
                p.detach().copy_(piece.reshape(-1, *p.shape[1:])[:p.shape[0]])
        self.memory.sample("after the update")

    def zero_grad(self) -> None:
        for p in self.params + self.shards:
            p.grad = None


# --------------------------------------------------------------------------------------------- ZeRO-3


class Zero3:
    """ZeRO-3: parameters, gradients and optimizer states all sharded; units gathered only while in use.

    Each unit's shards are views of one flat buffer, gathered with one all-gather and reduce-scattered with
    one reduce-scatter. Each parameter keeps one storage for its full rows (padded to ``N·k``), which is zero
    bytes while the parameter is sharded. ``reshard_after_forward=False`` keeps each block's gathered
    parameters from its forward to its backward (FSDP's switch between ZeRO-3 and ZeRO-2 behaviour for
    parameters): one all-gather fewer per block, at the cost of holding every block's full parameters at the
    peak. ``prefetch=True`` issues the all-gather of the next block (the previous one, in backward)
    asynchronously as soon as a block is gathered, so that it can travel while the block computes; it costs
    one more block's parameters at the peak.
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
        self.flats, shards = [], {}  # per unit: its shards side by side, the unit's all-gather input
        for unit in self.units:
            flat, unit_shards = flat_shards(unit, rank, self.world_size)
            self.flats.append(flat)
            shards.update(zip(unit, unit_shards))
        self.shards = {p: shards[p] for p in self.params}
        self.unsharded = {p: self._own_storage(p) for p in self.params}
        self.optimizer = torch.optim.AdamW(list(self.shards.values()), **adamw)
        self.waiting = [0] * len(self.units)  # per unit: the gradients its backward has still to produce
        self.in_flight: dict[int, tuple] = {}  # per unit: its prefetched all-gather and the buffer it fills
        self.memory = LiveMemory(model, self.optimizer,
                                 in_flight=lambda: [buffer for _, buffer in self.in_flight.values()])
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
        its backward, free it after its forward; count each gradient as it is accumulated."""
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

    def _start_gather(self, i: int, async_op: bool):
        """Unit ``i``'s all-gather, one collective: every rank's flat shard, rank after rank, into one buffer
        (with ``async_op``, the collective in flight and that buffer)."""
        gathered = self.flats[i].new_empty(self.world_size * self.flats[i].numel())
        return comms.all_gather(self.flats[i], 0, self.group, out=gathered, async_op=async_op), gathered

    def _copy_out(self, i: int, gathered: torch.Tensor) -> None:
        """Give unit ``i``'s parameters their storage back and copy their rows out of the gathered buffer."""
        fulls = [self.unsharded[p] for p in self.units[i]]
        for full in fulls:
            full.untyped_storage().resize_(full.numel() * full.element_size())
        unpack_rows(gathered, fulls, self.world_size)

    def _gather(self, i: int, then: int | None = None) -> None:
        """Make unit ``i``'s full parameters available; with prefetching, start gathering unit ``then``."""
        if i in self.in_flight:  # prefetched: wait for it
            self._copy_out(i, self.in_flight.pop(i)[0].wait())
        elif not self._gathered(i):
            self._copy_out(i, self._start_gather(i, async_op=False)[1])
        else:
            return  # still gathered
        self.waiting[i] = len(self.units[i])
        self.memory.sample("gathered", self.unit_names[i])
        if self.prefetch and then is not None:
            self._prefetch(then)

    def _prefetch(self, i: int) -> None:
        """Issue unit ``i``'s all-gather now, asynchronously: it travels while the current unit computes."""
        if not self._gathered(i) and i not in self.in_flight:
            self.in_flight[i] = self._start_gather(i, async_op=True)
            self.memory.sample("prefetch issued", self.unit_names[i])

    def _free(self, i: int) -> None:
        """Unit ``i``'s full parameters go: their storage, and with it every view autograd saved, to 0
        bytes."""
        for p in self.units[i]:
            p.untyped_storage().resize_(0)
        self.memory.sample("freed", self.unit_names[i])

    def _reduce_now(self, p: torch.nn.Parameter) -> None:
        """Count ``p``'s gradient; after its unit's last one, reduce-scatter the unit's gradients in one
        collective, add this rank's rows to its shards' gradients, and free the unit."""
        self.memory.sample("accumulated", self.names[p])  # its full gradient held until the unit's is done
        i = self.unit_of[p]
        self.waiting[i] -= 1
        if self.waiting[i]:
            return
        unit = self.units[i]
        reduced = reduce_scatter_flat([q.grad for q in unit], self.group)
        accumulate_flat([self.shards[q] for q in unit], reduced)
        del reduced  # after the first micro-batch, a temporary: gone before the sample
        self.memory.sample("reduced", self.unit_names[i])  # the full gradients and their shards both held
        for q in unit:
            q.grad = None
        self._free(i)

    def step(self) -> None:
        self.memory.sample("before the update")
        self.optimizer.step()
        self.memory.sample("after the update")

    def zero_grad(self) -> None:
        for shard in self.shards.values():
            shard.grad = None

    def full_parameters(self) -> dict[torch.nn.Parameter, torch.Tensor]:
        """Every parameter gathered, one all-gather per unit (for checking; a collective, so every rank must
        call it)."""
        full = {}
        for unit, flat in zip(self.units, self.flats):
            if not unit:
                continue
            padded = [torch.empty_like(self.unsharded[p]) for p in unit]
            unpack_rows(comms.all_gather(flat, 0, self.group), padded, self.world_size)
            full.update({p: t[:self.rows[p]] for p, t in zip(unit, padded)})
        return {p: full[p] for p in self.params}


class Zero3ReduceAtStep(Zero3):
    """:class:`Zero3` whose reduce-scatter waits for the step (chapter 10's composition): each unit's full
    gradients stay to the end of the step, summed over its micro-batches, as ``torch.distributed.pipelining``
    makes FSDP2 wait for the last micro-batch's backward (gradient sync on the last backward only). A block is
    still freed once its backward has produced its gradients and gathered again for the next; the root stays
    gathered for the step. :meth:`step` first reduce-scatters every unit (:meth:`reduce_scatter_gradients`),
    after whatever else the caller reduces (the tensor-parallel copies, a tied embedding's two stages) has
    summed the full gradients, so each reduction completes before the next one cuts it."""

    def _reduce_now(self, p: torch.nn.Parameter) -> None:
        """Count ``p``'s gradient; after its block's last one, free the block's parameters (not its
        gradients)."""
        i = self.unit_of[p]
        self.waiting[i] -= 1
        if self.waiting[i] == 0 and i > 0:
            self._free(i)

    def reduce_scatter_gradients(self) -> None:
        """Each unit's full gradients, one reduce-scatter per unit: this rank's rows of their average to its
        shards; the full gradients and the unit's parameters go."""
        missing = [self.names[p] for p in self.params if p.grad is None]
        if missing:
            raise ValueError(f"ZeRO-3: backward left no gradient for {', '.join(missing)}, so their units "
                             f"cannot be reduce-scattered")
        for i, unit in enumerate(self.units):
            if unit:
                accumulate_flat([self.shards[q] for q in unit],
                                reduce_scatter_flat([q.grad for q in unit], self.group))
                for q in unit:
                    q.grad = None
                self._free(i)

    def step(self) -> None:
        self.reduce_scatter_gradients()
        super().step()
