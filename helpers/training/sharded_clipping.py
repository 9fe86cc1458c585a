"""Global gradient-norm clipping when the model is sharded (chapter 13).

``torch.nn.utils.clip_grad_norm_`` on one process computes ``||g|| = sqrt(sum of g_i^2)`` over every
parameter and multiplies every gradient by ``min(1, max_norm / (||g|| + 1e-6))``. On a mesh no rank holds
all of ``g``, and some ranks hold the same piece: the sum must take **every element exactly once**.

- Tensor parallelism (chapter 05) splits the matrices, but every rank of a ``tp`` group holds the norms'
  weights and biases (and the learned positions) whole, and a KV head copied onto ``tp // n_kv_heads`` ranks:
  these are counted on one rank of their copies only (Megatron-LM's
  ``param_is_not_tensor_parallel_duplicate``).
- Pipeline parallelism (chapter 06) gives each stage its own blocks: every stage's sum is needed. A tied
  embedding has a copy on the last stage (its gradient summed with the first stage's): the copy is not
  counted (Megatron-LM marks it ``shared``).
- Data parallelism replicates the gradients (DDP): summing over ``dp`` would count each one ``dp`` times.
  ZeRO-1 (chapter 04) instead leaves each rank the rows of its shard after the reduce-scatter: then the shards
  are summed over ``dp`` too.

So each rank sums the squares it counts, the partial sums are added over the mesh dimensions that hold other
pieces (``tp``, ``pp``, and ``dp`` under ZeRO), and every rank clips all it holds, counted or not, by the
one coefficient (:func:`clip_`). Under ZeRO-1 the clip goes between the reduce-scatter that gives each rank
its rows and the AdamW step on them: :func:`clip_zero1` puts it there in chapter 04's ``ShardedAdamW``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from helpers.dist import device
from helpers.parallel import comms, tensor_parallel, zero


def rows_counted(dim, parts, tp_rank: int):
    """The weight of one tensor-parallel parameter (its entry ``(dim, parts)`` in
    ``tensor_parallel.shard_plan``) in the global norm on tp rank ``tp_rank``: a tensor every rank holds whole
    (``dim is None``) counts on rank 0 only (1.0 there, 0.0 elsewhere); a tensor stacking parts along dim 0
    of which some are held by ``copies`` ranks (a replicated KV head) gets a 0/1 weight per row, each part
    counted on the first rank of its copies; a split tensor counts whole (1.0)."""
    if dim is None:
        return 1.0 if tp_rank == 0 else 0.0
    if all(copies == 1 for _, _, copies in parts):
        return 1.0
    if dim != 0:
        raise ValueError(f"replicated parts stacked along dim {dim}, not 0: {parts}")
    return torch.cat([torch.full((n,), 1.0 if tp_rank % copies == 0 else 0.0, dtype=torch.float64,
                                 device=device())
                      for _, n, copies in parts])


def counted(chunk, tp_group=None) -> dict[str, torch.Tensor]:
    """For every parameter of this rank's chunk (a pipeline stage, made tensor-parallel over ``tp_group``):
    its weight in the global norm, as :func:`rows_counted` gives it (1.0 or 0.0, or one per dim-0 row)."""
    tp = dist.get_world_size(tp_group) if tp_group is not None else 1
    tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
    plan = tensor_parallel.shard_plan(chunk.cfg, tp) if tp > 1 else {}
    tied_copy = chunk.cfg.tie_embeddings and chunk.tok_emb is None and chunk.lm_head is not None
    weights = {}
    for name in dict(chunk.named_parameters()):
        if tied_copy and name == "lm_head.weight":  # the last stage's copy of the first stage's embedding
            weights[name] = 0.0
        else:
            weights[name] = rows_counted(*plan[name], tp_rank) if name in plan else 1.0
    return weights


def sum_of_squares(grads, weights) -> torch.Tensor:
    """``sum_p weight_p * sum(g_p ** 2)``, a weight per tensor or per dim-0 row: this rank's part of
    ``||g||^2``, in fp64."""
    grads = list(grads)
    total = torch.zeros((), dtype=torch.float64, device=grads[0].device if grads else device())
    for g, w in zip(grads, weights):
        squares = g.detach().to(torch.float64).pow(2)
        if isinstance(w, torch.Tensor):
            total += (w * squares.reshape(g.shape[0], -1).sum(dim=1)).sum()
        elif w:
            total += squares.sum()
    return total


def global_norm(local: torch.Tensor, groups) -> torch.Tensor:
    """``sqrt`` of the local sums of squares added over each group in ``groups`` in turn (the mesh
    dimensions whose ranks hold other pieces of the gradient)."""
    total = local.clone()
    for group in groups:
        comms.all_reduce(total, group)
    return total.sqrt()


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_``'s factor: ``min(1, max_norm / (total_norm + 1e-6))``."""
    return (max_norm / (total_norm + 1e-6)).clamp(max=1.0)


def clip_(grads, weights, max_norm: float, sum_over) -> torch.Tensor:
    """Clip ``grads`` in place by the global norm: this rank's :func:`sum_of_squares` under ``weights``, added
    over the groups ``sum_over``; every gradient, counted or not, times :func:`clip_coefficient`. Returns the
    norm."""
    total = global_norm(sum_of_squares(grads, weights), sum_over)
    coefficient = clip_coefficient(total, max_norm)
    for g in grads:
        g.mul_(coefficient.to(g.dtype))
    return total


def zero1_weights(weights: dict, names, dp_group) -> list:
    """The weights of :func:`counted` cut to this rank's ZeRO rows (chapter 04's ``shard_of``): a per-row
    weight is sharded as the gradient is; a weight per tensor holds for its rows."""
    rank, dp = dist.get_rank(dp_group), dist.get_world_size(dp_group)
    return [zero.shard_of(weights[n], rank, dp) if isinstance(weights[n], torch.Tensor) else weights[n]
            for n in names]


def clip_zero1(optimizer: zero.ShardedAdamW, chunk, max_norm: float, sum_over, *, tp_group=None,
               record: list | None = None):
    """Clip by the global norm inside ZeRO-1: before each AdamW step of ``optimizer`` (chapter 04's
    ``ShardedAdamW``), after its reduce-scatter, with :func:`clip_` on the shards' gradients (a step pre-hook
    on its inner AdamW). ``tp_group``: the group the chunk was split over; ``sum_over``: the data-parallel
    group (each rank holds other rows), ``tp`` and ``pp``. ``record`` gets each step's norm."""
    names = [optimizer.names[p] for p in optimizer.params]
    weights = zero1_weights(counted(chunk, tp_group), names, optimizer.group)

    def before_step(inner, args, kwargs):
        total = clip_([shard.grad for shard in optimizer.shards], weights, max_norm, sum_over)
        if record is not None:
            record.append(total)

    return optimizer.optimizer.register_step_pre_hook(before_step)


__all__ = ["rows_counted", "counted", "sum_of_squares", "global_norm", "clip_coefficient", "clip_",
           "zero1_weights", "clip_zero1"]
