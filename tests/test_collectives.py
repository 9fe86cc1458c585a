"""The from-scratch collectives, the byte ledger and the α–β model (chapter 02).

Formulas and the fit are checked in this process. The collectives run once, on 4 processes started with
``torch.multiprocessing`` (each joins a gloo group through ``helpers.dist.init_process_group``); each rank
writes what it found to a file, and the tests below read those files.
"""

import datetime
import os
import pickle
import random
import socket

import pytest
import torch

from helpers.cost import collective_costs
from helpers.cost.collective_costs import (AlphaBeta, bus_bandwidth, chunk_sizes, cost_terms,
                                               expected_bytes, fit)
from helpers.parallel.ledger import LEDGER

WORLD_SIZE = 4
SIZES = (3, 10, 17)  # fewer elements than ranks, uneven, prime
COLLECTIVES = ("ring_reduce_scatter", "ring_all_gather", "ring_all_reduce", "tree_broadcast", "tree_reduce",
               "pairwise_all_to_all", "recursive_doubling_all_reduce")
ROOTS = {"tree_broadcast": 1, "tree_reduce": 2}


# ---------------------------------------------------------------------------------------------------------
# Formulas, in this process
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("numel", [0, 1, 3, 10, 17, 64])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
def test_chunk_sizes_split_as_tensor_split(numel, world_size):
    assert chunk_sizes(numel, world_size) == [c.numel() for c in torch.arange(numel).tensor_split(world_size)]


@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 8])
def test_ring_fractions_with_even_chunks(world_size):
    n = 1024 * world_size
    for rank in range(world_size):
        assert expected_bytes("ring_all_reduce", n, world_size, rank, element_size=1) == \
            (2 * (world_size - 1) * n // world_size,) * 2
        for name in ("ring_reduce_scatter", "ring_all_gather", "pairwise_all_to_all"):
            one_chunk_short = (world_size - 1) * n // world_size
            assert expected_bytes(name, n, world_size, rank, element_size=1) == (one_chunk_short,) * 2


@pytest.mark.parametrize("name", ["ring_reduce_scatter", "ring_all_gather", "ring_all_reduce",
                                  "tree_broadcast", "tree_reduce", "pairwise_all_to_all"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("numel", [3, 10, 17])
def test_every_byte_sent_is_received(name, world_size, numel):
    for root in range(world_size):
        moved = [expected_bytes(name, numel, world_size, r, root=root) for r in range(world_size)]
        assert sum(s for s, _ in moved) == sum(r for _, r in moved)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 6, 8, 13])
def test_binomial_tree_spans_the_ranks(world_size):
    # every rank but the root has exactly one parent, so the children add up to N - 1
    assert sum(collective_costs.tree_children(v, world_size) for v in range(world_size)) == world_size - 1
    assert collective_costs.tree_children(0, world_size) == (world_size - 1).bit_length()


def test_torch_names_map_to_the_ring_and_tree_formulas():
    assert expected_bytes("all_reduce", 10, 4, 1) == expected_bytes("ring_all_reduce", 10, 4, 1)
    assert expected_bytes("broadcast", 10, 4, 0, root=0) == (2 * 40, 0)  # the root sends to two children
    assert expected_bytes("reduce", 10, 4, 0, root=0) == (0, 2 * 40)
    with pytest.raises(ValueError, match="no byte formula"):
        expected_bytes("all_scatter", 10, 4, 0)


def test_bus_bandwidth_factors_of_nccl_tests():
    # busbw = algbw * factor: 2(N-1)/N for all-reduce, (N-1)/N for the gather/scatter family, 1 for rooted
    # ones
    assert bus_bandwidth("all_reduce", 8e9, 1.0, 8) == pytest.approx(8e9 * 2 * 7 / 8)
    for name in ("reduce_scatter", "all_gather", "all_to_all"):
        assert bus_bandwidth(name, 8e9, 2.0, 8) == pytest.approx(4e9 * 7 / 8)
    for name in ("broadcast", "reduce"):
        assert bus_bandwidth(name, 8e9, 2.0, 8) == pytest.approx(4e9)
    with pytest.raises(ValueError):
        bus_bandwidth("ring_all_reduce", 1, 1, 2)


def test_cost_terms():
    assert cost_terms("ring_all_reduce", 4) == (6.0, 1.5)
    assert cost_terms("all_gather", 8) == (7.0, 7 / 8)
    assert cost_terms("recursive_doubling_all_reduce", 8) == (3.0, 3.0)
    assert cost_terms("broadcast", 5) == (3.0, 3.0)  # ⌈log2 5⌉ rounds of the whole buffer
    with pytest.raises(ValueError, match="no cost model"):
        cost_terms("gossip", 4)


def _samples(model, names, sizes, world_sizes, noise=0.0, seed=0):
    rng = random.Random(seed)
    return [(name, n, w, model.time(name, n, w) * (1 + rng.uniform(-noise, noise)))
            for name in names for n in sizes for w in world_sizes]


def test_fit_recovers_a_known_alpha_and_beta():
    truth = AlphaBeta(alpha=25e-6, beta=1 / 12e9)  # 25 µs per message, 12 GB/s
    sizes = [2**k for k in range(10, 31, 2)]
    fitted = fit(_samples(truth, ["ring_all_reduce", "all_gather", "broadcast"], sizes, [2, 4, 8]))
    assert fitted.alpha == pytest.approx(truth.alpha, rel=1e-9)
    assert fitted.beta == pytest.approx(truth.beta, rel=1e-9)
    assert fitted.bandwidth == pytest.approx(12e9, rel=1e-9)


def test_fit_with_noise_stays_close():
    truth = AlphaBeta(alpha=1e-3, beta=2e-9)
    sizes = [4096 * 4**k for k in range(7)]
    fitted = fit(_samples(truth, ["all_reduce"], sizes, [4], noise=0.05, seed=1))
    assert fitted.alpha == pytest.approx(truth.alpha, rel=0.1)
    assert fitted.beta == pytest.approx(truth.beta, rel=0.1)


def test_fit_needs_two_samples():
    with pytest.raises(ValueError, match="at least two"):
        fit([("all_reduce", 1024, 4, 1e-3)])


def test_prediction_follows_the_formula():
    model = AlphaBeta(alpha=1e-5, beta=1e-9)
    assert model.time("all_reduce", 1e9, 4) == pytest.approx(6 * 1e-5 + 1.5 * 1e9 * 1e-9)
    assert model.time("send_recv", 0, 2) == pytest.approx(1e-5)


# ---------------------------------------------------------------------------------------------------------
# The collectives, on 4 processes
# ---------------------------------------------------------------------------------------------------------


def _input(rank, n):
    return torch.randint(-50, 50, (n,), generator=torch.Generator().manual_seed(100 * rank + n)).float()


def _ring_all_gather_wrong_neighbour(chunks, group):
    """A ring all-gather that receives from its right neighbour, which sends to its own right: a deadlock."""
    import torch.distributed as dist

    rank, size = dist.get_rank(group), dist.get_world_size(group)
    for step in range(size - 1):
        LEDGER.exchange(chunks[(rank - step) % size], (rank + 1) % size,
                        chunks[(rank - step - 1) % size], (rank + 1) % size, group=group)


def _ring_all_reduce_missing_chunk(tensor):
    """A ring all-reduce whose all-gather stops one step early."""
    import torch.distributed as dist

    from helpers.parallel import collectives

    rank, size = dist.get_rank(), dist.get_world_size()
    chunks = list(tensor.clone().tensor_split(size))
    collectives.ring_reduce_scatter_(chunks)
    for step in range(size - 2):
        LEDGER.exchange(chunks[(rank - step) % size], (rank + 1) % size,
                        chunks[(rank - step - 1) % size], (rank - 1) % size)
    return torch.cat(chunks)


def _worker(rank, world_size, port, out_dir):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    from helpers.parallel import collectives
    from helpers.checks import CheckFailed, check_equal
    from helpers.dist import init_process_group
    from helpers.parallel.ledger import LEDGER

    init_process_group(timeout_s=30)
    found = {"values": {}, "bytes": {}, "broken": {}}
    for n in SIZES:
        inputs = [_input(r, n) for r in range(world_size)]
        x, total = inputs[rank], sum(inputs)
        received = [torch.empty(chunk_sizes(n, world_size)[rank]) for _ in range(world_size)]
        broadcast = x.clone()
        LEDGER.clear()
        got = {
            "ring_reduce_scatter": collectives.ring_reduce_scatter(x),
            "ring_all_gather": collectives.ring_all_gather(x.tensor_split(world_size)[rank].clone(), n),
            "ring_all_reduce": collectives.ring_all_reduce(x),
            "tree_broadcast": (collectives.tree_broadcast(broadcast, src=ROOTS["tree_broadcast"]),
                               broadcast)[1],
            "tree_reduce": collectives.tree_reduce(x, dst=ROOTS["tree_reduce"]),
            "pairwise_all_to_all": (
                collectives.pairwise_all_to_all(received, list(x.tensor_split(world_size))),
                torch.cat(received))[1],
            "recursive_doubling_all_reduce": collectives.recursive_doubling_all_reduce(x),
        }
        want = {
            "ring_reduce_scatter": total.tensor_split(world_size)[rank],
            "ring_all_gather": torch.cat([inputs[r].tensor_split(world_size)[r] for r in range(world_size)]),
            "ring_all_reduce": total,
            "tree_broadcast": inputs[ROOTS["tree_broadcast"]],
            "tree_reduce": total if rank == ROOTS["tree_reduce"] else None,
            "pairwise_all_to_all": torch.cat([x.tensor_split(world_size)[rank] for x in inputs]),
            "recursive_doubling_all_reduce": total,
        }
        for name in COLLECTIVES:
            same = got[name] is None if want[name] is None else torch.equal(got[name], want[name])
            found["values"][name, n] = same
            found["bytes"][name, n] = (LEDGER.totals(name),
                                       expected_bytes(name, n, world_size, rank, root=ROOTS.get(name, 0)))
        found["described", n] = {(m.numel, m.dtype, m.element_size, m.group_ranks, m.nbytes)
                                 for m in LEDGER.messages if m.collective == "ring_all_reduce"}
        LEDGER.clear()
        collectives.ring_all_reduce(x)
        dist.all_reduce(x.clone())
        LEDGER.record("all_reduce", x)
        found["booked", n] = [(m.collective, m.numel, m.dtype, m.element_size, m.group_ranks)
                              for m in LEDGER.booked()]
        found["counted only", n] = LEDGER.totals(counted=True), LEDGER.totals("ring_all_reduce")

    # a group of ranks 1-3: group ranks differ from global ones, and 3 ranks is not a power of two
    group = dist.new_group([1, 2, 3])
    if rank in (1, 2, 3):
        inputs = [_input(r, 10) for r in (1, 2, 3)]
        found["values"]["ring_all_reduce in group 1-3", 10] = torch.equal(
            collectives.ring_all_reduce(_input(rank, 10), group=group), sum(inputs))
        LEDGER.clear()
        dist.all_reduce(_input(rank, 10).double(), group=group)
        LEDGER.record("all_reduce", _input(rank, 10).double(), group)
        found["booked in group 1-3"] = [(m.collective, m.numel, m.dtype, m.element_size, m.group_ranks)
                                        for m in LEDGER.booked()]
        try:
            collectives.recursive_doubling_all_reduce(_input(rank, 10), group=group)
            found["broken"]["recursive doubling on 3 ranks"] = None
        except ValueError as err:
            found["broken"]["recursive doubling on 3 ranks"] = str(err)

    quick = dist.new_group(timeout=datetime.timedelta(seconds=2))
    chunks = list(_input(rank, 10).tensor_split(world_size))
    try:
        _ring_all_gather_wrong_neighbour(chunks, quick)
        found["broken"]["wrong neighbour"] = None
    except RuntimeError as err:
        found["broken"]["wrong neighbour"] = str(err)
    dist.barrier()
    try:
        x = _input(rank, 10)
        check_equal("ring all-reduce, missing chunk", _ring_all_reduce_missing_chunk(x),
                    sum(_input(r, 10) for r in range(world_size)), quiet=True)
        found["broken"]["missing chunk"] = None
    except CheckFailed as err:
        found["broken"]["missing chunk"] = str(err)
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(found, f)
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def found(tmp_path_factory):
    import multiprocessing

    import torch.multiprocessing as mp

    # The ranks fork from one server that has imported torch once, instead of importing it four times.
    multiprocessing.get_context("forkserver").set_forkserver_preload(["torch", "torch.distributed"])
    out = tmp_path_factory.mktemp("collectives")
    mp.start_processes(_worker, args=(WORLD_SIZE, _free_port(), str(out)), nprocs=WORLD_SIZE, join=True,
                       start_method="forkserver")
    return [pickle.load(open(out / f"rank{r}.pkl", "rb")) for r in range(WORLD_SIZE)]


def test_every_collective_equals_the_single_process_result(found):
    wrong = [(rank, key) for rank, per_rank in enumerate(found) for key, same in per_rank["values"].items()
             if not same]
    assert not wrong
    assert len(found[0]["values"]) == len(COLLECTIVES) * len(SIZES)


def test_ledger_counts_equal_the_formula(found):
    for rank, per_rank in enumerate(found):
        for key, (counted, formula) in per_rank["bytes"].items():
            assert counted == formula, (rank, key)
    # uneven chunks: the counts really differ by rank, and the formula follows them
    assert len({found[r]["bytes"]["ring_all_reduce", 10][0] for r in range(WORLD_SIZE)}) > 1


def test_counted_messages_describe_the_tensor_that_moved(found):
    for rank, per_rank in enumerate(found):
        for n in SIZES:
            # every message of a ring all-reduce is one fp32 chunk of the world's buffer
            chunks = set(chunk_sizes(n, WORLD_SIZE))
            for numel, dtype, element_size, group_ranks, nbytes in per_rank["described", n]:
                assert (dtype, element_size, group_ranks) == ("torch.float32", 4, (0, 1, 2, 3))
                assert numel in chunks and nbytes == 4 * numel


def test_a_booking_records_the_collective_group_and_buffer_it_was_called_with(found):
    for rank, per_rank in enumerate(found):
        for n in SIZES:
            assert per_rank["booked", n] == [("all_reduce", n, "torch.float32", 4, (0, 1, 2, 3))]
            counted_only, ring = per_rank["counted only", n]
            assert counted_only == ring  # the booked all_reduce is left out of counted totals
    for rank in (1, 2, 3):
        assert found[rank]["booked in group 1-3"] == [("all_reduce", 10, "torch.float64", 8, (1, 2, 3))]


def test_collectives_work_on_a_group_with_its_own_numbering(found):
    assert all(found[r]["values"]["ring_all_reduce in group 1-3", 10] for r in (1, 2, 3))
    assert all("power-of-two" in found[r]["broken"]["recursive doubling on 3 ranks"] for r in (1, 2, 3))


def test_a_wrong_neighbour_times_out_with_a_message_naming_the_peers(found):
    for rank, per_rank in enumerate(found):
        message = per_rank["broken"]["wrong neighbour"]
        assert message is not None, f"rank {rank}: the deadlocked ring completed"
        assert f"rank {rank}" in message and "did not complete" in message
        assert f"receive from {(rank + 1) % WORLD_SIZE}" in message


def test_a_missing_chunk_fails_the_check_on_every_rank(found):
    for rank, per_rank in enumerate(found):
        message = per_rank["broken"]["missing chunk"]
        assert message is not None and f"failed on rank {rank}" in message and "elements differ" in message
