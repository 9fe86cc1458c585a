"""The capstone in five dimensions (issue 38, item 1): a MoE GPT on 16 ranks, pp=2 × dp_shard=2 × cp=2 × tp=2,
the experts folded onto dp_shard × cp (ep=4, as torchtitan folds them), sequence parallelism, interleaved 1F1B
with vpp=2 and ring (or Ulysses) attention, in fp64, matching one process (``capstone.reference_run``) at
every step's loss and in every parameter at the end, within ``capstone.TOLERANCES["fp64"]``.

The model is chapter 08's MoE layer in every other block (blocks 1 and 3 of 4: with vpp=2 each of the 4
pipeline chunks holds one block, so two chunks are dense), its dense parameters sharded by ZeRO-3 over the
data-parallel group (or, with Ulysses, reduced by DDP; ZeRO-1 over it would average different ranks' experts:
refused by ``capstone.validate``), experts whole on every tp rank, each routing its own slice of the sequence.

Chapter 15 runs the ring attention and ZeRO-3 form at every build, with ``capstone_checks.check_dimensions``
(one check per dimension on every rank) and ``capstone_faults``' fault in each dimension, each caught first by
its own dimension's check on all 16 ranks; here the same checks pass on the Ulysses and DDP form, and the
refusals of impossible MoE runs are checked without ranks.

Measured on this machine (2 cores shared with other jobs, load average 7-24 while measuring): 16 engines start
in 3.4-11.7 s; a step of this run takes 0.84-1.8 s on the 16 ranks (the test prints it, ``seconds per step``),
the single process 0.1-0.2 s; the whole module about 30-40 s. With ``n_layers=4`` every chunk is one block, so
the MoE layers (blocks 1 and 3) both sit on pipeline rank 1 (interleaving places chunk c on rank c mod pp),
which alone sends ``ep`` bytes, and chunks 0 and 2 are dense: the path where ``expert_parallel.parallelize``
leaves a MoE GPT's dense chunk as it is. ``n_layers=8`` puts one MoE layer in every chunk, at about twice the
step time (1.7 s at load 18).
"""

import time

import ipyparallel as ipp
import pytest

from helpers.training import capstone, capstone_checks

def five_d(**changes) -> capstone.Run:
    return capstone.chapter_run(**changes)


INVALID = {
    "ZeRO-1 with experts": (dict(zero=1), r"zero=1 with experts: ZeRO-1 over dp_shard_cp would average"),
    "ep not the data-parallel group": (dict(ep=2), r"ep=2: .* folds the experts onto the whole data-parallel "
                                                   r"group dp_shard_cp of 4 ranks"),
    "ep not dividing the experts": (dict(n_experts=6), r"ep=4 must divide n_experts=6"),
    "ep without experts": (dict(n_experts=0), r"ep=4 > 1 but the book's GPT has no experts"),
    "Muon with experts": (dict(optimizer="muon"), r"optimizer='muon'"),
    "MoE more sparse than the model is deep": (dict(moe_every=5), r"moe_every=5 must be in 1..n_layers=4"),
}


@pytest.mark.parametrize("change, message", INVALID.values(), ids=INVALID.keys())
def test_an_impossible_moe_run_is_refused(change, message):
    with pytest.raises(ValueError, match=message):
        five_d(**change)


def test_the_5d_run_validates_on_16_ranks():
    run = five_d()
    capstone.validate(run, world_size=16)
    assert run.degrees() == {"pp": 2, "dp_shard": 2, "cp": 2, "tp": 2} and run.ep == 4
    model = capstone.build(run)
    assert [type(b.mlp).__name__ for b in model.blocks] == ["MLP", "MoELayer", "MLP", "MoELayer"]


@ipp.interactive  # sent by value: the engines cannot import this test module
def _train(run, plant=None):  # plant: a fault of capstone_faults, as chapter 15 plants them
    import contextlib

    import torch

    from helpers import checks
    from helpers.reference import named_params
    from helpers.training import capstone, capstone_checks, capstone_faults

    mesh = capstone.make_mesh(run)
    planted = capstone_faults.plant(plant) if plant else contextlib.nullcontext()
    with planted, capstone_checks.Recorder() as seen:
        out = capstone.train(run, mesh, capstone.data(run))
    shards = capstone_checks.reference_shards(named_params(capstone.build(run)), run, mesh)
    out["unlike_reference_shards"] = [n for n, t in out["params"][0].items() if not torch.equal(t, shards[n])]
    try:
        capstone_checks.check_dimensions(run, mesh, out, seen)
        out["caught"] = None
    except checks.CheckFailed as err:
        out["caught"] = str(err)
    checks.clear()
    return out


def compare(results, run, want) -> None:
    """Every step's loss, and the parameters every ``run.every`` steps, against one process."""
    diff = capstone_checks.differences(results, want, run)
    tol = capstone.TOLERANCES[run.precision]
    for step, (d, w) in enumerate(zip(diff["loss"], want["losses"])):
        assert d / w <= tol["loss"], f"loss of step {step}: {d / w:.2e} relative to one process"
    for step, d in diff["params"].items():
        assert d <= tol["params"], f"parameters after step {step}: {d:.2e} relative to one process"


@pytest.mark.parametrize("attention, zero", [("ulysses", 0)])
def test_the_5d_run_matches_one_process(sixteen, attention, zero):
    """The dense parameters reduced by DDP with Ulysses attention (chapter 15 runs ZeRO-3 with ring attention,
    and plants its faults, at every build); the experts by chapter 08's finish_gradients."""
    run = five_d(steps=4, every=2, attention=attention, zero=zero)
    started = time.perf_counter()
    results = sixteen.apply(_train, run)
    wall = time.perf_counter() - started
    want = capstone.reference_run(run, capstone.data(run))
    per_step = max(r["seconds"] for r in results) / (run.steps - 1)
    print(f"5D run ({attention}): {wall:.1f} s for {run.steps} steps on 16 ranks, "
          f"seconds per step {per_step:.2f}")
    assert len(results) == 16 and {r["where"]["cp"] for r in results} == {0, 1}
    for r in results:  # each rank started from its slice of the one model (capstone_checks.reference_shards)
        assert not r["unlike_reference_shards"], (r["rank"], r["unlike_reference_shards"])
        assert r["caught"] is None, r["caught"]  # every dimension's check passed
    sent_along = set().union(*(r["traffic"] for r in results))  # the measured step's bytes, by dimension
    assert sent_along == {"pp", "dp_shard_cp", "cp", "tp", "ep"}, sent_along
    assert {d for r in results for d, *_ in r["collectives"]} == sent_along
    compare(results, run, want)


def test_the_positions_by_hand():
    """``layout_positions`` is the zigzag of chapter 07's figure: 16 positions over 2 ranks, chunks of 4."""
    assert capstone_checks.layout_positions("zigzag", 0, 2, 16) == [0, 1, 2, 3, 12, 13, 14, 15]
    assert capstone_checks.layout_positions("zigzag", 1, 2, 16) == [4, 5, 6, 7, 8, 9, 10, 11]
    assert capstone_checks.layout_positions("contiguous", 1, 2, 16) == list(range(8, 16))
