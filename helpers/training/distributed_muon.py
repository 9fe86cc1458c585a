"""Muon on data-parallel ranks (chapter 12): whole matrices on owner ranks, never a dim-0 shard.

Muon's update of a matrix is the Newton–Schulz orthogonalisation of its (Nesterov) momentum, a function of
the *whole* matrix: the rows of the result depend on every row of the input. So where ZeRO-1 cuts every
parameter along dim 0 and updates the rows a rank owns (chapter 04's
:class:`~helpers.parallel.zero.ShardedAdamW`), distributed Muon hands out whole matrices instead:

- :func:`assign_owners` gives every Muon matrix one owner rank, largest first onto the least-loaded rank;
  :func:`check_owners` refuses an assignment that leaves a matrix unowned or owns one twice;
- :class:`DistributedMuon` keeps the momentum of a matrix on its owner only, and each step either
  (``mode="all_reduce"``) all-reduces every gradient, as plain data parallelism does, and lets each owner
  update its matrices, or (``mode="reduce_scatter"``) reduce-scatters the gradients *by matrix*, so that each
  owner receives only the summed gradients of what it owns; in both, the owners' updated matrices are then
  all-gathered. The matrices of one rank travel as one flat segment, zero-padded to the largest rank's load,
  so an unbalanced assignment costs bytes on the wire as well as time;
- the parameters Muon does not take (embeddings, norms, the head) are updated by ZeRO-1 AdamW, chapter 04's
  ``ShardedAdamW``, imported;
- :func:`orthogonalise_by_shards` is what a rank holding a dim-0 shard (FSDP) would compute if it ran
  Newton–Schulz on its shard: not Muon's update.

The single-process pieces (Newton–Schulz, the momentum, the shape-dependent learning rate, which parameters
Muon takes) are :mod:`helpers.training.optimizers`'s; every collective goes through
:mod:`helpers.parallel.comms`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from helpers.parallel import comms
from helpers.parallel.zero import ShardedAdamW
from helpers.training import optimizers

MODES = ("all_reduce", "reduce_scatter")


# --------------------------------------------------------------------------------------------- owners


def _check_matrices(shapes) -> list[tuple[int, int]]:
    shapes = [tuple(s) for s in shapes]
    for i, shape in enumerate(shapes):
        if len(shape) != 2:
            raise ValueError(f"Muon orthogonalises 2-D matrices only: matrix {i} has shape {shape} "
                             f"({len(shape)}-D); give it to AdamW")
    return shapes


def assign_owners(shapes, world_size: int) -> list[list[int]]:
    """Which matrices each rank owns: ``owned[r]`` lists the indices (into ``shapes``) rank ``r`` updates.

    Greedy, largest first: the matrices sorted by size (elements; ties by index) each go to the rank with the
    fewest elements so far (ties to the lowest rank). Every matrix gets exactly one owner, and every rank at
    least one matrix: more ranks than matrices is refused.
    """
    shapes = _check_matrices(shapes)
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, not {world_size}")
    if world_size > len(shapes):
        raise ValueError(f"{world_size} owner ranks for {len(shapes)} Muon matrices: a whole matrix cannot "
                         f"be split between owners, so there must be at least as many matrices as ranks")
    owned: list[list[int]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for i in sorted(range(len(shapes)), key=lambda i: (-shapes[i][0] * shapes[i][1], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owned[r].append(i)
        load[r] += shapes[i][0] * shapes[i][1]
    return [sorted(o) for o in owned]


def check_owners(owned, n_matrices: int, world_size: int) -> None:
    """Refuse an assignment that is not one owner per matrix, naming the matrices it gets wrong."""
    if len(owned) != world_size:
        raise ValueError(f"the assignment lists {len(owned)} ranks, the group has {world_size}")
    count = [0] * n_matrices
    for r, indices in enumerate(owned):
        for i in indices:
            if not 0 <= i < n_matrices:
                raise ValueError(f"rank {r} owns matrix {i}, but there are only {n_matrices}")
            count[i] += 1
    unowned = [i for i, c in enumerate(count) if c == 0]
    twice = [i for i, c in enumerate(count) if c > 1]
    if unowned or twice:
        raise ValueError(f"every matrix needs exactly one owner: unowned {unowned}, "
                         f"owned more than once {twice}")


def newton_schulz_flops(shape, steps: int = 5) -> int:
    """FLOPs of ``steps`` quintic Newton–Schulz iterations on a matrix of ``shape``, counted from its matmuls.

    With the matrix as ``X`` of ``m x n``, ``m <= n`` (it is transposed when it has more rows), each iteration
    computes ``A = X Xᵀ`` (``2 m² n``), ``A @ A`` (``2 m³``) and ``B @ X`` (``2 m² n``).
    """
    m, n = sorted(_check_matrices([shape])[0])
    return steps * (4 * m * m * n + 2 * m ** 3)


def rank_loads(shapes, owned) -> dict[str, list[int]]:
    """Per rank: the elements it owns and the Newton–Schulz FLOPs it runs each step."""
    return {"elements": [sum(shapes[i][0] * shapes[i][1] for i in o) for o in owned],
            "flops": [sum(newton_schulz_flops(shapes[i]) for i in o) for o in owned]}


# --------------------------------------------------------------------------------------------- segments


def pack(tensors, owned, rank: int, length: int) -> torch.Tensor:
    """Rank ``rank``'s matrices flattened one after another, zero-padded to ``length`` elements."""
    flat = torch.cat([tensors[i].reshape(-1) for i in owned[rank]])
    return torch.cat([flat, flat.new_zeros(length - flat.numel())])


def unpack(flat: torch.Tensor, shapes, owned, rank: int) -> dict[int, torch.Tensor]:
    """The matrices of rank ``rank``'s segment, by index: views into ``flat``."""
    out, offset = {}, 0
    for i in owned[rank]:
        n = shapes[i][0] * shapes[i][1]
        out[i] = flat[offset:offset + n].view(shapes[i])
        offset += n
    return out


def step_bytes(shapes, owned, mode: str, element_size: int) -> dict[str, int]:
    """What one rank sends per step for the Muon matrices, by the ring formulas (every rank sends the same).

    ``L`` is the largest rank's load (the segment length); ``P`` all the matrices' elements; ``N`` ranks:
    an all-reduce of ``P`` sends ``2 (N-1)/N · P`` elements (``N`` dividing ``P``: the ring's chunks are
    otherwise uneven), a reduce-scatter or an all-gather of ``N`` segments ``(N-1) · L``.
    """
    n = len(owned)
    segment = max(rank_loads(shapes, owned)["elements"])
    total = sum(a * b for a, b in shapes)
    gradients = 2 * (n - 1) * total // n if mode == "all_reduce" else (n - 1) * segment
    return {"gradients": gradients * element_size, "parameters": (n - 1) * segment * element_size}


def zero1_bytes(shapes, world_size: int, element_size: int) -> int:
    """What one rank sends per step under ZeRO-1 (``ShardedAdamW``): each parameter's rows, padded to ``N·k``
    (``k = ceil(rows / N)``), reduce-scattered and all-gathered once, ``(N-1) · k · columns`` each way,
    however many buckets carry them."""
    sent = 0
    for shape in shapes:
        rows, cols = shape[0], (torch.Size(shape[1:]).numel())
        k = -(-rows // world_size)
        sent += 2 * (world_size - 1) * k * cols
    return sent * element_size


# --------------------------------------------------------------------------------------------- the optimizer


class _Holder(nn.Module):
    """A module holding some of a model's parameters (the same objects), for ``ShardedAdamW``."""

    def __init__(self, params):
        super().__init__()
        self.held = nn.ParameterList(params)


class DistributedMuon:
    """Muon on whole matrices, each updated on its owner rank; ZeRO-1 AdamW for the other parameters.

    Every rank keeps the full model (data parallelism); after backward each ``p.grad`` holds the rank's own
    gradient. ``step()`` averages the gradients over the group (all-reduced, or reduce-scattered by owner),
    lets each owner run single-process Muon (``optimizers.Muon``) on its matrices, which alone keep momentum,
    and all-gathers the owners' updated matrices into every rank's model. ``muon`` are ``optimizers.Muon``'s
    settings, ``adamw`` those of the AdamW for the rest.
    """

    def __init__(self, model: nn.Module, group=None, *, mode: str = "reduce_scatter", adamw: dict, **muon):
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is not one of {MODES}")
        self.mode, self.group = mode, group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.matrices, others = optimizers.muon_params(model)
        self.shapes = _check_matrices(p.shape for p in self.matrices)
        self.owned = assign_owners(self.shapes, self.world_size)
        self.segment = max(rank_loads(self.shapes, self.owned)["elements"])
        mine = [self.matrices[i] for i in self.owned[self.rank]]
        self.muon = optimizers.Muon(mine, **muon)  # the owner's matrices only: their momentum lives here
        self.adamw = ShardedAdamW(_Holder(others), stage=1, group=group, **adamw)

    def _reduced_gradients(self) -> dict[int, torch.Tensor]:
        """The averaged gradients of this rank's matrices."""
        grads = [p.grad for p in self.matrices]
        if self.mode == "all_reduce":
            flat = comms.all_reduce(torch.cat([g.reshape(-1) for g in grads]), self.group)
            flat.div_(self.world_size)
            every, offset = {}, 0
            for i, shape in enumerate(self.shapes):
                every[i] = flat[offset:offset + shape[0] * shape[1]].view(shape)
                offset += shape[0] * shape[1]
            return {i: every[i] for i in self.owned[self.rank]}
        segments = torch.cat([pack(grads, self.owned, r, self.segment) for r in range(self.world_size)])
        mine = comms.reduce_scatter(segments, 0, self.group).div_(self.world_size)
        return unpack(mine, self.shapes, self.owned, self.rank)

    @torch.no_grad()
    def step(self) -> None:
        reduced = self._reduced_gradients()
        for i, g in reduced.items():
            self.matrices[i].grad = g.clone()
        self.muon.step()
        updated = pack([p.detach() for p in self.matrices], self.owned, self.rank, self.segment)
        gathered = comms.all_gather(updated, 0, self.group)
        for r in range(self.world_size):
            segment = gathered[r * self.segment:(r + 1) * self.segment]
            for i, value in unpack(segment, self.shapes, self.owned, r).items():
                self.matrices[i].copy_(value)
        self.adamw.step()

    def zero_grad(self) -> None:
        for p in self.matrices:
            p.grad = None
        self.adamw.zero_grad()


# --------------------------------------------------------------------------------------------- FSDP's shards


def orthogonalise_by_shards(matrix: torch.Tensor, world_size: int, **newton_schulz) -> torch.Tensor:
    """Newton–Schulz run on each rank's dim-0 shard separately, the shards stacked back: what FSDP's layout
    would give if every rank orthogonalised the rows it holds. Not the orthogonalisation of ``matrix``.
    ``newton_schulz``: the iteration's settings (``dtype=torch.float64`` for a comparison in fp64)."""
    rows = -(-matrix.shape[0] // world_size)
    return torch.cat([optimizers.newton_schulz(shard, **newton_schulz) for shard in matrix.split(rows)])


__all__ = ["MODES", "assign_owners", "check_owners", "newton_schulz_flops", "rank_loads", "pack", "unpack",
           "step_bytes", "zero1_bytes", "DistributedMuon", "orthogonalise_by_shards"]
