"""Tensor and sequence parallelism's communication operators (chapter 05), in Megatron-LM's names.

Four autograd Functions, each one collective forward and its mirror backward, stand between the layers of
:mod:`helpers.parallel.tensor_parallel`. Every collective is a call of :mod:`helpers.parallel.comms`, which
books it in :data:`helpers.parallel.ledger.LEDGER` once:

- ``f``, :func:`copy_to_tensor_parallel_region`: identity forward, all-reduce backward; before a
  column-parallel layer (Shoeybi et al. 2019).
- ``g``, :func:`reduce_from_tensor_parallel_region`: all-reduce forward, identity backward; after a
  row-parallel layer.
- With sequence parallelism (Korthikanti et al. 2022), ``f`` becomes
  :func:`gather_from_sequence_parallel_region` (all-gather the sequence forward, reduce-scatter backward) and
  ``g`` becomes :func:`reduce_scatter_to_sequence_parallel_region` (reduce-scatter forward, all-gather
  backward): the same bytes, with ``1/tp`` of those activations on each rank.

The split follows picotron's ``tp_communications.py`` and Megatron-LM's ``tensor_parallel/mappings.py``.
"""

from __future__ import annotations

import torch

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


__all__ = ["SEQ_DIM", "copy_to_tensor_parallel_region", "reduce_from_tensor_parallel_region",
           "gather_from_sequence_parallel_region", "reduce_scatter_to_sequence_parallel_region"]
