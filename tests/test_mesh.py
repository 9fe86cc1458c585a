"""The device mesh of chapter 10 (helpers.parallel.mesh): the groups by hand, the refusals, and every group of
several meshes on 8 ranks against the one ``torch.distributed.device_mesh.init_device_mesh`` builds.

The refusals and the rows need no ranks: a mesh is arithmetic until ``make_groups``. The 8 ranks start once
for the module.
"""

import ipyparallel as ipp
import pytest

from helpers.parallel.mesh import Mesh

SHAPES = [((2, 2, 2), ("pp", "dp_shard", "tp")), ((2, 2, 2), ("dp_shard", "cp", "tp")),
          ((2, 4), ("dp_replicate", "tp")), ((4, 2), ("pp", "cp")), ((8,), ("dp_shard",)),
          ((2, 2, 2), ("pp", "dp_shard", "cp"))]


def test_rows_are_the_grid_read_along_each_dimension():
    mesh = Mesh((2, 2, 2), ("pp", "dp_shard", "tp"), world_size=8)
    assert mesh.rows("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]  # innermost: consecutive ranks
    assert mesh.rows("dp_shard") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.rows("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert mesh.rows("cp") == [[r] for r in range(8)]  # a dimension the mesh lacks: groups of one
    assert mesh.coordinates(6) == {"pp": 1, "dp_shard": 1, "tp": 0}
    assert mesh.size("dp_shard_cp") == 2 and mesh.size("cp") == 1
    flat = Mesh((2, 2, 2), ("dp_shard", "cp", "tp"), world_size=8)
    assert flat.rows("dp_shard_cp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert flat.dimension_of((6, 2, 0, 4)) == "dp_shard_cp" and flat.dimension_of((0, 3)) is None


@pytest.mark.parametrize("shape, names, message", [
    ((2, 2), ("pp", "tp"), "a mesh of shape (2, 2) holds 2 * 2 = 4 ranks, but the world has 8"),
    ((2, 2, 2), ("pp", "tp", "tp"), "mesh dimension 'tp' is named 2 times in ('pp', 'tp', 'tp')"),
    ((2, 4), ("pp", "ep"), "mesh dimension 'ep' is not one of pp, dp_replicate, dp_shard, cp, tp"),
    ((4, 2), ("tp", "pp"), "mesh dimensions ('tp', 'pp') are not in torchtitan's order: ('pp', 'tp')"),
    ((8,), ("pp", "tp"), "the mesh's shape (8,) has 1 dimensions but 2 names ('pp', 'tp')"),
], ids=["product", "twice", "unknown", "order", "names"])
def test_a_wrong_mesh_is_refused_with_the_numbers(shape, names, message):
    with pytest.raises(ValueError) as err:
        Mesh(shape, names, world_size=8)
    assert str(err.value) == message


def test_an_unknown_name_is_refused_when_asked_for():
    with pytest.raises(ValueError, match="'ep' is neither a mesh dimension"):
        Mesh((8,), ("tp",), world_size=8).rows("ep")


@ipp.interactive  # sent by value: the engines cannot import this test module
def _groups(shapes):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from helpers.parallel.mesh import Mesh

    out = []
    for shape, names in shapes:
        mine = Mesh(shape, names).make_groups()
        theirs = init_device_mesh("cpu", shape, mesh_dim_names=names)
        pairs = {name: (dist.get_process_group_ranks(mine.group(name)),
                        dist.get_process_group_ranks(theirs.get_group(name))) for name in names}
        if "dp_shard" in names and "cp" in names:
            theirs["dp_shard", "cp"]._flatten("dp_shard_cp")
            pairs["dp_shard_cp"] = (dist.get_process_group_ranks(mine.group("dp_shard_cp")),
                                    dist.get_process_group_ranks(theirs.get_group("dp_shard_cp")))
        out.append(pairs)
    return out


def test_every_group_matches_init_device_mesh_on_8_ranks(eight):
    per_rank = eight.apply(_groups, SHAPES)
    for rank, results in enumerate(per_rank):
        for (shape, names), pairs in zip(SHAPES, results):
            assert set(pairs) >= set(names)
            for name, (mine, theirs) in pairs.items():
                assert mine == theirs, f"rank {rank}, mesh {shape} {names}, {name}: {mine} != {theirs}"
                assert rank in mine


def test_the_ledger_adds_bytes_by_group_and_the_mesh_names_each_group():
    from helpers.parallel.ledger import Ledger, Message

    ledger = Ledger()
    entries = [("send", 8, (4, 5), True), ("recv", 8, (4, 5), True), ("send", 64, (6, 4), False),
               ("send", 2, (5, 4), True), ("recv", 32, (4, 6), False)]
    for direction, nbytes, ranks, counted in entries:
        ledger.messages.append(Message("x", "x", 0, direction, 0, nbytes, counted=counted, group_ranks=ranks))
    assert ledger.by_group() == {(4, 5): (10, 8), (4, 6): (64, 32)}  # a group's ranks in any order: one key
    assert ledger.by_group(counted=True) == {(4, 5): (10, 8)}
    mesh = Mesh((2, 2, 2), ("pp", "dp_shard", "tp"), world_size=8)
    assert [mesh.dimension_of(ranks) for ranks in ledger.by_group()] == ["tp", "dp_shard"]
