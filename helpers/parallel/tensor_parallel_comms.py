"""Tensor and sequence parallelism's communication operators (chapter 05), in Megatron-LM's names.

Every collective of a tensor-parallel layer goes through one of three small wrappers, :func:`_all_reduce`,
:func:`_all_gather` and :func:`_reduce_scatter`, which book its bytes in
:data:`helpers.parallel.ledger.LEDGER` before they call ``torch.distributed``. On them stand the four
operators of the layers in :mod:`helpers.parallel.tensor_parallel`, autograd Functions that do one collective
forward and its mirror backward:

- ``f``, :func:`copy_to_tensor_parallel_region`: identity forward, all-reduce backward; before a
  column-parallel layer (Shoeybi et al. 2019).
- ``g``, :func:`reduce_from_tensor_parallel_region`: all-reduce forward, identity backward; after a
  row-parallel layer.
- With sequence parallelism (Korthikanti et al. 2022), ``f`` becomes
  :func:`gather_from_sequence_parallel_region` (all-gather the sequence forward, reduce-scatter backward) and
  ``g`` becomes :func:`reduce_scatter_to_sequence_parallel_region` (reduce-scatter forward, all-gather
  backward): the same bytes, with ``1/tp`` of those activations on each rank.

The split follows picotron's ``tp_communications.py`` and Megatron-LM's ``tensor_parallel/mappings.py``. The
layers call these; only the vocabulary-parallel loss also makes an all-reduce of its own (of a maximum).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from helpers.parallel.ledger import LEDGER

SEQ_DIM = 1  # activations are (batch, sequence, features), as in helpers.model


# ---------------------------------------------------------------------------------------------------------
# Collectives, booked in the ledger
# ---------------------------------------------------------------------------------------------------------


def _all_reduce(x: torch.Tensor, group=None) -> torch.Tensor:
    """The sum over the group's ranks, in a new tensor."""
    out = x.clone(memory_format=torch.contiguous_format)
    LEDGER.record("all_reduce", out, group)
    dist.all_reduce(out, group=group)
    return out


def _all_gather(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim``, in rank order."""
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((dist.get_world_size(group) * moved.shape[0], *moved.shape[1:]))
    LEDGER.record("all_gather", out, group)
    dist.all_gather_single(out, moved, group=group)
    return out.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """The sum over the group's ranks of ``x``, of which this rank keeps its slice along ``dim``."""
    moved = x.movedim(dim, 0).contiguous()
    world_size = dist.get_world_size(group)
    if moved.shape[0] % world_size:
        raise ValueError(f"a reduce-scatter over {world_size} ranks needs dim {dim} ({moved.shape[0]}) to "
                         f"divide by {world_size}")
    out = moved.new_empty((moved.shape[0] // world_size, *moved.shape[1:]))
    LEDGER.record("reduce_scatter", moved, group)
    dist.reduce_scatter_single(out, moved, group=group)
    return out.movedim(0, dim)


# ---------------------------------------------------------------------------------------------------------
# The communication operators: autograd Functions
# ---------------------------------------------------------------------------------------------------------


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
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    """Megatron's ``g`` (Shoeybi et al. 2019, section 3): all-reduce forward, identity backward.

    It follows a row-parallel layer: each rank's partial product is summed; the sum's gradient reaches every
    rank unchanged.
    """

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """Sequence parallelism's ``g`` (Korthikanti et al. 2022, section 4.2), in the place of Megatron's ``f``:
    all-gather the sequence forward, reduce-scatter the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, SEQ_DIM, ctx.group), None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Sequence parallelism's ``g-bar`` (Korthikanti et al. 2022, section 4.2), in the place of Megatron's
    ``g``: reduce-scatter along the sequence forward, all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, SEQ_DIM, ctx.group), None


def copy_to_tensor_parallel_region(x, group=None):
    return _CopyToTensorParallelRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x, group=None):
    return _ReduceFromTensorParallelRegion.apply(x, group)


def gather_from_sequence_parallel_region(x, group=None):
    return _GatherFromSequenceParallelRegion.apply(x, group)


def reduce_scatter_to_sequence_parallel_region(x, group=None):
    return _ReduceScatterToSequenceParallelRegion.apply(x, group)


__all__ = ["SEQ_DIM", "copy_to_tensor_parallel_region", "reduce_from_tensor_parallel_region",
           "gather_from_sequence_parallel_region", "reduce_scatter_to_sequence_parallel_region"]
