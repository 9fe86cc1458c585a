"""The calculator's command line (helpers/cost/calculator.py, issue 39): every flag, the presets against their
published sizes, and bad input as one line with exit status 2.

Expected values are written by hand from the formulas on chapter 01's page for a tiny custom model (exact
integers), or taken from the papers; none is taken from the function under test. Runs in this process but for
two subprocesses (the real `python -m`, and an import with no torch).
"""

import json
import os
import subprocess
import sys

import pytest

from helpers import ROOT
from helpers.cost import model_size
from helpers.cost.calculator import main, run
from helpers.cost.calculator_presets import GPUS, PRESETS

# 2 layers, d=64, 4 heads of 16, 2 KV heads, SwiGLU of 128, 256 tokens, untied: per layer attention
# 64·(64 + 2·32) + 64·64 = 12288, MLP 3·64·128 = 24576, two RMSNorms 128; embedding and head 2·256·64,
# final norm 64
TINY = ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--ffn", "128",
        "--vocab", "256"]
TINY_PARAMS = 2 * (12288 + 24576 + 128) + 2 * 256 * 64 + 64
SMALL_BATCH = ["--seq", "16", "--global-batch", "8", "--micro-batch", "1"]


def calc(*words: str) -> dict:
    return run(list(words))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_match_their_published_sizes(name):
    """Each preset's exact count within 1% of the size its authors publish (names round); DeepSeek-V3's
    active parameters 5-6% short, the gap its simplifications make (latent attention as multi-head attention,
    no shared expert), shown beside the figure."""
    p = PRESETS[name]
    total, active = model_size.count_params(p.shape).total, model_size.active_params(p.shape)
    assert abs(total / p.published_total - 1) < 0.01, (name, total)
    if name == "deepseek-v3-like":
        assert -0.06 < active / p.published_active - 1 < -0.04 and "5%" in p.note
    else:
        assert abs(active / p.published_active - 1) < 0.01, (name, active)


def test_published_figures_are_those_of_the_papers():
    """Typed from the sources, not from the code: GPT-3 175.0B (Brown et al. 2020, table 2.1), Llama 3 405B,
    Mixtral 47B/13B, DeepSeek-V3 671B/37B, Qwen2.5 7.61B (model card)."""
    expected = {"gpt3-175b": (175.0e9, 175.0e9), "llama3-405b": (405e9, 405e9), "mixtral-8x7b": (47e9, 13e9),
                "deepseek-v3-like": (671e9, 37e9), "qwen2.5-7b": (7.61e9, 7.61e9)}
    for name, (total, active) in expected.items():
        assert (PRESETS[name].published_total, PRESETS[name].published_active) == (total, active)
    bib = open(os.path.join(ROOT, "book", "references.bib")).read()
    for p in PRESETS.values():
        assert "{" + p.cite + "," in bib, p.cite
    for g in GPUS.values():
        assert "{" + g.cite + "," in bib, g.cite


def test_the_custom_shape_flags_count_by_hand():
    r = calc(*TINY, "--gpus", "1", *SMALL_BATCH)
    assert r["model"]["params"] == TINY_PARAMS and r["model"]["active_params"] == TINY_PARAMS
    assert (r["model"]["layers"], r["model"]["hidden"], r["model"]["heads"], r["model"]["kv_heads"],
            r["model"]["ffn"], r["model"]["vocab"]) == (2, 64, 4, 2, 128, 256)
    moe = calc(*TINY, "--experts", "4", "--top-k", "2", "--gpus", "1", *SMALL_BATCH)["model"]
    # each layer's MLP becomes 4 experts and a router of 4·64; a token passes through 2 of them
    assert moe["params"] == TINY_PARAMS + 2 * (3 * 24576 + 4 * 64)
    assert moe["active_params"] == TINY_PARAMS + 2 * (24576 + 4 * 64)
    # --kv-heads left out: multi-head attention (K and V as wide as Q)
    mha = calc(*TINY[:6], *TINY[8:], "--gpus", "1", *SMALL_BATCH)["model"]
    assert mha["kv_heads"] == 4 and mha["params"] == TINY_PARAMS + 2 * 2 * 64 * 32


def test_a_flag_changes_a_preset():
    r = calc("--model", "llama3-8b", "--layers", "16", "--gpus", "8")
    full = model_size.count_params(model_size.LLAMA3_8B)
    assert r["model"]["params"] == full.total - (full.attention + full.mlp_dense + full.norms) // 2
    assert r["model"]["name"].endswith("changed") and "published" not in r["model"]


@pytest.mark.parametrize("zero, params, grads, optim", [
    (0, 2 * TINY_PARAMS, 2 * TINY_PARAMS, 12 * TINY_PARAMS),
    (1, 2 * TINY_PARAMS, 2 * TINY_PARAMS, 12 * TINY_PARAMS // 4),
    (2, 2 * TINY_PARAMS, 2 * TINY_PARAMS // 4, 12 * TINY_PARAMS // 4),
    (3, 2 * TINY_PARAMS // 4, 2 * TINY_PARAMS // 4, 12 * TINY_PARAMS // 4)])
def test_zero_and_precision_itemise_the_model_state(zero, params, grads, optim):
    """bf16 with fp32 master weights: 2 + 2 + (4 + 8) bytes a parameter, ZeRO's stages shard them over dp=4
    (Rajbhandari et al. 2020); fp32: 4 + 4 + 8, no master copy."""
    mem = calc(*TINY, "--gpus", "4", "--zero", str(zero), *SMALL_BATCH)["memory"]
    assert (mem["parameters"]["bytes"], mem["gradients"]["bytes"], mem["optimizer states"]["bytes"]) == \
        (params, grads, optim)
    assert mem["overheads"]["bytes"] == 2e9
    fp32 = calc(*TINY, "--gpus", "4", "--zero", "0", "--precision", "fp32", *SMALL_BATCH)["memory"]
    assert (fp32["parameters"]["bytes"], fp32["optimizer states"]["bytes"]) == \
        (4 * TINY_PARAMS, 8 * TINY_PARAMS)


def test_batch_flags_and_full_recomputation():
    """Full recomputation keeps each layer's input: 16 tokens x 64 x 2 bytes a layer, for the one micro-batch
    1F1B keeps without a pipeline; the micro-batches per step are global / (dp x micro)."""
    r = calc(*TINY, "--gpus", "2", "--recompute", "full", "--seq", "16", "--global-batch", "8",
             "--micro-batch", "2")
    assert r["memory"]["activations"]["bytes"] == 2 * (2 * 16 * 64 * 2)
    assert r["micro_batches"] == 8 // (2 * 2)
    assert r["batch"] == {"seq": 16, "global_batch": 8, "micro_batch": 2}
    none = calc(*TINY, "--gpus", "2", "--seq", "16", "--global-batch", "8", "--micro-batch", "2")
    sel = calc(*TINY, "--gpus", "2", "--recompute", "selective", "--seq", "16", "--global-batch", "8",
               "--micro-batch", "2")
    acts = [x["memory"]["activations"]["bytes"] for x in (r, sel, none)]
    assert acts == sorted(acts) and len(set(acts)) == 3


def test_layout_flags_reach_the_layout_and_the_traffic():
    r = calc("--model", "llama3-70b", "--gpus", "64", "--tp", "8", "--pp", "4")
    degrees = ("dp", "tp", "pp", "cp", "ep", "vpp", "zero", "sequence_parallel")
    assert {k: r["layout"][k] for k in degrees} == \
        dict(dp=2, tp=8, pp=4, cp=1, ep=1, vpp=1, zero=1, sequence_parallel=False)
    assert set(r["traffic"]) == {"dp", "tp", "pp"}
    assert r["traffic"]["tp"]["link"] == "NVLink" and r["traffic"]["pp"]["link"] == "network"
    # zero 0 on dp=2: a ring all-reduce of the bf16 gradients sends 2(n-1)/n of them, the whole buffer
    z0 = calc("--model", "llama3-70b", "--gpus", "64", "--tp", "8", "--pp", "4", "--zero", "0")
    assert z0["traffic"]["dp"]["bytes"] == z0["memory"]["gradients"]["bytes"]
    sp = calc("--model", "llama3-70b", "--gpus", "64", "--tp", "8", "--pp", "4", "--sp")
    assert sp["layout"]["sequence_parallel"]
    assert sp["memory"]["activations"]["bytes"] < r["memory"]["activations"]["bytes"]
    v = calc("--model", "llama3-70b", "--gpus", "64", "--tp", "8", "--pp", "4", "--vpp", "2")
    assert v["step"]["bubble"] == pytest.approx(r["step"]["bubble"] / 2, rel=0.05)  # (pp-1)/(v·m)
    cp = calc("--model", "llama3-70b", "--gpus", "64", "--tp", "8", "--cp", "2", "--pp", "2", "--dp", "2")
    assert cp["layout"]["cp"] == 2 and "cp" in cp["traffic"]
    # ep=8 inside dp=16: each expert's gradients reduced over the 2 ranks that hold it
    ep = calc("--model", "mixtral-8x7b", "--gpus", "128", "--tp", "2", "--pp", "4", "--ep", "8")
    assert ep["layout"]["ep"] == 8 and ep["traffic"]["ep"]["bytes"] > 0 and "dp (experts)" in ep["traffic"]
    assert 0 < r["mfu"] < 1 and r["step_seconds"] == pytest.approx(sum(r["step"].values()), rel=1e-12)


def test_cluster_flags():
    h200 = calc("--model", "llama3-70b", "--gpus", "64", "--tp", "8", "--pp", "4", "--gpu", "h200")
    assert h200["gpu_memory"] == 141e9 and h200["cluster"]["gpu"] == "h200"
    assert not h200["cluster"]["ceiling_fitted"]
    b200 = calc("--model", "llama3-70b", "--gpus", "64", "--tp", "8", "--pp", "4", "--gpu", "b200")
    a100 = calc("--model", "llama3-70b", "--gpus", "64", "--tp", "8", "--pp", "4", "--gpu", "a100")
    assert a100["step"]["compute"] > h200["step"]["compute"] > b200["step"]["compute"]
    four = calc("--model", "llama3-70b", "--gpus", "64", "--tp", "8", "--pp", "4", "--gpus-per-node", "4")
    assert four["traffic"]["tp"]["link"] == "network" and four["cluster"]["gpus_per_node"] == 4


def test_search_prints_the_fastest_layouts_that_fit_with_why():
    r = calc("--model", "llama3-8b", "--gpus", "16", "--global-batch", "64", "--search", "--top", "3")
    rows = r["search"]
    assert len(rows) == 3 and [x["step_seconds"] for x in rows] == sorted(x["step_seconds"] for x in rows)
    assert all(x["memory_total"] <= 80e9 for x in rows)
    assert rows[0]["why"].startswith("fastest") and "slower than the best" in rows[1]["why"]


def test_json_and_text_print_the_same_report(capsys):
    words = ["--model", "llama3-70b", "--gpus", "64", "--tp", "8", "--pp", "4"]
    assert main(words + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(run(words)))
    assert main(words) == 0
    out = capsys.readouterr().out
    for item in ("parameters", "gradients", "optimizer states", "activations", "overheads", "total", "MFU"):
        assert item in out
    assert f"{run(words)['memory']['activations']['bytes'] / 1e9:.2f}" in out


INVALID = [
    (["--model", "llama3-70b", "--gpus", "64", "--tp", "3"], "world size 64 is not a multiple of tp*pp*cp"),
    (["--model", "qwen2.5-7b", "--tp", "8"], "tp=8 must divide n_heads=28 of Qwen2.5 7B"),
    (["--model", "qwen2.5-7b", "--gpus", "14", "--tp", "14"],
     "tp=14 must divide n_kv_heads=4 or be a multiple"),
    (["--model", "gpt2", "--gpus", "16", "--pp", "16"], "n_chunks=16 (pp·vpp) must not exceed n_layers=12"),
    (["--model", "llama3-8b", "--gpus", "24", "--cp", "3"], "cp=3 must divide seq_len=4096"),
    (["--model", "mixtral-8x7b", "--gpus", "48", "--ep", "3"], "ep=3 must divide n_experts=8"),
    (["--model", "llama3-8b", "--ep", "2"], "ep=2 > 1 but Llama-3 8B has no experts"),
    (["--model", "llama3-8b", "--sp"], "sequence parallelism shards along the tensor-parallel group"),
    (["--model", "llama3-8b", "--vpp", "2"], "virtual pipeline stages (vpp > 1) need pipeline parallelism"),
    (["--model", "llama3-8b", "--global-batch", "500"], "the global batch (500) must be a multiple of dp"),
    (["--model", "llama3-8b", "--dp", "4"], "world size 8 != dp*tp*pp*cp = 4*1*1*1 = 4"),
    (["--model", "llama3-8b", "--gpus", "0"],
     "argument --gpus: must be a whole number of at least 1, got '0'"),
    (["--model", "llama3-8b", "--heads", "30"], "n_heads=30 must divide d_model=4096"),
    (["--model", "llama3-8b", "--zero", "4"], "argument --zero: invalid choice: 4"),
    (["--layers", "4"], "--hidden --heads --ffn --vocab missing"),
    (["--model", "llama3-8b", "--gpus", "16", "--pp", "2", "--vpp", "2", "--global-batch", "8"],
     "interleaved 1F1B needs the micro-batches per step (1) to be a multiple of pp=2"),
]


@pytest.mark.parametrize("words, message", INVALID)
def test_bad_input_is_one_line_naming_the_rule_and_exit_2(words, message, capsys):
    assert main(words) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured.err
    assert message in captured.err and captured.err.startswith("error: ")


def test_the_module_runs_without_torch_and_exits_2_without_a_traceback(tmp_path):
    """`python -m helpers.cost.calculator` with torch made unimportable (as in the browser): it runs, and bad
    input gives exit status 2 and one line."""
    (tmp_path / "torch.py").write_text("raise ImportError('no torch here')\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    good = subprocess.run([sys.executable, "-m", "helpers.cost.calculator", "--model", "llama3-70b", "--gpus",
                           "64", "--tp", "8", "--pp", "4"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert good.returncode == 0 and "optimizer states" in good.stdout, good.stderr
    bad = subprocess.run([sys.executable, "-m", "helpers.cost.calculator", "--model", "llama3-70b", "--gpus",
                          "64", "--tp", "3"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and bad.stderr.count("\n") == 1


def test_the_published_size_is_shown_beside_the_count_with_the_gap(capsys):
    r = calc("--model", "llama3-70b", "--gpus", "64", "--tp", "8", "--pp", "4")["model"]
    assert r["published"]["gap"] == pytest.approx(70_553_706_496 / 70e9 - 1, rel=1e-12)  # the exact count
    assert main(["--model", "deepseek-v3-like", "--gpus", "256", "--ep", "32", "--pp", "8"]) == 0
    out = capsys.readouterr().out
    assert "published 671 B (-0.4%), 37 B active (-5.2%)" in out and "shared expert left out" in out


def test_the_page_gets_every_module_the_calculator_runs_and_every_chapter_it_links():
    """What helpers/tools/calculator_site.py ships to the browser: the modules a budget and a search load
    (matmul_rate and layout_search only when first used; listed in a Python where torch cannot be imported, so
    one that needs torch fails the listing), and a page for each chapter a number links to."""
    from helpers.cost.calculator_presets import CHAPTERS
    from helpers.tools import calculator_site

    shipped = calculator_site.calculator_sources()
    for path in ("helpers/cost/calculator.py", "helpers/cost/calculator_presets.py",
                 "helpers/cost/matmul_rate.py", "helpers/cost/time_model.py", "helpers/cost/layout_search.py",
                 "helpers/cost/budget_types.py", "helpers/layout_rules.py"):
        assert path in shipped, path
    pages = calculator_site.chapter_pages()  # notebooks/NN_name.html, from notebooks/NN_name.md
    for nn in set(CHAPTERS.values()):
        assert os.path.exists(os.path.join(ROOT, pages[nn][:-len(".html")] + ".md")), nn
    assert set(calculator_site.choices()["--model"]) == set(PRESETS)
