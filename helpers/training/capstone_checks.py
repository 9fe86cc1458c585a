"""Chapter 15's checks of a capstone run against one process: the run itself (configuration and loop) is
``helpers.training.capstone``'s.

- :func:`shared_reference` is the single process run once, on rank 0, and sent to every rank, and
  :func:`reference_shards` a rank's slice of its tensors: what each rank checks itself against (the same check
  under ``torchrun``, where no notebook pulls anything).
- :func:`losses`, :func:`assembled`, :func:`largest_difference` and :func:`differences` put the ranks' results
  together in the kernel and measure how far they are from one process.
"""

from __future__ import annotations

import math

import torch.distributed as dist

from helpers.parallel import composition, expert_parallel, tensor_parallel
from helpers.parallel.mesh import Mesh
from helpers.training.capstone import Run, reference_run


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


__all__ = ["shared_reference", "losses", "assembled", "largest_difference", "differences", "reference_shards"]
