"""Chapter 10's composition on every schedule chapter 06 validates, against one process (two ranks, fp64).

``composition.train`` on a two-stage pipeline (``ParallelDims(pp=2)``: the mesh built from the one run
description) under GPipe, 1F1B, interleaved 1F1B with ``vpp=2`` (four chunks of a four-layer GPT, two per
rank) and ZB-H1 (the backward split into input- and weight-gradient steps), on four micro-batches, with tied
embeddings: each rank runs its actions of that schedule (taken from chapter 06's module directly), in order;
each step's loss within 1e-12 relative of one process's, and every parameter after two AdamW steps
within 1e-10 of its tensor's largest entry (fp64: the pipeline only reorders the micro-batches' sums). With
interleaving, each rank holds two chunks, ``composition.apply`` returns both, and together the two ranks hold
every tensor of the reference once. The run description refuses bad runs in ``helpers.layout_rules``' and the
calculator's words, so the errors read as in chapter 01.
"""

import ipyparallel as ipp
import pytest

from conftest import assert_close_to_scale, seeded_batch, small_config
from helpers.model import GPT
from helpers.parallel.parallel_dims import ParallelDims

CFG = small_config(n_layers=4, n_heads=4, n_kv_heads=2)
RUNS = {"GPipe": ParallelDims(pp=2, schedule="gpipe", m=4),
        "1F1B": ParallelDims(pp=2, schedule="1f1b", m=4),
        "interleaved, vpp=2": ParallelDims(pp=2, schedule="interleaved", vpp=2, m=4),
        "ZB-H1": ParallelDims(pp=2, schedule="zb-h1", m=4)}


@ipp.interactive  # sent by value: the engines cannot import this test module
def _trained(cfg, run, data, lr):
    from helpers.model import GPT
    from helpers.parallel import composition

    mesh = run.mesh().make_groups()
    out = composition.train(GPT(cfg, seed=0).double(), mesh, run, data, lr)
    chunks = composition.apply(GPT(cfg, seed=0).double(), mesh, run)
    out["chunks"] = sorted(chunks)
    out["actions"] = [tuple(e[:3]) for e in composition.forward_backward(chunks, mesh, run, *data[0])[1]]
    return out


def _by_hand(run):
    """The run's schedule from chapter 06's module directly, not through the run description."""
    from helpers.cost import pipeline_schedules as ps

    if run.schedule == "interleaved":
        return ps.interleaved_1f1b(run.pp, run.m, run.vpp)
    return {"gpipe": ps.gpipe, "1f1b": ps.one_f_one_b, "zb-h1": ps.zb_h1}[run.schedule](run.pp, run.m)


@pytest.mark.parametrize("run", RUNS.values(), ids=RUNS.keys())
def test_composition_on_any_schedule_matches_one_process(ranks, run):
    from helpers.parallel import composition
    from helpers.reference import named_params, train_steps

    data = [seeded_batch(CFG, 8, seed=s) for s in range(2)]
    reference = GPT(CFG, seed=0).double()
    losses = train_steps(reference, data, lr=1e-2)
    results = ranks.apply(_trained, CFG, run, data, 1e-2)
    want_chunks = [[0, 2], [1, 3]] if run.vpp == 2 else [[0], [1]]
    assert [r["chunks"] for r in results] == want_chunks
    s = _by_hand(run)  # each rank ran its actions of the run's schedule, in order
    assert [r["actions"] for r in results] == [[tuple(a) for a in acts] for acts in s.actions]
    last = [r for r in results if r["losses"][0] is not None]
    assert len(last) == 1  # the rank of the last chunk
    for step, want in enumerate(losses):
        assert last[0]["losses"][step] == pytest.approx(want, rel=1e-12), f"step {step}"
    params, others = composition.assemble(results, CFG, "params")
    assert not others
    want = named_params(reference)
    params.pop("lm_head.weight", None)  # the last stage's copy of the tied embedding
    assert sorted(params) == sorted(want)
    assert_close_to_scale(params, want, 1e-10, f"{run.schedule}, parameters after 2 AdamW steps:")


BAD = {  # the change, and layout_rules' or the calculator's words
    "a degree of zero": (dict(tp=0), r"tp must be at least 1, got 0"),
    "SP without TP": (dict(sequence_parallel=True), r"sequence parallelism shards along the tensor-parallel "
                                                    r"group: it needs tp > 1"),
    "vpp without a pipeline": (dict(vpp=2, schedule="interleaved"), r"virtual pipeline stages \(vpp > 1\) "
                                                                    r"need pipeline parallelism"),
    "experts outside dp x cp": (dict(dp_shard=2, ep=4), r"ep=4 must divide dp\*cp=2"),
    "an unknown schedule": (dict(schedule="1f1b-v"), r"schedule='1f1b-v' is not one of 'gpipe', '1f1b'"),
    "interleaving without vpp": (dict(pp=2, schedule="interleaved"), r"interleaved 1F1B runs vpp >= 2"),
    "a ZeRO stage 4": (dict(zero=4), r"zero must be a ZeRO stage 0, 1, 2 or 3, got 4"),
}


@pytest.mark.parametrize("change, message", BAD.values(), ids=BAD.keys())
def test_a_bad_run_is_refused_in_the_rules_words(change, message):
    with pytest.raises(ValueError, match=message):
        ParallelDims(**change)


def test_the_run_builds_its_mesh_and_its_layout():
    run = ParallelDims(pp=2, dp_replicate=2, dp_shard=2, cp=1, tp=2, sequence_parallel=True, zero=1, m=2)
    mesh = run.mesh(world_size=16)
    assert (mesh.names, mesh.shape) == (("pp", "dp_replicate", "dp_shard", "tp"), (2, 2, 2, 2))
    layout = run.layout()
    assert (layout.dp, layout.tp, layout.pp, layout.sequence_parallel, layout.zero) == (4, 2, 2, True, 1)
    with pytest.raises(ValueError, match=r"holds 2 \* 2 \* 2 \* 2 = 16 ranks, but the world has 8"):
        run.mesh(world_size=8)
    with pytest.raises(ValueError, match=r"interleaved 1F1B needs m=3 to be a multiple of p=2"):
        ParallelDims(pp=2, schedule="interleaved", vpp=2, m=3).check()


def test_each_mesh_dimension_has_one_name_in_the_calculator():
    from helpers.parallel.parallel_dims import layout_dimension

    want = {"pp": "pp", "dp_replicate": "dp", "dp_shard": "dp", "cp": "cp", "tp": "tp", "dp": "dp",
            "dp_shard_cp": "dp", "dp_cp": "dp", "ep": "ep"}
    assert {name: layout_dimension(name) for name in want} == want


def test_the_composition_refuses_a_mesh_of_other_degrees():
    from helpers.parallel import composition
    from helpers.parallel.mesh import Mesh

    with pytest.raises(ValueError, match=r"the run's degrees \{'tp': 2\} are not its mesh's \{'pp': 2\}"):
        composition.apply(GPT(CFG, seed=0), Mesh((2,), ("pp",), world_size=2), ParallelDims(tp=2))


@pytest.mark.parametrize("change, message", [
    (dict(zero=2), r"zero=2: chapter 10's composition runs DDP \(zero=0\), ZeRO-1 \(zero=1\) or ZeRO-3"),
    (dict(recompute="full"), r"recompute='full': chapter 10's composition keeps every activation"),
], ids=["zero-2", "recomputation"])
def test_the_composition_refuses_what_it_does_not_run(change, message):
    from helpers.parallel import composition

    composition.check(ParallelDims())
    with pytest.raises(ValueError, match=message):
        composition.check(ParallelDims(**change))
