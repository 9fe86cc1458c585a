"""Mixed-precision training: bf16 with fp32 master weights, and dynamic loss scaling for fp16 (chapter 09).

- :class:`MasterWeightsAdamW` is the mixed-precision optimizer of Megatron-LM (Micikevicius et al. 2018): the
  model's parameters are bf16 (what forward and backward read), the optimizer keeps an fp32 master copy of
  each and AdamW's two fp32 moments, and writes the updated master back into the bf16 parameter (a rounding).
  With ``fp32_grads=True`` every bf16 gradient backward produces is added into an fp32 buffer (Megatron's
  ``main_grad``, its ``--accumulate-allreduce-grads-in-fp32``) and freed at once; with ``False`` the gradients
  stay bf16 until the step. :func:`accumulated_step` runs one step of micro-batches and, data-parallel,
  sums the gradients over the group on the wire in ``wire_dtype`` (:mod:`helpers.parallel.comms`: bf16
  casts, reduces in bf16, casts back): gradient accumulation and the data-parallel reduction are one sum,
  once over micro-batches, once over ranks.
- :class:`Bf16Compute` is the same recipe for a module of any parallelism (chapter 15's ``precision="bf16"``):
  the module keeps its fp32 parameters as the masters and swaps bf16 copies in for each forward, as FSDP2's
  ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` does (torch 2.13.0), so every
  reduction of the composition runs on fp32 gradients; :class:`MastersStep` rounds the stepped masters into
  the copies, and :class:`Zero3Masters` is chapter 04's ZeRO-3 of it: fp32 shards, bf16 all-gathers, fp32
  reduce-scatters.
- :class:`LossScaler` is dynamic loss scaling from scratch, with the rules and defaults of
  ``torch.amp.GradScaler``: multiply the loss by the scale, unscale the gradients (by the fp32 reciprocal of
  the scale), skip the step if any gradient is inf or NaN and halve the scale, double it after
  ``growth_interval`` steps in a row without one. Data-parallel, it all-reduces the found-inf flag (MAX)
  over the group, so that ranks that each hold a shard of the gradients skip the same steps
  (:func:`sharded_fp16_step`, with ZeRO-2's flat gradient partition); PyTorch's ``ShardedGradScaler`` for
  FSDP all-reduces the flags as a sum, which skips on the same steps.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from helpers import dist as book_dist
from helpers.parallel import comms, zero

# --------------------------------------------------------------------------------------------- bf16


class MasterWeightsAdamW:
    """AdamW on fp32 master copies of a bf16 model's parameters (Megatron-LM's mixed-precision optimizer).

    ``model`` must already be bf16. ``fp32_grads``: accumulate the gradients in one contiguous fp32 buffer,
    ``main_grad``, of which each master's ``.grad`` is a view (the bf16 gradients backward produces are added
    in and freed as they arrive), so that a data-parallel reduction is one collective on one buffer, as in
    Megatron-LM; otherwise they accumulate in bf16, in the parameters' own ``.grad``.
    """

    def __init__(self, model: torch.nn.Module, *, fp32_grads: bool = True, **adamw):
        self.params = list(model.parameters())
        wrong = sorted({str(p.dtype) for p in self.params if p.dtype != torch.bfloat16})
        if wrong:
            raise ValueError(f"MasterWeightsAdamW needs a bf16 model (model.to(torch.bfloat16)); it has "
                             f"{wrong}")
        self.fp32_grads = fp32_grads
        self.masters = [torch.nn.Parameter(p.detach().float()) for p in self.params]
        self.optimizer = torch.optim.AdamW(self.masters, **adamw)
        self.main_grad = None
        if fp32_grads:
            self.main_grad = torch.zeros(sum(p.numel() for p in self.params), device=self.params[0].device)
            offset = 0
            for p, master in zip(self.params, self.masters):
                master.grad = self.main_grad[offset:offset + p.numel()].view(p.shape)
                offset += p.numel()
                p.register_post_accumulate_grad_hook(lambda p, master=master: self._accumulate(p, master))

    @staticmethod
    def _accumulate(p: torch.nn.Parameter, master: torch.nn.Parameter) -> None:
        """Megatron's main_grad: the bf16 gradient added into its fp32 slice of the buffer, then freed."""
        master.grad += p.grad
        p.grad = None

    def buffers(self) -> list[torch.Tensor]:
        """What a data-parallel reduction reduces: the fp32 buffer, or every parameter's bf16 ``.grad``."""
        return [self.main_grad] if self.fp32_grads else [p.grad for p in self.params]

    def grads(self) -> list[torch.Tensor]:
        """Each parameter's gradient as it is held: its view of the fp32 buffer, or its bf16 ``.grad``."""
        return [m.grad for m in self.masters] if self.fp32_grads else [p.grad for p in self.params]

    def step(self) -> None:
        if not self.fp32_grads:
            for p, master in zip(self.params, self.masters):
                master.grad = p.grad.float()
        self.optimizer.step()
        with torch.no_grad():
            for p, master in zip(self.params, self.masters):
                p.copy_(master)  # round to bf16: the copy the next forward reads

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        if self.fp32_grads:
            self.main_grad.zero_()  # kept: the views stay the masters' gradients
        else:
            for master in self.masters:
                master.grad = None


def accumulated_step(model: torch.nn.Module, optimizer: MasterWeightsAdamW, micro_batches, *,
                     data_parallel: bool = False, group=None, wire_dtype=None) -> tuple[float, list]:
    """One step under bf16 autocast: forward and backward of every micro-batch (each loss divided by their
    number and, ``data_parallel``, by the group's size), the gradients summed over ``group`` on the wire in
    ``wire_dtype`` (``data_parallel`` only), then the update. Returns this rank's mean loss and a copy of the
    gradients the update used."""
    world_size = dist.get_world_size(group) if data_parallel else 1
    total = 0.0
    for x, y in micro_batches:
        with torch.autocast(_device_type(model), dtype=torch.bfloat16):
            _, loss = model(x, y)
        (loss / (len(micro_batches) * world_size)).backward()
        total += float(loss.detach()) / len(micro_batches)
    if data_parallel:
        for buffer in optimizer.buffers():  # the gradients of loss / world_size: their sum is the average
            comms.all_reduce(buffer, group, wire_dtype=wire_dtype)
    used = [g.detach().float().clone() for g in optimizer.grads()]
    optimizer.step()
    optimizer.zero_grad()
    return total, used


class Bf16Compute:
    """A module computing in bf16 while its parameters stay fp32 masters: FSDP2's
    ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` without the sharding, with
    Megatron-LM's fp32 ``main_grad`` accumulation.

    Each fp32 parameter of ``module`` (the master) gets a bf16 copy (``compute[master]``, rounded to nearest).
    Around each forward the module's parameter slots hold the bf16 copies (:meth:`to_compute`, a forward
    pre-hook), so that forward and the backward autograd records read bf16 and every activation is bf16; after
    it they hold the masters again (:meth:`to_masters`, a forward hook), as FSDP2 registers its unsharded
    bf16 parameters on the module for forward and its sharded fp32 ones after. Each bf16 gradient backward
    produces is added into its master's fp32 ``.grad`` (exactly: bf16 converts to fp32 without rounding) and
    freed, so micro-batches accumulate in fp32, and whatever reduces the module's gradients afterwards (the
    composition's tensor-parallel, pipeline, data- and expert-parallel sums) finds fp32 masters holding fp32
    gradients. An optimizer of the masters steps them; :meth:`write_back` rounds them into the copies.
    """

    def __init__(self, module: torch.nn.Module):
        self.slots = [(m, name, p) for m in module.modules() for name, p in m._parameters.items()
                      if p is not None]
        self.masters = list({id(p): p for _, _, p in self.slots}.values())  # a tied weight once
        wrong = sorted({str(p.dtype) for p in self.masters if p.dtype != torch.float32})
        if wrong:
            raise ValueError(f"Bf16Compute keeps fp32 masters: the module's parameters must be float32, not "
                             f"{', '.join(wrong)}")
        self.compute = {}
        for master in self.masters:
            copy = torch.nn.Parameter(master.detach().to(torch.bfloat16), requires_grad=master.requires_grad)
            copy.__dict__.update(master.__dict__)  # marks such as ``sequence_parallel``
            copy.register_post_accumulate_grad_hook(lambda p, master=master: self._accumulate(p, master))
            self.compute[master] = copy
        self.sharded: set = set()  # masters a ZeRO-3 keeps as shards instead (Zero3Masters): not written back
        module.register_forward_pre_hook(lambda *_: self.to_compute())
        module.register_forward_hook(lambda *_: self.to_masters())

    @staticmethod
    def _accumulate(p: torch.nn.Parameter, master: torch.nn.Parameter) -> None:
        master.grad = p.grad.float() if master.grad is None else master.grad.add_(p.grad)
        p.grad = None

    def to_compute(self) -> None:
        for module, name, master in self.slots:
            module._parameters[name] = self.compute[master]

    def to_masters(self) -> None:
        for module, name, master in self.slots:
            module._parameters[name] = master

    @torch.no_grad()
    def write_back(self) -> None:
        """Each master, rounded to bf16, into its copy: what the next forward reads."""
        for master, copy in self.compute.items():
            if master not in self.sharded:
                copy.copy_(master)


class Copies:
    """``view`` (a module, or a view of one such as chapter 10's ``Dense``) seen through the bf16 copies of
    its parameters (``compute``'s): what :class:`Zero3Masters` shards; the rest is ``view``'s."""

    def __init__(self, view, compute: Bf16Compute):
        self.view, self.compute = view, compute

    def named_parameters(self):
        return [(name, self.compute.compute[p]) for name, p in self.view.named_parameters()]

    def parameters(self):
        return [p for _, p in self.named_parameters()]

    def __getattr__(self, name):
        return getattr(self.view, name)


class Zero3Masters(zero.Zero3ReduceAtStep):
    """Chapter 04's ZeRO-3 in bf16, as FSDP2's ``MixedPrecisionPolicy(param_dtype=bfloat16,
    reduce_dtype=float32)``: each rank keeps the fp32 rows of every master (its shards, side by side in one
    fp32 flat buffer per unit, stepped by AdamW in fp32), casts them to bf16 and all-gathers them into the
    bf16 copies forward reads (``Copies``: gathered and freed as chapter 04 gathers and frees), and
    reduce-scatters the fp32 gradients :class:`Bf16Compute` accumulated in the full masters, whose own storage
    is freed: they only carry gradients (FSDP2's ``unsharded_accumulated_grad``)."""

    def __init__(self, model: Copies, units: list[Copies], group=None, **adamw):
        super().__init__(model, units, group, **adamw)
        compute = model.compute
        self.master_of = {copy: master for master, copy in compute.compute.items() if copy in self.shards}
        rank = dist.get_rank(group)
        for i, unit in enumerate(self.units):  # the shards again, from the fp32 masters
            self.flats[i], shards = zero.flat_shards([self.master_of[p] for p in unit], rank, self.world_size)
            self.shards.update(zip(unit, shards))
        self.optimizer = self.memory.optimizer = torch.optim.AdamW(list(self.shards.values()), **adamw)
        for master in self.master_of.values():  # its shape kept (its gradient's), no storage of its own
            master.data = master.data.new_zeros(()).expand(master.shape)
            compute.sharded.add(master)

    def _start_gather(self, i: int, async_op: bool):
        """Unit ``i``'s fp32 rows cast to bf16, then all-gathered (half the bytes of fp32)."""
        flat = self.flats[i].to(torch.bfloat16)
        gathered = flat.new_empty(self.world_size * flat.numel())
        return comms.all_gather(flat, 0, self.group, out=gathered, async_op=async_op), gathered

    def reduce_scatter_gradients(self) -> None:
        """Each unit's fp32 gradients (its masters'), one fp32 reduce-scatter per unit, averaged."""
        missing = [self.names[p] for p in self.params if self.master_of[p].grad is None]
        if missing:
            raise ValueError(f"ZeRO-3: backward left no gradient for {', '.join(missing)}")
        for i, unit in enumerate(self.units):
            if unit:
                grads = [self.master_of[q].grad for q in unit]
                reduced = zero.reduce_scatter_flat(grads, self.group)
                zero.accumulate_flat([self.shards[q] for q in unit], reduced)
                for q in unit:
                    self.master_of[q].grad = None
                self._free(i)

    def full_parameters(self) -> dict:
        """Every master gathered in fp32 (for checking; a collective), under its bf16 copy."""
        full = {}
        for unit, flat in zip(self.units, self.flats):
            if unit:
                padded = [flat.new_empty(self.unsharded[p].shape) for p in unit]
                zero.unpack_rows(comms.all_gather(flat, 0, self.group), padded, self.world_size)
                full.update({p: t[:self.rows[p]] for p, t in zip(unit, padded)})
        return full


class MastersStep:
    """``optimizer`` (of the fp32 masters of the :class:`Bf16Compute` in ``computes``; AdamW's moments fp32
    too), each step followed by every master's rounding into its bf16 copy; the rest is ``optimizer``'s."""

    def __init__(self, optimizer, computes: list[Bf16Compute]):
        self.optimizer, self.computes = optimizer, computes

    def step(self) -> None:
        self.optimizer.step()
        for compute in self.computes:
            compute.write_back()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def __getattr__(self, name):
        return getattr(self.optimizer, name)


# --------------------------------------------------------------------------------------------- fp16


class LossScaler:
    """Dynamic loss scaling with ``torch.amp.GradScaler``'s rules and defaults, from scratch.

    ``scale`` is an fp32 tensor, ``growth_tracker`` the good steps since the scale last changed. With
    ``data_parallel``, the found-inf flag of :meth:`unscale_` is all-reduced with MAX over ``group``: every
    rank then skips the same steps, whichever rank's shard of the gradients overflowed.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, *, data_parallel: bool = False, group=None, device=None):
        device = book_dist.device() if device is None else device  # the found-inf flag is all-reduced there
        self.scale = torch.tensor(init_scale, dtype=torch.float32, device=device)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.data_parallel, self.group = growth_interval, data_parallel, group
        self.growth_tracker, self.found_inf = 0, None  # found_inf: set by unscale_, cleared by update

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale_(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Divide the gradients by the scale, in place (times the fp32 reciprocal, as GradScaler does), once
        per step; return the found-inf flag (1.0 if any gradient of any rank of the group is inf or NaN)."""
        if self.found_inf is not None:
            raise RuntimeError("unscale_ was already called this step: a second call would divide by the "
                               "scale twice")
        inv_scale = self.scale.double().reciprocal().float()
        found = torch.zeros((), dtype=torch.float32, device=self.scale.device)
        for g in grads:
            if g is not None:
                found = torch.maximum(found, (~torch.isfinite(g)).any().float())
                g.mul_(inv_scale)
        if self.data_parallel:
            comms.all_reduce(found, self.group, op="max")  # one rank's overflow is every rank's skip
        self.found_inf = found
        return found

    def step(self, optimizer: torch.optim.Optimizer, grads: list[torch.Tensor]) -> bool:
        """Unscale (if not done yet), step the optimizer unless a gradient overflowed; whether it stepped."""
        found = self.found_inf if self.found_inf is not None else self.unscale_(grads)
        if found.item():
            return False
        optimizer.step()
        return True

    def update(self) -> None:
        """Back off after an overflow; grow after ``growth_interval`` good steps in a row (if finite)."""
        if self.found_inf is None:
            raise RuntimeError("update() before unscale_() or step(): there is no found-inf flag this step")
        if self.found_inf.item():
            self.scale = self.scale * self.backoff_factor
            self.growth_tracker = 0
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                grown = self.scale * self.growth_factor
                if torch.isfinite(grown):
                    self.scale = grown
                self.growth_tracker = 0
        self.found_inf = None


def _device_type(model: torch.nn.Module) -> str:
    """Autocast's device type: where the model's parameters are (``cpu`` on gloo, ``cuda`` on nccl)."""
    return next(model.parameters()).device.type


def fp16_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The loss with every matmul in fp16 (autocast on the model's device), the parameters fp32."""
    with torch.autocast(_device_type(model), dtype=torch.float16):
        return model(x, y)[1]


def flat_shard(model: torch.nn.Module, group=None) -> torch.nn.Parameter:
    """This rank's piece of all the parameters laid end to end (ZeRO's flat partition, as DeepSpeed's)."""
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    return torch.nn.Parameter(zero.shard_of(flat, dist.get_rank(group), dist.get_world_size(group)))


def sharded_fp16_step(model: torch.nn.Module, shard: torch.nn.Parameter, optimizer, scaler: LossScaler,
                      x: torch.Tensor, y: torch.Tensor, group=None) -> bool:
    """One data-parallel fp16 step with ZeRO-2's flat gradient partition; whether the optimizer stepped.

    The scaled gradients of this rank's ``loss / world_size``, laid end to end, are reduce-scattered
    (summed), so each rank holds its piece of the global batch's gradient and nothing else: an overflow
    lands in the piece of one rank, and only the scaler's all-reduce of the flag tells the others. The
    optimizer steps the rank's :func:`flat_shard` (or skips), and the pieces are all-gathered back into the
    model.
    """
    world_size = dist.get_world_size(group)
    scaler.scale_loss(fp16_loss(model, x, y) / world_size).backward()
    params = list(model.parameters())
    flat = torch.cat([p.grad.flatten() for p in params])
    for p in params:
        p.grad = None
    shard.grad = comms.reduce_scatter(flat, 0, group, pad=True)
    stepped = scaler.step(optimizer, [shard.grad])
    scaler.update()
    optimizer.zero_grad()
    with torch.no_grad():
        full, offset = zero.all_gather_rows(shard.detach(), flat.numel(), group), 0
        for p in params:
            p.copy_(full[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
    return stepped


__all__ = ["MasterWeightsAdamW", "accumulated_step", "Bf16Compute", "Copies", "Zero3Masters", "MastersStep",
           "LossScaler", "fp16_loss",
           "flat_shard", "sharded_fp16_step"]
