"""ZeRO-1, -2 and -3 from scratch (chapter 04), with FSDP2's layout: every parameter sharded along dim 0.

Each rank owns rows ``[r*k, (r+1)*k)`` of every parameter, with ``k = ceil(rows / N)`` (the last shards are
padded with zero rows, as FSDP2 pads), and keeps AdamW's state for those rows only (Rajbhandari et al. 2020):

- ZeRO-1 (:class:`ShardedAdamW`, ``stage=1``): backward leaves every full gradient in place; ``step()``
  reduce-scatters each one, so a rank receives the average of its own rows, updates them, and all-gathers the
  updated parameters;
- ZeRO-2 (``stage=2``): the same, but each gradient is reduce-scattered from a hook the moment backward has
  produced it, and the full gradient is freed at once;
- ZeRO-3 (:class:`Zero3`): the full parameters are not kept either. A block's parameters are all-gathered just
  before its forward and freed after it, gathered again just before its backward, and their gradients are
  reduce-scattered as they appear; the parameters outside the blocks (embeddings, final norm) are gathered
  for the whole step, as FSDP's root module is.

Every collective is booked in the chapter 02 ledger, and :class:`MemoryLog` records the bytes of parameters,
gradients and optimizer state a rank holds at each of these moments.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .ledger import LEDGER


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
    world_size = dist.get_world_size(group)
    out = shard.new_empty((shard.shape[0] * world_size, *shard.shape[1:]))
    LEDGER.record("all_gather", out, group)
    dist.all_gather_single(out, shard.contiguous(), group=group)
    return out[:n_rows]


def reduce_scatter_rows(full: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's rows of the average of ``full`` over the ranks."""
    world_size = dist.get_world_size(group)
    k = shard_rows(full.shape[0], world_size)
    padded = full.new_zeros((k * world_size, *full.shape[1:]))
    padded[:full.shape[0]] = full
    out = full.new_empty((k, *full.shape[1:]))
    LEDGER.record("reduce_scatter", padded, group)
    dist.reduce_scatter_single(out, padded, group=group)
    return out.div_(world_size)


def tensor_bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class MemoryLog:
    """Bytes a rank holds, by kind, each time something is gathered, freed or reduced."""

    def __init__(self):
        self.events: list[tuple[float, str, dict]] = []

    def snapshot(self, label: str, params, shards, optimizer, in_flight_bytes: int = 0) -> None:
        held = {"parameters": sum(tensor_bytes(p.data) for p in params) + in_flight_bytes,
                "gradients": sum(tensor_bytes(p.grad) for p in params) + sum(tensor_bytes(s.grad) for s in shards),
                "optimizer states": sum(tensor_bytes(s) for s in shards) + optimizer_bytes(optimizer)}
        self.events.append((time.perf_counter(), label, held))

    def peak(self) -> dict:
        return max((held for _, _, held in self.events), key=lambda h: sum(h.values()))


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of AdamW's moments (its scalar step counters left out, as in chapter 01)."""
    return sum(tensor_bytes(v) for state in optimizer.state.values() for k, v in state.items() if k != "step")


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
        self.shards = [torch.nn.Parameter(shard_of(p.detach(), self.rank, self.world_size)) for p in self.params]
        self.shard_of_param = dict(zip(self.params, self.shards))
        self.optimizer = torch.optim.AdamW(self.shards, **adamw)
        self.memory = MemoryLog()
        if stage == 2:
            for p in self.params:
                p.register_post_accumulate_grad_hook(self._reduce_now)

    def _reduce_now(self, p: torch.nn.Parameter) -> None:
        """ZeRO-2: keep only this rank's rows of the gradient, from the moment backward produces it."""
        self.shard_of_param[p].grad = reduce_scatter_rows(p.grad, self.group)
        self.memory.snapshot("gradient reduced", self.params, self.shards, self.optimizer)  # both still held
        p.grad = None

    def step(self) -> None:
        if self.stage == 1:
            for p, shard in zip(self.params, self.shards):
                shard.grad = reduce_scatter_rows(p.grad, self.group)
        self.memory.snapshot("before the update", self.params, self.shards, self.optimizer)
        self.optimizer.step()
        for p, shard in zip(self.params, self.shards):
            p.data.copy_(all_gather_rows(shard.detach(), p.shape[0], self.group))
        self.memory.snapshot("after the update", self.params, self.shards, self.optimizer)

    def zero_grad(self) -> None:
        for p in self.params + self.shards:
            p.grad = None


class Zero3:
    """ZeRO-3: parameters, gradients and optimizer states all sharded; blocks gathered only while in use.

    ``reshard_after_forward=False`` keeps each block's gathered parameters from its forward to its backward
    (FSDP's switch between ZeRO-3 and ZeRO-2 behaviour for parameters): one all-gather fewer per block, at the
    cost of holding every block's full parameters at the peak. ``prefetch=True`` issues the all-gather of the
    next block (the previous one, in backward) asynchronously as soon as a block is gathered, so that it can
    travel while the block computes; it costs one more block's parameters at the peak.
    """

    def __init__(self, model: torch.nn.Module, units: list[torch.nn.Module], group=None,
                 reshard_after_forward: bool = True, prefetch: bool = False, **adamw):
        self.group, self.reshard_after_forward, self.prefetch = group, reshard_after_forward, prefetch
        self.in_flight: dict[int, list] = {}  # unit: [(parameter, buffer, work)] of an all-gather under way
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.memory = MemoryLog()
        self.params = list(model.parameters())
        in_units = {p for unit in units for p in unit.parameters()}
        self.units = [list(unit.parameters()) for unit in units]
        self.units.insert(0, [p for p in self.params if p not in in_units])  # the root: embeddings, final norm
        self.rows = {p: p.shape[0] for p in self.params}
        self.shapes = {p: p.shape for p in self.params}
        self.shards = {p: torch.nn.Parameter(shard_of(p.detach(), self.rank, self.world_size)) for p in self.params}
        self.optimizer = torch.optim.AdamW(list(self.shards.values()), **adamw)
        self.unit_names = ["root"] + [f"block {i}" for i in range(len(units))]
        self.unit_of = {p: i for i, unit in enumerate(self.units) for p in unit}
        self.waiting = [0] * len(self.units)
        for i in range(len(self.units)):
            self._free(i)
        last = len(units)
        model.register_forward_pre_hook(lambda *_: self._gather(0, then=1))
        for i, unit in enumerate(units, start=1):
            unit.register_forward_pre_hook(lambda *_, i=i: self._gather(i, then=i + 1 if i < last else None))
            unit.register_forward_hook(lambda *_, i=i: self._free(i) if self.reshard_after_forward else None)
            unit.register_full_backward_pre_hook(lambda *_, i=i: self._gather(i, then=i - 1 if i > 1 else None))
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._reduce_now)

    def _snapshot(self, label: str) -> None:
        self.memory.snapshot(label, self.params, list(self.shards.values()), self.optimizer,
                             sum(tensor_bytes(out) for pending in self.in_flight.values() for _, out, _ in pending))

    def _gathered(self, i: int) -> bool:
        return all(p.data.numel() for p in self.units[i])

    def _gather(self, i: int, then: int | None = None) -> None:
        """Make unit ``i``'s full parameters available; with prefetching, start gathering unit ``then``."""
        if i in self.in_flight:  # prefetched: wait for it
            for p, out, work in self.in_flight.pop(i):
                work.wait()
                p.data = out[:self.rows[p]].view(self.shapes[p])
        elif not self._gathered(i):
            for p in self.units[i]:
                p.data = all_gather_rows(self.shards[p].detach(), self.rows[p], self.group).view(self.shapes[p])
        else:
            return  # still gathered
        self.waiting[i] = len(self.units[i])
        self._snapshot(f"{self.unit_names[i]} gathered")
        if self.prefetch and then is not None and not self._gathered(then) and then not in self.in_flight:
            pending = []
            for p in self.units[then]:
                shard = self.shards[p].detach()
                out = shard.new_empty((shard.shape[0] * self.world_size, *shard.shape[1:]))
                LEDGER.record("all_gather", out, self.group)
                pending.append((p, out, dist.all_gather_single(out, shard, group=self.group, async_op=True)))
            self.in_flight[then] = pending
            self._snapshot(f"{self.unit_names[then]} prefetch issued")

    def _free(self, i: int) -> None:
        for p in self.units[i]:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self._snapshot(f"{self.unit_names[i]} freed")

    def _reduce_now(self, p: torch.nn.Parameter) -> None:
        self.shards[p].grad = reduce_scatter_rows(p.grad, self.group)
        self._snapshot("gradient reduced")  # the full gradient and its shard both still held
        p.grad = None
        i = self.unit_of[p]
        self.waiting[i] -= 1
        if self.waiting[i] == 0:  # the unit's backward is done: its full parameters can go
            self._free(i)

    def step(self) -> None:
        self._snapshot("before the update")
        self.optimizer.step()
        self._snapshot("after the update")

    def zero_grad(self) -> None:
        for shard in self.shards.values():
            shard.grad = None

    def full_parameters(self) -> dict[torch.nn.Parameter, torch.Tensor]:
        """Every parameter gathered (for checking; a collective, so every rank must call it)."""
        return {p: all_gather_rows(self.shards[p].detach(), self.rows[p], self.group).view(self.shapes[p])
                for p in self.params}
