"""Chapter 15's planted faults: one per mesh dimension, each a small change to one chapter's module that
crashes nothing, sends messages of the right sizes, and leaves a loss that still falls.

:data:`FAULTS` names each by the dimension it breaks and says what it does; ``with plant(name):`` puts it in
place on this rank (every rank plants the same one) and takes it out again on leaving, even after an error.
``capstone_checks.check_dimensions`` must then fail the planted dimension's check first, on every rank.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist

from helpers.parallel import blockwise_attention, comms, composition, expert_parallel, tensor_parallel, zero

FAULTS = {
    "cp": "the zigzag's two chunks held in reverse order (chapter 07's CPLayout.positions)",
    "ep": "each rank's experts given the rows meant for the next expert-parallel rank's (chapter 08)",
    "dp": "ZeRO-3's reduce-scatter sums the data-parallel gradients without dividing by dp (chapter 04)",
    "tp": "the sequence-parallel norms' partial gradients left unsummed over tp (chapter 05)",
    "pp": "the last stage's two last backwards swapped, against the schedule's order (chapter 06)",
}


def _reversed_zigzag(positions):
    def planted(layout, rank, device="cpu"):
        p = positions(layout, rank, device)
        return torch.cat([p[len(p) // 2:], p[:len(p) // 2]]) if layout.kind == "zigzag" else p
    return planted


def _shifted_experts(compute):
    def planted(layer, rows, counts):
        n = len(counts) // dist.get_world_size(layer.group)  # experts per rank
        k = sum(counts[-n:])
        moved = torch.cat([rows[len(rows) - k:], rows[:len(rows) - k]])  # the last rank's rows first
        out = compute(layer, moved, counts[-n:] + counts[:-n])
        return torch.cat([out[k:], out[:k]])
    return planted


def _summed_not_averaged(grads, group=None):
    return comms.reduce_scatter(zero.pack_rows(grads, dist.get_world_size(group)).view(-1), 0, group)


def _swapped_backwards(schedule):
    def planted(mesh, run):
        s = schedule(mesh, run)
        last = list(s.actions[-1])
        last[-2], last[-1] = last[-1], last[-2]
        return dataclasses.replace(s, actions=(*s.actions[:-1], tuple(last)))
    return planted


PLANTS = {
    "cp": (blockwise_attention.CPLayout, "positions", _reversed_zigzag),
    "ep": (expert_parallel.ExpertParallelMoE, "compute_experts", _shifted_experts),
    "dp": (zero, "reduce_scatter_flat", lambda _: _summed_not_averaged),
    "tp": (tensor_parallel, "allreduce_sequence_parallel_grads", lambda _: lambda *args, **kwargs: None),
    "pp": (composition, "schedule", _swapped_backwards),
}


def applicable(run) -> list[str]:
    """The faults of :data:`FAULTS` that ``run`` has the code for: the dimension above 1 and, for ``dp``,
    ZeRO-3's reduce-scatter; for ``tp``, sequence parallelism's norms."""
    has = {"cp": run.cp > 1, "ep": run.n_experts > 0 and run.ep > 1,
           "dp": run.zero == 3 and run.dp * run.cp > 1, "tp": run.tp > 1 and run.sequence_parallel,
           "pp": run.pp > 1}
    return [name for name in FAULTS if has[name]]


def same_numbers(name: str, run) -> str | None:
    """Why fault ``name`` leaves ``run``'s numbers as one process's (only its own dimension's check can see
    it), or ``None`` where it moves them."""
    if name == "pp":
        return ("the two backwards it swaps are of one chunk's two micro-batches, whose gradients add either "
                "way")
    if name == "cp" and run.attention == "ulysses":
        return ("Ulysses attends over the whole sequence, gathered: the two chunks in the other order are "
                "the same tokens at the same positions")
    return None


@contextlib.contextmanager
def plant(name: str):
    """Fault ``name`` of :data:`FAULTS` in place within the block, on this rank."""
    if name not in PLANTS:
        raise ValueError(f"fault {name!r} is not one of {', '.join(PLANTS)}")
    owner, attribute, make = PLANTS[name]
    correct = getattr(owner, attribute)
    setattr(owner, attribute, make(correct))
    try:
        yield
    finally:
        setattr(owner, attribute, correct)


__all__ = ["FAULTS", "PLANTS", "applicable", "same_numbers", "plant"]
