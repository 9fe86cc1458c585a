"""Tensor and sequence parallelism's communication operators (chapter 05), in Megatron-LM's names.

Four autograd Functions, each one collective forward and its mirror backward, stand between the layers of
:mod:`helpers.parallel.tensor_parallel`; two functions, called after backward, complete the gradients the
layers leave partial. Every collective is a call of :mod:`helpers.parallel.comms`, which books it in
:data:`helpers.parallel.ledger.LEDGER` once:

- ``f``, :func:`copy_to_tensor_parallel_region`: identity forward, all-reduce backward; before a
  column-parallel layer (Shoeybi et al. 2019).
- ``g``, :func:`reduce_from_tensor_parallel_region`: all-reduce forward, identity backward; after a
  row-parallel layer.
- With sequence parallelism (Korthikanti et al. 2022), ``f`` becomes
  :func:`gather_from_sequence_parallel_region` (all-gather the sequence forward, reduce-scatter backward) and
  ``g`` becomes :func:`reduce_scatter_to_sequence_parallel_region` (reduce-scatter forward, all-gather
  backward): the same bytes, with ``1/tp`` of those activations on each rank.
- :func:`allreduce_sequence_parallel_grads` sums the gradients of the norms (and learned positions) over the
  ranks, each of which saw only its slice of the sequence under sequence parallelism;
  :func:`allreduce_replicated_kv_grads` sums the gradients of a KV head's copies over the ranks that hold it
  (tp > n_kv_heads), each of which saw only its own query heads.

The split follows picotron's ``tp_communications.py`` and Megatron-LM's ``tensor_parallel/mappings.py``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from helpers.parallel import comms

SEQ_DIM = 1  # activations are (batch, sequence, features), as in helpers.model


def _summed(x: torch.Tensor, group) -> torch.Tensor:
    """The sum over the group's ranks, in a new tensor (autograd may still need ``x``)."""
    return comms.all_reduce(x.clone(memory_format=torch.contiguous_format), group)


class _CopyToTensorParallelRegion(torch.autograd.Function):
    """Megatron's ``f`` (Shoeybi et al. 2019, section 3): identity forward, all-reduce backward.

    It stands before a column-parallel layer: every rank uses the whole input, and the input's gradient is the
    sum of each rank's contribution through its own slice of the weight.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _summed(grad, ctx.group), None


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    """Megatron's ``g`` (Shoeybi et al. 2019, section 3): all-reduce forward, identity backward.

    It follows a row-parallel layer: each rank's partial product is summed; the sum's gradient reaches every
    rank unchanged.
    """

    @staticmethod
    def forward(ctx, x, group):
        return _summed(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """Sequence parallelism's ``g`` (Korthikanti et al. 2022, section 4.2), in the place of Megatron's ``f``:
    all-gather the sequence forward, reduce-scatter the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comms.all_gather(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return comms.reduce_scatter(grad, SEQ_DIM, ctx.group), None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Sequence parallelism's ``g-bar`` (Korthikanti et al. 2022, section 4.2), in the place of Megatron's
    ``g``: reduce-scatter along the sequence forward, all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comms.reduce_scatter(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return comms.all_gather(grad, SEQ_DIM, ctx.group), None


def copy_to_tensor_parallel_region(x, group=None):
    return _CopyToTensorParallelRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x, group=None):
    return _ReduceFromTensorParallelRegion.apply(x, group)


def gather_from_sequence_parallel_region(x, group=None):
    return _GatherFromSequenceParallelRegion.apply(x, group)


def reduce_scatter_to_sequence_parallel_region(x, group=None):
    return _ReduceScatterToSequenceParallelRegion.apply(x, group)


def allreduce_sequence_parallel_grads(model: torch.nn.Module, group=None) -> None:
    """Sum over the ranks the gradients of the parameters marked ``sequence_parallel`` (norms, positions).

    Each rank's norm saw only its slice of the sequence, so its gradient is a partial sum; one all-reduce of
    all of them, flattened, completes it (Megatron's ``_allreduce_layernorm_grads``). A norm with a weight
    only (RMSNorm) contributes its weight.
    """
    params = [p for p in model.parameters() if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if not params:
        return
    flat = comms.all_reduce(torch.cat([p.grad.reshape(-1) for p in params]), group)
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        p.grad.copy_(g.view_as(p.grad))


def allreduce_replicated_kv_grads(model: torch.nn.Module, group=None) -> None:
    """Sum the gradients of each replicated KV head over the ranks that hold a copy of it.

    With ``tp > n_kv_heads`` the ``kv_replicas`` ranks ``r`` with the same ``r // kv_replicas`` hold the same
    K and V rows (the head their query heads use), and each copy's gradient holds only its own query heads'
    share. One all-reduce over the whole group completes them all: each rank writes its K and V rows'
    gradients, every layer's, into the slot of its KV head in a buffer of ``n_kv_heads`` slots, zeros
    elsewhere; slot ``j`` of the sum is then the sum over the ranks sharing head ``j``, the same on each. It
    needs no process group of its own (one per KV head would have to be made by every rank of the world).
    """
    layers = [m for m in model.modules()
              if getattr(m, "kv_replicas", 1) > 1 and m.qkv_proj.weight.grad is not None]
    if not layers:
        return
    replicas = {m.kv_replicas for m in layers}
    if len(replicas) > 1:
        raise ValueError(f"the layers replicate their KV heads differently: {sorted(replicas)}")
    kv_replicas = replicas.pop()
    slots, slot = dist.get_world_size(group) // kv_replicas, dist.get_rank(group) // kv_replicas
    kv = [m.qkv_proj.weight.grad[m.qkv_proj.sizes[0]:] for m in layers]  # this rank's K and V rows
    flat = torch.cat([g.reshape(-1) for g in kv])
    buffer = flat.new_zeros(slots, flat.numel())
    buffer[slot] = flat
    summed = comms.all_reduce(buffer, group)[slot]
    for g, s in zip(kv, summed.split([g.numel() for g in kv])):
        g.copy_(s.view_as(g))


__all__ = ["SEQ_DIM", "copy_to_tensor_parallel_region", "reduce_from_tensor_parallel_region",
           "gather_from_sequence_parallel_region", "reduce_scatter_to_sequence_parallel_region",
           "allreduce_sequence_parallel_grads", "allreduce_replicated_kv_grads"]
