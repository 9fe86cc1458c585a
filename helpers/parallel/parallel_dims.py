"""One description of a run's parallelism (chapters 10 and 15, and the bench): torchtitan's ``ParallelDims``,
with what the book needs besides.

torchtitan describes a job's parallelism by one dataclass, ``ParallelDims`` (``torchtitan/distributed/
parallel_dims.py``, read at commit 0119de1: the degrees ``dp_replicate, dp_shard, cp, tp, pp, ep, etp`` and
the world size, checked in ``__post_init__`` to multiply to it, and ``build_mesh``, which makes the device
meshes from them). :class:`ParallelDims` here holds the same degrees (no ``etp``: the book's experts are not
tensor-parallel), those it shares with chapter 01's calculator declared once in
:class:`helpers.cost.budget_types.Degrees`, the world's size given where a mesh is made, and what the book's
composition also needs to know about a run: chapter 06's pipeline schedule, its virtual stages ``vpp`` and the
micro-batches ``m``; chapter 05's sequence parallelism; chapter 04's ZeRO stage; recomputation; the precision
and the device; chapter 07's attention core and layout, and which group averages the gradients.

- Making one validates it (``__post_init__``): the choices, then every degree's rule through the one place
  that states it, ``helpers.layout_rules``, which the calculator's :class:`helpers.cost.budget_types.Layout`
  calls too, so an error reads the same in chapters 01, 10 and 15. :meth:`ParallelDims.check` adds the rules
  that need the model and the batch (chapter 01's ``memory_budget.validate``), the world's size (the mesh's)
  and chapter 06's schedule.
- :meth:`ParallelDims.mesh` is chapter 10's :class:`~helpers.parallel.mesh.Mesh` of the run (``make_groups()``
  on it makes the process groups), :meth:`ParallelDims.layout` the layout chapter 01's calculator costs, and
  :meth:`ParallelDims.pipeline_schedule` chapter 06's schedule, as data.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from helpers import layout_rules
from helpers.cost import memory_budget, pipeline_schedules
from helpers.cost.budget_types import Degrees, Layout
from helpers.parallel.mesh import FLATTENED, MESH_ORDER, Mesh

SCHEDULES = {"gpipe": pipeline_schedules.gpipe, "1f1b": pipeline_schedules.one_f_one_b,
             "interleaved": pipeline_schedules.interleaved_1f1b, "zb-h1": pipeline_schedules.zb_h1}
"""Chapter 06's schedules, by the name a run gives them."""
PRECISIONS = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}
"""The dtype forward and backward compute in, by the name a run gives it. "bf16" is mixed precision: bf16
parameters and activations, fp32 master weights stepped by AdamW in fp32 and gradients reduced in fp32
(:data:`MASTERS`; chapter 09's ``helpers.training.mixed_precision.Bf16Compute``)."""
MASTERS = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.float32}
"""The dtype of the parameters the optimizer steps (and of the reduced gradients), by precision."""
CHOICES = {"schedule": tuple(SCHEDULES), "precision": tuple(PRECISIONS),
           "recompute": ("none", "selective", "full"), "attention": ("ring", "ulysses"),
           "cp_layout": ("zigzag", "contiguous"),
           "dp_dim": ("dp_shard_cp", "dp_shard", "dp", "dp_cp")}


def layout_dimension(name: str) -> str:
    """The calculator's name (chapter 01's ``Layout``) of a mesh dimension or a flattened one: every
    data-parallel dimension (``dp_replicate``, ``dp_shard``, and those flattened with ``cp``, over which the
    gradients are averaged) is its ``dp``; ``pp``, ``cp``, ``tp`` and ``ep`` keep their names."""
    parts = FLATTENED.get(name, (name,))
    if any(part.startswith("dp") for part in parts):
        return "dp"
    return name


def make_schedule(name: str, pp: int, m: int, vpp: int = 1) -> pipeline_schedules.Schedule:
    """Chapter 06's schedule ``name`` on ``pp`` stages, ``m`` micro-batches (``vpp`` chunks a rank when
    interleaved); its own refusals are chapter 06's."""
    if name == "interleaved":
        return pipeline_schedules.interleaved_1f1b(pp, m, vpp)
    return SCHEDULES[name](pp, m)


@dataclass(frozen=True)
class ParallelDims(Degrees):
    """A run's parallelism: chapter 01's :class:`~helpers.cost.budget_types.Degrees` (``tp, pp, cp, ep``,
    ``vpp``, the ZeRO stage, sequence parallelism, the schedule: one of :data:`SCHEDULES`), the data-parallel
    ranks as torchtitan counts them, and the rest the composition needs. The mesh's degrees are taken in its
    order (helpers.parallel.mesh.MESH_ORDER); ep folds onto dp_shard x cp."""

    # the data-parallel ranks: replicated (HSDP's outer dimension) times sharded
    dp_replicate: int = 1
    dp_shard: int = 1
    # the pipeline's micro-batches of a step; recomputation
    m: int = 1
    recompute: str = "none"
    # the numbers and where they live
    precision: str = "fp64"
    device: str | None = None  # None: each rank's own (helpers.dist.device(): the CPU, or its GPU under nccl)
    # how chapter 10 composes: chapter 07's core and layout, the gradients' averaging group, DDP's bucket
    attention: str = "ring"
    cp_layout: str = "zigzag"
    dp_dim: str = "dp_shard_cp"
    cap_bytes: int = 1 << 16

    def __post_init__(self):
        self.check_choices()
        layout_rules.require_positive(**{name: getattr(self, name) for name in MESH_ORDER}, ep=self.ep,
                                      vpp=self.vpp, m=self.m)
        self.check_degrees()
        if (self.schedule == "interleaved") != (self.vpp > 1):
            raise ValueError(f"schedule={self.schedule!r} with vpp={self.vpp}: interleaved 1F1B runs "
                             f"vpp >= 2 chunks per rank, GPipe, 1F1B and ZB-H1 one (vpp=1)")

    def check_choices(self) -> None:
        """Each named choice (schedule, precision, recomputation, chapter 07's core and layout, the gradients'
        group) is one the book implements."""
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of "
                                 f"{', '.join(map(repr, allowed))}")

    @property
    def dp(self) -> int:
        """The data-parallel degree, replicated times sharded (torchtitan's flattened ``dp``)."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def dtype(self) -> torch.dtype:
        """What forward and backward compute in (:data:`PRECISIONS`)."""
        return PRECISIONS[self.precision]

    @property
    def master_dtype(self) -> torch.dtype:
        """What the optimizer steps and the gradients are reduced in (:data:`MASTERS`)."""
        return MASTERS[self.precision]

    def rank_device(self) -> torch.device:
        """Where this rank's tensors live: the run's ``device``, or the rank's own."""
        from helpers import dist as book_dist

        return torch.device(self.device) if self.device is not None else book_dist.device()

    def degrees(self) -> dict[str, int]:
        """The mesh's dimensions of more than one rank, in torchtitan's order."""
        return {name: getattr(self, name) for name in MESH_ORDER if getattr(self, name) > 1}

    def mesh(self, world_size: int | None = None) -> Mesh:
        """The run's mesh (refused unless its ranks are the world's); ``make_groups()`` makes its groups."""
        return Mesh(tuple(self.degrees().values()), tuple(self.degrees()), world_size=world_size)

    def layout(self) -> Layout:
        """The run as chapter 01's calculator describes it: the same degrees, ``dp`` counted as one, and the
        schedule's memory (interleaved is 1F1B with vpp chunks; ZB-H1 keeps 1F1B's first-rank peak)."""
        return Layout(**{**self.degree_values(), "schedule": "gpipe" if self.schedule == "gpipe" else "1f1b"},
                      dp=self.dp)

    def pipeline_schedule(self) -> pipeline_schedules.Schedule:
        """Chapter 06's schedule of the run, as data."""
        return make_schedule(self.schedule, self.pp, self.m, self.vpp)

    def check(self, model=None, batch=None, world_size: int | None = None) -> None:
        """The rules that need more than the run: the world's size (the mesh's), the model's shape and the
        batch (chapter 01's ``memory_budget.validate``), then chapter 06's schedule."""
        if world_size is not None:
            self.mesh(world_size)
        if model is not None and batch is not None:
            memory_budget.validate(model, batch, self.layout())
        if self.pp > 1:
            self.pipeline_schedule()

    def replace(self, **changes) -> "ParallelDims":
        return dataclasses.replace(self, **changes)


__all__ = ["SCHEDULES", "PRECISIONS", "MASTERS", "CHOICES", "layout_dimension", "make_schedule",
           "ParallelDims"]
