"""Chapter 13: the stability fixes against hand-computed cases, and global-norm clipping on a sharded model.

- z-loss, soft-capping and QK-clip (``helpers.training.stability``) on inputs small enough to compute by hand;
  the attention core that records each head's largest logit against causal SDPA, and its recorded maximum
  against the logits computed directly;
- which rows of each tensor-parallel parameter a rank counts in the global norm (``rows_counted``), and that
  the ranks' counted sums of squares, simulated in one process for several ``tp``, add up to ``||g||^2``;
- on 8 ranks, a 2 x 2 x 2 mesh ``(pp, dp_shard, tp)`` of chapter 10 with ZeRO-1 (chapter 04): the clipped
  gradients and the total norm against single-process ``torch.nn.utils.clip_grad_norm_``, in fp64 (the total
  norm within 1e-12 relative, every clipped gradient within 1e-10 of its tensor's largest entry: the ranks add
  in another order than one backward pass); and the norm of each wrong counting (replicated parameters on
  every tp rank, a pipeline stage left out, each rank's own norm) differs from the reference.
"""

import math

import ipyparallel as ipp
import pytest
import torch
import torch.nn.functional as F

from conftest import assert_close_to_scale, seeded_batch, small_config
from helpers.model import GPT, Attention, causal_attention
from helpers.parallel import tensor_parallel
from helpers.reference import named_grads
from helpers.training import sharded_clipping, stability, stability_run


def test_z_loss_by_hand():
    # logits (0, 0) -> log Z = log 2; (log 3, 0) -> log Z = log 4
    logits = torch.tensor([[[0.0, 0.0], [math.log(3.0), 0.0]]], dtype=torch.float64)
    want = 1e-4 * (math.log(2.0) ** 2 + math.log(4.0) ** 2) / 2
    assert stability.z_loss(logits).item() == pytest.approx(want, rel=1e-14)
    assert stability.z_loss(logits, 0.5).item() == pytest.approx(want / 1e-4 * 0.5, rel=1e-14)


def test_z_loss_gradient_pulls_log_z_to_zero():
    logits = torch.tensor([[2.0, 1.0, 0.0]], dtype=torch.float64, requires_grad=True)
    stability.z_loss(logits, 1.0).backward()
    log_z = torch.logsumexp(logits.detach(), -1)
    # d/dx (log Z)^2 = 2 log Z softmax(x): positive when log Z > 0, so a step lowers every logit
    assert torch.allclose(logits.grad, 2 * log_z * torch.softmax(logits.detach(), -1), rtol=1e-14)


def test_soft_cap_by_hand():
    x = torch.tensor([0.0, 1.0, -50.0, 1e6], dtype=torch.float64)
    got = stability.soft_cap(x, 50.0)
    want = torch.tensor([0.0, 50 * math.tanh(1 / 50), 50 * math.tanh(-1.0), 50.0], dtype=torch.float64)
    assert got.tolist() == pytest.approx(want.tolist(), rel=1e-15, abs=0)
    assert got.abs().max() <= 50.0


def test_qk_clip_by_hand_multi_head():
    attn = Attention(d_model=2, n_heads=2, n_kv_heads=2, head_dim=1)  # one feature per head
    with torch.no_grad():
        attn.q_proj.weight.copy_(torch.tensor([[2.0, 0.0], [0.0, 3.0]]))
        attn.k_proj.weight.copy_(torch.tensor([[5.0, 0.0], [0.0, 7.0]]))
    gamma = stability.qk_clip_(attn, torch.tensor([400.0, 50.0]), tau=100.0)
    # head 0: gamma = 100/400 = 1/4, W_q and W_k each times 1/2; head 1 is under tau: untouched
    assert gamma.tolist() == [0.25, 1.0]
    assert attn.q_proj.weight.tolist() == [[1.0, 0.0], [0.0, 3.0]]
    assert attn.k_proj.weight.tolist() == [[2.5, 0.0], [0.0, 7.0]]


def test_qk_clip_leaves_heads_at_or_under_tau_and_negative_maxima_alone():
    gamma = stability.qk_clip_factor(torch.tensor([100.0, 99.0, -5.0, 0.0, 200.0]), tau=100.0)
    assert gamma.tolist() == [1.0, 1.0, 1.0, 1.0, 0.5]


def test_qk_clip_query_heads_sharing_a_key_head_take_their_largest_logit():
    attn = Attention(d_model=4, n_heads=4, n_kv_heads=2, head_dim=1)  # query heads 0, 1 share key head 0
    with torch.no_grad():
        attn.q_proj.weight.copy_(torch.eye(4))
        attn.k_proj.weight.copy_(torch.ones(2, 4))
    gamma = stability.qk_clip_(attn, torch.tensor([10.0, 400.0, 100.0, 25.0]), tau=100.0)
    assert gamma.tolist() == [0.25, 0.25, 1.0, 1.0]  # key head 0: max 400; key head 1: 100, not above tau
    assert attn.q_proj.weight.diagonal().tolist() == [0.5, 0.5, 1.0, 1.0]
    assert attn.k_proj.weight.tolist() == [[0.5] * 4, [1.0] * 4]


def test_qk_clip_brings_the_measured_max_logit_to_tau():
    torch.manual_seed(0)
    attn = Attention(d_model=16, n_heads=4, n_kv_heads=2, head_dim=4).double()
    with torch.no_grad():
        attn.q_proj.weight.mul_(100)
    core = stability.StabilityCore(4)
    attn.core = core
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    attn(x)
    before = core.max_logit.clone()
    assert before.max() > 100
    stability.qk_clip_(attn, before, tau=100.0)
    attn(x)
    shared_max = before.view(2, 2).amax(1).repeat_interleave(2)  # over the query heads of each key head
    want = torch.where(shared_max > 100, before * 100 / shared_max, before)  # their largest lands on tau
    assert torch.allclose(core.max_logit, want, rtol=1e-12)


def test_stability_core_equals_sdpa_and_records_the_max():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 6, 8, dtype=torch.float64), *torch.randn(2, 2, 2, 6, 8, dtype=torch.float64)
    core = stability.StabilityCore(8)
    assert torch.allclose(core(q, k, v), causal_attention(q, k, v), rtol=1e-12, atol=1e-14)
    s = q @ k.repeat_interleave(2, 1).transpose(-2, -1) / math.sqrt(8)
    visible = torch.ones(6, 6, dtype=torch.bool).tril()
    assert torch.equal(core.max_logit, s[..., visible].amax(dim=(0, 2)))
    capped = stability.StabilityCore(8, cap=0.5)
    capped(q, k, v)
    assert torch.equal(capped.max_logit, core.max_logit)  # recorded before the cap
    assert capped.max_logit_seen.max() < 0.5
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), -1)
    want = -(p * p.clamp(min=1e-300).log()).sum(-1).mean(dim=(0, 2))
    assert torch.allclose(core.entropy, want, rtol=1e-12)


def test_stable_loss_is_cross_entropy_plus_z_loss():
    torch.manual_seed(0)
    logits, targets = torch.randn(2, 5, 7, dtype=torch.float64), torch.randint(0, 7, (2, 5))
    loss = stability.StableLoss(z_coefficient=1e-4, cap=30.0)
    capped = 30 * torch.tanh(logits / 30)
    z = torch.logsumexp(capped, -1)
    want = F.cross_entropy(capped.reshape(-1, 7), targets.reshape(-1)) + 1e-4 * z.pow(2).mean()
    assert loss(logits, targets).item() == pytest.approx(want.item(), rel=1e-14)
    assert torch.equal(loss.log_z, torch.logsumexp(capped, -1))


def test_stable_loss_leaves_out_the_z_loss_of_ignored_targets():
    torch.manual_seed(0)
    logits, targets = torch.randn(2, 5, 7, dtype=torch.float64), torch.randint(0, 7, (2, 5))
    targets[0, :3] = -100  # e.g. a prompt's positions: no loss there, so no z-loss either
    loss = stability.StableLoss(z_coefficient=1e-4)
    z = torch.logsumexp(logits, -1)
    kept = [(b, t) for b in range(2) for t in range(5) if targets[b, t] != -100]  # 7 of the 10 positions
    want = F.cross_entropy(logits.reshape(-1, 7), targets.reshape(-1)) + 1e-4 * sum(
        float(z[b, t]) ** 2 for b, t in kept) / len(kept)
    assert loss(logits, targets).item() == pytest.approx(want.item(), rel=1e-14)
    # nothing counted: the z-loss is 0, never 0/0
    assert stability.z_loss(logits, 1e-4, torch.zeros(2, 5, dtype=torch.bool)).item() == 0.0


def test_skip_rule_is_olmo_cores():
    # OLMo-core's SkipStepOptimizer (v2.5.0): judged once max(2, 128 // 2) = 64 values are known (the last one
    # included), on the mean and sample std of those before it; only a rise above 6 std skips
    history = [1.0, 3.0] * 40  # mean 2, sample std of an even alternation of n values: sqrt(n / (n - 1))
    n = 63
    std63 = math.sqrt(sum((v - sum(history[:n]) / n) ** 2 for v in history[:n]) / (n - 1))
    mean63 = sum(history[:n]) / n
    up = mean63 + 6.5 * std63
    flat = [1.0] * 200
    assert stability_run.is_outlier(history[:n] + [up], flat[:n + 1], 6.0)      # 64 values: judged, skipped
    assert not stability_run.is_outlier(history[:n - 1] + [up], flat[:n], 6.0)  # 63 values: not judged yet
    down = mean63 - 6.5 * std63
    assert not stability_run.is_outlier(history[:n] + [down], flat[:n + 1], 6.0)  # a fall is never skipped
    assert not stability_run.is_outlier(history[:n] + [mean63 + 5.5 * std63], flat[:n + 1], 6.0)
    # the gradient norm alone can skip; a history without spread makes any rise an outlier
    assert stability_run.is_outlier(history[:n] + [2.0], flat[:n] + [1.0 + 1e-9], 6.0)
    # a short window: judged from max(2, 8 // 2) = 4 values (before 2025-01-21 OLMo-core waited for 20)
    assert stability_run.is_outlier([1.0, 3.0, 1.0, 100.0], [1.0] * 4, 6.0, window=8)
    assert not stability_run.is_outlier([1.0, 3.0, 100.0], [1.0] * 3, 6.0, window=8)
    # the window: only the 128 values before the last count (a huge early value is forgotten)
    long = [1e6] + history * 2
    assert stability_run.is_outlier(long[:130] + [up], flat[:131], 6.0) == stability_run.is_outlier(
        long[1:130] + [up], flat[:130], 6.0)


def test_rows_counted_once_over_the_tp_ranks():
    cfg = small_config(n_kv_heads=1)  # tp=2 > n_kv_heads: the KV head is copied onto both ranks
    grads = {name: torch.randn(p.shape, dtype=torch.float64) for name, p in GPT(cfg).named_parameters()}
    want = sum(float(g.pow(2).sum()) for g in grads.values())
    for tp in (1, 2, 4) if cfg.n_heads % 4 == 0 else (1, 2):
        plan = tensor_parallel.shard_plan(cfg, tp)
        got = 0.0
        for r in range(tp):
            shards = tensor_parallel.shard_state(grads, cfg, r, tp)
            weights = [sharded_clipping.rows_counted(*plan[n], r) for n in shards]
            got += float(sharded_clipping.sum_of_squares(list(shards.values()), weights))
        assert got == pytest.approx(want, rel=1e-12), f"tp={tp}"
    # without the rule every replicated tensor counts tp times: the sum is larger
    shards = [tensor_parallel.shard_state(grads, cfg, r, 2) for r in range(2)]
    naive = sum(float(g.pow(2).sum()) for s in shards for g in s.values())
    assert naive > want * (1 + 1e-3)


@ipp.interactive  # sent by value: the engines cannot import this test module
def _clipped(cfg, x, y, max_norm, wrong):
    import torch.distributed as dist

    from helpers.model import GPT
    from helpers.parallel import composition, zero
    from helpers.parallel.parallel_dims import ParallelDims
    from helpers.training import sharded_clipping

    plan = ParallelDims(pp=2, dp_shard=2, tp=2, m=2, zero=1)
    mesh = plan.mesh().make_groups()
    chunks = composition.apply(GPT(cfg, seed=0).double(), mesh, plan)
    chunk = composition.holder(chunks)
    optimizer = composition.optimizer(chunks, mesh, plan, lr=1e-3)
    dp_group, tp_group, pp_group = optimizer.group, mesh.group("tp"), mesh.group("pp")
    sum_over = {"a stage left out": [dp_group, tp_group], "each rank its own norm": []}.get(
        wrong, [dp_group, tp_group, pp_group])
    counted = sharded_clipping.counted
    if wrong == "replicated counted tp times":  # every row of every tensor, on every rank
        sharded_clipping.counted = lambda chunk, tp_group=None: dict.fromkeys(
            dict(chunk.named_parameters()), 1.0)
    norms = []
    try:
        sharded_clipping.clip_zero1(optimizer, chunk, max_norm, sum_over, tp_group=tp_group, record=norms)
    finally:
        sharded_clipping.counted = counted
    clipped = {}
    optimizer.optimizer.register_step_pre_hook(  # after the clip (hooks run in order): keep what it left
        lambda *a: clipped.update({optimizer.names[p]: zero.all_gather_rows(s.grad, p.shape[0], dp_group)
                                   for p, s in zip(optimizer.params, optimizer.shards)}))
    composition.forward_backward(chunks, mesh, plan, x, y)
    optimizer.step()
    out = composition.state(chunks, mesh, grads=False)
    out.update(grads=clipped, norm=float(norms[0]), rank=dist.get_rank())
    return out


@pytest.fixture(scope="module")
def clip_case():
    cfg = small_config(n_heads=4, n_kv_heads=2)  # tied embeddings, LayerNorm, learned positions
    x, y = seeded_batch(cfg, 8)
    reference = GPT(cfg, seed=0).double()
    reference(x, y)[1].backward()
    return cfg, x, y, reference


def test_clip_by_global_norm_on_pp_dp_tp_with_zero1_matches_clip_grad_norm(eight, clip_case):
    from helpers.parallel import composition

    cfg, x, y, reference = clip_case
    unclipped = named_grads(reference)
    total = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
    want = named_grads(reference)
    assert total > 0.1, "the case must clip"
    results = eight.apply(_clipped, cfg, x, y, 0.1, None)
    for r in results:
        assert r["norm"] == pytest.approx(float(total), rel=1e-12), f"rank {r['rank']}"
    grads, others = composition.assemble(results, cfg, "grads")
    assert_close_to_scale(grads, want, 1e-10, "clipped gradients:")
    assert_close_to_scale(others[0], {n: grads[n] for n in others[0]}, 0.0, "the other dp replica:")
    # the last stage's copy of the tied embedding was clipped by the same factor as the first stage's
    for tp in (0, 1):
        first = next(r for r in results if r["where"]["pp"] == 0 and r["where"]["tp"] == tp)
        last = next(r for r in results if r["where"]["pp"] == 1 and r["where"]["tp"] == tp
                    and r["where"]["dp_shard"] == first["where"]["dp_shard"])
        assert torch.equal(last["grads"]["lm_head.weight"], first["grads"]["tok_emb.weight"])
    assert not torch.allclose(want["blocks.0.ln1.weight"], unclipped["blocks.0.ln1.weight"])


WRONG = ["replicated counted tp times", "a stage left out", "each rank its own norm"]


@pytest.mark.parametrize("wrong", WRONG)
def test_wrong_counting_gives_another_norm(eight, clip_case, wrong):
    cfg, x, y, reference = clip_case
    total = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()])))
    norms = [r["norm"] for r in eight.apply(_clipped, cfg, x, y, 0.1, wrong)]
    assert all(abs(n - total) > 1e-6 * total for n in norms) or len({round(n, 12) for n in norms}) > 1, norms
