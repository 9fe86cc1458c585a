"""A device mesh from scratch (chapter 10): the ranks as a grid, one process group per row of each dimension.

The ``world_size`` ranks are ``torch.arange(world_size).reshape(shape)``, the dimensions in torchtitan's order
(v0.1.0's ``parallel_dims.py``: ``pp, dp_replicate, dp_shard, cp, tp``; v0.2.2 keeps the order in the
meshes it unflattens), so the last one, tensor parallelism, changes fastest: its ranks are neighbours, which
on a real cluster means the same node and its fastest links. A dimension's groups are the grid's rows along
it: move that dimension last and read the rows. Several dimensions flattened into one (``dp_shard`` and ``cp``
as torchtitan v0.1.0's ``dp_shard_cp``, v0.2.2's ``fsdp``, over which it shards and reduces the dense
parameters) are the rows of those dimensions moved last together.

:class:`Mesh` does the arithmetic without any process group (so its refusals need no ranks):
:meth:`Mesh.rows` lists a dimension's groups as lists of global ranks, :meth:`Mesh.coordinates` says where a
rank sits. :meth:`Mesh.make_groups` then creates every group of every dimension, on every rank, in the same
order (``torch.distributed.new_group`` is collective over the world: each rank must call it for each group,
even the groups it is not in), and :meth:`Mesh.group` is this rank's group along a dimension.
:meth:`Mesh.dimension_of` names the dimension a group belongs to, from its ranks, which is how the ledger's
traffic is split by dimension.
"""

from __future__ import annotations

import math

import torch

MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""torchtitan's order of the mesh's dimensions, the slowest-changing first."""

FLATTENED = {"dp_shard_cp": ("dp_shard", "cp"), "dp_cp": ("dp_replicate", "dp_shard", "cp"),
             "dp": ("dp_replicate", "dp_shard")}
"""Combined dimensions, as torchtitan v0.1.0 names them: each is the rows of its parts moved last together."""


class Mesh:
    """``world_size`` ranks as a grid of ``shape``, its dimensions named ``names`` (a subset of
    :data:`MESH_ORDER`, in that order)."""

    def __init__(self, shape, names, world_size: int | None = None):
        shape, names = tuple(int(n) for n in shape), tuple(names)
        if len(shape) != len(names):
            raise ValueError(f"the mesh's shape {shape} has {len(shape)} dimensions but {len(names)} names "
                             f"{names}")
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"mesh dimension {twice[0]!r} is named {names.count(twice[0])} times in {names}")
        unknown = [n for n in names if n not in MESH_ORDER]
        if unknown:
            raise ValueError(f"mesh dimension {unknown[0]!r} is not one of {', '.join(MESH_ORDER)}")
        order = sorted(names, key=MESH_ORDER.index)
        if list(names) != order:
            raise ValueError(f"mesh dimensions {names} are not in torchtitan's order: {tuple(order)}")
        if any(n < 1 for n in shape):
            raise ValueError(f"every mesh dimension needs at least one rank, got shape {shape}")
        if world_size is None:
            import torch.distributed as dist

            world_size = dist.get_world_size()
        if math.prod(shape) != world_size:
            raise ValueError(f"a mesh of shape {shape} holds {' * '.join(map(str, shape))} = "
                             f"{math.prod(shape)} ranks, but the world has {world_size}")
        self.shape, self.names, self.world_size = shape, names, world_size
        self.grid = torch.arange(world_size).reshape(shape)
        self._groups: dict = {}

    def size(self, name: str) -> int:
        """The degree of a dimension, or the product of a flattened one's parts; 1 if the mesh lacks it."""
        return math.prod(self.shape[self.names.index(p)] for p in self.parts(name) if p in self.names)

    def parts(self, name: str) -> tuple[str, ...]:
        """The dimensions a name stands for: itself, or the parts of a flattened dimension."""
        if name in MESH_ORDER:
            return (name,)
        if name in FLATTENED:
            return FLATTENED[name]
        raise ValueError(f"{name!r} is neither a mesh dimension ({', '.join(MESH_ORDER)}) nor a flattened "
                         f"one ({', '.join(FLATTENED)})")

    def rows(self, name: str) -> list[list[int]]:
        """The groups along ``name``: every row of the grid along that dimension (or those dimensions,
        flattened), as lists of global ranks; a dimension the mesh lacks gives every rank a group of one."""
        dims = [self.names.index(part) for part in self.parts(name) if part in self.names]
        moved = self.grid.movedim(dims, list(range(-len(dims), 0))) if dims else self.grid.unsqueeze(-1)
        return moved.reshape(-1, math.prod(self.grid.shape[d] for d in dims)).tolist()

    def coordinates(self, rank: int) -> dict[str, int]:
        """Where ``rank`` sits: its index along each dimension."""
        where = (self.grid == rank).nonzero()[0].tolist()
        return dict(zip(self.names, where))

    def make_groups(self, names=None) -> "Mesh":
        """Create the process groups of ``names`` (by default every dimension of the mesh and every
        flattened one it has parts of), each row of each, in one order on every rank."""
        import torch.distributed as dist

        if dist.get_world_size() != self.world_size:
            raise ValueError(f"the mesh holds {self.world_size} ranks, the world {dist.get_world_size()}")
        if names is None:
            names = self.names + tuple(f for f, parts in FLATTENED.items() if set(parts) & set(self.names))
        for name in names:
            made = [dist.new_group(row) for row in self.rows(name)]  # every rank makes every group
            mine = next(i for i, row in enumerate(self.rows(name)) if dist.get_rank() in row)
            self._groups[name] = made[mine]
        return self

    def group(self, name: str):
        """This rank's process group along ``name`` (made by :meth:`make_groups`)."""
        if name not in self._groups:
            raise ValueError(f"no process group for {name!r}: call make_groups() first (made: "
                             f"{', '.join(self._groups) or 'none'})")
        return self._groups[name]

    def dimension_of(self, ranks) -> str | None:
        """The first dimension (or flattened dimension) one of whose groups holds exactly ``ranks``."""
        ranks = sorted(ranks)
        for name in self.names + tuple(FLATTENED):
            if any(sorted(row) == ranks for row in self.rows(name)):
                return name
        return None

    def with_group(self, name: str, rows) -> "Mesh":
        """A copy of this mesh whose groups along ``name`` are ``rows`` instead (made on every rank, in
        order): a wrong mesh, for replaying a break."""
        import copy

        import torch.distributed as dist

        made = [dist.new_group(row) for row in rows]
        other = copy.copy(self)
        mine = next(g for row, g in zip(rows, made) if dist.get_rank() in row)
        other._groups = {**self._groups, name: mine}
        return other

    def __repr__(self) -> str:
        return f"Mesh({', '.join(f'{n}={s}' for n, s in zip(self.names, self.shape))})"


__all__ = ["MESH_ORDER", "FLATTENED", "Mesh"]
