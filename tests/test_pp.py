"""Pipeline parallelism (chapter 06): schedules, their validation and simulation, the model's chunks, and one
small run of each schedule on two ranks.

The schedule tests run in this process, in exact fractions: the simulator reproduces every bubble and
peak-memory formula, and a broken schedule raises a ScheduleError naming the rank, the action and the
micro-batch. The split backward (I, then W) is checked against the whole backward in this process: the same
gradients bit for bit, and between them exactly its FLOPs; the model's chunks (GPTs, under the reference's
names) in a row are the model bit for bit, at positions other than the default too. The distributed test
starts two ranks, runs each schedule on a small GPT, and compares the loss (within 1e-6 relative) and the
gradients (within rtol 1e-6 of each tensor's largest entry: fp32 rounding) with the single process here, and
the activations each rank kept, measured by saved-tensor hooks, and the bytes each rank sent and received with
the formulas, exactly; so does a run given positions other than the default. Fixed stage times change no
gradient, bit for bit. The book's default GPT, whose LM head is tied to the token embedding, runs too: the
last chunk holds its own copy, and the embedding group of the first and last ranks sums the two copies'
gradients, so each is the single process's gradient of the one weight (within the same rtol) and the copies
are equal, bit for bit, after an AdamW step; a Llama-style GPT (rotary positions in every chunk) matches the
single process as well.
"""

from fractions import Fraction

import ipyparallel as ipp
import pytest
import torch

from conftest import assert_close_to_scale, seeded_batch, small_config
from helpers import measure
from helpers.model import GPT, GPTConfig
from helpers.parallel import pipeline_parallel, pipeline_timeline
from helpers.cost import pipeline_schedules
from helpers.reference import named_grads

CFG = small_config(n_layers=4, tie_embeddings=False)
TIED = small_config(n_layers=4)  # the book's default: the LM head is the token embedding
M = 4  # micro-batches of one sequence: the global batch of the two-rank tests
X, Y = seeded_batch(CFG, M)
RTOL = 1e-6

SIZES = [(2, 2), (2, 6), (3, 3), (3, 9), (4, 8), (4, 12), (8, 16), (8, 24)]


def all_schedules(p, m):
    out = [pipeline_schedules.gpipe(p, m), pipeline_schedules.one_f_one_b(p, m),
           pipeline_schedules.zb_h1(p, m)]
    if m % p == 0:
        out += [pipeline_schedules.interleaved_1f1b(p, m, 2), pipeline_schedules.interleaved_1f1b(p, m, 3)]
    return out


@pytest.mark.parametrize("p, m", SIZES)
def test_the_simulated_bubble_is_the_papers_formula_exactly(p, m):
    for s in all_schedules(p, m):
        v = len(s.chunks_of(0))
        bubble = pipeline_schedules.bubble_fraction(pipeline_schedules.simulate(s))
        assert set(bubble.values()) == {pipeline_schedules.bubble_formula(s.name, p, m, v)}, s.name


@pytest.mark.parametrize("p, m", SIZES)
def test_peak_micro_batches_kept_follow_the_formula(p, m):
    for s in all_schedules(p, m):
        v = len(s.chunks_of(0))
        want = [pipeline_schedules.peak_alive_formula(s.name, p, m, r, v) for r in range(p)]
        assert pipeline_schedules.peak_alive(s) == want, s.name


def test_zb_h1_has_a_third_of_the_1f1b_bubble_when_f_i_w_are_equal():
    one_f = pipeline_schedules.simulate(pipeline_schedules.one_f_one_b(4, 8))
    zb = pipeline_schedules.simulate(pipeline_schedules.zb_h1(4, 8))
    assert pipeline_schedules.bubble_fraction(zb)[0] == pipeline_schedules.bubble_fraction(one_f)[0] / 3
    # (p-1)(F+B+W) - (p-1)(F+B-W) = 2(p-1)W
    assert pipeline_schedules.makespan(zb) == pipeline_schedules.makespan(one_f) - Fraction(6)


def test_the_simulator_adds_the_latency_of_each_message():
    # F on rank 0, F on rank 1, B on rank 1, B on rank 0: two messages on the critical path
    s = pipeline_schedules.gpipe(2, 1)
    with_latency = pipeline_schedules.simulate(s, comm=Fraction(1, 2))
    without = pipeline_schedules.simulate(s)
    assert pipeline_schedules.makespan(with_latency) == pipeline_schedules.makespan(without) + 1


def _with_rank(s, rank, actions):
    return pipeline_schedules.Schedule(s.name, s.p, s.m, s.placement,
                                       s.actions[:rank] + (tuple(actions),) + s.actions[rank + 1:])


def test_a_backward_before_its_forward_names_the_rank_action_and_micro_batch():
    s = pipeline_schedules.one_f_one_b(4, 8)
    acts = list(s.actions[2])
    acts[0], acts[2] = acts[2], acts[0]  # rank 2: B0 first
    with pytest.raises(pipeline_schedules.ScheduleError,
                       match="wrong order on rank 2: action 0, the backward of micro-batch 0"):
        pipeline_schedules.validate(_with_rank(s, 2, acts))


def test_a_deadlock_names_every_stuck_rank():
    # rank 0 waits for micro-batch 0's gradient before sending micro-batch 1; rank 1 wants micro-batch 1 first
    Action = pipeline_schedules.Action
    swapped = pipeline_schedules.Schedule("x", 2, 2, (0, 1), (
        (Action("F", 0, 0), Action("B", 0, 0), Action("F", 0, 1), Action("B", 0, 1)),
        (Action("F", 1, 1), Action("B", 1, 1), Action("F", 1, 0), Action("B", 1, 0))))
    with pytest.raises(pipeline_schedules.ScheduleError,
                       match=r"deadlock: rank 0 at action 1 \(backward of micro-batch 0 on chunk 0\)"
                             r".*rank 1 at action 0 \(forward of micro-batch 1 on chunk 1\)"):
        pipeline_schedules.validate(swapped)


@pytest.mark.parametrize("change, message", [
    (lambda acts: acts[1:], "rank 1 never runs the forward of micro-batch 0 on chunk 1"),
    (lambda acts: acts + acts[:1], "appears twice"),
    (lambda acts: [pipeline_schedules.Action("F", 0, 9)] + acts, "chunk 0 does not run on rank 1"),
    (lambda acts: acts + [pipeline_schedules.Action("F", 1, 9)], "there are only 4 micro-batches"),
    (lambda acts: [pipeline_schedules.Action("X", 1, 0)] + acts, "unknown kind 'X'"),
])
def test_a_malformed_schedule_is_rejected_before_it_runs(change, message):
    s = pipeline_schedules.one_f_one_b(2, 4)
    with pytest.raises(pipeline_schedules.ScheduleError, match=message):
        pipeline_schedules.validate(_with_rank(s, 1, change(list(s.actions[1]))))


def test_interleaving_needs_m_to_be_a_multiple_of_p():
    with pytest.raises(pipeline_schedules.ScheduleError, match="m=6 to be a multiple of p=4"):
        pipeline_schedules.interleaved_1f1b(4, 6, 2)


@pytest.mark.parametrize("cfg, n_chunks, message", [
    (CFG, 5, "n_chunks=5 .* must not exceed n_layers=4"),
    (CFG, 0, "at least one chunk"),
])
def test_a_bad_layout_names_the_broken_constraint(cfg, n_chunks, message):
    with pytest.raises(ValueError, match=message):
        pipeline_parallel.check_layout(cfg, n_chunks)


def test_a_tied_model_is_cut_with_a_copy_of_the_embedding_on_the_last_chunk():
    pipeline_parallel.check_layout(TIED, 2)  # no longer refused
    first, middle, last = pipeline_parallel.split_model(GPT(TIED, seed=0), 3)
    assert torch.equal(last.lm_head.weight, first.tok_emb.weight)
    assert last.lm_head.weight is not first.tok_emb.weight
    assert pipeline_parallel.tied_copies({1: middle}) == []
    assert pipeline_parallel.tied_copies({0: pipeline_parallel.split_model(GPT(TIED, seed=0), 1)[0]}) == []
    assert len(pipeline_parallel.tied_copies({0: first, 2: last})) == 2
    with pytest.raises(ValueError, match="holds one copy of the embedding .* no embedding group"):
        pipeline_parallel.allreduce_embedding_grads({2: last}, None)


@pytest.mark.parametrize("cfg", [CFG, TIED], ids=["untied", "tied"])
@pytest.mark.parametrize("n_chunks", [1, 2, 3, 4])
def test_the_chunks_in_a_row_are_the_reference_bit_for_bit(n_chunks, cfg):
    reference = GPT(cfg, seed=0)
    chunks = pipeline_parallel.split_model(reference, n_chunks)
    assert all(isinstance(c, GPT) for c in chunks)
    # the reference's names, each once; a tied weight under both of its names
    names = sorted(n for c in chunks for n, _ in c.named_parameters(remove_duplicate=False))
    assert names == sorted(n for n, _ in reference.named_parameters(remove_duplicate=False))
    full = dict(reference.named_parameters(remove_duplicate=False))
    for c in chunks:
        for n, p in c.named_parameters(remove_duplicate=False):
            assert torch.equal(p, full[n]) and p is not full[n], n  # a copy, equal
    x, y = seeded_batch(CFG, 2)
    positions = torch.arange(1, CFG.seq_len)  # not the default: the first chunk must use them
    h = x[:, 1:]
    for c in chunks[:-1]:
        h = c(h, positions=positions)
    logits, loss = chunks[-1](h, y[:, 1:], positions=positions)
    want_logits, want_loss = reference(x[:, 1:], y[:, 1:], positions=positions)
    assert torch.equal(logits, want_logits) and torch.equal(loss, want_loss)


def test_the_formula_for_bytes_counts_the_boundaries_between_ranks():
    assert pipeline_schedules.expected_p2p_bytes(pipeline_schedules.one_f_one_b(4, 8), 0, 10) == (80, 80)
    assert pipeline_schedules.expected_p2p_bytes(pipeline_schedules.one_f_one_b(4, 8), 1, 10) == (160, 160)
    interleaved = pipeline_schedules.interleaved_1f1b(4, 8, 2)
    assert pipeline_schedules.expected_p2p_bytes(interleaved, 0, 10) == (240, 240)
    assert pipeline_schedules.expected_p2p_bytes(interleaved, 2, 10) == (320, 320)


def _one_chunk(index=1, n_chunks=4):
    chunk = pipeline_parallel.split_model(GPT(CFG, seed=0), n_chunks)[index]
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(2, CFG.seq_len, CFG.d_model, generator=gen).requires_grad_()
    return chunk, h, torch.randn(2, CFG.seq_len, CFG.d_model, generator=gen)


def test_input_then_weight_gradients_are_the_whole_backward_and_its_flops_exactly():
    chunk, h, grad = _one_chunk()
    state = {}

    def forward():
        state["out"], state["edges"] = pipeline_parallel.forward_step(chunk, h)

    def total(fn):
        return sum(measure.count_flops(fn).values())

    total(forward)
    whole = total(lambda: torch.autograd.backward(state.pop("out"), grad))
    want = {"input": h.grad, **{n: p.grad for n, p in chunk.named_parameters()}}
    h.grad = None
    chunk.zero_grad(set_to_none=True)
    total(forward)
    input_flops = total(lambda: state.update(zip(("h_grad", "kept"), pipeline_parallel.backward_input(
        state.pop("out"), grad, h, state.pop("edges")))))
    weight_flops = total(lambda: pipeline_parallel.backward_weight(state.pop("kept")))
    got = {"input": state["h_grad"], **{n: p.grad for n, p in chunk.named_parameters()}}
    assert h.grad is None  # I returns the input's gradient, it does not accumulate it
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert input_flops + weight_flops == whole
    linear = sum(m.weight.numel() for m in chunk.modules() if isinstance(m, torch.nn.Linear))
    assert weight_flops == 2 * 2 * CFG.seq_len * linear


def test_saved_activations_follow_autograd_from_forward_to_the_last_backward():
    per_layer = measure.saved_bytes_per_layer(CFG, 2, CFG.seq_len)
    chunk, h, grad = _one_chunk()  # one layer
    saved = pipeline_timeline.SavedActivations([chunk])
    try:
        out, edges = pipeline_parallel.forward_step(chunk, h)
        assert saved.bytes == per_layer
        kept = pipeline_parallel.backward_input(out, grad, h, edges)[1]
        del out, edges
        assert saved.bytes == per_layer  # the graph stays saved for W
        pipeline_parallel.backward_weight(kept)
        del kept
        assert saved.bytes == 0 and not saved.live
        out = chunk(h)
        torch.autograd.backward(out, grad, retain_graph=True)
        assert saved.bytes == per_layer  # a retained graph keeps everything
        del out
        assert saved.bytes == 0
    finally:
        saved.close()


@ipp.interactive  # sent by value: the engines cannot import this test module
def _pipeline_step(cfg, schedule, x, y, stage_seconds=None, positions=None):
    import torch.distributed as dist

    from helpers.model import GPT
    from helpers.parallel import pipeline_parallel
    from helpers.parallel.ledger import LEDGER
    from helpers.reference import named_grads

    base = GPT(cfg, seed=0)
    chunks = {c: pipeline_parallel.pipeline_chunk(base, c, schedule.n_chunks)
              for c in schedule.chunks_of(dist.get_rank())}
    embedding = pipeline_parallel.embedding_group(schedule.placement)  # every rank calls it
    LEDGER.clear()
    losses, events = pipeline_parallel.run_schedule(schedule, chunks, x, y, stage_seconds=stage_seconds,
                                                    positions=positions, embedding_group=embedding)
    return ({k: float(v) for k, v in losses.items()}, {n: g for c in chunks.values()
                                                        for n, g in named_grads(c).items()},
            (max(e.saved_bytes for e in events), events[-1].saved_bytes), LEDGER.totals("pipeline"),
            [tuple(e) for e in events])


@ipp.interactive  # sent by value: the engines cannot import this test module
def _unmeasured_step(cfg, schedule, x, y):
    import torch.distributed as dist

    from helpers.model import GPT
    from helpers.parallel import pipeline_parallel
    from helpers.reference import named_grads

    base = GPT(cfg, seed=0)
    chunks = {c: pipeline_parallel.pipeline_chunk(base, c, schedule.n_chunks)
              for c in schedule.chunks_of(dist.get_rank())}
    embedding = pipeline_parallel.embedding_group(schedule.placement)
    _, events = pipeline_parallel.run_schedule(schedule, chunks, x, y, embedding_group=embedding,
                                               record_saved=False)
    return {n: g for c in chunks.values() for n, g in named_grads(c).items()}, [e.saved_bytes for e in events]


def test_every_schedule_on_two_ranks_matches_the_single_process(ranks):
    reference = GPT(CFG, seed=0)
    loss = reference(X, Y)[1]
    loss.backward()
    want = named_grads(reference)
    activation_bytes = 1 * CFG.seq_len * CFG.d_model * 4
    per_layer = measure.saved_bytes_per_layer(CFG, 1, CFG.seq_len)
    for s in [pipeline_schedules.gpipe(2, M), pipeline_schedules.one_f_one_b(2, M),
              pipeline_schedules.interleaved_1f1b(2, M, 2), pipeline_schedules.zb_h1(2, M)]:
        results = ranks.apply(_pipeline_step, CFG, s, X, Y)
        losses = results[s.placement[-1]][0]
        assert sum(losses.values()) / M == pytest.approx(loss.item(), rel=1e-6), s.name
        grads = {n: g for _, per_rank, _, _, _ in results for n, g in per_rank.items()}
        assert_close_to_scale(grads, want, RTOL, f"{s.name}, the two stages' gradients:")
        v = len(s.chunks_of(0))
        unit = per_layer * CFG.n_layers // s.n_chunks  # one micro-batch through one chunk
        peaks = [pipeline_schedules.peak_alive_formula(s.name, 2, M, r, v) * unit for r in range(2)]
        assert [r[2] for r in results] == [(peak, 0) for peak in peaks]
        assert [r[3] for r in results] == [pipeline_schedules.expected_p2p_bytes(s, r, activation_bytes)
                                           for r in range(2)]
        # a training loop that does not read the saved bytes leaves them unmeasured, and computes the same
        unmeasured = ranks.apply(_unmeasured_step, CFG, s, X, Y)
        assert all(r[1] == [None] * len(r[1]) for r in unmeasured), s.name
        for (_, grads_, *_), (again, _) in zip(results, unmeasured):
            assert all(torch.equal(grads_[n], again[n]) for n in grads_), s.name


def test_fixed_stage_seconds_pad_every_action_and_keep_the_gradients(ranks):
    s = pipeline_schedules.zb_h1(2, M)
    seconds = {"F": 0.004, "B": 0.008, "I": 0.004, "W": 0.004}
    plain = ranks.apply(_pipeline_step, CFG, s, X, Y)
    padded = ranks.apply(_pipeline_step, CFG, s, X, Y, seconds)
    for r in range(2):
        for name, g in plain[r][1].items():
            assert torch.equal(padded[r][1][name], g), name
        for kind, _, _, _, start, computed, end, _ in padded[r][4]:
            assert start <= computed <= end and end - start >= seconds[kind]  # a sleep only overshoots


def test_a_deadlocking_schedule_fails_on_the_ranks_without_a_hang(ranks):
    good = pipeline_schedules.one_f_one_b(2, M)
    swap = [tuple(pipeline_schedules.Action(a.kind, r, a.micro_batch) for a in good.actions[1 - r])
            for r in range(2)]
    bad = pipeline_schedules.Schedule("1F1B", 2, M, good.placement, tuple(swap))  # warm-up counts reversed
    with pytest.raises(ipp.error.CompositeError, match="deadlock"):
        ranks.apply(_pipeline_step, CFG, bad, X, Y)


def _matches_at_positions(ranks, cfg, positions, what):
    """1F1B on two ranks over the tokens at ``positions``, given to the executor, against one process."""
    x, y = X[:, positions], Y[:, positions]
    reference = GPT(cfg, seed=0)
    loss = reference(x, y, positions=positions)[1]
    loss.backward()
    want = named_grads(reference)
    results = ranks.apply(_pipeline_step, cfg, pipeline_schedules.one_f_one_b(2, M), x, y, None, positions)
    assert sum(results[1][0].values()) / M == pytest.approx(loss.item(), rel=1e-6), f"{what}: loss"
    grads = {n: g for _, per_rank, _, _, _ in results for n, g in per_rank.items()}
    assert_close_to_scale(grads, want, RTOL, f"{what}, the two stages' gradients:")


def test_the_first_chunk_takes_the_positions_it_is_given(ranks):
    # the second half of each sequence, at its own positions (as a context-parallel rank holds it)
    _matches_at_positions(ranks, CFG, torch.arange(CFG.seq_len // 2, CFG.seq_len), "positions given")


def _reference_grads(cfg, x, y):
    """The single process's loss and gradients by name, a tied weight's under both of its names."""
    reference = GPT(cfg, seed=0)
    loss = reference(x, y)[1]
    loss.backward()
    return loss, {n: p.grad for n, p in reference.named_parameters(remove_duplicate=False)}


@ipp.interactive
def _tied_adamw_step(cfg, schedule, x, y):
    import torch
    import torch.distributed as dist

    from helpers.model import GPT
    from helpers.parallel import pipeline_parallel
    from helpers.reference import named_params

    base = GPT(cfg, seed=0)
    chunks = {c: pipeline_parallel.pipeline_chunk(base, c, schedule.n_chunks)
              for c in schedule.chunks_of(dist.get_rank())}
    embedding = pipeline_parallel.embedding_group(schedule.placement)
    optimizer = torch.optim.AdamW([p for c in chunks.values() for p in c.parameters()], lr=1e-2)
    pipeline_parallel.run_schedule(schedule, chunks, x, y, embedding_group=embedding)
    optimizer.step()
    return {n: p for c in chunks.values() for n, p in named_params(c).items()}


@pytest.mark.parametrize("make", [lambda: pipeline_schedules.one_f_one_b(2, M),
                                  lambda: pipeline_schedules.interleaved_1f1b(2, M, 2),
                                  lambda: pipeline_schedules.zb_h1(2, M)],
                         ids=["1F1B", "interleaved", "ZB-H1"])
def test_the_tied_gpt_on_two_ranks_matches_the_single_process(ranks, make):
    s = make()
    loss, want = _reference_grads(TIED, X, Y)
    results = ranks.apply(_pipeline_step, TIED, s, X, Y)
    assert sum(results[1][0].values()) / M == pytest.approx(loss.item(), rel=1e-6), f"{s.name}, tied: loss"
    grads = {n: g for _, per_rank, _, _, _ in results for n, g in per_rank.items()}
    # each copy's gradient is the sum of both uses': the one weight's gradient in one process
    assert_close_to_scale(grads, want, RTOL, f"{s.name}, tied embeddings, the two stages' gradients:")
    params = ranks.apply(_tied_adamw_step, TIED, s, X, Y)
    assert not torch.equal(params[0]["tok_emb.weight"], GPT(TIED, seed=0).tok_emb.weight)  # it moved
    assert torch.equal(params[0]["tok_emb.weight"], params[1]["lm_head.weight"]), \
        f"{s.name}: the two copies of the tied embedding differ after an AdamW step"


def test_a_llama_style_gpt_on_two_ranks_matches_the_single_process(ranks):
    # rotary positions: every chunk builds its tables from the positions the executor gives it
    shape = {f: getattr(CFG, f) for f in ("vocab_size", "seq_len", "n_layers", "d_model", "n_heads",
                                          "n_kv_heads", "d_ff")}
    cfg = GPTConfig.llama_style(**shape)
    # the first and the last quarter of each sequence, as a zig-zag context-parallel rank holds it: RoPE sees
    # only the gaps between positions, so a chunk left at the default 0 … t-1 would be caught by the gap
    q = cfg.seq_len // 4
    positions = torch.cat([torch.arange(q), torch.arange(cfg.seq_len - q, cfg.seq_len)])
    _matches_at_positions(ranks, cfg, positions, "Llama-style GPT")
