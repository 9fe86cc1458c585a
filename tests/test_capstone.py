"""The capstone's trainer on three dimensions (chapter 15's run before it had five: PP 2 x DP 2 x TP 2 with
sequence parallelism and ZeRO-1, the dense GPT; ``THREE_D``): its configuration validated without a rank, and
changed runs trained on 8.

Validation needs no ranks: a configuration a reader changes (tensor parallelism 4 with two pipeline stages,
GPipe, interleaving, fp32, DDP, Muon) still validates on a world of 8, and an invalid one is refused with a
ValueError naming the broken constraint and its numbers, whichever module owns it (the model, the layout, the
mesh, chapter 01's rules, chapter 06's schedule, chapter 12's owners, or the composition itself).

On 8 ranks, a few changed runs train for a handful of steps and match one process on the same batches, within
the chapter's tolerances (fp64: the loss within 1e-12 relative, every parameter within 1e-10 of its tensor's
largest entry), every data-parallel replica equal to the first and the last stage's copy of the tied
embedding equal to the embedding, bit for bit (chapter 15's kernel checks), and the measured step's actions
in the order of the run's schedule, taken from chapter 06's module directly; and with chapter 04's shard
offset broken (each rank starts its ZeRO-1 master copy from its
neighbour's rows) the capstone's comparison fails by far more than its tolerance: a broken module fails the
capstone, not only its own chapter.
"""

import dataclasses

import ipyparallel as ipp
import pytest

from helpers.training import capstone, capstone_checks

THREE_D = dict(pp=2, dp_shard=2, tp=2, sequence_parallel=True, m=2, zero=1)


def three_d(**changes) -> capstone.Run:
    return capstone.Run(**{**THREE_D, **changes})

VALID = {
    "TP 4 x PP 2": dict(tp=4, dp_shard=1),
    "TP 8, no pipeline": dict(tp=8, dp_shard=1, pp=1, m=1),
    "GPipe, 4 micro-batches": dict(schedule="gpipe", m=4),
    "interleaved 1F1B": dict(schedule="interleaved", vpp=2, n_layers=4),
    "fp32": dict(precision="fp32"),
    "DDP without SP": dict(zero=0, sequence_parallel=False),
    "Muon, TP 1": dict(optimizer="muon", tp=1, dp_shard=4, sequence_parallel=False),
    "data parallelism alone": dict(pp=1, tp=1, dp_shard=8, m=1, sequence_parallel=False),
}


@pytest.mark.parametrize("change", VALID.values(), ids=VALID.keys())
def test_a_changed_configuration_still_validates(change):
    run = three_d(**change)
    capstone.validate(run, world_size=8)
    assert run.dp * run.tp * run.pp == 8 and run.mesh(world_size=8).world_size == 8


INVALID = {  # the change, and what the error must say
    "TP 4 x DP 2 x PP 2 on 8 ranks": (dict(tp=4), r"holds 2 \* 2 \* 4 = 16 ranks, but the world has 8"),
    "tp not dividing the heads": (dict(tp=3), r"tp=3 must divide n_heads=8"),
    "micro-batches not dividing the batch": (dict(m=3), r"dp\*m=6 must divide global_batch=8"),
    "ZeRO-2 in the composition": (dict(zero=2), r"zero=2: chapter 10's composition runs DDP"),
    "Muon with tensor parallelism": (dict(optimizer="muon"), r"optimizer='muon' needs tp=1, not 2"),
    "Muon with more owners than matrices": (dict(optimizer="muon", tp=1, pp=1, m=1, dp_shard=8, n_layers=1,
                                                 sequence_parallel=False),
                                            r"8 owner ranks for 6 Muon matrices"),
    "more chunks than layers": (dict(schedule="interleaved", vpp=2), r"n_chunks=4 \(pp·vpp\) must not exceed "
                                                                     r"n_layers=2"),
    "interleaving with too few micro-batches": (dict(schedule="interleaved", vpp=2, n_layers=4, m=1),
                                                r"micro-batches per step \(1\) to be a multiple of pp=2"),
    "vpp without interleaving": (dict(vpp=2, n_layers=4), r"interleaved 1F1B runs vpp >= 2 chunks"),
    "SP without TP": (dict(tp=1, dp_shard=4), r"sequence parallelism .* needs tp > 1"),
    "micro-batches without a pipeline": (dict(pp=1, dp_shard=4), r"m=2 micro-batches go through a pipeline"),
    "an unknown precision": (dict(precision="fp16"),
                             r"precision='fp16' is not one of 'fp64', 'fp32', 'bf16'"),
    "heads not dividing d_model": (dict(d_model=60), r"n_heads=8 must divide d_model=60"),
    "comparisons not dividing the steps": (dict(steps=95), r"every=10 must divide steps=95"),
    "one step": (dict(steps=1, every=1), r"steps=1: the run measures its step 1"),
}


@pytest.mark.parametrize("change, message", INVALID.values(), ids=INVALID.keys())
def test_an_invalid_configuration_is_refused_with_the_constraint_named(change, message):
    with pytest.raises(ValueError, match=message):
        capstone.validate(dataclasses.replace(three_d(), **change), world_size=8)


def test_the_loop_measures_one_step_alone_and_compares_every_k():
    run = three_d(steps=20, every=5)
    blocks = capstone._blocks(run)
    assert blocks == [(0, 1), (1, 2), (2, 5), (5, 10), (10, 15), (15, 20)]
    assert (capstone.MEASURED_STEP, capstone.MEASURED_STEP + 1) in blocks


@ipp.interactive  # sent by value: the engines cannot import this test module
def _train(run, break_shard_offset=False):
    from helpers.parallel import zero
    from helpers.training import capstone

    mesh = capstone.make_mesh(run)
    correct = zero.shard_of
    if break_shard_offset:  # each rank's master copy starts from its neighbour's rows
        zero.shard_of = lambda full, rank, world_size: correct(full, (rank + 1) % world_size, world_size)
    try:
        return capstone.train(run, mesh, capstone.data(run), stage_seconds={"F": 0.02, "B": 0.04})
    finally:
        zero.shard_of = correct


@ipp.interactive
def _shard_of_name():
    from helpers.parallel import zero

    return zero.shard_of.__name__


TRAINED = {
    "the chapter's run": dict(),
    "TP 4 x PP 2, GPipe": dict(tp=4, dp_shard=1, schedule="gpipe", m=4),
    "ZB-H1, DDP without SP": dict(schedule="zb-h1", m=4, zero=0, sequence_parallel=False),
    "interleaved 1F1B, DDP": dict(schedule="interleaved", vpp=2, n_layers=4, zero=0),
    "Muon, PP 2 x DP 4": dict(optimizer="muon", tp=1, dp_shard=4, sequence_parallel=False),
}


def _schedule_by_hand(run):
    """The run's schedule from chapter 06's module directly, not through the capstone's table."""
    from helpers.cost import pipeline_schedules as ps

    if run.schedule == "interleaved":
        return ps.interleaved_1f1b(run.pp, run.m, run.vpp)
    return {"gpipe": ps.gpipe, "1f1b": ps.one_f_one_b, "zb-h1": ps.zb_h1}[run.schedule](run.pp, run.m)


def _check_every_copy(results, want, run):
    """What chapter 15's kernel checks of the parameters, beyond the first replica put together: every
    data-parallel replica within the tolerance of one process and bit for bit the first; the last stage's
    copy of a tied embedding, put together from its tensor-parallel ranks, bit for bit the embedding."""
    import torch

    tol = capstone.TOLERANCES[run.precision]["params"]
    for step, params in want["params"].items():
        whole, others = capstone_checks.assembled(results, run, step)
        for i, other in enumerate(others):
            off = capstone_checks.largest_difference(other, {n: params[n] for n in other})
            assert off <= tol, (step, i + 1)
            assert all(torch.equal(other[n], whole[n]) for n in other), f"replica {i + 1}, step {step}"
        if run.pp > 1 and run.model_config().tie_embeddings:
            for dp in range(run.dp):
                heads = sorted((r for r in results if r["where"]["dp_shard"] == dp
                                and "lm_head.weight" in r["params"][step]), key=lambda r: r["where"]["tp"])
                head = torch.cat([r["params"][step]["lm_head.weight"] for r in heads])
                assert torch.equal(head, whole["tok_emb.weight"]), f"tied head copy, dp {dp}, step {step}"


@pytest.mark.parametrize("change", TRAINED.values(), ids=TRAINED.keys())
def test_a_changed_run_matches_one_process(eight, change):
    run = three_d(**change, steps=4, every=2)
    results = eight.apply(_train, run)
    want = capstone.reference_run(run, capstone.data(run))
    diff = capstone_checks.differences(results, want, run)
    tol = capstone.TOLERANCES[run.precision]
    assert max(d / w for d, w in zip(diff["loss"], want["losses"])) <= tol["loss"]
    assert max(diff["params"].values()) <= tol["params"], diff["params"]
    _check_every_copy(results, want, run)
    if run.pp > 1:  # the measured step ran the run's schedule, each rank its actions in order
        s = _schedule_by_hand(run)
        for r in results:
            assert [tuple(e[:3]) for e in r["events"]] == [tuple(a) for a in s.actions[r["where"]["pp"]]], \
                f"rank {r['rank']}: the measured step's actions are not {s.name}'s"


def test_a_broken_shard_offset_fails_the_capstone(eight):
    run = three_d(steps=4, every=2)
    results = eight.apply(_train, run, True)
    assert eight.apply(_shard_of_name) == ["shard_of"] * 8, "the module is restored on every rank"
    diff = capstone_checks.differences(results, capstone.reference_run(run, capstone.data(run)), run)
    assert diff["params"][0] == 0.0  # the model starts right: only the optimizer's shards are wrong
    assert diff["params"][2] > 1e6 * capstone.TOLERANCES[run.precision]["params"], diff["params"]
