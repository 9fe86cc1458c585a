"""Pipeline schedules as data (chapter 06): generate them, check them, and simulate them under a cost model.

A schedule says, for every rank, the ordered list of :class:`Action` s it runs: the forward of micro-batch
``i`` through model chunk ``c`` (``F``), its whole backward (``B``), or, for zero-bubble schedules, the
backward split in two, the gradient of the chunk's input (``I``, the zero-bubble paper's "B") and the gradient
of its weights (``W``). The model is cut into ``n_chunks`` chunks along its depth; ``placement[c]`` is the
rank that runs chunk ``c``: one chunk per rank for GPipe, 1F1B and ZB-H1, ``v`` chunks per rank, round robin,
for the interleaved schedule.

- :func:`gpipe` (Huang et al. 2019), :func:`one_f_one_b` (PipeDream-Flush, Narayanan et al. 2021),
  :func:`interleaved_1f1b` (Narayanan et al. 2021, SC) and :func:`zb_h1` (Qi et al. 2024) generate schedules.
- :func:`validate` checks one statically, before any rank runs it: every action present once, every backward
  after its forward on that rank, and a deadlock-free order, found by simulating it. A bad schedule raises a
  :class:`ScheduleError` naming the rank, the action and the micro-batch, instead of hanging the ranks.
- :func:`simulate` gives every action's start and end under a cost model (times of ``F``, ``B``, ``I``, ``W``
  as exact fractions), from which :func:`bubble_fraction` and :func:`peak_alive` follow; the same function,
  fed the durations the ranks measured, predicts the measured timeline.
- :func:`expected_p2p_bytes`: what each rank sends and receives in a step, from the placement of the chunks.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import NamedTuple


class ScheduleError(ValueError):
    """A schedule that cannot run: a missing or repeated action, a wrong order, or a deadlock."""


class Action(NamedTuple):
    kind: str  # "F" forward, "B" whole backward, "I" input gradient, "W" weight gradient
    chunk: int  # which model chunk, counted along the pipeline
    micro_batch: int

    def __str__(self) -> str:
        names = {"F": "forward", "B": "backward", "I": "input-gradient backward",
                 "W": "weight-gradient backward"}
        return f"{names[self.kind]} of micro-batch {self.micro_batch} on chunk {self.chunk}"


@dataclass(frozen=True)
class Schedule:
    name: str
    p: int  # ranks (pipeline stages)
    m: int  # micro-batches per step
    placement: tuple[int, ...]  # placement[c]: the rank that runs model chunk c
    actions: tuple[tuple[Action, ...], ...]  # actions[r]: rank r's actions, in order

    @property
    def n_chunks(self) -> int:
        return len(self.placement)

    def chunks_of(self, rank: int) -> list[int]:
        return [c for c, r in enumerate(self.placement) if r == rank]


def _check_sizes(p: int, m: int, v: int = 1) -> None:
    if p < 1 or m < 1 or v < 1:
        raise ScheduleError(f"p={p}, m={m} and v={v} must be at least 1")


def gpipe(p: int, m: int) -> Schedule:
    """All forwards, then all backwards (Huang et al. 2019): each stage keeps all ``m`` micro-batches
    alive."""
    _check_sizes(p, m)
    return Schedule("GPipe", p, m, tuple(range(p)),
                    tuple(tuple([Action("F", r, i) for i in range(m)] + [Action("B", r, i) for i in range(m)])
                          for r in range(p)))


def one_f_one_b(p: int, m: int) -> Schedule:
    """PipeDream-Flush (Narayanan et al. 2021): ``p-1-r`` warm-up forwards on rank ``r``, then one forward and
    one backward in turn, then the remaining backwards. Rank ``r`` keeps at most ``p-r`` micro-batches
    alive."""
    _check_sizes(p, m)
    ranks = []
    for r in range(p):
        warmup = min(p - 1 - r, m)
        acts = [Action("F", r, i) for i in range(warmup)]
        for i in range(m - warmup):
            acts += [Action("F", r, warmup + i), Action("B", r, i)]
        acts += [Action("B", r, i) for i in range(m - warmup, m)]
        ranks.append(tuple(acts))
    return Schedule("1F1B", p, m, tuple(range(p)), tuple(ranks))


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    """Megatron-LM's interleaved 1F1B (Narayanan et al. 2021, SC, section 2.2): ``v`` chunks per rank, chunk
    ``c`` on rank ``c mod p``. A rank runs micro-batches in rounds of ``p``, one chunk after the other; it
    warms up with ``2(p-1-r) + (v-1)p`` chunk-forwards, then alternates one forward and one backward."""
    _check_sizes(p, m, v)
    if m % p:
        raise ScheduleError(f"interleaved 1F1B needs m={m} to be a multiple of p={p}: micro-batches go in "
                            f"rounds of p")
    total = v * m

    def forward(k: int, r: int) -> Action:  # the k-th chunk-forward of rank r
        group = k // (p * v)
        return Action("F", (k // p) % v * p + r, group * p + k % p)

    def backward(k: int, r: int) -> Action:  # the k-th chunk-backward: the chunks in reverse
        group = k // (p * v)
        return Action("B", (v - 1 - (k // p) % v) * p + r, group * p + k % p)

    ranks = []
    for r in range(p):
        warmup = min(2 * (p - 1 - r) + (v - 1) * p, total)
        acts = [forward(k, r) for k in range(warmup)]
        for k in range(total - warmup):
            acts += [forward(warmup + k, r), backward(k, r)]
        acts += [backward(k, r) for k in range(total - warmup, total)]
        ranks.append(tuple(acts))
    return Schedule(f"interleaved 1F1B, v={v}", p, m, tuple(c % p for c in range(v * p)), tuple(ranks))


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al. 2024, section 3.1): 1F1B with the backward split into ``I`` and ``W``; rank ``r`` runs
    the ``W`` of a micro-batch only ``r`` backwards later, so that every rank keeps at most ``p``
    micro-batches alive (the first rank's 1F1B peak) and the postponed ``W`` fill the bubbles at the end."""
    base = one_f_one_b(p, m)
    ranks = []
    for r, acts in enumerate(base.actions):
        out, done = [], []
        for a in acts:
            if a.kind == "F":
                out.append(a)
                continue
            out.append(Action("I", a.chunk, a.micro_batch))
            done.append(a.micro_batch)
            if len(done) > r:
                out.append(Action("W", a.chunk, done[len(done) - 1 - r]))
        out += [Action("W", r, i) for i in done[max(0, len(done) - r):]] if r else []
        ranks.append(tuple(out))
    return Schedule("ZB-H1", p, m, base.placement, tuple(ranks))


# ---------------------------------------------------------------------------------------------------------
# Dependencies, validation and simulation
# ---------------------------------------------------------------------------------------------------------


def dependencies(a: Action, n_chunks: int) -> list[tuple[str, int, int]]:
    """What must have finished before ``a`` starts, as ``(event, chunk, micro_batch)``.

    ``("F", c, i)``: the forward's output of chunk ``c``; ``("grad", c, i)``: the gradient of chunk ``c``'s
    input (produced by its ``B`` or ``I``); ``("I", c, i)``: the input-gradient step, which ``W`` needs.
    """
    c, i = a.chunk, a.micro_batch
    if a.kind == "F":
        return [("F", c - 1, i)] if c > 0 else []
    if a.kind in ("B", "I"):
        return [("F", c, i)] + ([("grad", c + 1, i)] if c < n_chunks - 1 else [])
    return [("I", c, i)]


def _produces(a: Action) -> list[tuple[str, int, int]]:
    c, i = a.chunk, a.micro_batch
    return {"F": [("F", c, i)], "B": [("grad", c, i)], "I": [("grad", c, i), ("I", c, i)], "W": []}[a.kind]


def _describe(event: tuple[str, int, int], placement) -> str:
    kind, c, i = event
    what = {"F": "the activations of", "grad": "the input gradient of",
            "I": "the input-gradient step of"}[kind]
    return f"{what} micro-batch {i} from chunk {c} (rank {placement[c]})"


def _check_contents(s: Schedule) -> None:
    """Every rank runs each action of its chunks exactly once, and only those."""
    for r, acts in enumerate(s.actions):
        seen = set()
        for k, a in enumerate(acts):
            if a.kind not in ("F", "B", "I", "W"):
                raise ScheduleError(f"rank {r}, action {k}: unknown kind {a.kind!r} (F, B, I or W)")
            if not 0 <= a.chunk < s.n_chunks or s.placement[a.chunk] != r:
                raise ScheduleError(f"rank {r}, action {k} ({a}): chunk {a.chunk} does not run on rank {r}")
            if not 0 <= a.micro_batch < s.m:
                raise ScheduleError(f"rank {r}, action {k} ({a}): there are only {s.m} micro-batches")
            if a in seen:
                raise ScheduleError(f"rank {r}, action {k}: the {a} appears twice")
            seen.add(a)
        for c in s.chunks_of(r):
            for i in range(s.m):
                missing = [Action("F", c, i)]
                missing += [Action("B", c, i)] if Action("I", c, i) not in seen else [Action("W", c, i)]
                for a in missing:
                    if a not in seen:
                        raise ScheduleError(f"rank {r} never runs the {a}")
                if Action("B", c, i) in seen and Action("I", c, i) in seen:
                    raise ScheduleError(f"rank {r} runs both B and I of micro-batch {i} on chunk {c}")


def simulate(s: Schedule, costs: dict | None = None, comm=0, durations: dict | None = None) -> dict:
    """Every action's ``(start, end)`` under a cost model: ``{rank: [(action, start, end), ...]}``.

    A rank runs its actions in order; an action starts when the rank is free and its inputs have arrived
    (``comm`` after they were produced on another rank). ``costs`` gives the time of each kind for a whole
    stage (default ``F=1, B=2, I=1, W=1``); a chunk of a rank holding ``v`` chunks takes ``1/v`` of it.
    ``durations`` (``{(rank, action): seconds}``) overrides the cost of individual actions, e.g. with the
    times the ranks measured. A schedule that cannot proceed raises :class:`ScheduleError`: the wrong order on
    a rank (a backward before its forward) or a deadlock, naming each stuck rank and what it waits for.
    """
    _check_contents(s)
    costs = {"F": Fraction(1), "B": Fraction(2), "I": Fraction(1), "W": Fraction(1), **(costs or {})}
    for r, acts in enumerate(s.actions):  # a local prerequisite must come earlier in the same list
        ran = set()
        for k, a in enumerate(acts):
            for dep in dependencies(a, s.n_chunks):
                if s.placement[dep[1]] == r and dep not in ran:
                    raise ScheduleError(f"wrong order on rank {r}: action {k}, the {a}, needs "
                                        f"{_describe(dep, s.placement)}, which rank {r} runs later or never")
            ran.update(_produces(a))
    done: dict = {}
    free = [Fraction(0)] * s.p
    pos = [0] * s.p
    timeline = {r: [] for r in range(s.p)}
    while any(pos[r] < len(s.actions[r]) for r in range(s.p)):
        progressed = False
        for r in range(s.p):
            while pos[r] < len(s.actions[r]):
                a = s.actions[r][pos[r]]
                deps = dependencies(a, s.n_chunks)
                if any(d not in done for d in deps):
                    break
                start = max([free[r]] + [done[d] + (comm if s.placement[d[1]] != r else 0) for d in deps])
                v = len(s.chunks_of(r))
                cost = durations[(r, a)] if durations is not None else costs[a.kind] / v
                timeline[r].append((a, start, start + cost))
                free[r] = start + cost
                for e in _produces(a):
                    done[e] = start + cost
                pos[r] += 1
                progressed = True
        if not progressed:
            stuck = []
            for r in range(s.p):
                if pos[r] < len(s.actions[r]):
                    a = s.actions[r][pos[r]]
                    waits = [d for d in dependencies(a, s.n_chunks) if d not in done]
                    stuck.append(f"rank {r} at action {pos[r]} ({a}) waits for "
                                 f"{_describe(waits[0], s.placement)}")
            raise ScheduleError("deadlock: " + "; ".join(stuck))
    return timeline


def validate(s: Schedule) -> None:
    """Raise a :class:`ScheduleError` if ``s`` is incomplete, out of order or deadlocks (simulated, unit
    costs)."""
    simulate(s)


def makespan(timeline: dict):
    return max(end for events in timeline.values() for _, _, end in events) - \
        min(start for events in timeline.values() for _, start, _ in events)


def bubble_fraction(timeline: dict) -> dict:
    """Per rank: idle time within the step divided by busy time, the papers' bubble fraction."""
    total = makespan(timeline)
    out = {}
    for r, events in timeline.items():
        busy = sum(end - start for _, start, end in events)
        out[r] = (total - busy) / busy
    return out


def peak_alive(s: Schedule) -> list[int]:
    """Per rank: the most (chunk, micro-batch) pairs whose activations are kept at once, from the action
    order: a forward keeps them, the whole backward (or the weight-gradient step) frees them."""
    peaks = []
    for acts in s.actions:
        alive = peak = 0
        for a in acts:
            alive += {"F": 1, "B": -1, "I": 0, "W": -1}[a.kind]
            peak = max(peak, alive)
        peaks.append(peak)
    return peaks


def bubble_formula(name: str, p: int, m: int, v: int = 1, costs: dict | None = None) -> Fraction:
    """The papers' bubble fractions: ``(p-1)/m`` for GPipe and 1F1B (Huang et al. 2019; Narayanan et al.
    2021), ``(p-1)/(v·m)`` interleaved (Narayanan et al. 2021, SC), ``(p-1)(F+I-W)/(m(F+I+W))`` for ZB-H1 (Qi
    et al. 2024, section 3.1: a third of 1F1B's when the three take equal time)."""
    if name in ("GPipe", "1F1B"):
        return Fraction(p - 1, m)
    if name.startswith("interleaved"):
        return Fraction(p - 1, v * m)
    if name == "ZB-H1":
        c = {"F": Fraction(1), "I": Fraction(1), "W": Fraction(1), **(costs or {})}
        return (p - 1) * (c["F"] + c["I"] - c["W"]) / (m * (c["F"] + c["I"] + c["W"]))
    raise ValueError(f"no bubble formula for {name!r}")


def peak_alive_formula(name: str, p: int, m: int, rank: int, v: int = 1) -> int:
    """The most (chunk, micro-batch) pairs rank ``rank`` keeps: ``m`` in GPipe; ``min(p-r, m)`` in 1F1B
    (Narayanan et al. 2021); its warm-up plus one, ``min(2(p-1-r) + (v-1)p + 1, vm)`` chunks, interleaved
    (Narayanan et al. 2021, SC: ``p + (p-1)/v`` stages' worth on the first rank); ``min(p, m)`` on every rank
    in ZB-H1, the first rank's 1F1B peak (Qi et al. 2024)."""
    if name == "GPipe":
        return m
    if name == "1F1B":
        return min(p - rank, m)
    if name.startswith("interleaved"):
        return min(2 * (p - 1 - rank) + (v - 1) * p + 1, v * m)
    if name == "ZB-H1":
        return min(p, m)
    raise ValueError(f"no peak formula for {name!r}")


def stage_layers(n_layers: int, pp: int) -> list[range]:
    """The layers of each pipeline stage: as even as possible, the first stages taking one more if needed."""
    base, extra = divmod(n_layers, pp)
    bounds = [0]
    for stage in range(pp):
        bounds.append(bounds[-1] + base + (1 if stage < extra else 0))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def micro_batches_in_flight(schedule: str, pp: int, vpp: int, m: int, stage: int) -> float:
    """How many micro-batches' worth of its activations pipeline stage ``stage`` holds at its peak.

    GPipe keeps all ``m``; 1F1B keeps ``pp - stage`` (Narayanan et al. 2021). Interleaved 1F1B keeps
    ``2(pp-1-stage) + (vpp-1)·pp + 1`` chunks, each ``1/vpp`` of the stage; on the first stage that is
    ``pp + (pp-1)/vpp``, Korthikanti et al. (2022), eq. 5. Chapter 06 measures these peaks on every rank.
    """
    if schedule == "gpipe":
        return m
    if vpp == 1:
        return min(pp - stage, m)
    return min(2 * (pp - 1 - stage) + (vpp - 1) * pp + 1, vpp * m) / vpp


def expected_p2p_bytes(s: Schedule, rank: int, activation_bytes: int) -> tuple[int, int]:
    """Bytes ``rank`` sends and receives in one step of ``s``: per micro-batch, one activation from each of
    its chunks to the next chunk's rank and one gradient from each chunk to the previous one's, when that is
    another rank."""
    sent = received = 0
    for c in s.chunks_of(rank):
        for neighbour in (c - 1, c + 1):
            if 0 <= neighbour < s.n_chunks and s.placement[neighbour] != rank:
                sent += s.m * activation_bytes
                received += s.m * activation_bytes
    return sent, received
