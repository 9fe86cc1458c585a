"""Mixture of experts and expert parallelism (chapter 08): routing, losses, layouts, and one run on two ranks.

The routing, loss and layout tests run in this process; the grouped matmul matches the loop over experts
within rtol 1e-6, atol 1e-6. The distributed tests start two ranks, run an expert-parallel MoE GPT forward and
backward on each (dispatch and combine by all-to-all), and compare with the single process here: the rows
each rank receives and the tokens dropped exactly, the logits within 1e-6 absolute, the loss within 1e-6
relative, and every gradient within rtol 1e-6 of its tensor's largest entry (fp32 rounding). Expert
parallelism takes its rank and size from the group it is given: on a group of both ranks made by
``new_group``, and on two groups of one rank each, a layer's output matches the single process within 1e-6
absolute.
"""

from dataclasses import asdict, replace

import ipyparallel as ipp
import pytest
import torch

from conftest import assert_close_to_scale, seeded_batch, small_config
from helpers.parallel import expert_parallel, moe
from helpers.cost.collective_costs import all_to_all_bytes
from helpers.reference import named_grads

# the tests' small GPT, its MLPs four experts of d_ff 32; capacity factor 1 drops tokens
CFG = moe.MoEConfig(**asdict(small_config(d_ff=32)), n_experts=4, top_k=2, capacity_factor=1.0)
ROWS = 4  # the global batch: two sequences per rank
RTOL = 1e-6


@pytest.mark.parametrize("changes, message", [
    ({"top_k": 5}, "top_k=5 must be in 1..n_experts=4"),
    ({"top_k": 0}, "top_k=0 must be in 1..n_experts=4"),
    ({"capacity_factor": 0.0}, "capacity_factor must be positive"),
])
def test_a_bad_config_names_the_broken_constraint(changes, message):
    with pytest.raises(ValueError, match=message):
        replace(CFG, **changes)


def test_a_bad_layout_names_the_broken_constraint():
    with pytest.raises(ValueError, match="ep=3 must divide n_experts=4"):
        expert_parallel.check_layout(CFG, 3)
    expert_parallel.check_layout(CFG, 2)


def test_parallelize_refuses_a_model_without_moe_layers():
    from helpers.model import GPT

    with pytest.raises(ValueError, match="needs blocks whose mlp is a single-process MoELayer"):
        expert_parallel.parallelize(GPT(small_config()))


def test_moe_every_other_block_and_a_dense_chunk_left_as_it_is():
    from helpers.parallel import pipeline_parallel

    cfg = replace(CFG, n_layers=4, moe_every=2)
    model = moe.MoEGPT(cfg, seed=0)
    assert [type(b.mlp).__name__ for b in model.blocks] == ["MLP", "MoELayer", "MLP", "MoELayer"]
    assert model.moe_layers() == [model.blocks[1].mlp, model.blocks[3].mlp]
    dense = pipeline_parallel.pipeline_chunk(model, 0, 4)  # block 0 alone: nothing to split, nothing refused
    assert expert_parallel.parallelize(dense) is dense and dense.moe_layers() == []
    with pytest.raises(ValueError, match="moe_every=5 must be in 1..n_layers=4"):
        replace(cfg, moe_every=5)


def test_the_load_balancing_loss_is_one_at_perfect_balance_and_E_at_collapse():
    E, tokens = 8, 64
    uniform = torch.full((tokens, E), 1 / E, dtype=torch.float64)
    balanced = torch.arange(tokens * 2).view(tokens, 2) % E
    assert moe.load_balancing_loss(uniform, balanced).item() == 1.0
    collapsed = torch.zeros(tokens, E, dtype=torch.float64)
    collapsed[:, 0] = 1.0
    assert moe.load_balancing_loss(collapsed, torch.zeros(tokens, 1, dtype=torch.long)).item() == E


def test_capacity_keeps_first_choices_before_second_choices():
    # four tokens all choose expert 0 first and expert 1 second; capacity 2 per expert
    expert = torch.tensor([[0, 1]] * 4)
    kept = moe.within_capacity(expert, 2, 2)
    assert kept.tolist() == [[True, True], [True, True], [False, False], [False, False]]
    expert = torch.tensor([[0, 1], [1, 0], [1, 0]])
    # expert 1's queue: token 1, token 2 (first choices), then token 0's second choice
    assert moe.within_capacity(expert, 2, 2).tolist() == [[True, False], [True, True], [True, False]]
    assert moe.expert_capacity(64, replace(CFG, capacity_factor=1.25)) == 40
    assert moe.expert_capacity(64, replace(CFG, capacity_factor=None)) is None


def test_the_bias_chooses_experts_but_never_changes_the_gates():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    plain = moe.route(logits, 1)
    biased = moe.route(logits, 2, bias=torch.tensor([0.0, 0.0, 1.0, 0.0]))
    assert plain.expert.tolist() == [[0]]
    assert biased.expert.tolist() == [[2, 0]]
    probs = logits.softmax(-1)[0]
    torch.testing.assert_close(biased.gate[0], torch.stack([probs[2], probs[0]]) / (probs[2] + probs[0]))


def test_the_grouped_matmul_matches_the_loop_and_refuses_float64():
    torch.manual_seed(0)
    experts = moe.Experts(4, 8, 16)
    for p in experts.parameters():
        torch.nn.init.normal_(p)
    rows, counts = torch.randn(10, 8), [3, 0, 5, 2]
    torch.testing.assert_close(moe.experts_grouped(rows, counts, experts),
                               moe.experts_loop(rows, counts, experts), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="not torch.float64"):
        moe.experts_grouped(rows.double(), counts, experts.double())


def test_uneven_all_to_all_bytes_leave_out_the_own_split():
    assert all_to_all_bytes([3, 1, 4], [2, 7, 1], 1, row_bytes=8) == ((3 + 4) * 8, (2 + 1) * 8)
    with pytest.raises(ValueError, match="one input and one output split per rank"):
        all_to_all_bytes([1, 2], [1, 2, 3], 0, row_bytes=4)


def test_dispatch_arrivals_follow_source_rank_then_expert_then_token():
    # two segments (ranks) of two tokens, top-1; expert 0 lives on rank 0, expert 1 on rank 1
    expert = torch.tensor([[[1], [0]], [[0], [1]]])
    kept = torch.ones_like(expert, dtype=torch.bool)
    assert expert_parallel.dispatch_arrivals(expert, kept, 2, 0).tolist() == [1, 2]
    assert expert_parallel.dispatch_arrivals(expert, kept, 2, 1).tolist() == [0, 3]
    kept[1, 1, 0] = False  # segment 1's token 1 was dropped: it never travels
    assert expert_parallel.dispatch_arrivals(expert, kept, 2, 1).tolist() == [0]


def test_identify_rows_names_each_copied_row_and_refuses_ambiguity():
    tokens = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    assert expert_parallel.identify_rows(tokens[[2, 0, 2]], tokens).tolist() == [2, 0, 2]
    assert expert_parallel.identify_rows(torch.tensor([[3.0, 4.5]]), tokens).tolist() == [-1]  # of no token
    twice = torch.cat([tokens, tokens[:1]])
    assert expert_parallel.identify_rows(tokens[:1], twice).tolist() == [-1]  # a copy of two


def test_segments_must_divide_the_tokens():
    layer = moe.MoELayer(CFG, segments=3)
    with pytest.raises(ValueError, match="segments=3 must divide the 16 tokens of the batch"):
        layer(torch.zeros(2, 8, CFG.d_model))


def test_the_moe_gpt_passes_positions_and_the_loss_through():
    x, y = seeded_batch(CFG, 2)
    model, shifted = moe.MoEGPT(CFG, seed=0), moe.MoEGPT(CFG, seed=0)
    with torch.no_grad():
        shifted.pos_emb.weight[:4] = model.pos_emb.weight[4:8]  # positions 4-7 of one are 0-3 of the other
        torch.testing.assert_close(model(x[:, :4], positions=torch.arange(4, 8)), shifted(x[:, :4]),
                                   rtol=0, atol=0)
        _, loss = model(x, y, loss_fn=lambda logits, targets: logits.new_tensor(5.0))
    assert model.lm_loss.item() == 5.0
    aux = sum(CFG.aux_loss_coef * m.aux_loss + CFG.z_loss_coef * m.z_loss for m in model.moe_layers())
    assert loss.item() == pytest.approx(5.0 + aux.item(), rel=1e-6)


@ipp.interactive  # sent by value: the engines cannot import this test module
def _expert_parallel_step(cfg, x, y):
    from torch import distributed

    from helpers.parallel import expert_parallel, moe
    from helpers.reference import named_grads

    ep, rank = distributed.get_world_size(), distributed.get_rank()
    model = expert_parallel.from_reference(moe.MoEGPT(cfg, seed=0, segments=ep))
    part = slice(rank * len(x) // ep, (rank + 1) * len(x) // ep)
    logits, loss = model(x[part], y[part])
    loss.backward()
    expert_parallel.finish_gradients(model)
    dropped = [layer.stats["dropped"] for layer in model.moe_layers()]
    return logits.detach(), loss.item(), dropped, named_grads(model)


@ipp.interactive
def _dispatch_one_layer(cfg, h):
    import torch
    from torch import distributed

    from helpers.parallel import expert_parallel, moe

    ep, rank = distributed.get_world_size(), distributed.get_rank()
    layer = expert_parallel.ExpertParallelMoE.from_layer(moe.MoEGPT(cfg, seed=0).blocks[0].mlp)
    with torch.no_grad():
        layer(h[rank * len(h) // ep:(rank + 1) * len(h) // ep])
    return layer.stats


def test_dispatch_delivers_the_rows_the_single_process_routes_to_each_rank(ranks):
    h = torch.randn(4, CFG.seq_len, CFG.d_model, generator=torch.Generator().manual_seed(1))
    reference = moe.MoEGPT(CFG, seed=0, segments=2).blocks[0].mlp
    with torch.no_grad():
        reference(h)
    kept, n = reference.stats["kept"], CFG.n_experts // 2
    crossed = 0
    for r, stats in enumerate(ranks.apply(_dispatch_one_layer, CFG, h)):
        assert stats["send"].tolist() == kept[r].view(2, n).sum(-1).tolist()
        assert stats["from_ranks"].tolist() == kept[:, r * n:(r + 1) * n].tolist()
        arrived = expert_parallel.identify_rows(stats["arrived"], h.reshape(-1, CFG.d_model))
        want = expert_parallel.dispatch_arrivals(reference.stats["expert"], reference.stats["kept_mask"],
                                                 CFG.n_experts, r)
        assert arrived.tolist() == want.tolist()
        crossed += int((arrived // (2 * CFG.seq_len) != r).sum())
    assert crossed > 0  # rows really travelled between the ranks


def test_two_ranks_match_the_single_process(ranks):
    x, y = seeded_batch(CFG, ROWS)
    reference = moe.MoEGPT(CFG, seed=0, segments=2)
    logits, loss = reference(x, y)
    loss.backward()
    results = ranks.apply(_expert_parallel_step, CFG, x, y)
    assert sum(r[1] for r in results) / 2 == pytest.approx(loss.item(), rel=1e-6)
    torch.testing.assert_close(torch.cat([r[0] for r in results]), logits.detach(), rtol=0, atol=1e-6)
    for i, layer in enumerate(reference.moe_layers()):
        assert torch.cat([r[2][i] for r in results]).tolist() == layer.stats["dropped"].tolist()
    assert sum(layer.stats["dropped"].sum().item() for layer in reference.moe_layers()) > 0  # capacity bites
    grads = expert_parallel.unshard_experts([r[3] for r in results])
    assert_close_to_scale(grads, named_grads(reference), RTOL, "expert parallel on two ranks, gradients:")


@ipp.interactive
def _layer_on_groups(cfg, h):
    from dataclasses import replace

    import torch
    from torch import distributed

    from helpers.parallel import expert_parallel, moe

    rank = distributed.get_rank()
    both = distributed.new_group([0, 1])
    alone = [distributed.new_group([0]), distributed.new_group([1])][rank]  # every rank creates every group
    outs = {}
    for name, group in (("both", both), ("alone", alone)):
        try:
            layer = expert_parallel.ExpertParallelMoE.from_layer(moe.MoEGPT(cfg, seed=0).blocks[0].mlp, group)
            with torch.no_grad():
                outs[name] = layer(h[rank * len(h) // 2:(rank + 1) * len(h) // 2])
        except RuntimeError as err:  # e.g. a slice of the experts taken by the global rank
            outs[name] = f"rank {rank}: {err}"
    try:
        expert_parallel.from_reference(moe.MoEGPT(replace(cfg, n_experts=3), seed=0), both)
    except ValueError as err:
        outs["refused"] = str(err)
    return outs


def test_expert_parallel_takes_rank_and_size_from_its_group(ranks):
    h = torch.randn(4, CFG.seq_len, CFG.d_model, generator=torch.Generator().manual_seed(1))
    results = ranks.apply(_layer_on_groups, CFG, h)
    for r, out in enumerate(results):
        assert "ep=2 must divide n_experts=3" in out.get("refused", ""), f"rank {r}: {out.get('refused')}"
    for name, segments in (("both", 2), ("alone", 1)):  # alone: each rank is one group, holding every expert
        reference = moe.MoEGPT(CFG, seed=0, segments=segments).blocks[0].mlp
        with torch.no_grad():
            want = reference(h) if segments == 2 else torch.cat([reference(half) for half in h.chunk(2)])
        failed = [out[name] for out in results if isinstance(out[name], str)]
        assert not failed, f"EP on group {name!r} failed: {failed}"
        got = torch.cat([out[name] for out in results])
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=lambda m: f"EP on group {name!r}: {m}")
