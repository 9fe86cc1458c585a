"""The RL objectives of chapter 14 (helpers.training.rl_objectives) on numbers worked out by hand, the KL
estimators against exact expectations, the refusals of bad input, and the tiny RL run (helpers.training.grpo):
its reward, its sampling, and one data-parallel step on two ranks against one process (fp64: the ranks sum
their terms in another order, so within 1e-10 of each tensor's largest entry, not bit for bit)."""

import functools
import math

import ipyparallel as ipp
import pytest
import torch

from conftest import assert_close_to_scale
from helpers.model import GPT, GPTConfig
from helpers.reference import named_grads, named_params
from helpers.training import grpo
from helpers.training import rl_objectives as rl

F64 = dict(dtype=torch.float64)
# Four responses to a prompt with one right answer, and four responses to another, all right (no signal)
REWARDS = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0], **F64)


def close(got, want, tol=1e-12):
    want = torch.as_tensor(want, **F64)
    assert got.shape == want.shape, f"shape {tuple(got.shape)}, want {tuple(want.shape)}"
    assert torch.allclose(got.double(), want, rtol=0, atol=tol), f"got {got.tolist()}, want {want.tolist()}"


# ---- advantages -------------------------------------------------------------------------------------------


def test_grpo_dr_grpo_rloo_on_four_responses():
    # prompt 1: mean 1/4, sample std sqrt((3/4)^2 + 3 (1/4)^2) / 3) = 1/2; prompt 2: all equal, no signal
    close(rl.grpo_advantages(REWARDS, 4), [0.75 / (0.5 + 1e-6), -0.25 / (0.5 + 1e-6), -0.25 / (0.5 + 1e-6),
                                           -0.25 / (0.5 + 1e-6), 0, 0, 0, 0])
    close(rl.dr_grpo_advantages(REWARDS, 4), [0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0])
    # r_i minus the mean of the other three: 1 - 0, 0 - 1/3
    close(rl.rloo_advantages(REWARDS, 4), [1, -1 / 3, -1 / 3, -1 / 3, 0, 0, 0, 0])


def test_reinforce_pp_normalises_over_the_whole_batch():
    mask = torch.ones(8, 1, **F64)
    # five 1s and three 0s: mean 5/8, sample variance (5 (3/8)^2 + 3 (5/8)^2) / 7 = 15/56
    std = math.sqrt(15 / 56)
    want = [(1 - 5 / 8) / (std + 1e-6) if r else (0 - 5 / 8) / (std + 1e-6) for r in REWARDS.tolist()]
    close(rl.reinforce_pp_advantages(REWARDS, mask)[:, 0], want)
    # with the prompt's mean as a baseline first: [3/4, -1/4, -1/4, -1/4, 0, 0, 0, 0], mean 0, variance
    # (9/16 + 3/16) / 7
    std = math.sqrt(0.75 / 7)
    want = [x / (std + 1e-6) for x in (0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0)]
    close(rl.reinforce_pp_advantages(REWARDS, mask, responses_per_prompt=4)[:, 0], want)
    # padding gets no advantage, and longer responses weigh more in the token statistics
    mask = torch.tensor([[1, 1], [1, 0]], **F64)
    got = rl.reinforce_pp_advantages(torch.tensor([1.0, 0.0], **F64), mask)
    std = math.sqrt((2 * (1 / 3) ** 2 + (2 / 3) ** 2) / 2)  # tokens 1, 1, 0: mean 2/3
    close(got, [[(1 / 3) / (std + 1e-6)] * 2, [(-2 / 3) / (std + 1e-6), 0]])


def test_gae_by_hand():
    r = torch.tensor([[0.0, 0.0, 1.0]], **F64)
    v = torch.tensor([[0.5, 0.6, 0.7]], **F64)
    # delta = (0 + .9 * .6 - .5, 0 + .9 * .7 - .6, 1 - .7) = (.04, .03, .3); A_t = delta_t + .72 A_{t+1}
    a, ret = rl.gae(r, v, gamma=0.9, lam=0.8)
    close(a, [[0.04 + 0.72 * (0.03 + 0.72 * 0.3), 0.03 + 0.72 * 0.3, 0.3]])
    close(ret, a + v)
    _, ret = rl.gae(r, v, gamma=0.9, lam=1.0)  # lam = 1: the return is the discounted sum of rewards
    close(ret, [[0.81, 0.9, 1.0]])


def test_gae_matches_the_sum_of_discounted_deltas():
    gen = torch.Generator().manual_seed(0)
    r, v = torch.rand(3, 6, generator=gen, **F64), torch.rand(3, 6, generator=gen, **F64)
    gamma, lam = 0.95, 0.9
    nxt = torch.cat([v[:, 1:], torch.zeros(3, 1, **F64)], dim=1)
    delta = r + gamma * nxt - v
    want = torch.stack([sum((gamma * lam) ** (k - t) * delta[:, k] for k in range(t, 6))
                        for t in range(6)], dim=1)
    close(rl.gae(r, v, gamma, lam)[0], want)


# ---- per-token losses -------------------------------------------------------------------------------------


def _loss_and_grad(fn, ratio, advantages, **kw):
    # log-probabilities away from 0: at log pi = 0 a term A log pi d(weight) would vanish and hide a weight
    # left undetached (CISPO)
    logp = torch.full((len(ratio), 1), -0.7, **F64, requires_grad=True)
    old = logp.detach() - torch.log(torch.tensor(ratio, **F64))[:, None]
    loss = fn(logp, old, torch.tensor(advantages, **F64), **kw)
    loss.sum().backward()
    return loss.detach()[:, 0], logp.grad[:, 0]


def test_ppo_clip_symmetric_clip_higher_and_dual_clip():
    ratio, adv = [1.5, 0.5, 5.0, 1.1, 1.25], [1.0, -1.0, -1.0, 2.0, 1.0]
    loss, grad = _loss_and_grad(rl.ppo_clip_loss, ratio, adv)
    # min(rho A, clip(rho) A): 1.2 (clipped), -0.8 (clipped), -5, 2.2, 1.2 (clipped), negated
    close(loss, [-1.2, 0.8, 5.0, -2.2, -1.2])
    close(grad, [0, 0, 5.0, -2.2, 0])  # d/dlogp of -rho A is -rho A where not clipped
    loss, grad = _loss_and_grad(rl.ppo_clip_loss, ratio, adv, eps_high=0.28)  # DAPO's clip-higher
    close(loss, [-1.28, 0.8, 5.0, -2.2, -1.25])
    close(grad, [0, 0, 5.0, -2.2, -1.25])  # 1.25 is inside [0.8, 1.28]: it learns
    loss, grad = _loss_and_grad(rl.ppo_clip_loss, ratio, adv, dual_clip=3.0)
    close(loss, [-1.2, 0.8, 3.0, -2.2, -1.2])  # a negative advantage costs at most c |A|
    close(grad, [0, 0, 0, -2.2, 0])
    with pytest.raises(ValueError, match="dual clip c must exceed 1, got 0.5"):
        rl.ppo_clip_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1), dual_clip=0.5)


def test_cispo_keeps_the_gradient_of_clipped_tokens():
    loss, grad = _loss_and_grad(rl.cispo_loss, [1.5, 0.5, 1.1], [1.0, -1.0, 2.0], eps_high=0.28)
    close(grad, [-1.28, 0.5, -2.2])  # -sg(clip(rho)) A, no lower bound: 0.5 stays 0.5
    _, grad = _loss_and_grad(rl.cispo_loss, [1.5, 0.5, 1.1], [1.0, -1.0, 2.0], eps_high=0.28, eps_low=0.2)
    close(grad, [-1.28, 0.8, -2.2])
    # and the loss itself: -sg(clip(rho)) A log pi, with log pi = -0.7
    close(loss, [-1.28 * 1.0 * -0.7, 0.5 * 1.0 * -0.7, -1.1 * 2.0 * -0.7])


def test_aggregation_of_a_response_without_tokens_is_never_nan():
    # TRL's choice: the empty response adds 0 and still counts in B (verl would leave it out of the count)
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]], **F64)
    loss = torch.tensor([[2.0, 4.0, 9.0], [5.0, 5.0, 5.0]], **F64, requires_grad=True)
    close(rl.aggregate(loss, mask, "seq-mean-token-mean").detach(), (2 + 4) / 2 / 2)
    close(rl.token_weights(mask, "seq-mean-token-mean"), [[1 / 4, 1 / 4, 0], [0, 0, 0]])
    close(rl.aggregate(loss, mask, "token-mean").detach(), (2 + 4) / 2)
    none = torch.zeros(2, 3, **F64)
    for mode in ("seq-mean-token-mean", "token-mean"):
        close(rl.aggregate(loss, none, mode).detach(), 0.0)
        close(rl.token_weights(none, mode), torch.zeros(2, 3, **F64))


def test_gspo_one_ratio_per_response():
    logp = torch.zeros(2, 2, **F64, requires_grad=True)
    old = -torch.tensor([[0.1, 0.3], [-1e-4, 0.0]], **F64)  # log-ratios; response 2 has one token
    mask = torch.tensor([[1, 1], [1, 0]], **F64)
    adv = torch.tensor([1.0, -2.0], **F64)
    loss = rl.gspo_loss(logp, old, adv, mask)
    s1, s2 = math.exp(0.2), math.exp(-1e-4)  # exp of the mean log-ratio
    assert s1 > 1 + 4e-4 and 1 - 3e-4 < s2 < 1 + 4e-4
    close(loss.detach(), [[-(1 + 4e-4)] * 2, [2 * s2] * 2])  # response 1 clipped at 1 + 4e-4
    rl.aggregate(loss, mask, "seq-mean-token-mean").backward()
    # response 1: clipped, no gradient; response 2: d(2 s2)/dlogp = 2 s2 / |y| on its token, halved by
    # the mean over the two responses
    close(logp.grad, [[0, 0], [s2, 0]])


# ---- aggregation ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode, want", [("seq-mean-token-mean", [[1 / 2, 0, 0], [1 / 6, 1 / 6, 1 / 6]]),
                                        ("token-mean", [[1 / 4, 0, 0], [1 / 4, 1 / 4, 1 / 4]]),
                                        ("seq-mean-token-sum-norm", [[1 / 8, 0, 0], [1 / 8, 1 / 8, 1 / 8]])])
def test_aggregation_weights_by_hand(mode, want):
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]], **F64)  # lengths 1 and 3; max_len 4
    loss = torch.ones(2, 3, **F64, requires_grad=True)
    rl.aggregate(loss, mask, mode, max_len=4).backward()
    close(loss.grad, want)
    close(rl.token_weights(mask, mode, max_len=4), want)


def test_aggregation_refuses_unknown_modes_and_a_missing_constant():
    with pytest.raises(ValueError, match="'seq-sum' is not one of"):
        rl.aggregate(torch.ones(1, 1), torch.ones(1, 1), "seq-sum")
    with pytest.raises(ValueError, match="give max_len"):
        rl.aggregate(torch.ones(1, 1), torch.ones(1, 1), "seq-mean-token-sum-norm")


def test_dapo_overlong_penalty_and_dynamic_sampling():
    close(rl.overlong_penalty(torch.tensor([10, 16, 18, 20, 25]), max_len=20, cache_len=4),
          [0, 0, -0.5, -1, -1])
    assert rl.informative_prompts(REWARDS, 4).tolist() == [True, False]
    with pytest.raises(ValueError, match=r"cache_len=0 must be in \(0, max_len=20\]"):
        rl.overlong_penalty(torch.tensor([1]), 20, 0)


# ---- bad input --------------------------------------------------------------------------------------------


def test_responses_per_prompt_that_do_not_divide_the_batch_are_refused():
    for fn in (rl.grpo_advantages, rl.dr_grpo_advantages, rl.rloo_advantages, rl.informative_prompts):
        with pytest.raises(ValueError, match="a batch of 8 rewards .* into prompts of 3 responses each"):
            fn(REWARDS, 3)
        with pytest.raises(ValueError, match="at least 2 responses per prompt, got responses_per_prompt=1"):
            fn(REWARDS, 1)


def test_equal_rewards_give_exactly_zero_advantage_never_nan():
    for rewards in (torch.ones(4, **F64), torch.zeros(4, **F64), torch.full((3,), 0.1, **F64)):
        for fn in (rl.grpo_advantages, rl.dr_grpo_advantages, rl.rloo_advantages):
            a = fn(rewards, rewards.numel())
            assert torch.equal(a, torch.zeros_like(a)), f"{fn.__name__}({rewards.tolist()}) = {a.tolist()}"


# ---- KL estimators and importance weights ----------------------------------------------------------------


def test_kl_estimators_by_hand():
    logp, ref = torch.log(torch.tensor([0.5], **F64)), torch.log(torch.tensor([0.25], **F64))  # r = 1/2
    close(rl.kl_k1(logp, ref), [math.log(2)])
    close(rl.kl_k2(logp, ref), [0.5 * math.log(2) ** 2])
    close(rl.kl_k3(logp, ref), [(0.5 - 1) + math.log(2)])


def _categoricals():
    gen = torch.Generator().manual_seed(0)
    theta = torch.randn(10, generator=gen, **F64).requires_grad_()
    ref_logp = torch.log_softmax(torch.randn(10, generator=gen, **F64), 0)
    return theta, ref_logp


def test_k1_and_k3_are_unbiased_k2_is_not():
    theta, ref_logp = _categoricals()
    logp = torch.log_softmax(theta, 0).detach()
    q = logp.exp()
    kl = (q * (logp - ref_logp)).sum()
    assert abs(float((q * rl.kl_k1(logp, ref_logp)).sum() - kl)) < 1e-14
    assert abs(float((q * rl.kl_k3(logp, ref_logp)).sum() - kl)) < 1e-14
    assert abs(float((q * rl.kl_k2(logp, ref_logp)).sum() - kl)) > 1e-3


def test_kl_estimators_as_losses_give_these_gradients_in_expectation():
    theta, ref_logp = _categoricals()

    def grad(f):
        theta.grad = None
        f().backward()
        return theta.grad.clone()

    def expected(k):  # E_{x ~ pi}[grad k(x)]: the samples' probabilities are not differentiated
        logp = torch.log_softmax(theta, 0)
        return (logp.exp().detach() * k(logp, ref_logp)).sum()

    reverse = grad(lambda: (torch.softmax(theta, 0) * (torch.log_softmax(theta, 0) - ref_logp)).sum())
    forward = grad(lambda: (ref_logp.exp() * (ref_logp - torch.log_softmax(theta, 0))).sum())
    close(grad(lambda: expected(rl.kl_k1)), torch.zeros(10), 1e-14)  # the score has mean 0
    close(grad(lambda: expected(rl.kl_k2)), reverse, 1e-14)  # KL(pi || ref), the one intended
    close(grad(lambda: expected(rl.kl_k3)), forward, 1e-14)  # GRPO's: KL(ref || pi), the other direction
    assert (forward - reverse).norm() > 0.1 * reverse.norm()


def test_truncated_and_masked_importance_weights():
    train = torch.log(torch.tensor([0.3, 0.1, 0.5], **F64))
    rollout = torch.log(torch.tensor([0.1, 0.1, 0.6], **F64))  # ratios 3, 1, 5/6
    close(rl.tis_weights(train, rollout, cap=2.0), [2.0, 1.0, 5 / 6])
    close(rl.mis_weights(train, rollout, low=0.5, high=2.0), [0.0, 1.0, 5 / 6])


# ---- the tiny RL run --------------------------------------------------------------------------------------

CFG = GPTConfig(vocab_size=13, seq_len=8, n_layers=1, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64)


def test_answers_rewards_and_masks():
    ab = torch.tensor([[3, 4], [9, 8], [0, 0]])
    assert grpo.answers(ab).tolist() == [[7, 12, 12], [1, 7, 12], [0, 12, 12]]  # 12 is the newline
    responses = torch.tensor([[7, 12, 5], [1, 7, 12], [0, 0, 12], [1, 7, 3]])
    close(grpo.response_mask(responses), [[1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 1, 1]])
    # what follows the newline does not count; "00" is not "0"; "17" without its newline is not an answer
    ab = torch.tensor([[3, 4], [9, 8], [0, 0], [9, 8]])
    close(grpo.rewards(responses, ab), [1, 1, 0, 0])


def test_sampling_depends_on_the_noise_not_on_the_batch():
    model = GPT(CFG, seed=0).double()
    ab = grpo.problems(6, seed=1)
    noise = grpo.rollout_noise(0, 3, range(4), 6)  # (6 prompts, 4 members, 3 tokens)
    p = grpo.prompts(ab).repeat_interleave(4, dim=0)
    whole = grpo.sample(model, p, noise.flatten(0, 1)).view(6, 4, -1)
    halves = [grpo.sample(model, grpo.prompts(ab).repeat_interleave(2, dim=0),
                          grpo.rollout_noise(0, 3, members, 6).flatten(0, 1)).view(6, 2, -1)
              for members in (range(0, 2), range(2, 4))]
    assert torch.equal(torch.cat(halves, dim=1), whole)


def test_expected_reward_is_the_probability_of_the_right_answer():
    model = GPT(CFG, seed=0).double()
    ab = torch.tensor([[2, 3]])
    right = grpo.answers(ab)  # "5\n"
    with torch.no_grad():
        logits = model(torch.cat([grpo.prompts(ab), right[:, :1]], dim=1))
    probs = torch.softmax(logits, dim=-1)
    want = probs[0, 3, 5] * probs[0, 4, grpo.NEWLINE]
    assert abs(grpo.expected_reward(model, ab) - float(want)) < 1e-15


@ipp.interactive  # sent by value: the engines cannot import this test module
def _data_parallel(cfg, state, algo, steps, n_prompts, per_prompt):
    import torch
    import torch.distributed as dist

    from helpers.model import GPT
    from helpers.reference import named_grads, named_params
    from helpers.training import grpo

    model = GPT(cfg, seed=0).double()
    model.load_state_dict(state)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    out = [grpo.rl_step(model, optimizer, algo, step, n_prompts=n_prompts, responses_per_prompt=per_prompt,
                        group=dist.group.WORLD) for step in range(steps)]
    return named_params(model), named_grads(model), [o["losses"] for o in out], [o["responses"] for o in out]


@functools.cache
def _warm_state():
    """The policy every run starts from, warm-started here once and sent to the ranks (a random one never
    answers right, and would give every prompt equal rewards: nothing to compare)."""
    model = GPT(CFG, seed=0).double()
    grpo.warm_start(model, 60, 64, 1e-2)
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("algo", [grpo.GRPO, grpo.DAPO], ids=lambda a: a.name)
def test_data_parallel_rl_step_matches_one_process(ranks, algo):
    steps, n_prompts, per_prompt = 2, 8, 4
    state = _warm_state()
    model = GPT(CFG, seed=0).double()
    model.load_state_dict(state)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    single = [grpo.rl_step(model, optimizer, algo, step, n_prompts=n_prompts, responses_per_prompt=per_prompt)
              for step in range(steps)]
    assert all(s["informative"] > 0 for s in single), "all rewards equal per prompt: a vacuous test"
    results = ranks.apply(_data_parallel, CFG, state, algo, steps, n_prompts, per_prompt)
    for step in range(steps):
        union = torch.cat([r[3][step].view(n_prompts, per_prompt // 2, -1) for r in results], dim=1)
        assert torch.equal(union.flatten(0, 1), single[step]["responses"]), f"step {step}: rollouts differ"
    for params, grads, losses, _ in results:
        assert_close_to_scale(params, named_params(model), rtol=1e-10, what=f"{algo.name} parameters")
        assert_close_to_scale(grads, named_grads(model), rtol=1e-10, what=f"{algo.name} last gradients")
        got, want = torch.tensor(losses, **F64), torch.tensor([s["losses"] for s in single], **F64)
        assert torch.allclose(got, want, rtol=1e-10, atol=1e-12), (
            f"losses {got.tolist()}, want {want.tolist()}")


@ipp.interactive
def _odd_split(cfg):
    import torch
    import torch.distributed as dist

    from helpers.model import GPT
    from helpers.training import grpo

    model = GPT(cfg, seed=0)
    try:
        grpo.rl_step(model, torch.optim.AdamW(model.parameters()), grpo.GRPO, 0, n_prompts=2,
                     responses_per_prompt=3, group=dist.group.WORLD)
    except ValueError as err:
        return str(err)


def test_rl_step_refuses_responses_that_do_not_split_over_the_ranks(ranks):
    for message in ranks.apply(_odd_split, CFG):
        assert message == "3 responses per prompt do not split evenly over 2 ranks"
