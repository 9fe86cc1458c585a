"""The layout search (chapter 10): a case whose best layout is known by hand, the prunings against the brute
force, where a published layout ranks, and the errors. Pure Python, no ranks; float formulas to rel=1e-12."""

import pytest

from helpers.cost import layout_search, memory_budget, model_size, time_model
from helpers.cost.memory_budget import Layout
from helpers.cost.model_size import LLAMA3_70B, LLAMA3_405B, ModelShape

TINY = ModelShape("tiny", n_layers=2, d_model=64, n_heads=4, n_kv_heads=4, d_ff=256, vocab_size=256)
# two GPUs on one node, fast links, no latency: every overhead is as small as it can be but not zero
PAIR = time_model.Cluster("a pair", gpus_per_node=2, peak_flops=1e12, intra_bw=1e12, inter_bw=1e12,
                          intra_alpha=0.0, inter_alpha=0.0, efficiency=1.0)


def test_the_best_tiny_layout_is_data_parallel_with_its_all_reduce_hidden():
    """By hand: on 2 GPUs a tiny model's layouts are dp=2, tp=2, pp=2 or cp=2. Compute is the same for all
    (no recomputation: 6 FLOPs per weight per token plus the attention matmuls, over 2 GPUs); tp, pp and cp
    add traffic or a bubble on the critical path, while dp's gradient all-reduce (2·(2-1)/2 of 2-byte
    gradients) hides behind the last micro-batch's backward. So the fastest step is dp=2 with nothing
    exposed, its time exactly the compute."""
    result = layout_search.search(TINY, PAIR, 2, seq_len=64, global_batch=8)
    tokens, n = 8 * 64, model_size.matmul_params(TINY)
    flops = 3 * (2 * n * tokens + 4 * TINY.n_layers * tokens * 64 * TINY.d_model)
    compute = flops / 2 / PAIR.peak_flops
    best = result.best
    assert best.step_s == pytest.approx(compute, rel=1e-12)
    assert best.time.comm_s["dp"] < 2 / 3 * compute / best.budget.micro_batches  # it does hide
    fastest = [c for c in result.ranked if c.step_s == pytest.approx(compute, rel=1e-12)]
    assert {(c.layout.dp, c.layout.tp, c.layout.pp, c.layout.cp, c.recompute) for c in fastest} == {
        (2, 1, 1, 1, "none")}
    assert all(c.step_s > compute * (1 + 1e-9) for c in result.ranked if c.layout.dp == 1)
    assert {(c.layout.tp, c.layout.pp, c.layout.cp) for c in result.ranked} == {
        (1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)}
    assert layout_search.why(best, best).startswith("fastest")
    slower = result.ranked[-1]
    assert "slower than the best, mostly in" in layout_search.why(slower, best)


def test_the_prunings_keep_the_brute_forces_best():
    """The exact prunings (a structure whose most frugal variant does not fit; recomputation past the first
    that fits; ZeRO 1-2 past a stage that fits without it) leave the same best as budgeting every variant."""
    kwargs = dict(seq_len=8192, global_batch=128)
    pruned = layout_search.search(LLAMA3_70B, time_model.H100, 64, **kwargs)
    brute = layout_search.search(LLAMA3_70B, time_model.H100, 64, prune=False, **kwargs)
    assert brute.budgets > pruned.budgets
    assert pruned.best.describe() == brute.best.describe()
    assert pruned.best.step_s == brute.best.step_s
    assert all(c.budget.total_bytes <= 80e9 for c in brute.ranked)


def test_a_given_layout_is_placed_and_ranked():
    result = layout_search.search(LLAMA3_70B, time_model.H100, 64, seq_len=8192, global_batch=128)
    rank, c = layout_search.place(result, Layout(dp=8, tp=8, sequence_parallel=True, zero=1))
    assert rank == 1 + sum(x.step_s < c.step_s for x in result.ranked) and rank > 1
    first, same = result.rank_of(dp=result.best.layout.dp, cp=result.best.layout.cp)
    assert first == 1 and same is result.best
    cells = layout_search.heat_map(result)
    assert cells[result.best.layout.tp, result.best.layout.pp] is result.best
    assert all(c.step_s >= result.best.step_s for c in cells.values())
    with pytest.raises(ValueError, match="does not fit: .* GB > 80 GB per GPU"):
        layout_search.place(result, Layout(dp=8, tp=8, sequence_parallel=True), recompute="none")


def test_fp8_gathers_make_zero3_cheaper_in_the_search():
    """The same search with FP8 parameter gathers: no ZeRO-3 layout gets slower, at least one faster."""
    args = (LLAMA3_70B, time_model.H100, 64)
    kw = dict(seq_len=8192, global_batch=128, zeros=(3,))
    bf16 = {c.describe(): c.step_s for c in layout_search.search(*args, **kw).ranked}
    fp8 = {c.describe(): c.step_s
           for c in layout_search.search(*args, precision=memory_budget.FP8_GATHER, **kw).ranked}
    shared = bf16.keys() & fp8.keys()
    assert shared and all(fp8[k] <= bf16[k] for k in shared) and any(fp8[k] < bf16[k] for k in shared)


def test_bad_input_is_refused_with_the_numbers():
    with pytest.raises(ValueError, match="world_size=12 is not a whole number of 8-GPU nodes"):
        layout_search.search(LLAMA3_70B, time_model.H100, 12, seq_len=8192, global_batch=128)
    single = time_model.Cluster("one GPU a node", 1, 1e12, 1e9, 1e9)
    with pytest.raises(ValueError, match="no layout of tiny meets the rules on world_size=3"):
        layout_search.search(TINY, single, 3, seq_len=64, global_batch=8)
    with pytest.raises(ValueError, match=r"Llama-3 405B fits nowhere on world_size=8 with 80 GB per GPU; "
                                         r"the most frugal layout needs \d+\.\d GB"):
        layout_search.search(LLAMA3_405B, time_model.H100, 8, seq_len=8192, global_batch=64)


def test_the_deepseek_v3_like_shape_counts_close_to_the_published_sizes():
    """671B total parameters and 37B active (DeepSeek-AI 2024): the total within 1%, the active within 6%
    (the shared expert and the dense layers' wider MLP are not in the shape)."""
    m = model_size.DEEPSEEK_V3_LIKE
    assert abs(model_size.count_params(m).total / 671e9 - 1) < 0.01
    assert abs(model_size.active_params(m) / 37e9 - 1) < 0.06
