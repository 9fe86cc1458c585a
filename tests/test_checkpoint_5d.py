"""Stop, save, resume elsewhere for the 5D run (issue 38, item 5), on 16 ranks.

The 5D run of ``test_capstone_5d`` (pp=2 × dp_shard=2 × cp=2 × tp=2, SP, the MoE GPT's experts folded onto
dp_shard × cp with ep=4, interleaved 1F1B with vpp=2, ring attention, ZeRO-3 for the dense parameters, fp64)
trains ``STEPS`` steps uninterrupted and saves a checkpoint after ``AT`` (parameters, AdamW's two moments and
step; each rank writing only boxes it keeps: its ZeRO-3 shard's rows of each dense parameter, its experts).

- Resumed on another layout of the same 16 ranks, without context parallelism and with TP 4 (pp=2 ×
  dp_shard=2 × tp=4, so ep=2 and 4 experts a rank), the remaining steps' losses and the final parameters match
  the uninterrupted run within ``capstone.TOLERANCES["fp64"]`` (loss 1e-12 relative, parameters 1e-10 of
  each tensor's largest entry): both runs compute the same sums in fp64, in other orders (tp 4 sums
  a row-parallel matmul's partial products in four parts, not two; without cp the attention is not
  combined block by block; the gradient average runs over 2 ranks, not 4), and each of the two layouts
  matches one process within these tolerances (``test_capstone_5d``). Both runs also match one process.
- Resumed on the same layout, the run is bit for bit the uninterrupted one (measured: the same boxes are read
  back into the same places, and the steps after run the same sums in the same order).
- The bytes each rank wrote (tensor elements counted from its file) equal, exactly, what
  ``checkpoint_bytes.expected_bytes`` derives from the model's shapes and the layout; the metadata file and
  ``torch.save``'s framing are reported beside them, not compared.
- A checkpoint with a shard file missing, or of another model (other n_experts, other d_model), is refused on
  every rank with a message naming the file or the tensors and shapes.
"""

import re
import shutil
import time

import ipyparallel as ipp
import pytest

from helpers.training import capstone, capstone_checks

STEPS, AT = 6, 3
FIVE_D = dict(steps=STEPS, every=STEPS)  # chapter 15's run (capstone.chapter_run), for STEPS steps
TP4 = dict(FIVE_D, cp=1, tp=4, ep=2)  # no context parallelism, TP 4: the experts over dp_shard=2


def layout(base, **changes):
    return capstone.chapter_run(**{**base, **changes})


@ipp.interactive  # sent by value: the engines cannot import this test module
def _save(run, path, at):
    from helpers.training import capstone, checkpoint_run

    return checkpoint_run.train_and_save(run, capstone.make_mesh(run), path, capstone.data(run), at)


@ipp.interactive
def _resume(run, path):
    from helpers.training import capstone, checkpoint, checkpoint_run

    try:
        return checkpoint_run.resume_run(run, capstone.make_mesh(run), path, capstone.data(run))
    except checkpoint.CheckpointError as err:
        return {"error": str(err)}


@pytest.fixture(scope="module")
def saved(sixteen, tmp_path_factory):
    """The uninterrupted 5D run, which saved its checkpoint after ``AT`` steps."""
    path = tmp_path_factory.mktemp("checkpoint5d") / f"step{AT}"
    started = time.perf_counter()
    results = sixteen.apply(_save, layout(FIVE_D), str(path), AT)
    print(f"5D run of {STEPS} steps, saving after {AT}: {time.perf_counter() - started:.1f} s")
    yield path, results
    shutil.rmtree(path.parent)


def _whole(results, base, step):
    return capstone_checks.assembled(results, layout(base), step)[0]


def _check_resumed(uninterrupted, resumed, base):
    tol = capstone.TOLERANCES["fp64"]
    assert {r["start"] for r in resumed} == {AT}
    want, got = capstone_checks.losses(uninterrupted), capstone_checks.losses(resumed)
    assert len(want) == STEPS and len(got) == STEPS - AT
    worst = max(abs(a - b) / b for a, b in zip(got, want[AT:]))
    assert worst <= tol["loss"], (worst, got, want)
    off = capstone_checks.largest_difference(_whole(resumed, base, STEPS),
                                             _whole(uninterrupted, FIVE_D, STEPS))
    assert off <= tol["params"], off
    return worst, off


def test_resumed_with_tp4_and_no_cp_matches_the_uninterrupted_run(sixteen, saved):
    path, uninterrupted = saved
    started = time.perf_counter()
    resumed = sixteen.apply(_resume, layout(TP4), str(path))
    assert not any("error" in r for r in resumed), resumed[0].get("error")
    print(f"resumed on {layout(TP4).degrees()}: {time.perf_counter() - started:.1f} s")
    # what was loaded is what was saved (the loaded parameters put together against the saved ones)
    loaded = capstone_checks.largest_difference(_whole(resumed, TP4, AT), _whole(uninterrupted, FIVE_D, AT))
    assert loaded == 0.0, loaded
    worst, off = _check_resumed(uninterrupted, resumed, TP4)
    print(f"resumed vs uninterrupted: loss {worst:.1e} relative, parameters {off:.1e}")
    want = capstone.reference_run(layout(FIVE_D), capstone.data(layout(FIVE_D)))
    assert capstone_checks.largest_difference(_whole(resumed, TP4, STEPS), want["params"][STEPS]) <= \
        capstone.TOLERANCES["fp64"]["params"]


def test_resumed_on_the_same_layout_is_bit_for_bit_the_uninterrupted_run(sixteen, saved):
    path, uninterrupted = saved
    resumed = sixteen.apply(_resume, layout(FIVE_D), str(path))
    assert not any("error" in r for r in resumed), resumed[0].get("error")
    assert capstone_checks.losses(resumed) == capstone_checks.losses(uninterrupted)[AT:]
    whole, want = _whole(resumed, FIVE_D, STEPS), _whole(uninterrupted, FIVE_D, STEPS)
    assert capstone_checks.largest_difference(whole, want) == 0.0


def test_each_rank_wrote_its_expected_bytes(saved):
    from helpers.training import checkpoint, checkpoint_bytes

    path, _ = saved
    written = checkpoint.bytes_by_rank(path)
    expected = checkpoint_bytes.expected_bytes(layout(FIVE_D))
    assert sorted(written) == list(range(16))
    for rank in range(16):
        assert written[rank]["tensor_bytes"] == expected[rank]["tensor_bytes"], (rank, written, expected)
    rows = checkpoint.against_expected(path, layout(FIVE_D))  # what a page shows: the same, by rank
    assert [r["rank"] for r in rows] == [*range(16), None]
    assert all(r["tensor_bytes"] == r["expected"] and r["framing"] > 0 for r in rows[:-1]), rows
    print("tensor bytes by rank:", {r["rank"]: r["tensor_bytes"] for r in rows[:-1]},
          f"framing {sum(r['framing'] for r in rows[:-1])} bytes, metadata {rows[-1]['bytes']} bytes")


REFUSED = {
    "other n_experts": (dict(n_experts=16), r"blocks\.1\.mlp\.experts\.up_proj\.weight: the checkpoint's "
                                            r"shape \(8, 256, 64\), the model's \(16, 256, 64\)"),
    "other d_model": (dict(d_model=32), r"blocks\.0\.attn\.q_proj\.weight: the checkpoint's shape "
                                        r"\(64, 64\), the model's \(32, 32\)"),
}


@pytest.mark.parametrize("change, message", REFUSED.values(), ids=REFUSED.keys())
def test_a_checkpoint_of_another_model_is_refused(sixteen, saved, change, message):
    path, _ = saved
    errors = [r.get("error", "loaded, no error") for r in sixteen.apply(_resume, layout(TP4, **change),
                                                                        str(path))]
    assert all(e == errors[0] for e in errors), "every rank refuses alike"
    assert re.search(message, errors[0]), errors[0]


def test_a_missing_shard_file_is_named(sixteen, saved, tmp_path):
    from helpers.training import checkpoint

    path = tmp_path / "broken"
    shutil.copytree(saved[0], path)
    victim = next(f["file"] for f in checkpoint.files(path) if f["rank"] == 5)
    (path / victim).unlink()
    errors = [r.get("error", "loaded") for r in sixteen.apply(_resume, layout(TP4), str(path))]
    assert all(f"shard file {victim} is missing" in e for e in errors), errors[0]
    shutil.rmtree(path)


def test_a_checkpoint_missing_a_box_is_refused_not_partly_loaded(sixteen, saved, tmp_path):
    """A checkpoint whose metadata lacks one box (one expert's rows, say: DCP would leave those elements as
    they were, without a word) is refused, naming the tensor and how many of the elements asked for are
    not in it."""
    import math
    import pickle

    path = tmp_path / "holed"
    shutil.copytree(saved[0], path)
    with open(path / ".metadata", "rb") as f:
        md = pickle.load(f)
    key = "model.blocks.1.mlp.experts.up_proj.weight"
    chunks = md.state_dict_metadata[key].chunks
    hole = next(c for c in chunks if tuple(c.offsets) == (0, 0, 0))
    chunks.remove(hole)
    md.storage_data = {i: s for i, s in md.storage_data.items()
                       if not (i.fqn == key and tuple(i.offset) == (0, 0, 0))}
    with open(path / ".metadata", "wb") as f:
        pickle.dump(md, f)
    errors = [r.get("error", "loaded") for r in sixteen.apply(_resume, layout(TP4), str(path))]
    asked = 4 * 256 * 64  # expert-parallel rank 0 of ep=2 asks for experts 0-3 of the 8
    message = f"{key} ({math.prod(hole.sizes)} of {asked} elements)"
    assert all(message in e for e in errors), errors[0]
    shutil.rmtree(path)
