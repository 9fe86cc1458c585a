"""The 5D capstone's measured step, byte for byte (issue 38, item 1): on 16 ranks, pp=2 × dp_shard=2 × cp=2 ×
tp=2 with the experts folded onto dp_shard × cp (ep=4), interleaved 1F1B with vpp=2, sequence parallelism.

- Every rank's ledger bytes by mesh dimension (``composition.traffic_by_dimension`` of the measured step)
  equal ``capstone_bytes.predicted``, which starts from the model's shapes and the routing of the single
  process, exactly (integers): ZeRO-3 with ring attention, and DDP (zero=0) with Ulysses.
- What each rank holds after the measured step's backward, read from live storages (under ZeRO-3 by
  ``capstone.train``'s meter, over ZeRO-3's shards too), equals
  ``capstone_memory.predicted`` to the byte, and that is chapter 01's calculator plus the named differences
  (``capstone_memory.differences``); so do the activations at the step's peak (chapter 06's
  ``SavedActivations`` against ``capstone_memory.activation_peak``: chapter 01's layers, the MoE layers
  itemised from the routing, the schedule replayed).
- Three planted faults, one dimension each, change that dimension's bytes and no other's: ring attention
  passing one K/V block too many (cp), ZeRO-3 gathering each unit twice (dp_shard_cp), every expert's rows
  sent to the next expert-parallel rank (ep); a fourth, ZeRO-3 leaving a block gathered after its backward,
  changes the dp_shard_cp bytes and the parameters held, and nothing else.

The pipeline's messages and ring attention's are counted by the book's code as they move; every other byte of
the ledger is booked from the buffer a torch collective was given (chapter 02). Measured here (2 cores shared
with other jobs): one run of 2 steps on the 16 ranks takes 4-6 s after they have started.
"""

import ipyparallel as ipp
import pytest

from helpers.training import capstone, capstone_bytes, capstone_memory

FIVE_D = dict(steps=2, every=2)  # chapter 15's run (capstone.chapter_run), its measured step and one more


def five_d(**changes) -> capstone.Run:
    return capstone.chapter_run(**{**FIVE_D, **changes})


@ipp.interactive  # sent by value: the engines cannot import this test module
def _measure(run, plant=None):
    import contextlib

    import torch.distributed as dist

    from helpers.parallel import comms, context_parallel, zero
    from helpers.training import capstone, capstone_faults

    saved = []

    def patch(owner, name, new):
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, new)

    if plant == "cp":  # ring attention passes its first forward K/V block twice
        transfer = context_parallel.RingTransfer.__init__

        def twice(self, t, what, step, group=None, tag=0):
            if what == "forward K/V" and step == 0:
                rank, world_size = dist.get_rank(group), dist.get_world_size(group)
                comms.send_recv(t, (rank + 1) % world_size, (rank - 1) % world_size, group, tag=2,
                                label="ring attention", phase=what, step=step)
            transfer(self, t, what, step, group, tag)
        patch(context_parallel.RingTransfer, "__init__", twice)
    if plant == "dp_shard_cp":  # each ZeRO-3 unit gathered twice
        start = zero.Zero3._start_gather

        def gather_twice(self, i, async_op):
            start(self, i, async_op=False)
            return start(self, i, async_op)
        patch(zero.Zero3, "_start_gather", gather_twice)
    faults = contextlib.ExitStack()
    if plant == "ep":  # every expert's rows sent to the next expert-parallel rank's (chapter 15's fault)
        faults.enter_context(capstone_faults.plant("ep"))
    if plant == "left gathered":  # ZeRO-3 forgets to free a block after its backward
        def count_only(self, p):
            self.waiting[self.unit_of[p]] -= 1
        patch(zero.Zero3ReduceAtStep, "_reduce_now", count_only)
    try:
        mesh = capstone.make_mesh(run)
        out = capstone.train(run, mesh, capstone.data(run))
        return {"rank": out["rank"], "where": out["where"], "traffic": out["traffic"],
                "held": out["held"], "events": out["events"]}
    finally:
        faults.close()
        for owner, name, old in reversed(saved):
            setattr(owner, name, old)


def wrong_bytes(results, run) -> dict[str, list]:
    """``{dimension: [(rank, ledger, formula), ...]}``: every rank whose ledger differs from the formulas."""
    routing = capstone_bytes.expected_routing(run, capstone.data(run))
    wrong: dict[str, list] = {}
    for r in results:
        want = capstone_bytes.predicted(run, r["where"], routing)
        for dim in sorted(set(want) | set(r["traffic"])):
            if r["traffic"].get(dim) != want.get(dim):
                wrong.setdefault(dim, []).append((r["rank"], r["traffic"].get(dim), want.get(dim)))
    return wrong


CASES = {"ring, ZeRO-3": dict(attention="ring", zero=3), "Ulysses, DDP": dict(attention="ulysses", zero=0),
         # a MoE layer in every chunk (both pipeline ranks send ep); d_ff/tp = 130 rows of the MLP's
         # weights over 4 ranks, which ZeRO-3 pads to 4 x 33
         "ring, ZeRO-3, 8 layers, padded shards": dict(attention="ring", zero=3, n_layers=8, d_ff=260)}


@pytest.mark.parametrize("changes", CASES.values(), ids=CASES.keys())
def test_every_rank_sends_what_the_formulas_say(sixteen, changes):
    """Exact: integer bytes, booked or counted, against formulas of the shapes (no tolerance)."""
    run = five_d(**changes)
    results = sixteen.apply(_measure, run)
    assert {dim for r in results for dim in r["traffic"]} == {"pp", "dp_shard_cp", "cp", "tp", "ep"}
    wrong = wrong_bytes(results, run)
    assert not wrong, "\n".join(f"{dim}: rank {rank} sent {got} B, the formulas say {want} B"
                                for dim, rows in wrong.items() for rank, got, want in rows)
    for r in results:  # memory after backward, by kind: live storages against the prediction, to the byte
        want = capstone_memory.predicted(run, r["where"])
        got = {k: r["held"][k] for k in capstone_memory.KINDS}
        assert got == want, f"rank {r['rank']} {r['where']}: held {got}, predicted {want}"
        assert r["held"]["activations"] == 0  # nothing autograd saved outlives backward
    routing = capstone_bytes.expected_routing(run, capstone.data(run))
    for r in results:  # the activations at the step's peak: saved tensors against the itemisation
        peak = max(event[7] for event in r["events"])
        want = capstone_memory.activation_peak(run, r["where"], routing)
        assert peak == want, f"rank {r['rank']} {r['where']}: {peak} B saved at the peak, not {want}"


@pytest.mark.parametrize("plant", ["cp", "dp_shard_cp", "ep"])
def test_a_planted_fault_changes_the_bytes_of_its_dimension_only(sixteen, plant):
    run = five_d()
    wrong = wrong_bytes(sixteen.apply(_measure, run, plant), run)
    assert set(wrong) == {plant}, wrong


def test_a_block_left_gathered_after_its_backward_is_seen_in_memory_and_bytes(sixteen):
    """A block not freed after its backward: its next micro-batch's backward gathers nothing (fewer
    dp_shard_cp bytes), and after the step's backward each rank still holds its blocks' full parameters."""
    run = five_d()
    results = sixteen.apply(_measure, run, "left gathered")
    assert set(wrong_bytes(results, run)) == {"dp_shard_cp"}
    for r in results:
        want = capstone_memory.predicted(run, r["where"])
        assert [k for k in capstone_memory.KINDS if r["held"][k] != want[k]] == ["parameters"], r["held"]


def test_the_calculator_is_shown_beside_the_formulas_with_its_differences_named():
    """Without ranks: every dimension the calculator has a figure for has a named difference, and the
    calculator's memory and activations plus the named differences are the predictions (both raise if not)."""
    for run in (five_d(), five_d(zero=0, attention="ulysses")):
        routing = capstone_bytes.expected_routing(run, capstone.data(run))
        for stage, sent in capstone_bytes.calculator(run).items():
            assert set(sent) <= set(capstone_bytes.CALCULATOR_DIFFERENCES), sent
            assert capstone_memory.differences(run, dict(RANK0, pp=stage))
            assert capstone_memory.activation_differences(run, dict(RANK0, pp=stage), routing)


THREE_D = capstone.Run(pp=2, dp_shard=2, tp=2, sequence_parallel=True, m=2, zero=1, steps=2, every=2)
RANK0, RANK8 = dict(pp=0, dp_shard=0, cp=0, tp=0), dict(pp=1, dp_shard=0, cp=0, tp=0)
BAD = {
    "no routing with experts": (lambda: capstone_bytes.predicted(five_d(), RANK8), r"ep > 1: give"),
    "ZeRO-1": (lambda: capstone_bytes.predicted(THREE_D, RANK0),
               r"zero=1: .* zero=0 and"),
    "memory under ZeRO-1": (lambda: capstone_memory.predicted(THREE_D, RANK0),
                            r"zero=1, .*DDP's \(zero=0\) or ZeRO-3's"),
}


@pytest.mark.parametrize("call, message", BAD.values(), ids=BAD.keys())
def test_what_the_formulas_do_not_cover_is_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call()
