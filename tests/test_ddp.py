"""Data parallelism (chapter 03): buckets and the batch's split in this process; every version of DDP on two
ranks against one process.

The bucket and split tests run in this process. The distributed tests start two ranks, run each version (per
parameter, bucketed, overlapped, PyTorch's DDP, the book's ring as the all-reduce) with each rank taking half
of the global batch, and compare the averaged gradients with one backward pass here over the whole batch,
within fp32 rounding: rtol 1e-6 of each tensor's largest entry. Gradient accumulation runs three micro-batches
per rank under ``no_sync``; the bookings and the ring's counted bytes are compared exactly.
"""

import ipyparallel as ipp
import pytest
import torch

from conftest import assert_close_to_scale, seeded_batch, small_config
from helpers.data import rank_rows
from helpers.model import GPT
from helpers.parallel.data_parallel import build_buckets
from helpers.reference import named_grads

CFG = small_config()
CAP_BYTES = 9000  # a few parameters per bucket; the 8 KiB MLP matrices fit, two of them do not
GLOBAL_BATCH = 6  # 3 rows per rank: three micro-batches of one row for the accumulation test
RTOL = 1e-6


def test_buckets_cover_every_parameter_once_in_reverse_order_within_the_cap():
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (10, 300, 20, 20, 5)]
    buckets = build_buckets(params, cap_bytes=4 * 100)
    assert [[p.numel() for p in b] for b in buckets] == [[5, 20, 20], [300], [10]]
    flat = [p for b in buckets for p in b]
    assert flat == list(reversed(params))
    assert all(sum(p.numel() * 4 for p in b) <= 400 for b in buckets if len(b) > 1)


def test_each_rank_takes_its_own_rows_and_an_uneven_batch_is_refused():
    x, _ = seeded_batch(CFG, GLOBAL_BATCH)
    assert torch.equal(torch.cat([rank_rows(x, r, 3) for r in range(3)]), x)
    assert torch.equal(rank_rows(x, 1, 2), x[3:])
    with pytest.raises(ValueError, match="a batch of 6 rows does not split evenly over 4 ranks"):
        rank_rows(x, 0, 4)


@pytest.fixture(scope="module")
def reference():
    model = GPT(CFG, seed=0)
    x, y = seeded_batch(CFG, GLOBAL_BATCH)
    model(x, y)[1].backward()
    return named_grads(model)


@ipp.interactive  # sent by value: the engines cannot import this test module
def _data_parallel_step(cfg, x, y, version, cap_bytes, micro_batches=1):
    import contextlib

    import torch.distributed as dist

    from helpers.data import rank_rows
    from helpers.model import GPT
    from helpers.parallel import collectives, data_parallel
    from helpers.cost.collective_costs import expected_bytes
    from helpers.parallel.ledger import LEDGER
    from helpers.reference import named_grads

    rank, world_size = dist.get_rank(), dist.get_world_size()
    xs, ys = rank_rows(x, rank, world_size), rank_rows(y, rank, world_size)
    model = GPT(cfg, seed=0)
    LEDGER.clear()
    found = {}
    if version == "torch":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model, bucket_cap_mb=cap_bytes / 2**20)
        wrapped(xs, ys)[1].backward()
    elif version == "per parameter":
        model(xs, ys)[1].backward()
        data_parallel.average_gradients(model)
    elif version == "bucketed":
        model(xs, ys)[1].backward()
        buckets = data_parallel.build_buckets(list(model.parameters()), cap_bytes)
        data_parallel.bucketed_average(buckets)
        found["bucket_numels"] = [sum(p.numel() for p in b) for b in buckets]
    else:
        watch = data_parallel.CommunicationWatch(model)
        ring = collectives.ring_all_reduce if version == "overlapped, ring" else None
        trainer = data_parallel.OverlappedDDP(model, cap_bytes, all_reduce=ring)
        found["bucket_numels"] = [sum(p.numel() for p in b) for b in trainer.buckets]
        with watch:
            micro = list(zip(xs.chunk(micro_batches), ys.chunk(micro_batches)))
            for i, (xm, ym) in enumerate(micro):
                last = i == len(micro) - 1
                with contextlib.nullcontext() if last else trainer.no_sync():
                    (model(xm, ym)[1] / len(micro)).backward()
                if i == 0 and not last:
                    found["messages after the first micro-batch"] = len(LEDGER.messages)
            trainer.finish()
        if ring is None:
            data_parallel.check_communication("pattern", watch, cap_bytes)
        found["counted"] = LEDGER.totals("ring_all_reduce", counted=True)
        found["formula"] = [sum(expected_bytes("ring_all_reduce", n, world_size, rank)[k]
                                for n in found["bucket_numels"]) for k in (0, 1)]
    found["booked"] = [(m.collective, m.numel, m.dtype, m.group_ranks) for m in LEDGER.booked()]
    found["grads"] = named_grads(model)
    return found


@pytest.mark.parametrize("version", ["per parameter", "bucketed", "overlapped", "torch"])
def test_two_ranks_average_to_the_single_process_gradient(ranks, reference, version):
    x, y = seeded_batch(CFG, GLOBAL_BATCH)
    results = ranks.apply(_data_parallel_step, CFG, x, y, version, CAP_BYTES)
    for rank, found in enumerate(results):
        assert_close_to_scale(found["grads"], reference, RTOL, f"{version}, rank {rank}:")
    if version == "torch":
        return
    # the bookings prove which buffers went to torch.distributed.all_reduce, and on which group
    numels = results[0].get("bucket_numels", [p.numel() for p in GPT(CFG, seed=0).parameters()])
    for found in results:
        assert [b[1] for b in found["booked"]] == numels
        assert {(b[0], b[2], b[3]) for b in found["booked"]} == {("all_reduce", "torch.float32", (0, 1))}


def test_accumulating_three_micro_batches_communicates_once_and_matches(ranks, reference):
    x, y = seeded_batch(CFG, GLOBAL_BATCH)
    results = ranks.apply(_data_parallel_step, CFG, x, y, "overlapped", CAP_BYTES, 3)
    for rank, found in enumerate(results):
        assert_close_to_scale(found["grads"], reference, RTOL, f"three micro-batches, rank {rank}:")
        assert found["messages after the first micro-batch"] == 0
        assert len(found["booked"]) == len(found["bucket_numels"])


def test_the_book_ring_as_all_reduce_moves_what_the_formula_says(ranks, reference):
    x, y = seeded_batch(CFG, GLOBAL_BATCH)
    results = ranks.apply(_data_parallel_step, CFG, x, y, "overlapped, ring", CAP_BYTES)
    for rank, found in enumerate(results):
        assert_close_to_scale(found["grads"], reference, RTOL, f"the ring, rank {rank}:")
        assert found["booked"] == []
        assert list(found["counted"]) == found["formula"]
        grad_bytes = 4 * sum(found["bucket_numels"])
        # 2(N-1)/N = 1 at N=2; a bucket of odd length splits into chunks one element apart
        assert abs(found["counted"][0] - grad_bytes) <= 4 * len(found["bucket_numels"])


@ipp.interactive
def _wrong_pattern(cfg, x, y, wrong, cap_bytes, overlapped=True):
    import torch.distributed as dist

    from helpers.checks import CheckFailed
    from helpers.data import rank_rows
    from helpers.model import GPT
    from helpers.parallel import data_parallel

    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = GPT(cfg, seed=0)
    watch = data_parallel.CommunicationWatch(model)
    if wrong == "synchronous":
        buckets = data_parallel.build_buckets(list(model.parameters()), cap_bytes)
    else:
        cap = {"per parameter": 1, "one bucket": 2**40, "overlapped": cap_bytes}[wrong]
        trainer = data_parallel.OverlappedDDP(model, cap)
    with watch:
        model(rank_rows(x, rank, world_size), rank_rows(y, rank, world_size))[1].backward()
        data_parallel.bucketed_average(buckets) if wrong == "synchronous" else trainer.finish()
    try:
        data_parallel.check_communication("pattern", watch, cap_bytes, overlapped=overlapped)
    except CheckFailed as err:
        return str(err)
    return None


@pytest.mark.parametrize("wrong, message", [("synchronous", "called before backward's last gradient"),
                                            ("per parameter", "would fit under the cap as one"),
                                            ("one bucket", "over the 9,000-byte cap")])
def test_the_communication_check_rejects_a_wrong_pattern(ranks, wrong, message):
    x, y = seeded_batch(CFG, GLOBAL_BATCH)
    for err in ranks.apply(_wrong_pattern, CFG, x, y, wrong, CAP_BYTES):
        assert err is not None and message in err, err


@ipp.interactive
def _a_parameter_without_gradient():
    import torch

    from helpers.parallel import data_parallel

    used, unused = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    trainer = data_parallel.OverlappedDDP(torch.nn.ModuleList([used, unused]), cap_bytes=64)
    used(torch.ones(2, 4)).sum().backward()
    try:
        trainer.finish()
    except RuntimeError as err:
        return str(err)
    return None


def test_a_parameter_that_gets_no_gradient_stops_the_step(ranks):
    for err in ranks.apply(_a_parameter_without_gradient):
        assert err is not None and "never became ready: a parameter got no gradient" in err, err


def test_the_after_backward_check_passes_version_2_and_rejects_an_overlapped_one(ranks):
    """Chapter 03's version 2 is checked with ``overlapped=False``: its buckets, and no all-reduce before
    backward's last gradient; an overlapped DDP with the same buckets fails that last part."""
    x, y = seeded_batch(CFG, GLOBAL_BATCH)
    assert ranks.apply(_wrong_pattern, CFG, x, y, "synchronous", CAP_BYTES, False) == [None, None]
    for err in ranks.apply(_wrong_pattern, CFG, x, y, "overlapped", CAP_BYTES, False):
        assert err is not None and "called before backward's last gradient" in err, err
