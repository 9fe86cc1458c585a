"""Choosing a layout: every valid layout of a model on a cluster, kept if it fits and ranked by its step time
(chapter 10).

Nothing here is a new model: a layout fits if chapter 01's calculator
(:func:`helpers.cost.memory_budget.budget`) says one rank of its busiest stage holds at most ``memory`` bytes,
and it is ranked by chapter 01's time model (:func:`helpers.cost.time_model.step_time`: compute, exposed
communication, pipeline bubble). The rules a layout must meet are chapter 01's too
(:mod:`helpers.layout_rules`): they prune the grid before any budget is made.

What is searched: the degrees ``dp``, ``tp``, ``pp``, ``cp``, ``ep`` (each a divisor of the world size, ``tp``
within a node), sequence parallelism, ``vpp``, the ZeRO stage, the micro-batch size (hence the micro-batch
count) and the recomputation. Three prunings, all exact under the calculator:

- a structure (its five degrees) whose most frugal variant (micro-batch 1, no interleaving, SP on, ZeRO-3,
  full recomputation) does not fit has no variant that fits: each of those choices only lowers memory;
- recomputation is tried in the order none, selective, full and stops at the first that fits: it adds compute
  and can hide at most as much communication as it adds, so a later one is never faster;
- ZeRO 1 and 2 are not tried once a lower stage fits without recomputation: they only add exposed traffic
  (ZeRO-1's all-gather hides behind nothing, ZeRO-2 reduce-scatters every micro-batch). ZeRO-3 is always
  tried: its gathers hide behind the micro-batches they serve, so it can beat ZeRO 1 and 2.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import product

from helpers import layout_rules
from helpers.cost.memory_budget import (BF16, FRAMEWORK_ALLOWANCE, ActivationModel, Budget, Layout, Precision,
                                   budget)
from helpers.cost.model_size import Batch, ModelShape
from helpers.cost.time_model import Assumptions, Cluster, StepTime, step_time

RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Candidate:
    """One layout that fits, with its budget and its step time."""

    layout: Layout
    micro_batch: int
    recompute: str
    budget: Budget
    time: StepTime

    @property
    def step_s(self) -> float:
        return self.time.step_s

    def terms(self) -> dict:
        """The step in seconds, split into its terms: compute, bubble, and each group's exposed traffic (the
        data-parallel part: what does not hide behind compute)."""
        t = self.time
        other = {k: v for k, v in t.exposed_s.items() if k != "dp"}
        out = {"compute": t.compute_s, "bubble": t.bubble_s, **{f"{k} traffic": v for k, v in other.items()}}
        if "dp" in t.exposed_s:
            out["dp traffic (exposed)"] = t.exposed_s["dp"]
        return out

    def describe(self) -> str:
        L = self.layout
        parts = [f"dp={L.dp}", f"tp={L.tp}{'+sp' if L.sequence_parallel else ''}", f"pp={L.pp}"]
        parts += [f"vpp={L.vpp}"] if L.vpp > 1 else []
        parts += [f"cp={L.cp}"] if L.cp > 1 else []
        parts += [f"ep={L.ep}"] if L.ep > 1 else []
        parts += [f"zero={L.zero}", f"micro_batch={self.micro_batch} (m={self.budget.micro_batches})"]
        return ", ".join(parts) + f", recompute={self.recompute}"


@dataclass
class SearchResult:
    model: ModelShape
    cluster: Cluster
    world_size: int
    seq_len: int
    global_batch: int
    memory: float
    ranked: list            # every fitting Candidate, fastest first
    structures: int         # degree tuples that meet the rules
    structures_fit: int     # ... of which some variant fits
    budgets: int            # budgets computed
    assumptions: Assumptions | None = None
    allowance: float = 0.0

    @property
    def best(self) -> Candidate:
        return self.ranked[0]

    def rank_of(self, **fixed) -> tuple[int, Candidate]:
        """The 1-based rank of the fastest fitting layout whose fields equal ``fixed`` (Layout fields, and
        ``micro_batch`` or ``recompute``); what is not fixed is the search's choice for them."""
        for i, c in enumerate(self.ranked):
            if all(getattr(c.layout, k, None) == v if hasattr(c.layout, k) else getattr(c, k) == v
                   for k, v in fixed.items()):
                return i + 1, c
        raise ValueError(f"no fitting layout of {self.model.name} on {self.world_size} GPUs has {fixed}")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def valid_vpps(model: ModelShape, pp: int) -> list[int]:
    """Every number of virtual stages the rules allow with ``pp`` stages: each of the ``pp·vpp`` chunks holds
    a layer (:func:`helpers.layout_rules.pipeline_parallel`); 1 alone without a pipeline."""
    if pp == 1:
        return [1]
    return [v for v in range(1, model.n_layers // pp + 1) if _obeys(layout_rules.pipeline_parallel, pp * v,
                                                                      model.n_layers)]


def _obeys(rule, *args, **kwargs) -> bool:
    try:
        rule(*args, **kwargs)
        return True
    except ValueError:
        return False


def structures(model: ModelShape, cluster: Cluster, world_size: int, seq_len: int, global_batch: int):
    """Every (dp, tp, pp, cp, ep) whose product dp·tp·pp·cp is the world size and that meets the rules of
    :mod:`helpers.layout_rules` (``ep`` inside dp·cp), with tensor parallelism inside one node."""
    found = []
    for tp in divisors(min(world_size, cluster.gpus_per_node)):
        if not _obeys(layout_rules.tensor_parallel, tp, model.n_heads, model.n_kv_heads, model.d_ff,
                      model.vocab_size):
            continue
        for pp in divisors(world_size // tp):
            if not _obeys(layout_rules.pipeline_parallel, pp, model.n_layers):
                continue
            for cp in divisors(world_size // (tp * pp)):
                dp = world_size // (tp * pp * cp)
                if not _obeys(layout_rules.context_parallel, cp, seq_len) or global_batch % dp:
                    continue
                eps = [e for e in divisors(dp * cp) if model.n_experts % e == 0] if model.n_experts else [1]
                found += [(dp, tp, pp, cp, ep) for ep in eps]
    return found


def _variants(model: ModelShape, tp: int, pp: int, micro_batches, vpps):
    allowed = valid_vpps(model, pp) if vpps is None else [v for v in vpps if v == 1 or pp > 1]
    return product(micro_batches, allowed, [True, False] if tp > 1 else [False])


def _evaluate(model, batch, layout, recompute, precision, cluster, memory, world_size, allowance=0.0):
    """The budget if the layout fits (with its traffic), its bytes if not, None if it breaks a rule."""
    act = ActivationModel(recompute=recompute)
    try:
        b = budget(model, batch, layout, precision, act, world_size, traffic=False)
    except ValueError:  # a rule that depends on the variant (interleaving needs m a multiple of pp; SP)
        return None
    if b.total_bytes + allowance > memory:
        return b.total_bytes
    return budget(model, batch, layout, precision, act, world_size)


def search(model: ModelShape, cluster: Cluster, world_size: int, seq_len: int, global_batch: int,
           precision: Precision = BF16, memory: float = 80e9, micro_batches=(1, 2), vpps=None,
           zeros=(0, 1, 2, 3), prune: bool = True, assumptions: Assumptions | None = None,
           allowance: float = FRAMEWORK_ALLOWANCE) -> SearchResult:
    """Every layout of ``model`` on ``world_size`` GPUs of ``cluster`` that fits (its budget plus
    ``allowance`` at most ``memory``), ranked by step time. ``vpps=None`` tries every vpp the rules allow;
    ``prune=False`` is the brute force (the same best, more budgets). Raises ValueError when no layout meets
    the rules (naming the world size and the node) or none fits (naming the least memory one needs)."""
    if world_size < 1 or (world_size > cluster.gpus_per_node and world_size % cluster.gpus_per_node):
        raise ValueError(f"world_size={world_size} is not a whole number of {cluster.gpus_per_node}-GPU "
                         f"nodes of {cluster.name}")
    shapes = structures(model, cluster, world_size, seq_len, global_batch)
    if not shapes:
        raise ValueError(f"no layout of {model.name} meets the rules on world_size={world_size} with "
                         f"global_batch={global_batch} and seq_len={seq_len}: dp must divide the global "
                         f"batch, tp (at most {cluster.gpus_per_node}, a node) the heads, pp the layers, cp "
                         f"seq_len")
    ranked, n_budgets, n_fit, least = [], 0, 0, None
    for dp, tp, pp, cp, ep in shapes:
        base = Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep)
        frugal = _evaluate(model, Batch(seq_len, 1, global_batch),
                           replace(base, zero=3, sequence_parallel=tp > 1), "full", precision, cluster,
                           memory, world_size, allowance)
        n_budgets += 1
        if not isinstance(frugal, Budget) and prune:
            if frugal is not None:
                least = frugal if least is None else min(least, frugal)
            continue
        n_fit += isinstance(frugal, Budget)
        for micro_batch, vpp, sequence_parallel in _variants(model, tp, pp, micro_batches, vpps):
            if global_batch % (dp * micro_batch):
                continue
            batch = Batch(seq_len, micro_batch, global_batch)
            sharded_enough = False  # ZeRO 0, 1 and 2 fit without recomputation from here on
            for zero in (z for z in zeros if z == 0 or dp * cp > 1):
                if sharded_enough and zero < 3 and prune:
                    continue
                layout = replace(base, vpp=vpp, sequence_parallel=sequence_parallel, zero=zero)
                for recompute in RECOMPUTE:
                    b = _evaluate(model, batch, layout, recompute, precision, cluster, memory, world_size,
                                  allowance)
                    n_budgets += 1
                    if isinstance(b, Budget):
                        ranked.append(Candidate(layout, micro_batch, recompute, b,
                                                step_time(b, cluster, assumptions=assumptions)))
                        sharded_enough = recompute == "none"
                        if prune:
                            break
                        continue
                    if isinstance(b, int):
                        least = b if least is None else min(least, b)
                    if b is None:
                        break
    if not ranked:
        need = f"; the most frugal layout needs {least / 1e9:.1f} GB" if least else ""
        raise ValueError(f"{model.name} fits nowhere on world_size={world_size} with {memory / 1e9:.0f} GB "
                         f"per GPU{need}")
    ranked.sort(key=lambda c: c.step_s)
    return SearchResult(model, cluster, world_size, seq_len, global_batch, memory, ranked, len(shapes), n_fit,
                        n_budgets, assumptions, allowance)


# --------------------------------------------------------------------------------------------- why

def dominant(c: Candidate) -> tuple[str, float]:
    """The largest term of a step besides compute, and its seconds."""
    rest = {k: v for k, v in c.terms().items() if k != "compute"}
    return max(rest.items(), key=lambda kv: kv[1]) if rest else ("nothing", 0.0)


def why(c: Candidate, best: Candidate) -> str:
    """Why ``c`` wins or loses, computed: against the best, the term that costs it the most."""
    if c is best:
        term, seconds = dominant(c)
        return (f"fastest: compute is {c.time.compute_s / c.step_s:.0%} of its step; its largest other term "
                f"is {term}, {seconds:.2f} s")
    mine, theirs = c.terms(), best.terms()
    gaps = {k: mine.get(k, 0.0) - theirs.get(k, 0.0) for k in set(mine) | set(theirs)}
    term = max(gaps, key=gaps.get)
    return (f"{c.step_s / best.step_s - 1:+.1%} slower than the best, mostly in {term} "
            f"({gaps[term]:+.2f} s)")


def heat_map(result: SearchResult, rows: str = "tp", cols: str = "pp") -> dict:
    """(row degree, column degree) -> the fastest fitting candidate with those degrees (the others: the
    search's best for them), as the Ultra-Scale Playbook draws its grid of layouts."""
    cells = {}
    for c in result.ranked:  # fastest first: the first one seen in a cell is its best
        key = (getattr(c.layout, rows), getattr(c.layout, cols))
        cells.setdefault(key, c)
    return cells


def place(result: SearchResult, layout: Layout, micro_batch: int = 1, recompute: str | None = None,
          act: ActivationModel | None = None):
    """Where a given layout (a published one) ranks among the search's candidates: its 1-based rank (one
    more than the candidates faster than it) and its Candidate. ``recompute=None`` takes the first of none,
    selective, full that fits. Raises ValueError naming the bytes when it does not fit."""
    batch = Batch(result.seq_len, micro_batch, result.global_batch)
    need = None
    for r in RECOMPUTE if recompute is None else (recompute,):
        b = budget(result.model, batch, layout, precision=result.ranked[0].budget.precision,
                   act=replace(act or ActivationModel(), recompute=r), world_size=result.world_size)
        if b.total_bytes + result.allowance <= result.memory:
            t = step_time(b, result.cluster, assumptions=result.assumptions)
            c = Candidate(layout, micro_batch, r, b, t)
            return 1 + sum(x.step_s < c.step_s for x in result.ranked), c
        need = b.total_bytes
    raise ValueError(f"{layout} does not fit: {(need + result.allowance) / 1e9:.1f} GB > "
                     f"{result.memory / 1e9:.0f} GB per GPU ({need / 1e9:.1f} GB budget + "
                     f"{result.allowance / 1e9:.0f} GB framework allowance)")
