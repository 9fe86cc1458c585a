"""Chapter 11's cost model of an RL step: the simulator against its closed forms, bounds and refusals."""

import random

import numpy as np
import pytest

from helpers.training import rl_timing


def no_overlap(timeline):
    """No pool does two things at once, and every event takes the time it was given."""
    for pool in timeline.pools:
        events = sorted((e for e in timeline.events if e.pool == pool), key=lambda e: e.start)
        for a, b in zip(events, events[1:]):
            assert a.end <= b.start + 1e-12, f"{pool}: {a} overlaps {b}"


@pytest.mark.parametrize("t_r, t_t", [(3.0, 1.0), (1.0, 3.0), (2.0, 2.0), (0.0, 1.5)])
@pytest.mark.parametrize("staleness", [0, 1])
def test_equal_steps_give_the_closed_form(t_r, t_t, staleness):
    for n in (1, 2, 7):
        timeline = rl_timing.simulate([t_r] * n, [t_t] * n, 0.5, staleness)
        want = rl_timing.closed_form(t_r, t_t, 0.5, n, staleness)
        assert timeline.makespan == pytest.approx(want, rel=1e-12)
        no_overlap(timeline)


def test_colocated_is_the_sum_and_keeps_one_pool():
    timeline = rl_timing.simulate([1.0, 2.0, 4.0], [0.5, 0.25, 1.0], 0.125, colocated=True)
    assert timeline.makespan == 1.0 + 2.0 + 4.0 + 0.5 + 0.25 + 1.0 + 3 * 0.125
    assert timeline.pools == ("all devices",) and timeline.staleness == [0, 0, 0]
    assert [e.kind for e in timeline.events[:3]] == ["rollout", "train", "update"]
    no_overlap(timeline)


@pytest.mark.parametrize("staleness", [1, 2, 3])
def test_steady_state_step_is_max_plus_update(staleness):
    for t_r, t_t in ((3.0, 1.0), (1.0, 3.0)):
        ends = rl_timing.simulate([t_r] * 30, [t_t] * 30, 0.5, staleness).ends("train")
        periods = [b - a for a, b in zip(ends, ends[1:])][5:20]
        assert periods == pytest.approx([rl_timing.steady_step_s(t_r, t_t, 0.5, staleness)] * len(periods))
    assert rl_timing.steady_step_s(3.0, 1.0, 0.5) == 4.5


@pytest.mark.parametrize("staleness", [0, 1, 2, 4])
def test_staleness_is_recorded_and_the_generator_waits_for_its_weights(staleness):
    rng = random.Random(staleness)
    rollout, train = [rng.uniform(0, 3) for _ in range(12)], [rng.uniform(0, 3) for _ in range(12)]
    timeline = rl_timing.simulate(rollout, train, 0.25, staleness)
    assert timeline.staleness == [min(j, staleness) for j in range(12)]
    gen = {e.step: e for e in timeline.events if e.pool == "generator" and e.kind == "rollout"}
    updates = {e.step + 1: e.end for e in timeline.events if e.pool == "trainer" and e.kind == "update"}
    trains = {e.step: e for e in timeline.events if e.kind == "train"}
    for j in range(12):
        version = max(0, j - staleness)  # batch j uses the weights after training step version - 1
        assert gen[j].start >= (updates[version] if version else 0.0) - 1e-12
        assert trains[j].start >= gen[j].end - 1e-12  # a batch is trained on only once generated
        assert trains[j].end - trains[j].start == pytest.approx(train[j])
    no_overlap(timeline)
    # both pools take part in every update, at the same moment
    by_pool = {p: sorted((e.start, e.end) for e in timeline.events if e.pool == p and e.kind == "update")
               for p in timeline.pools}
    assert by_pool["generator"] == by_pool["trainer"] and len(by_pool["trainer"]) == 12


def test_random_steps_lie_between_the_bounds():
    rng = random.Random(0)
    for trial in range(20):
        n = rng.randint(1, 40)
        rollout, train = [rng.expovariate(1.0) for _ in range(n)], [rng.expovariate(0.7) for _ in range(n)]
        sync = rl_timing.simulate(rollout, train, 0.3, 0).mean_step_s
        stale = rl_timing.simulate(rollout, train, 0.3, 1).mean_step_s
        assert sync == pytest.approx((sum(rollout) + sum(train)) / n + 0.3)
        assert max(sum(rollout), sum(train)) / n + 0.3 - 1e-12 <= stale <= sync + 1e-12


def test_costs_follow_the_longest_response_and_every_token():
    costs = rl_timing.RLCosts(decode_s=0.01, train_s_per_token=0.001, update_s=1.0)
    assert costs.rollout_s([3, 100, 7]) == pytest.approx(1.0)
    assert costs.train_s([3, 100, 7]) == pytest.approx(0.11)
    timeline = rl_timing.simulate_lengths(costs, [[10, 20], [30]], staleness=0)
    assert timeline.makespan == pytest.approx(0.2 + 0.03 + 0.3 + 0.03 + 2 * 1.0)


def test_a_decode_step_is_the_slower_of_its_reads_and_its_arithmetic_by_hand():
    # [3, 1, 1]: step 1 reads the weights (1) and 3 caches of 1 token (0.75), step 2 one of 2, step 3 one of 3
    assert rl_timing.RLCosts(1.0, 0.0, 0.0, kv_s_per_token=0.25).rollout_s([3, 1, 1]) == pytest.approx(5.0)
    # [2, 1]: reads 1 + 0.5·2 = 2 then 1 + 0.5·2 = 2; computing 1.5 a response makes step 1 take 3
    assert rl_timing.RLCosts(1.0, 0.0, 0.0, kv_s_per_token=0.5).rollout_s([2, 1]) == pytest.approx(4.0)
    with_arithmetic = rl_timing.RLCosts(1.0, 0.0, 0.0, 0.5, compute_s_per_token=1.5)
    assert with_arithmetic.rollout_s([2, 1]) == pytest.approx(5.0)


def test_lognormal_lengths_have_the_mean_asked_for_and_obey_the_cap():
    rng = np.random.default_rng(0)
    lengths = rl_timing.lognormal_lengths(rng, 200_000, mean=500, sigma=1.0)
    assert all(isinstance(n, int) and n >= 1 for n in lengths[:1000])
    standard_error = np.std(lengths) / np.sqrt(len(lengths))
    assert abs(np.mean(lengths) - 500) < 4 * standard_error
    assert rl_timing.lognormal_lengths(rng, 5, mean=300, sigma=0) == [300] * 5
    capped = rl_timing.lognormal_lengths(rng, 10_000, mean=500, sigma=1.5, max_len=2000)
    assert max(capped) == 2000


def test_refusals_name_the_problem():
    with pytest.raises(ValueError, match="colocated design cannot generate while it trains"):
        rl_timing.simulate([1.0], [1.0], 0.1, staleness=1, colocated=True)
    with pytest.raises(ValueError, match="as many rollout times as training times"):
        rl_timing.simulate([1.0, 2.0], [1.0], 0.1)
    with pytest.raises(ValueError, match="staleness must be at least 0"):
        rl_timing.simulate([1.0], [1.0], 0.1, staleness=-1)
    with pytest.raises(ValueError, match="decode_s must be non-negative"):
        rl_timing.RLCosts(decode_s=-1.0, train_s_per_token=0.0, update_s=0.0)
    with pytest.raises(ValueError, match="closed form covers staleness 0 and 1"):
        rl_timing.closed_form(1.0, 1.0, 0.1, 3, staleness=2)
    with pytest.raises(ValueError, match="sigma >= 0"):
        rl_timing.lognormal_lengths(np.random.default_rng(0), 3, mean=10, sigma=-0.5)
