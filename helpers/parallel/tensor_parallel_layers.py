"""Tensor and sequence parallelism's layers from scratch (chapter 05), in Megatron-LM's names.

Tensor parallelism (Shoeybi et al. 2019) splits every weight matrix of a transformer layer over the ``tp``
ranks of a group, so that each rank stores and multiplies ``1/tp`` of it. The operators between the layers,
``f`` and ``g`` and their sequence-parallel forms, are in :mod:`helpers.parallel.tensor_parallel_comms`;
:mod:`helpers.parallel.tensor_parallel` swaps these layers into the book's GPT.

- :class:`ColumnParallelLinear` splits a weight along its outputs: each rank computes some output features
  from the full input, which enters through ``f`` (identity forward, all-reduce backward).
- :class:`RowParallelLinear` splits a weight along its inputs: each rank multiplies its slice of the features
  and the partial products are summed by ``g`` (all-reduce forward, identity backward). A column-parallel
  layer followed by a row-parallel one needs one all-reduce forward, one backward.
- :class:`VocabParallelEmbedding` and :func:`vocab_parallel_cross_entropy` split the vocabulary; the loss is
  computed without ever gathering the full logits.

Under sequence parallelism (Korthikanti et al. 2022) ``g`` becomes a reduce-scatter and ``f`` an all-gather;
backward gathers each column-parallel layer's input again (:class:`_SequenceParallelLinear`), since only this
rank's slice of it is kept, and the position embedding (:class:`SequenceParallelEmbedding`) looks up only its
rank's positions.

Each layer takes its rank and ``tp`` from its process group and cuts its shard from the weights it replaces.
Every collective is a call of :mod:`helpers.parallel.comms`, booked in the ledger.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from helpers.parallel import comms
from helpers.parallel.tensor_parallel_comms import (SEQ_DIM, copy_to_tensor_parallel_region,
                                                    reduce_from_tensor_parallel_region,
                                                    reduce_scatter_to_sequence_parallel_region)


def _mine(weight: torch.Tensor, dim: int, group, what: str, replicas: int = 1) -> torch.Tensor:
    """This rank's block of ``weight`` along ``dim``: rank ``r`` of ``tp`` holds the ``r``-th of ``tp`` equal
    blocks (a copy: a shard owns its storage); with ``replicas`` ranks holding each block (a KV head when
    ``tp > n_kv_heads``), the ``r // replicas``-th of ``tp / replicas``."""
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    blocks = tp // replicas  # the distinct blocks
    if tp % replicas or weight.shape[dim] % blocks:
        raise ValueError(f"tp={tp} must divide {what} ({weight.shape[dim]})" if replicas == 1 else
                         f"tp={tp} must be {replicas} times a divisor of {what} ({weight.shape[dim]})")
    n = weight.shape[dim] // blocks
    return weight.detach().narrow(dim, (rank // replicas) * n, n).clone()


class _SequenceParallelLinear(torch.autograd.Function):
    """All-gather the sequence, then multiply, keeping only this rank's slice of the input for backward.

    Storing the gathered input would cost ``tp`` times the slice, and Korthikanti et al. 2022 count every
    activation of a sequence-parallel layer divided by ``tp``; so, as Megatron does, backward gathers the
    input again to form the weight's gradient, and the input's gradient is reduce-scattered back to the
    sequence slices. One weight may hold several column-parallel layers stacked (Q, K and V): each gets its
    own output tensor, so that only what attention keeps stays alive.
    """

    @staticmethod
    def forward(ctx, x, weight, sizes, group):
        ctx.save_for_backward(x, weight)
        ctx.sizes, ctx.group = sizes, group
        gathered = comms.all_gather(x, SEQ_DIM, group)
        return tuple(F.linear(gathered, w) for w in weight.split(sizes))

    @staticmethod
    def backward(ctx, *grads):
        x, weight = ctx.saved_tensors
        gathered = comms.all_gather(x, SEQ_DIM, ctx.group)  # again: it was not kept
        grad = torch.cat(grads, dim=-1)  # autograd passes zeros for an output that was not used
        grad_input = comms.reduce_scatter(grad @ weight, SEQ_DIM, ctx.group)
        grad_weight = grad.reshape(-1, grad.shape[-1]).t() @ gathered.reshape(-1, gathered.shape[-1])
        return grad_input, grad_weight, None, None


class ColumnParallelLinear(nn.Module):
    """``Y = X Aᵀ`` with ``A``'s rows (the output features) split over the ranks: rank ``r`` holds rows
    ``r·out/tp … (r+1)·out/tp`` and returns those output features (Shoeybi et al. 2019).

    Given several full weights of layers that share the input (Q, K and V), it stacks this rank's rows of each
    in one weight and returns one tensor per layer; ``replicas`` gives, for each, how many ranks hold the same
    rows (1: split). With ``sequence_parallel`` the input is this rank's slice of the sequence and is
    all-gathered first.
    """

    def __init__(self, *weights: torch.Tensor, group=None, sequence_parallel: bool = False, replicas=None):
        super().__init__()
        shards = [_mine(w, 0, group, "the output features of a column-parallel layer", n)
                  for w, n in zip(weights, replicas or [1] * len(weights))]
        self.sizes = tuple(len(shard) for shard in shards)
        self.weight = nn.Parameter(torch.cat(shards))
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, x):
        if self.sequence_parallel:
            out = _SequenceParallelLinear.apply(x, self.weight, self.sizes, self.group)
        else:
            x = copy_to_tensor_parallel_region(x, self.group)
            out = tuple(F.linear(x, w) for w in self.weight.split(self.sizes))
        return out[0] if len(out) == 1 else out


class RowParallelLinear(nn.Module):
    """``Y = X Aᵀ`` with ``A``'s columns (the input features) split over the ranks: rank ``r`` multiplies its
    slice of the features, and the partial products are summed over the ranks (Shoeybi et al. 2019), or, with
    ``sequence_parallel``, summed and scattered along the sequence (Korthikanti et al. 2022)."""

    def __init__(self, weight: torch.Tensor, group=None, sequence_parallel: bool = False):
        super().__init__()
        self.weight = nn.Parameter(_mine(weight, 1, group, "the input features of a row-parallel layer"))
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, x):
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(partial, self.group)
        return reduce_from_tensor_parallel_region(partial, self.group)


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows (the vocabulary) are split over the ranks (Shoeybi et al. 2019, section 3).

    Each rank looks up the tokens of its vocabulary range and writes zeros for the others; summing over the
    ranks (or, with ``sequence_parallel``, reduce-scattering along the sequence) gives every token its row.
    """

    def __init__(self, weight: torch.Tensor, group=None, sequence_parallel: bool = False):
        super().__init__()
        self.weight = nn.Parameter(_mine(weight, 0, group, "the vocabulary"))
        self.vocab_start = dist.get_rank(group) * len(self.weight)
        self.vocab_end = self.vocab_start + len(self.weight)
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, idx):
        elsewhere = (idx < self.vocab_start) | (idx >= self.vocab_end)
        local = (idx - self.vocab_start).masked_fill(elsewhere, 0)
        partial = F.embedding(local, self.weight).masked_fill(elsewhere.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(partial, self.group)
        return reduce_from_tensor_parallel_region(partial, self.group)


class SequenceParallelEmbedding(nn.Module):
    """The position embedding under sequence parallelism: the rows of this rank's slice of the positions it is
    given, since the residual stream holds only those. Each rank's gradient holds its positions' rows: it is
    marked to be summed with the norms'."""

    def __init__(self, weight: nn.Parameter, group=None):
        super().__init__()
        self.weight, self.group = weight, group
        weight.sequence_parallel = True

    def forward(self, positions):
        return F.embedding(_mine(positions, -1, self.group, "the positions"), self.weight)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy of logits split along the vocabulary, without gathering them (Shoeybi et al. 2019,
    section 3).

    Per token, three all-reduces of one number: the largest logit (for a stable exponential), the sum of the
    exponentials, and the logit of the target, which lies in one rank's range. Backward needs no
    communication: ``softmax - onehot(target)`` restricted to this rank's vocabulary.
    """

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group):
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # at least fp32
        largest = comms.all_reduce(logits.max(dim=-1).values, group, op="max")
        shifted = logits - largest.unsqueeze(-1)
        mine = (targets >= vocab_start) & (targets < vocab_start + logits.shape[-1])
        local = (targets - vocab_start).masked_fill(~mine, 0)
        target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        target_logit = comms.all_reduce(target_logit, group)
        exp = shifted.exp()
        sum_exp = comms.all_reduce(exp.sum(dim=-1), group)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), mine, local)
        return sum_exp.log() - target_logit  # per token: log Σ exp(z) - z_target

    @staticmethod
    def backward(ctx, grad):
        softmax, mine, local = ctx.saved_tensors
        onehot = torch.zeros_like(softmax).scatter_(-1, local.unsqueeze(-1),
                                                    mine.unsqueeze(-1).to(softmax.dtype))
        return (softmax - onehot) * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits, targets, group=None) -> torch.Tensor:
    """The mean cross-entropy of ``logits`` split along the vocabulary over ``group``: rank ``r`` holds the
    ``r``-th slice (``helpers.model.cross_entropy``, vocabulary-parallel)."""
    vocab_start = dist.get_rank(group) * logits.shape[-1]
    return _VocabParallelCrossEntropy.apply(logits, targets, vocab_start, group).mean()


__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "SequenceParallelEmbedding",
           "vocab_parallel_cross_entropy"]
