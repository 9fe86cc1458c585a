"""Stop, save, resume elsewhere (chapter 15, ``helpers.training.checkpoint``), on 8 ranks.

The capstone's three-dimensional run (``three_d()``: PP 2 x DP 2 x TP 2, sequence parallelism, ZeRO-1, AdamW,
fp64) trains ``STEPS`` steps uninterrupted, and on the way saves a checkpoint after ``AT`` steps (parameters
and AdamW's moments, each rank only its slices). The checkpoint is then loaded onto another layout on the same
8 ranks, which trains the remaining steps: TP 8 without a pipeline (every KV head copied onto two ranks, plain
AdamW), or DP 2 x TP 4 without a pipeline (ZeRO-1 over other rows). A run saved with context parallelism, with
an interleaved pipeline, or under ZeRO-3 (each rank writing its flat shard's rows) resumes elsewhere too. Its
losses and final parameters match the uninterrupted run's within the capstone's fp64 tolerances (the loss
within 1e-12 relative, every parameter within 1e-10 of its tensor's largest entry): the layouts sum in other
orders, so the two agree to fp64's rounding, not bit for bit.

The checks can fail: each rank reading its tensor-parallel neighbour's slices (a load that does not reshard),
or a resumption without the optimizer's moments, leaves the parameters far off; a checkpoint with a shard file
deleted, or loaded into another model (a wider MLP; more or fewer layers; fp32), raises on every rank with a
message naming the file, the shapes, the names or the dtypes. No rank's file holds the whole of a
tensor-parallel weight, and the files hold every element of the parameters and both moments exactly once.
"""

import math
import re
import shutil

import ipyparallel as ipp
import pytest

from helpers.model import GPT
from helpers.training import capstone, capstone_checks

THREE_D = dict(pp=2, dp_shard=2, tp=2, sequence_parallel=True, m=2, zero=1)


def three_d(**changes) -> capstone.Run:
    return capstone.Run(**{**THREE_D, **changes})

STEPS, AT = 4, 2
SAVED = dict()  # the capstone's run
RESUMED = dict(pp=1, dp_shard=1, tp=8, m=1)  # TP 8, no pipeline: KV heads copied, plain AdamW
ELSEWHERE = {"TP 8, no pipeline": RESUMED,
             "DP 2 x TP 4, ZeRO-1": dict(pp=1, dp_shard=2, tp=4, m=1)}  # ZeRO-1 over other rows


@ipp.interactive  # sent by value: the engines cannot import this test module
def _train(layout, steps, at, path=None, save=False, resume=False, moments=True, neighbour=False, **model):
    """The run ``layout`` from step 0 (saving after ``at`` steps) or resumed from ``path`` at ``at``, to
    ``steps``. Returns where the rank sits, its losses and its final parameters; or a load's error."""
    import torch.distributed as dist

    from helpers.parallel import composition
    from helpers.reference import train_steps
    from helpers.training import capstone, checkpoint

    run = capstone.Run(**{**dict(pp=2, dp_shard=2, tp=2, sequence_parallel=True, m=2, zero=1), **layout},
                       **model, steps=steps, every=steps)  # three_d's, on an engine
    mesh = capstone.make_mesh(run)
    chunks = composition.apply(capstone.build(run).to(run.rank_device()), mesh, run)
    opt = composition.optimizer(chunks, mesh, run, run.lr)
    data = capstone.data(run)
    where = mesh.coordinates(dist.get_rank())
    names = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    out = {"where": {n: where.get(n, 0) for n in names}, "losses": []}

    def step(x, y):
        return composition.forward_backward(chunks, mesh, run, x, y)[0]
    start = 0
    if resume:
        from helpers.training import checkpoint_pieces

        correct = checkpoint_pieces.tp_rank
        if neighbour:  # each rank takes its tensor-parallel neighbour's place: its slices, unresharded
            checkpoint_pieces.tp_rank = lambda m: (correct(m) + 1) % m.size("tp")
        try:
            start = checkpoint.load(chunks, mesh, run, path, opt if moments else None)
        except checkpoint.CheckpointError as err:
            return {"error": str(err)}
        finally:
            checkpoint_pieces.tp_rank = correct
    if save:
        out["losses"] += train_steps(None, data[:at], step=step, optimizer=opt)
        checkpoint.save(chunks, mesh, run, at, path, opt)
        start = at
    out["start"] = start
    out["losses"] += train_steps(None, data[start:], step=step, optimizer=opt)
    out["params"] = {steps: composition.params(chunks)}
    return out


def _whole(results, layout):
    run = three_d(**layout, steps=STEPS, every=STEPS)
    return capstone_checks.assembled(results, run, STEPS)[0]


@pytest.fixture(scope="module")
def saved(eight, tmp_path_factory):
    """The uninterrupted run, which saved its checkpoint after ``AT`` steps."""
    path = tmp_path_factory.mktemp("checkpoint") / "step2"
    results = eight.apply(_train, SAVED, STEPS, AT, str(path), save=True)
    yield path, results
    shutil.rmtree(path.parent)


def test_each_rank_writes_only_its_slices(saved):
    from helpers.training import checkpoint, checkpoint_bytes

    path, _ = saved
    listed = checkpoint.files(path)
    assert sorted(f["rank"] for f in listed if f["rank"] is not None) == list(range(8))
    by_rank = checkpoint.bytes_by_rank(path)
    assert all(0 < b["tensor_bytes"] < b["bytes"] for b in by_rank.values()), by_rank
    split = 0
    boxes = [(f, name, box) for f in listed for name, held in f["boxes"].items() for box in held]
    for f, name, (offsets, sizes, whole) in boxes:
        if name.endswith(("q_proj.weight", "up_proj.weight", "down_proj.weight", "o_proj.weight")):
            assert sizes != whole, f"{f['file']} holds the whole of {name} {whole}"
            split += 1
    assert split > 0
    # every slice once: the data-parallel replicas' copies were written by one rank
    names = [(name, box[0]) for _, name, box in boxes]
    assert len(names) == len(set(names))
    # and every element once: the parameters and AdamW's two moments of each, and the two step counts
    run = three_d(**SAVED, steps=STEPS, every=STEPS)
    numel = sum(p.numel() for p in capstone.build(run).parameters())
    assert sum(math.prod(box[1]) for _, _, box in boxes) == 3 * numel + 2
    # in fp64 (8 bytes), the step counts an int64 and a float64
    assert sum(b["tensor_bytes"] for b in by_rank.values()) == 8 * (3 * numel + 2)
    # rank by rank: a 1/c of what c ranks hold (checkpoint_bytes, from the shapes and the layout)
    expected = checkpoint_bytes.expected_bytes(run)
    assert {r: b["tensor_bytes"] for r, b in by_rank.items()} == \
        {r: e["tensor_bytes"] for r, e in expected.items()}


@pytest.mark.parametrize("layout", ELSEWHERE.values(), ids=ELSEWHERE.keys())
def test_resumed_on_another_layout_matches_the_uninterrupted_run(eight, saved, layout):
    path, uninterrupted = saved
    resumed = eight.apply(_train, layout, STEPS, AT, str(path), resume=True)
    assert {r["start"] for r in resumed} == {AT}
    tol = capstone.TOLERANCES["fp64"]
    want, got = capstone_checks.losses(uninterrupted), capstone_checks.losses(resumed)
    assert len(got) == STEPS - AT
    assert max(abs(a - b) / b for a, b in zip(got, want[AT:])) <= tol["loss"], (got, want)
    off = capstone_checks.largest_difference(_whole(resumed, layout), _whole(uninterrupted, SAVED))
    assert off <= tol["params"], off


FROM_ELSEWHERE = {  # saved on, loaded onto, the model's changes
    "DP 2 x CP 2 x TP 2 to TP 8": (dict(pp=1, dp_shard=2, cp=2, tp=2, m=1), RESUMED, {}),
    "interleaved 1F1B, DDP to DP 2 x TP 4, ZeRO-1": (dict(schedule="interleaved", vpp=2, zero=0),
                                                     ELSEWHERE["DP 2 x TP 4, ZeRO-1"], dict(n_layers=4)),
    "ZeRO-3 to TP 8": (dict(zero=3), RESUMED, {}),  # each rank wrote its flat shard's rows
}


@pytest.mark.parametrize("source, target, model", FROM_ELSEWHERE.values(), ids=FROM_ELSEWHERE.keys())
def test_saved_with_context_parallelism_or_interleaving_resumes_elsewhere(eight, tmp_path, source, target,
                                                                          model):
    """The context-parallel ranks hold the same slices, as the data-parallel ones do; an interleaved
    pipeline's rank holds two chunks, the tied head's copy on the last; under ZeRO-3 each rank keeps only
    its flat shard's rows."""
    path = tmp_path / "step2"
    uninterrupted = eight.apply(_train, source, STEPS, AT, str(path), save=True, **model)
    resumed = eight.apply(_train, target, STEPS, AT, str(path), resume=True, **model)
    shutil.rmtree(path)
    tol = capstone.TOLERANCES["fp64"]
    want, got = capstone_checks.losses(uninterrupted), capstone_checks.losses(resumed)
    assert max(abs(a - b) / b for a, b in zip(got, want[AT:])) <= tol["loss"], (got, want)
    whole = {}
    for results, layout in ((resumed, target), (uninterrupted, source)):
        run = three_d(**layout, **model, steps=STEPS, every=STEPS)
        whole[layout is target] = capstone_checks.assembled(results, run, STEPS)[0]
    off = capstone_checks.largest_difference(whole[True], whole[False])
    assert off <= tol["params"], off


@pytest.mark.parametrize("plant", ["neighbour", "no moments"])
def test_a_load_without_resharding_or_moments_is_caught(eight, saved, plant):
    path, uninterrupted = saved
    flags = {"neighbour": dict(neighbour=True), "no moments": dict(moments=False)}[plant]
    resumed = eight.apply(_train, RESUMED, STEPS, AT, str(path), resume=True, **flags)
    try:
        off = capstone_checks.largest_difference(_whole(resumed, RESUMED), _whole(uninterrupted, SAVED))
    except ValueError as err:  # the two copies of a KV head were read from different slices: refused
        assert plant == "neighbour" and "hold copies of the same KV head that differ" in str(err), err
        return
    assert off > 1e6 * capstone.TOLERANCES["fp64"]["params"], off


@pytest.mark.parametrize("change, message", [
    (dict(d_ff=128), r"blocks\.0\.mlp\.up_proj\.weight: the checkpoint's shape \(256, 64\), the model's "
                     r"\(128, 64\)"),
    (dict(n_layers=4), r"(\d+) parameters missing from the checkpoint: blocks\.2\.attn"),
    (dict(n_layers=1), r"(\d+) parameters in the checkpoint but not in the model: blocks\.1\.attn"),
    (dict(precision="fp32"), r"tensors saved in torch\.float64, the model's in torch\.float32"),
], ids=["wider MLP", "more layers", "fewer layers (DCP alone would load a part, silently)",
        "fp32 (DCP alone would cast, silently)"])
def test_a_checkpoint_of_another_model_is_refused(eight, saved, change, message):
    path, _ = saved
    errors = [r.get("error", "loaded, no error") for r in eight.apply(_train, RESUMED, STEPS, AT, str(path),
                                                                  resume=True, **change)]
    assert all(e == errors[0] for e in errors), "every rank refuses alike"
    found = re.search(message, errors[0])
    assert found, errors[0]
    if "n_layers" in change:  # as many as the blocks that differ hold
        configs = {n: three_d(**RESUMED, n_layers=n).model_config()
                   for n in (2, change["n_layers"])}
        names = {n: {k for k, _ in GPT(cfg).named_parameters()} for n, cfg in configs.items()}
        assert int(found.group(1)) == len(names[change["n_layers"]] ^ names[2]), errors[0]


def test_a_missing_shard_file_is_named(eight, tmp_path):
    from helpers.training import checkpoint

    path = tmp_path / "step2"
    eight.apply(_train, SAVED, AT, AT, str(path), save=True)  # a checkpoint of its own, to break
    victim = next(f["file"] for f in checkpoint.files(path) if f["rank"] == 3)
    (path / victim).unlink()
    errors = [r["error"] for r in eight.apply(_train, RESUMED, STEPS, AT, str(path), resume=True)]
    assert all(f"shard file {victim} is missing" in e for e in errors), errors[0]
    shutil.rmtree(path)
