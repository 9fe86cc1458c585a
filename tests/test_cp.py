"""Context parallelism (chapter 07): layouts, the parts of each block ring attention computes, the
online-softmax merge (helpers.parallel.blockwise_attention), the byte formulas, and runs on two ranks.

The layout, block, merge and formula tests run in this process; the distributed ones on two ranks. One runs
ring and Ulysses attention (forward and backward, causal and not, both layouts) on each, and compares what
they return with PyTorch's single-process attention here, the FLOPs the ring really ran with the parts it
should compute, the order of its transfers and computations, and the bytes: the ring's as counted by the
ledger, Ulysses' from the all-to-alls torch ran. Attention runs in fp64, so the outputs and the gradients of
q, k and v, merged by blocks here or computed on the ranks, match the reference entry by entry within
rtol 1e-12, atol 1e-13 (torch.testing.assert_close); FLOPs, bytes, positions and order are compared exactly.
Another makes the book's GPT context-parallel (``context_parallel.parallelize``, ``shard_sequence``,
``average_gradients``) in fp64, GPT-2 style and Llama style (rotary positions, at each rank's own
offsets), and compares each rank's logits, the mean of the ranks' losses and the averaged gradients with one
process's, within rtol 1e-12 of each tensor's largest entry; it also checks what ``parallelize`` refuses (a
layout for another degree than the group's, an unknown attention). The last shows that the check sees rotary
offsets: with every rank's positions 0 ... s/cp-1 the Llama-style logits are wrong wherever a rank's true
positions are others.
"""

import ipyparallel as ipp
import pytest
import torch
import torch.nn.functional as F

from conftest import assert_close_to_scale, seeded_batch, small_config
from helpers.cost import memory_budget, model_size
from helpers.model import GPT, GPTConfig
from helpers.parallel import blockwise_attention, context_parallel


@pytest.mark.parametrize("seq_len, degree, kind, message", [
    (32, 3, "contiguous", "cp=3 must divide seq_len=32"),
    (36, 4, "zigzag", r"2\*cp=8 must divide seq_len=36: the zig-zag"),
    (32, 0, "contiguous", "cp must be at least 1"),
    (32, 2, "striped", "the layout must be"),
])
def test_a_bad_layout_names_the_broken_constraint(seq_len, degree, kind, message):
    with pytest.raises(ValueError, match=message):
        context_parallel.CPLayout(seq_len, degree, kind)


@pytest.mark.parametrize("n_heads, n_kv_heads, degree, message", [
    (8, 4, 3, "cp=3 must divide n_heads=8"), (8, 4, 8, "cp=8 must divide n_kv_heads=4")])
def test_ulysses_refuses_a_degree_that_does_not_divide_the_heads(n_heads, n_kv_heads, degree, message):
    with pytest.raises(ValueError, match=message):
        context_parallel.check_heads(n_heads, n_kv_heads, degree)
    context_parallel.check_heads(n_heads, n_kv_heads, 4)


@pytest.mark.parametrize("kind", ["contiguous", "zigzag"])
@pytest.mark.parametrize("degree", [1, 2, 4])
def test_the_ranks_positions_cover_the_sequence_once(kind, degree):
    layout = context_parallel.CPLayout(16, degree, kind)
    held = torch.cat([layout.positions(r) for r in range(degree)])
    assert torch.equal(held.sort().values, torch.arange(16))
    pairs = [context_parallel.causal_pairs(layout, r) for r in range(degree)]
    assert sum(pairs) == 16 * 17 // 2
    if kind == "zigzag":
        assert len(set(pairs)) == 1


def _computed(layout, rank, causal=True):
    """Every (query, key) position pair ``rank`` computes, once per part that computes it."""
    pairs = []
    for owner in range(layout.cp):
        for rows, cols in blockwise_attention.score_blocks(layout, rank, owner, causal):
            part = [(p, k) for p in layout.positions(rank)[rows].tolist()
                    for k in layout.positions(owner)[cols].tolist()]
            assert any(k <= p for p, k in part) or not causal, f"rank {rank} computes a part in the future"
            pairs += part
    return pairs


@pytest.mark.parametrize("kind", ["contiguous", "zigzag"])
@pytest.mark.parametrize("degree", [1, 2, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_the_parts_computed_cover_every_pair_the_mask_keeps_once(kind, degree, causal):
    layout = context_parallel.CPLayout(32, degree, kind)
    for rank in range(degree):
        computed = _computed(layout, rank, causal)
        assert len(computed) == len(set(computed)), "a pair computed twice"
        kept = {(p, k) for p in layout.positions(rank).tolist() for k in range(32) if k <= p or not causal}
        assert kept <= set(computed), "a pair the mask keeps is never computed"


@pytest.mark.parametrize("degree", [2, 4, 8])
def test_zigzag_half_blocks_balance_the_work_and_the_other_ways_do_not(degree):
    s = 64
    half_block, even = (s // (2 * degree)) ** 2, s * (s + 1) / (2 * degree)
    zigzag, contiguous = ([len(_computed(context_parallel.CPLayout(s, degree, kind), r))
                           for r in range(degree)] for kind in ("zigzag", "contiguous"))
    assert all(abs(n - even) <= half_block for n in zigzag), (zigzag, even, half_block)
    assert max(abs(n - even) for n in contiguous) > half_block
    whole_blocks = degree * (s // degree) ** 2  # every block computed whole, masked: "balanced", and too much
    assert whole_blocks - even > half_block


def _reference(q, k, v, causal, upstream):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    n_rep = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1),
                                         is_causal=causal)
    out.backward(upstream)
    return out.detach(), q.grad, k.grad, v.grad


def _inputs(seq_len=12):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, seq_len, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 2, seq_len, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    return q, k, v, torch.randn(q.shape, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("causal", [False, True])
def test_blocks_merged_by_log_sum_exp_equal_attention_over_all_keys(causal):
    q, k, v, upstream = _inputs()
    want_out, want_dq, want_dk, want_dv = _reference(q, k, v, causal, upstream)
    pos = torch.arange(12)
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)
    ke, ve = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    blocks = [pos[8:], pos[:3], pos[3:8]]  # any order, the future first
    for keys in blocks:
        block = blockwise_attention.block_attention(q, ke[:, :, keys], ve[:, :, keys], pos, keys, causal)
        out, lse = blockwise_attention.merge(out, lse, *block)
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-13)
    delta = (upstream * out).sum(-1)
    dq = torch.zeros_like(q)
    for keys in blocks:
        dq_block, dk, dv = blockwise_attention.block_attention_backward(
            upstream, delta, q, ke[:, :, keys], ve[:, :, keys], lse, pos, keys, causal)
        dq += dq_block
        torch.testing.assert_close(blockwise_attention.fold_kv(dk, 2), want_dk[:, :, keys], rtol=1e-12,
                                   atol=1e-13)
        torch.testing.assert_close(blockwise_attention.fold_kv(dv, 2), want_dv[:, :, keys], rtol=1e-12,
                                   atol=1e-13)
    torch.testing.assert_close(dq, want_dq, rtol=1e-12, atol=1e-13)


def test_a_merge_without_the_rescale_is_wrong():
    q, k, v, _ = _inputs()
    pos = torch.arange(12)
    ke, ve = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    halves = [blockwise_attention.block_attention(q, ke[:, :, p], ve[:, :, p], pos, p, False)
              for p in (pos[:6], pos[6:])]
    want = _reference(q, k, v, False, torch.zeros_like(q))[0]
    assert not torch.allclose(halves[0][0] + halves[1][0], want, rtol=1e-3)
    torch.testing.assert_close(blockwise_attention.merge(*halves[0], *halves[1])[0], want, rtol=1e-12,
                               atol=1e-13)


@pytest.mark.parametrize("degree", [2, 4, 8])
def test_the_ring_formula_is_chapter_01s(degree):
    cfg = small_config(seq_len=32, d_model=64, n_heads=8, n_kv_heads=4, d_ff=256)
    shape = model_size.ModelShape.from_gpt(cfg)
    step = memory_budget.budget(shape, model_size.Batch(32, 8, 8), memory_budget.Layout(cp=degree),
                                precision=memory_budget.FP32, act=memory_budget.ActivationModel())
    assert context_parallel.ring_bytes(8, 32, 4, 8, degree) == step.sent["cp"] / cfg.n_layers


def test_ulysses_sends_less_per_rank_as_the_degree_grows_and_the_ring_more():
    ring = [context_parallel.ring_bytes(1, 4096, 8, 128, d) for d in (2, 4, 8)]
    ulysses = [context_parallel.ulysses_bytes(1, 4096, 32, 8, 128, d) for d in (2, 4, 8)]
    assert ring == sorted(ring) and ulysses == sorted(ulysses, reverse=True)


@ipp.interactive  # sent by value: the engines cannot import this test module
def _attention_on_this_rank(q, k, v, upstream, kind, causal):
    import torch.distributed as dist
    from torch.utils.flop_counter import FlopCounterMode

    from helpers import measure
    from helpers.parallel import context_parallel
    from helpers.parallel.ledger import LEDGER

    rank = dist.get_rank()
    layout = context_parallel.CPLayout(q.shape[2], dist.get_world_size(), kind)
    mine = layout.positions(rank)
    results = {}
    for name, attention in (("ring", context_parallel.ring_attention),
                            ("ulysses", context_parallel.ulysses_attention)):
        LEDGER.clear()
        context_parallel.EVENTS.clear()
        local = [t.index_select(2, mine).clone().requires_grad_() for t in (q, k, v)]
        with measure.TorchCollectives() as ran, FlopCounterMode(display=False) as flops:
            out = attention(*local, layout, causal)
            out.backward(upstream.index_select(2, mine))
        counted = sum(m.nbytes for m in LEDGER.messages if m.counted and m.direction == "send")
        results[name] = ([out.detach()] + [t.grad for t in local], counted, ran.calls,
                         flops.get_total_flops(), list(context_parallel.EVENTS))
    return rank, mine, results


@pytest.mark.parametrize("kind", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [False, True])
def test_two_ranks_match_the_single_process(ranks, kind, causal):
    q, k, v, upstream = _inputs()
    b, h, s, d = q.shape
    want = _reference(q, k, v, causal, upstream)
    layout = context_parallel.CPLayout(s, 2, kind)
    for rank, mine, results in ranks.apply(_attention_on_this_rank, q, k, v, upstream, kind, causal):
        for name, (got, counted, calls, flops, events) in results.items():
            for what, g, w in zip(("out", "dq", "dk", "dv"), got, want):
                torch.testing.assert_close(g, w.index_select(2, mine), rtol=1e-12, atol=1e-13,
                                           msg=lambda m: f"{name} {what}, rank {rank}: {m}")
            if name == "ring":
                assert counted == context_parallel.ring_bytes(2, 12, 2, 8, 2, 8)
                assert {op for op, *_ in calls} == {"send", "recv_"}
                scores = sum((rows.stop - rows.start) * (cols.stop - cols.start) for owner in range(2)
                             for rows, cols in blockwise_attention.score_blocks(layout, rank, owner, causal))
                assert flops == (4 + 10) * d * b * h * scores  # forward QKᵀ, PV; backward five products
                t = {(what, step, event): when for what, step, event, when in events}
                for what in ("forward", "backward"):  # the K/V transfer runs while step 0 is computed
                    assert t[f"{what} K/V", 0, "posted"] <= t[what, 0, "compute"]
                    assert t[what, 0, "computed"] <= t[f"{what} K/V", 0, "arrived"]
            else:
                assert counted == 0  # Ulysses' all-to-alls are torch's: booked, not counted
                assert [op for op, *_ in calls] == ["alltoall_base_"] * 8
                sent = sum(sizes[-1] * element_size / 2 for _, _, sizes, element_size in calls)
                assert sent == context_parallel.ulysses_bytes(2, 12, 4, 2, 8, 2, 8)


def test_an_unknown_attention_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="attention='flash' is not one of 'ring', 'ulysses'"):
        context_parallel.parallelize(GPT(small_config()), context_parallel.CPLayout(8, 2), attention="flash")


def _config(style):
    """The small GPT of the distributed tests, in the GPT-2 style or, at the same sizes, the Llama style."""
    cfg = small_config(seq_len=16)
    if style == "llama":
        sizes = ("vocab_size", "seq_len", "n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff")
        cfg = GPTConfig.llama_style(**{name: getattr(cfg, name) for name in sizes})
    return cfg


@ipp.interactive
def _gpt_on_this_rank(cfg, x, y, kind, attention, offset_zero=False):
    import copy

    import torch
    import torch.distributed as dist

    from helpers import reference
    from helpers.model import GPT
    from helpers.parallel import context_parallel

    try:  # a layout for four ranks on a group of two
        context_parallel.parallelize(GPT(cfg), context_parallel.CPLayout(cfg.seq_len, 4))
        refused = None
    except ValueError as err:
        refused = str(err)
    group = dist.new_group([0, 1])  # a group, not the default: a process group cannot be deep-copied
    layout = context_parallel.CPLayout(cfg.seq_len, dist.get_world_size(group), kind)
    model = context_parallel.parallelize(GPT(cfg, seed=0).double(), layout, group, attention=attention)
    model = copy.deepcopy(model)  # as a pipeline stage is cut: the core, and its group, are shared
    xs, ys, positions = context_parallel.shard_sequence(x, y, layout, group)
    if offset_zero:  # the bug the offset check must see: every rank counts its tokens from 0
        positions = torch.arange(xs.shape[1])
    logits, loss = model(xs, ys, positions=positions)
    loss.backward()
    context_parallel.average_gradients(model, group)
    return positions, logits.detach(), loss.item(), reference.named_grads(model), refused


@pytest.mark.parametrize("style", ["gpt2", "llama"])
@pytest.mark.parametrize("kind, attention", [("contiguous", "ring"), ("zigzag", "ring"),
                                             ("contiguous", "ulysses"), ("zigzag", "ulysses")])
def test_the_context_parallel_gpt_matches_one_process(ranks, kind, attention, style):
    from helpers import reference

    cfg = _config(style)
    x, y = seeded_batch(cfg, rows=2)
    single = GPT(cfg, seed=0).double()
    want_logits, want_loss = single(x, y)
    want_loss.backward()
    results = ranks.apply(_gpt_on_this_rank, cfg, x, y, kind, attention)
    layout = context_parallel.CPLayout(cfg.seq_len, 2, kind)
    for rank, (_, logits, *_) in enumerate(results):  # every rank's logits at its true positions first
        assert_close_to_scale({"logits": logits}, {"logits": want_logits[:, layout.positions(rank)].detach()},
                              1e-12, f"{style}, {attention}, {kind}, rank {rank}")
    for rank, (positions, _, _, grads, refused) in enumerate(results):
        assert torch.equal(positions, layout.positions(rank)), \
            f"{style}, {attention}, {kind}, rank {rank}: shard_sequence gave positions {positions.tolist()}"
        assert_close_to_scale(grads, reference.named_grads(single), 1e-12,
                              f"{style}, {attention}, {kind}, rank {rank}: gradients")
        assert refused == "the layout is for cp=4 ranks, the group has 2", refused
    mean_loss = sum(loss for _, _, loss, _, _ in results) / len(results)
    assert abs(mean_loss - want_loss.item()) <= 1e-12 * abs(want_loss.item()), (mean_loss, want_loss.item())


@pytest.mark.parametrize("kind, attention", [("contiguous", "ring"), ("zigzag", "ring"),
                                             ("contiguous", "ulysses"), ("zigzag", "ulysses")])
def test_rotary_offsets_of_0_on_every_rank_give_wrong_logits(ranks, kind, attention):
    """Rotary positions are relative: only the gaps matter. With every rank at offset 0 the gaps between
    ranks are wrong, and so are the logits of every rank whose true positions are not 0 ... s/cp-1: by more
    than 1e-8 of their scale (about 1e-3 here), far outside the 1e-12 the matching check allows."""
    cfg = _config("llama")
    x, y = seeded_batch(cfg, rows=2)
    want = GPT(cfg, seed=0).double()(x).detach()
    layout = context_parallel.CPLayout(cfg.seq_len, 2, kind)
    results = ranks.apply(_gpt_on_this_rank, cfg, x, y, kind, attention, offset_zero=True)
    for rank, (positions, logits, *_) in enumerate(results):
        assert torch.equal(positions, torch.arange(cfg.seq_len // 2))
        truth = layout.positions(rank)
        error, scale = (logits - want[:, truth]).abs().max().item(), want.abs().max().item()
        if torch.equal(truth, positions):  # rank 0 of the contiguous layout: offset 0 is its true offset
            assert error <= 1e-12 * scale, f"{attention}, {kind}, rank {rank}: {error:.3e}"
        else:
            assert error > 1e-8 * scale, f"{attention}, {kind}, rank {rank}: offset 0 went unnoticed"
