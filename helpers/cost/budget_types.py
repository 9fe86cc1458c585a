"""The dataclasses chapter 01's calculator passes between its parts (chapter 01): how the world is split
(:class:`Layout`, made of the run's :class:`Degrees`), the bytes of each copy a rank keeps
(:class:`Precision`), what a layer saves for backward (:class:`ActivationModel`) and one rank's share of a
step (:class:`Budget`).

:mod:`helpers.cost.memory_budget` fills a :class:`Budget` and :mod:`helpers.cost.time_model` times it; both
import these from here, so that neither imports the other's types (the two were an import cycle).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from helpers import layout_rules
from helpers.cost.model_size import Batch, ModelShape, whole_number


@dataclass(frozen=True)
class Degrees:
    """A run's degrees of parallelism, declared once: chapter 01's :class:`Layout` and chapter 10's
    ``ParallelDims`` (:mod:`helpers.parallel.parallel_dims`) are both made of these fields and check them by
    the same rules. How the data-parallel ranks are counted is each one's own: the calculator's one ``dp``,
    torchtitan's ``dp_replicate`` times ``dp_shard``; and each says which schedules it takes."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    vpp: int = 1                     # virtual pipeline stages per rank (interleaved 1F1B)
    zero: int = 0                    # the ZeRO stage over the data-parallel (x context-parallel) ranks
    sequence_parallel: bool = False  # sequence parallelism (needs tp > 1)
    schedule: str = "1f1b"           # the pipeline's schedule, by name

    def check_degrees(self) -> None:
        """The rules every description of a run shares (:mod:`helpers.layout_rules`): a ZeRO stage, sequence
        parallelism inside tensor parallelism, virtual stages inside a pipeline, experts folded onto dp x cp
        (``dp``: each description's own count of the data-parallel ranks)."""
        layout_rules.zero_stage(self.zero)
        layout_rules.sequence_parallel(self.sequence_parallel, self.tp)
        layout_rules.virtual_stages(self.vpp, self.pp)
        layout_rules.experts_folded(self.ep, self.dp, self.cp)

    def degree_values(self) -> dict:
        """The fields of :class:`Degrees`, by name: what another description of the same run is made from."""
        return {f.name: getattr(self, f.name) for f in fields(Degrees)}


@dataclass(frozen=True)
class Layout(Degrees):
    """How the world is split, as the calculator counts it: :class:`Degrees` and ``dp`` data-parallel ranks
    (the ZeRO stage says what they shard). ``schedule`` is "1f1b" or "gpipe"; vpp > 1 means interleaved
    1F1B."""

    dp: int = 1

    def __post_init__(self):
        for f in ("dp", "tp", "pp", "cp", "ep", "vpp"):
            whole_number(f"Layout: {f}", getattr(self, f), least=1)
        if self.schedule not in ("1f1b", "gpipe"):
            raise ValueError(f"schedule must be '1f1b' or 'gpipe', got {self.schedule!r}")
        self.check_degrees()

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each copy a rank keeps, and per activation element."""

    name: str
    param_bytes: int    # the copy forward and backward read
    grad_bytes: int     # the gradient accumulated over micro-batches
    master_bytes: int   # an fp32 master copy kept by the optimizer (0: the params are the master)
    optim_bytes: int    # Adam's two moments
    act_bytes: int      # one stored activation element
    fp8: bool = False   # matmuls in FP8 (inputs of linear layers stored in one byte)
    gather_bytes: int | None = None  # per parameter in ZeRO-3's all-gathers (None: param_bytes)

    def __post_init__(self):
        if self.gather_bytes is None:  # the gathers carry the copy forward and backward read
            object.__setattr__(self, "gather_bytes", self.param_bytes)
        for f in ("param_bytes", "grad_bytes", "act_bytes", "gather_bytes"):
            whole_number(f"Precision {self.name!r}: {f}", getattr(self, f), least=1)
        for f in ("master_bytes", "optim_bytes"):
            whole_number(f"Precision {self.name!r}: {f}", getattr(self, f), least=0)

    @property
    def k(self) -> int:
        """ZeRO's K: optimizer-state bytes per parameter (master copy + moments)."""
        return self.master_bytes + self.optim_bytes


@dataclass(frozen=True)
class ActivationModel:
    """What a transformer layer saves for backward, following the accounting of Korthikanti et al. 2022.

    ``norm_stat_bytes`` is what a norm saves per token besides its input (LayerNorm's mean and 1/std in fp32:
    8; RMSNorm's 1/rms: 4; the paper ignores them: 0). ``attention`` is "materialized" (the softmax
    probabilities, a*s*s per sequence, are stored) or "flash" (only a log-sum-exp per query row, in fp32).
    ``kv_expanded``: the grouped K/V heads are repeated to all query heads before attention, and the repeated
    copies are what is saved. ``norm_keeps_normalized``: each norm also keeps its normalized input
    ``x / rms(x)`` (which its weight's gradient reads) as a tensor of its own, as PyTorch's unfused RMSNorm
    does; a fused norm recomputes it from the input and the statistics. ``recompute`` is "none", "selective"
    (the attention core, from its inputs Q, K and V, is recomputed: neither the probabilities nor a
    log-sum-exp are kept) or "full" (only each layer's input is kept).
    """

    dropout: bool = False
    attention: str = "flash"
    kv_expanded: bool = False
    norm_stat_bytes: int = 4
    recompute: str = "none"
    norm_keeps_normalized: bool = False

    def __post_init__(self):
        if self.attention not in ("flash", "materialized"):
            raise ValueError(f"attention must be 'flash' or 'materialized', got {self.attention!r}")
        if self.recompute not in ("none", "selective", "full"):
            raise ValueError(f"recompute must be 'none', 'selective' or 'full', got {self.recompute!r}")
        whole_number("ActivationModel: norm_stat_bytes", self.norm_stat_bytes, least=0)



@dataclass
class Budget:
    """One rank's share of a training step. Bytes unless named otherwise; the worst pipeline stage."""

    model: ModelShape
    batch: Batch
    layout: Layout
    precision: Precision
    activations_model: ActivationModel
    params_on_rank: int            # parameter count this rank holds before ZeRO sharding
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    micro_batches: int
    flops: dict
    sent: dict = field(default_factory=dict)    # bytes this rank sends per step, by parallelism
    messages: dict = field(default_factory=dict)  # sequential message steps per step, by parallelism
    dp_transfers: list = field(default_factory=list)  # when data-parallel traffic runs: DPTransfer each

    @property
    def state_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + self.activation_bytes

    def breakdown(self) -> dict:
        return {"parameters": self.param_bytes, "gradients": self.grad_bytes,
                "optimizer states": self.optimizer_bytes, "activations": self.activation_bytes}
