"""Chapter 15's checks of a capstone run against one process: the run itself (configuration and loop) is
``helpers.training.capstone``'s.

- :func:`shared_reference` is the single process run once, on rank 0, and sent to every rank, and
  :func:`reference_shards` a rank's slice of its tensors: what each rank checks itself against (the same check
  under ``torchrun``, where no notebook pulls anything).
- :func:`losses`, :func:`assembled`, :func:`largest_difference` and :func:`differences` put the ranks' results
  together in the kernel and measure how far they are from one process.
- :func:`check_dimensions` runs on every rank one check per mesh dimension, each an invariant of that
  dimension alone, written without the code it checks, from what a :class:`Recorder` saw during the run:
  ``cp``, the positions each rank trained on are the layout's (chapter 07), by hand; ``ep``, every row that
  reached a rank's experts is a token of its group that chose one of them (chapter 08); ``dp``, each ZeRO-3
  shard's reduced gradient is this rank's rows of the mean of the data-parallel ranks' full gradients (chapter
  04); ``tp``, what tensor parallelism keeps whole on every tp rank is bit for bit the same on each after
  training (chapter 05); ``pp``, the measured step ran the schedule's actions in its order (chapter 06). The
  ranks agree on each verdict before any raises, so a fault seen on one rank fails its dimension's check on
  every rank, and the checks' collectives never part ways.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from helpers import checks
from helpers.parallel import composition, context_parallel, expert_parallel, tensor_parallel, zero
from helpers.parallel.mesh import Mesh
from helpers.parallel.parallel_dims import make_schedule
from helpers.reference import named_params
from helpers.training.capstone import TOLERANCES, Run, build, reference_run


def tolerance(run: Run) -> dict:
    """The run's ``rtol`` against one process of its own precision (``capstone.TOLERANCES``); a bf16 run has
    none: it is held to ``precision_bound``'s bound against the fp64 process instead."""
    if run.precision not in TOLERANCES:
        raise ValueError(f"precision={run.precision!r} has no tolerance against one process of its own "
                         f"precision ({', '.join(TOLERANCES)} have): chapter 15 holds a bf16 run to "
                         f"precision_bound's bound against the fp64 process")
    return TOLERANCES[run.precision]


def shared_reference(run: Run, batches_) -> dict:
    """:func:`reference_run` computed once, on rank 0, and sent to every rank (each would only repeat it):
    what each rank checks its own parameters against."""
    box = [reference_run(run, batches_) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def losses(results: list[dict]) -> list[float]:
    """Each step's loss of the whole batch: the mean of the last stage's ranks' losses (each its rows' mean,
    the tensor-parallel ranks of one replica holding the same)."""
    last = [r["losses"] for r in results if r["losses"][0] is not None]
    return [math.fsum(column) / len(column) for column in zip(*last)]


def assembled(results: list[dict], run: Run, step: int) -> tuple[dict, list[dict]]:
    """The reference's tensors after ``step`` steps, put together from every rank's (chapter 10's
    ``composition.assemble``), and the same from every other data-parallel replica; a tied head's copy on the
    last stage is left out (it is not one of the reference's tensors: it is checked against the embedding)."""
    cfg = run.model_config()
    states = [{"where": r["where"], "params": r["params"][step]} for r in results]
    whole, others = composition.assemble(states, cfg, "params")
    for part in [whole, *others] if cfg.tie_embeddings else []:
        part.pop("lm_head.weight", None)
    return whole, others


def largest_difference(got: dict, want: dict) -> float:
    """The largest of each tensor's ``max |got - want| / max |want|``: how far the worst tensor is, relative
    to its own scale (the measure ``check_close`` holds to ``rtol``)."""
    worst = 0.0
    for name, w in want.items():
        scale = w.abs().max().item()
        worst = max(worst, (got[name].double() - w.double()).abs().max().item() / (scale or 1.0))
    return worst


def differences(results: list[dict], want: dict, run: Run) -> dict:
    """Per step, ``|loss - loss of one process|``; every ``run.every`` steps, the largest parameter difference
    (:func:`largest_difference`)."""
    got = losses(results)
    return {"loss": [abs(a - b) for a, b in zip(got, want["losses"])],
            "params": {k: largest_difference(assembled(results, run, k)[0], want["params"][k])
                       for k in sorted(want["params"])}}


def reference_shards(full: dict, run: Run, mesh: Mesh) -> dict:
    """This rank's slice of each of the single process's tensors, under the rank's names (chapter 05's
    ``shard_state``; a tied head's copy on the last stage is the embedding's slice)."""
    if run.tp == 1:
        shards = dict(full)
    else:
        tp_rank = dist.get_rank(mesh.group("tp"))
        shards = tensor_parallel.shard_state(full, run.model_config(), tp_rank, run.tp)
    if run.n_experts and run.ep > 1:
        ep_rank = dist.get_rank(mesh.group(run.dp_dim))
        shards = expert_parallel.expert_shards(shards, run.model_config(), ep_rank, run.ep)
    if run.model_config().tie_embeddings:
        shards["lm_head.weight"] = shards["tok_emb.weight"]
    return shards



class Recorder:
    """Within ``with Recorder() as seen:`` this rank keeps what the dimensions' checks read: the positions of
    its last context-parallel shard, each MoE layer's input of its last forward (with the layer's own routing
    statistics), and each ZeRO-3 chunk's full gradients and reduced shards around its last reduce-scatter.
    It wraps the modules' functions and puts them back on leaving."""

    def __enter__(self):
        self.positions, self.moe_inputs, self.reductions, self._saved = None, {}, {}, []
        shard_sequence = context_parallel.shard_sequence
        moe_forward = expert_parallel.ExpertParallelMoE.forward
        reduce_scatter = zero.Zero3ReduceAtStep.reduce_scatter_gradients

        def shard(*args, **kwargs):
            out = shard_sequence(*args, **kwargs)
            self.positions = out[2].tolist()
            return out

        def moe(layer, x):
            self.moe_inputs[layer] = x.detach().reshape(-1, x.shape[-1])
            return moe_forward(layer, x)

        def reduce(z3):
            full = {z3.names[p]: p.grad.detach().clone() for p in z3.params if p.grad is not None}
            reduce_scatter(z3)
            self.reductions[z3] = (full, {z3.names[p]: z3.shards[p].grad.detach().clone() for p in z3.params})

        self._patch(context_parallel, "shard_sequence", shard)
        self._patch(expert_parallel.ExpertParallelMoE, "forward", moe)
        self._patch(zero.Zero3ReduceAtStep, "reduce_scatter_gradients", reduce)
        return self

    def _patch(self, owner, name, new) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, new)

    def __exit__(self, *exc):
        for owner, name, old in reversed(self._saved):
            setattr(owner, name, old)


def layout_positions(kind: str, rank: int, cp: int, seq_len: int) -> list[int]:
    """Chapter 07's positions of context-parallel rank ``rank``, by hand: a contiguous ``seq_len/cp``, or the
    zigzag's chunk ``rank`` and chunk ``2·cp-1-rank`` of ``2·cp``."""
    if kind == "contiguous":
        c = seq_len // cp
        return list(range(rank * c, (rank + 1) * c))
    c = seq_len // (2 * cp)
    return list(range(rank * c, (rank + 1) * c)) + list(range((2 * cp - 1 - rank) * c, (2 * cp - rank) * c))


def _agree(name: str, findings: list[str]) -> None:
    """Every rank's findings to every rank, then one check on each: no rank found anything."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, findings)
    seen = [(r, f) for r, per_rank in enumerate(everyone) for f in per_rank]
    where = sorted({r for r, _ in seen})
    where = f"all {len(everyone)} ranks" if len(where) == len(everyone) else f"ranks {where}"
    verdict = f"{len(seen)} findings on {where}; rank {seen[0][0]}: {seen[0][1]}" if seen else "none"
    checks.check_equal(name, verdict, "none", quiet=True)


def _cp_findings(run: Run, mesh: Mesh, seen: Recorder) -> list[str]:
    if run.cp == 1:
        return []
    rank = dist.get_rank(mesh.group("cp"))
    want = layout_positions(run.cp_layout, rank, run.cp, run.seq_len)
    return [] if seen.positions == want else [f"trained on positions {seen.positions}, not {want}"]


def _ep_findings(run: Run, mesh: Mesh, seen: Recorder) -> list[str]:
    """Per MoE layer of this rank (the same layers in the same order on every rank of its group, a pipeline
    stage's): the rows that arrived against the group's tokens and the experts each chose."""
    if not run.n_experts or run.ep == 1:
        return []
    group, found = mesh.group(run.dp_dim), []
    for i, (layer, x) in enumerate(seen.moe_inputs.items()):
        tokens = _gather(x, group)
        expert = _gather(layer.stats["expert"].contiguous(), group)
        kept = _gather(layer.stats["kept_mask"].to(torch.uint8), group).bool()  # gloo gathers no booleans
        want = expert_parallel.dispatch_arrivals(expert, kept, run.n_experts, dist.get_rank(group))
        if not torch.equal(expert_parallel.identify_rows(layer.stats["arrived"], tokens), want):
            found.append(f"its experts in MoE layer {i} of its last forward received rows of tokens that did "
                         f"not choose them")
    return found


def _dp_findings(run: Run, mesh: Mesh, seen: Recorder) -> list[str]:
    """Each ZeRO-3 shard's gradient after the last reduce-scatter against this rank's ``k = ceil(rows/dp)``
    rows of the data-parallel mean, sliced by hand (zero-padded), within ``rtol`` 1e-12 (fp64 sums in another
    order)."""
    if run.zero != 3 or mesh.size(run.dp_dim) == 1:
        return []
    group, found = mesh.group(run.dp_dim), []
    dp, rank = dist.get_world_size(group), dist.get_rank(group)
    for full, reduced in seen.reductions.values():
        for name, g in full.items():
            mean = _gather(g.unsqueeze(0), group).sum(0) / dp
            k = -(-g.shape[0] // dp)
            want = torch.zeros((k, *g.shape[1:]), dtype=g.dtype, device=g.device)
            rows = mean[rank * k:(rank + 1) * k]
            want[:rows.shape[0]] = rows
            off = (reduced[name] - want).abs().max().item() / (want.abs().max().item() or 1.0)
            if off > 1e-12:
                found.append(f"the reduced gradient of {name} is {off:.1e} off its rows of the mean over "
                             f"{run.dp_dim}")
    return found


def _tp_findings(run: Run, mesh: Mesh, out: dict) -> list[str]:
    """What tensor parallelism leaves whole (the reference's shape on this rank: norms, a MoE layer's router
    and experts) after training, against tp rank 0's, bit for bit."""
    if run.tp == 1:
        return []
    group, found = mesh.group("tp"), []
    shapes = {n: t.shape for n, t in named_params(build(run)).items()}
    for name, t in out["params"][run.steps].items():
        if name in shapes and t.shape == shapes[name]:
            first = t.clone()
            dist.broadcast(first, dist.get_global_rank(group, 0), group=group)
            if not torch.equal(t, first):
                found.append(f"{name}, whole on every tp rank, differs from tp rank 0's after training")
    return found


def _pp_findings(run: Run, mesh: Mesh, out: dict) -> list[str]:
    if run.pp == 1:
        return []
    rank = dist.get_rank(mesh.group("pp"))
    want = [tuple(a) for a in make_schedule(run.schedule, run.pp, run.m, run.vpp).actions[rank]]
    ran = [tuple(e[:3]) for e in out["events"]]
    return [] if ran == want else [f"ran {ran} in the measured step, not {run.schedule}'s order {want}"]


def _gather(t: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t, group=group)
    return torch.cat(parts)


CHECKS = {
    "cp": "cp: every rank trained on its context-parallel positions (chapter 07, by hand)",
    "ep": "ep: every row a rank's experts received chose one of them (chapter 08)",
    "dp": "dp: each ZeRO-3 shard's gradient is its rows of the data-parallel mean (chapter 04)",
    "tp": "tp: what tp keeps whole is the same on every tp rank (chapter 05)",
    "pp": "pp: the measured step ran the schedule's actions in order (chapter 06)",
}
"""The name of each dimension's check, which starts with the dimension."""


def check_dimensions(run: Run, mesh: Mesh, out: dict, seen: Recorder) -> None:
    """One check per mesh dimension (the module's docstring), on every rank, in the order of :data:`CHECKS`;
    each fails on every rank when any rank found a fault."""
    _agree(CHECKS["cp"], _cp_findings(run, mesh, seen))
    _agree(CHECKS["ep"], _ep_findings(run, mesh, seen))
    _agree(CHECKS["dp"], _dp_findings(run, mesh, seen))
    _agree(CHECKS["tp"], _tp_findings(run, mesh, out))
    _agree(CHECKS["pp"], _pp_findings(run, mesh, out))


__all__ = ["Recorder", "layout_positions", "CHECKS", "check_dimensions", "tolerance", "shared_reference",
           "losses", "assembled", "largest_difference", "differences", "reference_shards"]
