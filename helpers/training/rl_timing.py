"""The time of one reinforcement-learning step: rollout, training, weight update (chapter 11).

An RL step generates responses with the current policy (the rollout, ``t_R``), scores them and trains on them
(``t_T``), and moves the new weights to the generator (the weight update, ``t_W``). Run one after the other,
as a colocated design must (its devices either generate or train), a step lasts ``t_R + t_T + t_W``. With two
pools of devices the generator can produce the next batch with weights one step old while the trainer trains
on the last one: in the steady state a step lasts ``max(t_R, t_T) + t_W``, and every sample is trained on by
a policy one step newer than the one that generated it (its staleness).

A rollout lasts as long as its longest response: the engine decodes every unfinished response one token per
decode step, and runs ``max(lengths)`` steps. A decode step is modelled as the slower of its memory traffic
and its arithmetic: it reads the weights once (``decode_s``) and each unfinished response's cache of keys and
values (``kv_s_per_token`` per cached token: at step ``t`` a response holds ``t`` tokens of its own), and
computes one token for each unfinished response (``compute_s_per_token``). With ``u_t`` responses unfinished
at step ``t``,

    t_R = sum over t = 1 .. max(lengths) of
          max(decode_s + kv_s_per_token * t * u_t, compute_s_per_token * u_t),

which is ``decode_s * max(lengths)`` when the last two are zero. Training costs every token, ``t_T =
train_s_per_token * sum(lengths)``. Response lengths have long tails, so ``t_R`` grows with the batch and with
the tail.

:func:`simulate` plays the pools' timelines step by step from each step's ``t_R`` and ``t_T``, for any bound
on the staleness; :func:`closed_form` is the makespan when every step costs the same, which the simulator must
reproduce exactly; :class:`RLCosts` turns response lengths into ``t_R`` and ``t_T``; :func:`lognormal_lengths`
draws lengths with a given mean and tail.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RLCosts:
    """What a step's rollout and training cost, given its responses' lengths (in tokens)."""

    decode_s: float            # a decode step's read of the weights (a token for every unfinished response)
    train_s_per_token: float   # the trainer's seconds per token (forward and backward, and the log-probs)
    update_s: float            # moving the new weights from the trainer to the generator
    kv_s_per_token: float = 0.0       # a decode step's read of one cached token's keys and values
    compute_s_per_token: float = 0.0  # a decode step's arithmetic for one unfinished response

    def __post_init__(self):
        for name in ("decode_s", "train_s_per_token", "update_s", "kv_s_per_token", "compute_s_per_token"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be non-negative, got {getattr(self, name)}")

    def rollout_s(self, lengths) -> float:
        """The longest response sets how many decode steps run; each step is the slower of reading the
        weights and the unfinished responses' caches, and computing their next tokens."""
        import numpy as np

        lengths = np.sort(np.asarray(lengths))
        t = np.arange(1, int(lengths[-1]) + 1)
        unfinished = len(lengths) - np.searchsorted(lengths, t, side="left")  # responses with length >= t
        memory = self.decode_s + self.kv_s_per_token * t * unfinished
        return float(np.maximum(memory, self.compute_s_per_token * unfinished).sum())

    def train_s(self, lengths) -> float:
        """Training reads every token once."""
        return self.train_s_per_token * sum(lengths)


def lognormal_lengths(rng, n: int, mean: float, sigma: float, max_len: int | None = None) -> list[int]:
    """``n`` response lengths, lognormal with mean ``mean`` tokens and log-standard-deviation ``sigma`` (the
    tail: 0 gives every response the mean's length), rounded to whole tokens, at least one, and cut at
    ``max_len`` when given (an engine's limit on new tokens). ``rng`` is a ``numpy.random.Generator``."""
    if mean < 1 or sigma < 0 or n < 1:
        raise ValueError(f"need n >= 1, mean >= 1 and sigma >= 0, got n={n}, mean={mean}, sigma={sigma}")
    import numpy as np

    mu = math.log(mean) - sigma ** 2 / 2  # a lognormal's mean is exp(mu + sigma^2 / 2)
    lengths = np.maximum(1, np.rint(rng.lognormal(mu, sigma, n))) if sigma else np.full(n, round(mean))
    return np.minimum(lengths, max_len if max_len else lengths.max()).astype(int).tolist()


# --------------------------------------------------------------------------------------------- the timelines

@dataclass(frozen=True)
class Event:
    """One interval on one pool: ``kind`` is "rollout", "train" or "update"; ``step`` the batch it serves (for
    an update, the training step whose weights it moves)."""

    pool: str
    kind: str
    step: int
    start: float
    end: float


@dataclass
class Timeline:
    events: list[Event]
    staleness: list[int]   # per batch: how many steps older the generating policy is than the trainer's
    makespan: float = 0.0
    pools: tuple = ()
    steps: int = 0

    @property
    def mean_step_s(self) -> float:
        return self.makespan / self.steps

    def busy_s(self, pool: str) -> float:
        return sum(e.end - e.start for e in self.events if e.pool == pool)

    def ends(self, kind: str) -> list[float]:
        """When each step's ``kind`` event ended, in step order."""
        return [e.end for e in sorted((e for e in self.events if e.kind == kind), key=lambda e: e.step)]


@dataclass
class _Pools:
    events: list = field(default_factory=list)

    def run(self, pool, kind, step, start, seconds):
        self.events.append(Event(pool, kind, step, start, start + seconds))
        return start + seconds


def simulate(rollout_s, train_s, update_s: float, staleness: int = 0, colocated: bool = False) -> Timeline:
    """The timeline of ``len(rollout_s)`` RL steps, step ``j`` generating in ``rollout_s[j]`` and training in
    ``train_s[j]`` seconds, each update taking ``update_s``.

    ``colocated``: one pool does everything in turn (rollout, training, resharding the weights for the next
    rollout). Otherwise a generator pool and a trainer pool: batch ``j`` is generated with the weights of
    training step ``j - staleness`` (the first ``staleness + 1`` batches with the initial ones), so the
    generator may run ``staleness`` batches ahead. An update needs both pools: the trainer to have finished
    the step and the generator to be between batches (it finishes the last batch that needs older weights).
    Step ``j``'s training starts once its batch is generated and the trainer has sent the weights before it.
    """
    n = len(rollout_s)
    if n != len(train_s) or n == 0:
        raise ValueError(f"need as many rollout times as training times, at least one: {n} and "
                         f"{len(train_s)}")
    if staleness < 0:
        raise ValueError(f"staleness must be at least 0, got {staleness}")
    if colocated and staleness:
        raise ValueError("a colocated design cannot generate while it trains: its staleness is 0, got "
                         f"{staleness}")
    p = _Pools()
    if colocated:
        t = 0.0
        for j in range(n):
            t = p.run("all devices", "rollout", j, t, rollout_s[j])
            t = p.run("all devices", "train", j, t, train_s[j])
            t = p.run("all devices", "update", j, t, update_s)
        return Timeline(p.events, _staleness(p.events, "all devices"), t, ("all devices",), n)
    s = staleness
    gen_end, train_end, update_end = [0.0] * n, [0.0] * n, {0: 0.0}  # weights 0 are on the generator at 0

    def generate(j):  # batch j needs the generator free and the weights of step max(0, j - s)
        start = max(gen_end[j - 1] if j else 0.0, update_end[max(0, j - s)])
        gen_end[j] = p.run("generator", "rollout", j, start, rollout_s[j])

    def update(i):  # the weights after training step i - 1 replace those that batch i - 1 + s was made with
        start = max(train_end[i - 1], gen_end[min(i - 1 + s, n - 1)])
        update_end[i] = p.run("trainer", "update", i - 1, start, update_s)
        p.run("generator", "update", i - 1, start, update_s)

    for j in range(min(s, n)):
        generate(j)
    for j in range(n):
        if j:
            update(j)
        if j + s < n:
            generate(j + s)
        start = max(gen_end[j], update_end[j])
        train_end[j] = p.run("trainer", "train", j, start, train_s[j])
    update(n)
    return Timeline(p.events, _staleness(p.events, "generator"), update_end[n], ("generator", "trainer"), n)


def _staleness(events, pool: str) -> list[int]:
    """Batch j's staleness, read off the timeline: j minus the updates the generating pool had received when
    the batch's rollout began (the weights of training step j are the newest it could have)."""
    updates = [e.end for e in events if e.pool == pool and e.kind == "update"]
    starts = sorted((e.step, e.start) for e in events if e.pool == pool and e.kind == "rollout")
    return [j - sum(1 for end in updates if end <= start) for j, start in starts]


def closed_form(t_r: float, t_t: float, t_w: float, n: int, staleness: int = 0) -> float:
    """The makespan of ``n`` steps that all cost the same: ``n (t_R + t_T + t_W)`` synchronously; with one
    step of staleness ``n (max(t_R, t_T) + t_W) + min(t_R, t_T)`` (the first rollout and the last training
    step cannot overlap anything)."""
    if staleness == 0:
        return n * (t_r + t_t + t_w)
    if staleness == 1:
        return n * (max(t_r, t_t) + t_w) + min(t_r, t_t)
    raise ValueError(f"the closed form covers staleness 0 and 1, got {staleness}")


def steady_step_s(t_r: float, t_t: float, t_w: float, staleness: int = 0) -> float:
    """The time of one step in the steady state: ``t_R + t_T + t_W``, or ``max(t_R, t_T) + t_W`` when the
    generator may run at least one step ahead."""
    return t_r + t_t + t_w if staleness == 0 else max(t_r, t_t) + t_w


def simulate_lengths(costs: RLCosts, batches, staleness: int = 0, colocated: bool = False) -> Timeline:
    """:func:`simulate` for a list of batches, each a list of response lengths."""
    return simulate([costs.rollout_s(b) for b in batches], [costs.train_s(b) for b in batches],
                    costs.update_s, staleness, colocated)


__all__ = ["RLCosts", "lognormal_lengths", "Event", "Timeline", "simulate", "closed_form", "steady_step_s",
           "simulate_lengths"]
