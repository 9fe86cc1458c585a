"""Distributed Muon (chapter 12): the owner assignment, the FLOP count, the shard's wrong update, and both
modes on two ranks against single-process Muon (fp64: the averaged gradients are summed in another order,
so within 1e-10 of each tensor's largest entry after three steps, not bit for bit)."""

import functools

import ipyparallel as ipp
import pytest
import torch

from conftest import assert_close_to_scale, seeded_batch, small_config
from helpers.measure import count_flops
from helpers.model import GPT
from helpers.reference import named_params
from helpers.training import optimizers
from helpers.training.distributed_muon import (assign_owners, check_owners, newton_schulz_flops,
                                               orthogonalise_by_shards, rank_loads, step_bytes, zero1_bytes)

CFG = small_config(tie_embeddings=False)
STEPS, ROWS = 3, 4
MUON = dict(lr=0.02, momentum=0.95, weight_decay=0.1, dtype=torch.float64)  # Newton–Schulz in fp64
ADAMW = dict(lr=3e-3, weight_decay=0.01)


def test_assign_owners_is_greedy_largest_first_onto_the_least_loaded_rank():
    shapes = [(2, 2), (4, 4), (2, 2), (1, 1), (3, 3)]
    owned = assign_owners(shapes, 2)
    # 16 to rank 0; 9, 4, 4 to rank 1 (the lighter); the last 1 to rank 0 (16 < 17)
    assert owned == [[1, 3], [0, 2, 4]]
    check_owners(owned, len(shapes), 2)
    assert rank_loads(shapes, owned)["elements"] == [17, 17]


def test_assign_owners_balances_the_book_gpt():
    model = GPT(small_config(n_layers=4, tie_embeddings=False))
    shapes = [tuple(p.shape) for p in optimizers.muon_params(model)[0]]
    for world_size in (2, 3, 4):
        owned = assign_owners(shapes, world_size)
        check_owners(owned, len(shapes), world_size)
        loads = rank_loads(shapes, owned)["elements"]
        assert max(loads) - min(loads) <= max(a * b for a, b in shapes)  # the greedy bound: one matrix


def test_bad_input_is_refused_naming_the_constraint():
    with pytest.raises(ValueError, match=r"2-D matrices only: matrix 1 has shape \(8,\)"):
        assign_owners([(4, 4), (8,)], 1)
    with pytest.raises(ValueError, match="5 owner ranks for 3 Muon matrices"):
        assign_owners([(4, 4)] * 3, 5)
    with pytest.raises(ValueError, match=r"unowned \[1\], owned more than once \[\]"):
        check_owners([[0], [2]], 3, 2)
    with pytest.raises(ValueError, match=r"unowned \[\], owned more than once \[0\]"):
        check_owners([[0, 1], [0, 2]], 3, 2)
    with pytest.raises(ValueError, match="2-D"):
        newton_schulz_flops((2, 3, 4))


@pytest.mark.parametrize("shape", [(16, 48), (48, 16), (32, 32)])
def test_newton_schulz_flops_match_the_counter(shape):
    x = torch.randn(shape, dtype=torch.float64)
    counted = sum(count_flops(lambda: optimizers.newton_schulz(x, dtype=torch.float64)).values())
    assert counted == newton_schulz_flops(shape)


def test_orthogonalising_shards_is_not_muon():
    m = torch.randn(64, 48, dtype=torch.float64)
    whole = optimizers.newton_schulz(m, dtype=torch.float64)
    assert torch.equal(orthogonalise_by_shards(m, 1, dtype=torch.float64), whole)
    assert (orthogonalise_by_shards(m, 4, dtype=torch.float64) - whole).norm() > 0.1 * whole.norm()


def test_step_bytes_reduce_scatter_halves_the_gradient_traffic_when_balanced():
    shapes = [(8, 8)] * 4
    owned = assign_owners(shapes, 4)
    want = {"gradients": 2 * 3 * 64 * 8, "parameters": 3 * 64 * 8}
    assert step_bytes(shapes, owned, "all_reduce", 8) == want
    assert step_bytes(shapes, owned, "reduce_scatter", 8)["gradients"] == 3 * 64 * 8


BATCHES = [seeded_batch(CFG, ROWS, seed=s) for s in range(STEPS)]


@functools.cache
def _single_process():
    model = GPT(CFG, seed=0).double()
    matrices, others = optimizers.muon_params(model)
    muon, adamw = optimizers.Muon(matrices, **MUON), torch.optim.AdamW(others, **ADAMW)
    for x, y in BATCHES:
        model(x, y)[1].backward()
        muon.step()
        adamw.step()
        model.zero_grad()
    return named_params(model)


@ipp.interactive  # sent by value: the engines cannot import this test module
def _distributed(cfg, batches, mode, muon, adamw):
    import torch.distributed as dist

    from helpers.data import rank_rows
    from helpers.model import GPT
    from helpers.parallel.ledger import LEDGER
    from helpers.reference import named_params
    from helpers.training.distributed_muon import DistributedMuon

    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = GPT(cfg, seed=0).double()
    optimizer = DistributedMuon(model, mode=mode, adamw=adamw, **muon)
    for x, y in batches:
        model(rank_rows(x, rank, world_size), rank_rows(y, rank, world_size))[1].backward()
        LEDGER.clear()  # the last step's collectives only
        optimizer.step()
        optimizer.zero_grad()
    booked = [m.collective for m in LEDGER.booked()]
    return named_params(model), booked, LEDGER.totals()[0], optimizer.owned, optimizer.shapes


@pytest.mark.parametrize("mode", ["all_reduce", "reduce_scatter"])
def test_distributed_muon_matches_one_process(ranks, mode):
    results = ranks.apply(_distributed, CFG, BATCHES, mode, MUON, ADAMW)
    want = _single_process()
    rest = [tuple(p.shape) for p in optimizers.muon_params(GPT(CFG))[1]]
    for params, booked, sent, owned, shapes in results:
        assert_close_to_scale(params, want, rtol=1e-10)
        first = "all_reduce" if mode == "all_reduce" else "reduce_scatter"
        assert booked[:2] == [first, "all_gather"]  # the Muon matrices: one flat collective each way
        assert sent == sum(step_bytes(shapes, owned, mode, 8).values()) + zero1_bytes(rest, 2, 8)
