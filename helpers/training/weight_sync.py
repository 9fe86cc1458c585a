"""Weight synchronisation for reinforcement learning (chapter 11): from a trainer's FSDP shards to an
inference group's tensor-parallel layout, after every training step.

An RL system trains the policy on one group of ranks and generates with it on another. After each step the
trainer's updated weights must reach the inference ranks, in *their* layout. Here the trainer holds every
parameter as chapter 04's dim-0 shards (:func:`helpers.parallel.zero.shard_of`: rank ``t`` of ``N`` holds
rows ``t·k … (t+1)·k`` with ``k = ceil(rows / N)``, the last shard zero-padded) and the inference group
holds chapter 05's tensor-parallel shards (:func:`helpers.parallel.tensor_parallel.shard_state`, the
reference for what each inference rank must hold): Q, K and V stacked in one column-parallel ``qkv_proj``
(a KV head copied onto ``tp / n_kv_heads`` ranks when there are more ranks than KV heads), gate and up in
one ``gate_up_proj``, ``o_proj`` and ``down_proj`` row-parallel (cut along dim 1), the vocabulary split.

Two ways to move them, both through :mod:`helpers.parallel.comms`, so the ledger sees every byte:

- :func:`gather_then_broadcast`: the trainer all-gathers each parameter whole (chapter 04's
  :func:`~helpers.parallel.zero.all_gather_rows`), its rank 0 sends the whole model, as one bucket, to
  every inference rank, and each inference rank cuts its own slice;
- :func:`direct_slices`: each trainer rank sends each inference rank exactly the rows of its shard that the
  inference rank's slice needs, one bucket per (trainer rank, inference rank) pair, as :func:`plan` says.

:func:`plan` is pure (no ranks): for every pair it lists the :class:`Piece` s to move, so it can be tested,
drawn and costed without starting anything; :func:`apply_locally` runs it in one process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from helpers import dist as book_dist
from helpers.model import GPT, GPTConfig
from helpers.parallel import comms, tensor_parallel
from helpers.parallel.zero import all_gather_rows, shard_of, shard_rows


@dataclass(frozen=True)
class Piece:
    """One block of reference parameter ``source`` that trainer rank ``trainer`` sends to inference rank
    ``inference``: the full parameter's rows ``rows`` (``[start, stop)``) and columns ``cols`` (``None`` for a
    1-D tensor), written into the inference parameter ``target`` at row ``at[0]``, column ``at[1]``. ``k`` is
    the rows of the trainer's dim-0 shard of ``source``."""

    target: str
    source: str
    trainer: int
    inference: int
    rows: tuple[int, int]
    cols: tuple[int, int] | None
    at: tuple[int, int]
    k: int

    @property
    def shape(self) -> tuple[int, ...]:
        n = self.rows[1] - self.rows[0]
        return (n,) if self.cols is None else (n, self.cols[1] - self.cols[0])

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())


def reference_shapes(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every parameter of the reference GPT (a tied weight once), without allocating it."""
    with torch.device("meta"):
        return {name: tuple(p.shape) for name, p in GPT(cfg).named_parameters()}


def check_sizes(cfg: GPTConfig, n_trainers: int, tp: int) -> None:
    """Refuse a trainer count below 1 or an inference layout chapter 05 cannot make, naming the rule."""
    if n_trainers < 1:
        raise ValueError(f"the trainer group needs at least one rank, got n_trainers={n_trainers}")
    try:
        tensor_parallel.check_layout(cfg, tp)
    except ValueError as err:
        raise ValueError(f"the inference group's tensor-parallel layout: {err}") from None


def _slice(dim, i: int, n: int, copies: int, shape) -> tuple[tuple[int, int], tuple[int, int] | None]:
    """The rows and columns of a reference parameter that inference rank ``i`` stacks (chapter 05's cut)."""
    rows, cols = (0, shape[0]), None if len(shape) == 1 else (0, shape[1])
    start = i // copies * n
    if dim == 0:
        rows = (start, start + n)
    elif dim == 1:
        cols = (start, start + n)
    return rows, cols


def plan(cfg: GPTConfig, n_trainers: int, tp: int) -> dict[tuple[int, int], list[Piece]]:
    """For every (trainer rank, inference rank): the pieces to move, in the order both sides pack them.

    For each tensor-parallel parameter and inference rank ``i``, :func:`tensor_parallel.shard_plan` gives
    the reference parameters it stacks and the slice of each; a slice is cut from the trainer shards whose
    rows ``[t·k, (t+1)·k)`` overlap its rows. A column-parallel slice (rows) overlaps one or two shards; a
    row-parallel slice (columns, every row) and a replicated tensor take rows from every trainer rank."""
    check_sizes(cfg, n_trainers, tp)
    shapes = reference_shapes(cfg)
    pieces: dict[tuple[int, int], list[Piece]] = {(t, i): [] for t in range(n_trainers) for i in range(tp)}
    for target, (dim, parts) in tensor_parallel.shard_plan(cfg, tp).items():
        for i in range(tp):
            offset = 0  # where this part starts in the stacked tensor, along ``dim``
            for source, n, copies in parts:
                shape = shapes[source]
                rows, cols = _slice(dim, i, n, copies, shape)
                k = shard_rows(shape[0], n_trainers)
                for t in range(n_trainers):
                    lo, hi = max(rows[0], t * k), min(rows[1], (t + 1) * k)
                    if lo < hi:
                        at = (offset + lo - rows[0], 0) if dim == 0 else (lo, offset if dim == 1 else 0)
                        pieces[(t, i)].append(Piece(target, source, t, i, (lo, hi), cols, at, k))
                offset += n
    return pieces


def target_shapes(cfg: GPTConfig, tp: int) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor-parallel parameter one inference rank holds."""
    shapes, out = reference_shapes(cfg), {}
    for target, (dim, parts) in tensor_parallel.shard_plan(cfg, tp).items():
        shape = list(shapes[parts[0][0]])
        if dim is not None:
            shape[dim] = sum(n for _, n, _ in parts)
        out[target] = tuple(shape)
    return out


def pack(pieces: list[Piece], state: dict[str, torch.Tensor]) -> torch.Tensor:
    """One flat bucket of the pieces, cut from a trainer rank's ``state`` (its dim-0 shards by name)."""
    blocks = []
    for p in pieces:
        if p.source not in state:
            raise KeyError(f"the trainer's state has no parameter {p.source!r}, which the inference "
                           f"group's {p.target!r} needs")
        shard = state[p.source]
        if shard.shape[0] != p.k:
            raise ValueError(f"{p.source}: the trainer's shard has {shard.shape[0]} rows, the plan's dim-0 "
                             f"shards {p.k}: the trainer group has another size than the plan's")
        local = shard[p.rows[0] - p.trainer * p.k:p.rows[1] - p.trainer * p.k]
        if p.cols is not None:
            local = local[:, p.cols[0]:p.cols[1]]
        blocks.append(local.reshape(-1))
    return torch.cat(blocks) if blocks else torch.empty(0, device=book_dist.device())


def unpack(bucket: torch.Tensor, pieces: list[Piece], into: dict[str, torch.Tensor]) -> None:
    """Write a bucket's pieces into an inference rank's tensors ``into``, in place."""
    at = 0
    for p in pieces:
        block = bucket[at:at + p.numel].view(p.shape)
        at += p.numel
        dst = into[p.target][p.at[0]:p.at[0] + p.shape[0]]
        (dst if p.cols is None else dst[:, p.at[1]:p.at[1] + p.shape[1]]).copy_(block)
    if at != bucket.numel():
        raise ValueError(f"a bucket of {bucket.numel()} elements for pieces of {at}")


def empty_shards(cfg: GPTConfig, tp: int, dtype=torch.float32, device=None) -> dict[str, torch.Tensor]:
    """An inference rank's tensors, filled with NaN: anything the synchronisation misses shows. On the run's
    device unless ``device`` says otherwise."""
    device = book_dist.device() if device is None else device
    return {name: torch.full(shape, float("nan"), dtype=dtype, device=device)
            for name, shape in target_shapes(cfg, tp).items()}


def apply_locally(full: dict[str, torch.Tensor], cfg: GPTConfig, n_trainers: int,
                  tp: int) -> list[dict[str, torch.Tensor]]:
    """The plan run in one process: cut ``full`` into the trainers' dim-0 shards, pack every pair's bucket
    and unpack it on its inference rank; each inference rank's tensors, in rank order."""
    pieces = plan(cfg, n_trainers, tp)
    states = [{name: shard_of(w, t, n_trainers) for name, w in full.items()} for t in range(n_trainers)]
    dtype = next(iter(full.values())).dtype
    out = [empty_shards(cfg, tp, dtype) for _ in range(tp)]
    for (t, i), these in pieces.items():
        unpack(pack(these, states[t]), these, out[i])
    return out


# ---------------------------------------------------------------------------------------------------------
# On ranks: a trainer group and an inference group
# ---------------------------------------------------------------------------------------------------------


def make_groups(n_trainers: int, tp: int):
    """The trainer group (global ranks ``0 … n_trainers-1``) and the inference group (the next ``tp``),
    made by every rank in the same order (``new_group`` is a collective over the world)."""
    world_size = dist.get_world_size()
    if n_trainers < 1 or tp < 1 or n_trainers + tp != world_size:
        raise ValueError(f"mismatched group sizes: {n_trainers} trainer and {tp} inference ranks, but the "
                         f"world has {world_size}")
    return dist.new_group(list(range(n_trainers))), dist.new_group(list(range(n_trainers, world_size)))


def _member(group, ranks) -> int | None:
    """This rank's place in ``group``, or None if it is not in it."""
    me = dist.get_rank()
    return ranks.index(me) if me in ranks else None


def direct_slices(pieces, trainer_group, inference_group, state=None, into=None, *, step: int = 0):
    """Strategy (b): each trainer rank sends each inference rank the pieces of its shards that rank needs,
    one bucket per pair, point to point. A trainer rank passes its ``state``; an inference rank its tensors
    ``into``, filled in place. Every rank of both groups calls it."""
    trainers = dist.get_process_group_ranks(trainer_group)
    inference = dist.get_process_group_ranks(inference_group)
    n_trainers, tp = len(trainers), len(inference)
    if {key for key, these in pieces.items()} != {(t, i) for t in range(n_trainers) for i in range(tp)}:
        raise ValueError(f"mismatched group sizes: the plan is for other groups than {n_trainers} trainer "
                         f"and {tp} inference ranks")
    t, i = _member(trainer_group, trainers), _member(inference_group, inference)
    if t is not None:
        sent = [comms.send(pack(pieces[(t, j)], state), inference[j], label="sync: direct", step=step)
                for j in range(tp) if pieces[(t, j)]]
        for pending in sent:
            pending.wait()
    elif i is not None:
        dtype, device = next(iter(into.values())).dtype, next(iter(into.values())).device
        for s in range(n_trainers):
            these = pieces[(s, i)]
            if these:
                like = torch.empty(sum(p.numel for p in these), dtype=dtype, device=device)
                unpack(comms.recv(like, trainers[s], label="sync: direct", step=step), these, into)
    return into


def gather_then_broadcast(cfg: GPTConfig, trainer_group, inference_group, state=None, into=None, *,
                          step: int = 0):
    """Strategy (a): the trainer all-gathers every parameter whole over its group, its rank 0 sends the whole
    model (one bucket, the reference's names in order) to every inference rank, and each inference rank
    cuts its slice with chapter 05's ``shard_state``. Every rank of both groups calls it."""
    trainers = dist.get_process_group_ranks(trainer_group)
    inference = dist.get_process_group_ranks(inference_group)
    shapes = reference_shapes(cfg)
    t, i = _member(trainer_group, trainers), _member(inference_group, inference)
    if t is not None:
        missing = [name for name in shapes if name not in state]
        if missing:
            raise KeyError(f"the trainer's state has no parameter {missing[0]!r}")
        full = [all_gather_rows(state[name], shape[0], trainer_group).reshape(-1)
                for name, shape in shapes.items()]
        if t == 0:
            bucket = torch.cat(full)
            for pending in [comms.send(bucket, dst, label="sync: broadcast", step=step) for dst in inference]:
                pending.wait()
    elif i is not None:
        sizes = [int(torch.Size(shape).numel()) for shape in shapes.values()]
        dtype, device = next(iter(into.values())).dtype, next(iter(into.values())).device
        bucket = comms.recv(torch.empty(sum(sizes), dtype=dtype, device=device), trainers[0],
                            label="sync: broadcast", step=step)
        full = {name: w.view(shape) for (name, shape), w in zip(shapes.items(), bucket.split(sizes))}
        for name, w in tensor_parallel.shard_state(full, cfg, i, len(inference)).items():
            into[name].copy_(w)
    return into


def load(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy synced tensors into a tensor-parallel model's parameters, name by name; every one must come."""
    names = dict(model.named_parameters())
    if sorted(names) != sorted(tensors):
        raise ValueError(f"the synced tensors ({len(tensors)}) are not the model's parameters "
                         f"({len(names)}): {sorted(set(names) ^ set(tensors))[:3]}")
    with torch.no_grad():
        for name, p in names.items():
            p.copy_(tensors[name])


__all__ = ["Piece", "reference_shapes", "check_sizes", "plan", "target_shapes", "pack", "unpack",
           "empty_shards", "apply_locally", "make_groups", "direct_slices", "gather_then_broadcast", "load"]
