"""The capstone (chapter 15): one run, configured in one place, validated before any rank starts, and trained
by the modules of chapters 03-12, imported.

- :class:`Run` is what a reader changes: the run's parallelism, one
  :class:`~helpers.parallel.parallel_dims.ParallelDims` (the mesh ``pp × dp_shard × cp × tp``, sequence
  parallelism, ``m`` micro-batches, chapter 06's schedule and its ``vpp``, the ZeRO stage, the precision), and
  what the capstone adds to it: the size of the book's GPT (dense, or with chapter 08's MoE layer in every
  ``moe_every``-th block, its experts folded onto the data-parallel group), the global batch, the optimizer
  (AdamW with chapter 03's DDP or chapter 04's ZeRO-1, or chapter 12's Muon) and the steps. Making one runs
  :func:`validate`, which raises a ``ValueError`` naming the broken constraint. The constraints are the
  modules' own, called, not restated: the run description's (its degrees, through ``helpers.layout_rules`` and
  the calculator's ``memory_budget.Layout``), the model's (``GPTConfig``), the mesh's (``Mesh``), chapter 10's
  composition's, chapter 01's rules for the model and batch (``memory_budget.validate``), the schedule's and
  Muon's owners; the few the capstone adds are stated once, here.
- :func:`train` is the run on one rank: chapter 10's mesh and composition (``composition.apply``,
  ``forward_backward``, ``optimizer``: chapter 06's executor on the run's schedule), by the book's one loop
  (``reference.train_steps``). It keeps what chapter 15 checks: every step's loss, the parameters every
  ``every`` steps, and of one measured step the ledger's bytes by mesh dimension, the memory the rank holds
  (chapter 04's ``LiveMemory``) and its pipeline events (chapter 06's ``Timeline``).
- :func:`reference_run` is the single process on the same batches, by the same loop. Comparing the two (in the
  kernel or on a rank) is ``helpers.training.capstone_checks``'.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from helpers import layout_rules
from helpers.cost import model_size
from helpers.data import make_tokens
from helpers.model import GPT, GPTConfig
from helpers.parallel import composition, pipeline_parallel
from helpers.parallel.ledger import LEDGER
from helpers.parallel.mesh import FLATTENED, MESH_ORDER, Mesh
from helpers.parallel.moe import MoEConfig, MoEGPT
from helpers.parallel.parallel_dims import PRECISIONS, SCHEDULES, ParallelDims
from helpers.measure import LiveMemory
from helpers.reference import batches, named_params, train_steps
from helpers.training import distributed_muon, mixed_precision, optimizers

OPTIMIZERS = ("adamw", "muon")
MEASURED_STEP = 1  # the second step: the first also creates the optimizer's state
TOLERANCES = {"fp64": {"loss": 1e-12, "params": 1e-10}, "fp32": {"loss": 1e-6, "params": 2e-3}}
"""``rtol`` of each comparison with one process, by precision, relative to each tensor's largest entry
(chapter 15 says why each is what it is)."""


PARALLELISM = dict(pp=2, dp_shard=2, cp=2, tp=2, ep=4, sequence_parallel=True, schedule="interleaved", vpp=2,
                   m=2, zero=3, attention="ring")
"""Chapter 15's parallelism, five dimensions on 16 ranks: a pp x dp_shard x cp x tp mesh, the experts folded
onto dp_shard x cp (ep=4, as torchtitan folds them), SP inside tp, interleaved 1F1B with two chunks per rank
and two micro-batches, ZeRO-3 over dp_shard x cp, ring attention (values of ``ParallelDims``' fields, which
declare them)."""

MODEL = dict(n_layers=4, n_experts=8, top_k=2, moe_every=2)
"""Chapter 15's model: the book's GPT, four blocks, chapter 08's MoE layer of 8 experts, top 2, in every
other one (values of ``Run``'s fields)."""


@dataclass(frozen=True)
class Run(ParallelDims):
    """One training run of the book's GPT: the run's parallelism (:class:`ParallelDims`: the mesh, the
    schedule, sequence parallelism, ZeRO, the precision), and what the capstone adds to it."""

    # the parallelism: ParallelDims' fields (chapter 15's values: PARALLELISM)
    # the model: the book's GPT (helpers.model.GPTConfig)
    n_layers: int = 2
    d_model: int = 64
    n_heads: int = 8
    n_kv_heads: int = 4
    d_ff: int = 256
    seq_len: int = 16
    # chapter 08's experts: none (0) for the dense GPT; else a MoE layer of n_experts, top_k of them per
    # token, in every moe_every-th block (2: every other one), expert-parallel over the data-parallel group
    n_experts: int = 0
    top_k: int = 2
    moe_every: int = 2
    # one step: sequences over all data-parallel ranks; the optimizer
    global_batch: int = 8
    optimizer: str = "adamw"
    lr: float = 1e-2
    # how long, and how often the parameters are compared
    steps: int = 100
    every: int = 10

    def __post_init__(self):
        validate(self)

    def model_config(self) -> GPTConfig:
        shape = dict(seq_len=self.seq_len, n_layers=self.n_layers, d_model=self.d_model, n_heads=self.n_heads,
                     n_kv_heads=self.n_kv_heads, d_ff=self.d_ff)
        if not self.n_experts:
            return GPTConfig(**shape)
        # no capacity (every token reaches its experts) and no auxiliary losses: see _validate_experts
        return MoEConfig(**shape, n_experts=self.n_experts, top_k=self.top_k, moe_every=self.moe_every,
                         capacity_factor=None, aux_loss_coef=0.0, z_loss_coef=0.0)

    def batch(self) -> model_size.Batch:
        return model_size.Batch(self.seq_len, self.global_batch // (self.dp * self.m), self.global_batch)


def model_shape(run: Run) -> model_size.ModelShape:
    """The run's model as chapter 01's calculator describes it (its MoE layers counted, not placed)."""
    cfg = run.model_config()
    shape = model_size.ModelShape.from_gpt(cfg)
    if not run.n_experts:
        return shape
    moe = sum(cfg.is_moe(i) for i in range(cfg.n_layers))
    return dataclasses.replace(shape, n_experts=cfg.n_experts, top_k=cfg.top_k,
                               n_dense_layers=cfg.n_layers - moe)


def chapter_run(**changes) -> Run:
    """Chapter 15's run (``PARALLELISM``, ``MODEL`` and ``Run``'s own defaults), with ``changes``."""
    return Run(**{**PARALLELISM, **MODEL, **changes})


def validate(run: Run, world_size: int | None = None) -> None:
    """Raise a ValueError naming the first constraint ``run`` breaks (and, given ``world_size``, whether its
    mesh holds that many ranks). Needs no ranks."""
    ParallelDims.__post_init__(run)  # the run's own: choices, degrees, the calculator's layout rules
    if run.optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={run.optimizer!r} is not one of {', '.join(map(repr, OPTIMIZERS))}")
    layout_rules.require_positive(steps=run.steps, every=run.every, global_batch=run.global_batch)
    if run.steps < 2:
        raise ValueError(f"steps={run.steps}: the run measures its step {MEASURED_STEP} (the first also "
                         f"creates the optimizer's state), so it needs at least 2")
    layout_rules.require_divides("every", run.every, "steps", run.steps,
                                 "the parameters are compared every `every` steps, and after the last")
    if not run.lr > 0:
        raise ValueError(f"lr={run.lr} must be positive")
    _validate_precision(run)
    run.model_config()  # the model's own refusals
    if world_size is not None:
        run.mesh(world_size)  # the mesh's: its ranks are the world's
    composition.check(run)  # what chapter 10's composition adds
    if run.pp == 1 and run.m > 1:
        raise ValueError(f"m={run.m} micro-batches go through a pipeline: with pp=1 each rank runs its rows "
                         f"at once (m=1)")
    layout_rules.require_divides("dp*m", run.dp * run.m, "global_batch", run.global_batch,
                                 "each data-parallel rank cuts its rows into m micro-batches")
    run.check(model_shape(run), run.batch())  # chapters 01 and 05-07's, chapter 06's
    _validate_experts(run)
    if run.optimizer == "muon":
        _validate_muon(run)


def _validate_precision(run: Run) -> None:
    """bf16 (chapter 09's mixed precision) steps its fp32 masters (or ZeRO-3's fp32 shards) with AdamW."""
    if run.precision != "bf16":
        return
    if run.optimizer != "adamw":
        raise ValueError(f"precision='bf16' with optimizer={run.optimizer!r}: the bf16 run steps its fp32 "
                         f"masters with AdamW")


def _validate_experts(run: Run) -> None:
    """The composition folds the experts onto the whole data-parallel group (``run.dp_dim``, torchtitan's
    ``dp_shard × cp``): ``ep`` is that group's size. A rank routes its own tokens, a micro-batch's rows at its
    context- (and sequence-) parallel positions, which are no consecutive slice of one process's batch; so no
    expert drops a token (no capacity) and the per-segment auxiliary losses are left out (their weights 0),
    which also keeps a pipeline's earlier stages, whose layers' losses no head adds, exact."""
    folded = math.prod(getattr(run, part) for part in FLATTENED.get(run.dp_dim, (run.dp_dim,)))
    if not run.n_experts:
        if run.ep > 1:
            raise ValueError(f"ep={run.ep} needs experts: set n_experts (the dense GPT has none)")
        return
    layout_rules.expert_parallel(run.ep, run.n_experts, of="the capstone's MoE layers")
    if run.ep != folded:
        raise ValueError(f"ep={run.ep}: chapter 10's composition folds the experts onto the whole "
                         f"data-parallel group {run.dp_dim} of {folded} ranks, so ep must be {folded}")
    if run.zero not in (0, 3):
        raise ValueError(f"zero={run.zero} with experts: ZeRO-1 over {run.dp_dim} would average different "
                         f"ranks' experts; a MoE run reduces its experts by chapter 08's finish_gradients, "
                         f"and its dense parameters by DDP (zero=0) or ZeRO-3 (zero=3)")
    if run.optimizer != "adamw":
        raise ValueError(f"optimizer={run.optimizer!r} with experts: the MoE run trains with AdamW")


def _validate_muon(run: Run) -> None:
    if run.tp > 1:
        raise ValueError(f"optimizer='muon' needs tp=1, not {run.tp}: Muon orthogonalises whole matrices "
                         f"(chapter 12), and tensor parallelism leaves each rank a slice of them")
    if run.zero != 1 or run.vpp > 1:
        raise ValueError(f"optimizer='muon' runs chapter 12's DistributedMuon on one chunk per rank, its "
                         f"AdamW part ZeRO-1: set zero=1 and vpp=1 (got zero={run.zero}, vpp={run.vpp})")
    if run.dp > 1:  # every stage's matrices must go round the data-parallel ranks (chapter 12's owners)
        model = build(run)
        for stage in range(run.pp):
            chunk = pipeline_parallel.pipeline_chunk(model, stage, run.pp) if run.pp > 1 else model
            distributed_muon.assign_owners([p.shape for p in optimizers.muon_params(chunk)[0]], run.dp)


def build(run: Run) -> GPT:
    """The one reference GPT (a MoE GPT with experts: by a loop over them, no grouped matmul in fp64),
    seeded, in the dtype of the run's optimizer (``run.master_dtype``: fp32 for bf16, whose bf16 copies
    chapter 10's composition and :func:`reference_optimizer` make)."""
    if run.n_experts:
        return MoEGPT(run.model_config(), seed=0, grouped=False).to(run.master_dtype)
    return GPT(run.model_config(), seed=0).to(run.master_dtype)


def data(run: Run) -> list:
    """The global batches of every step, the same in the kernel and on every rank."""
    return batches(make_tokens(), run.steps, run.global_batch, run.seq_len)


def make_mesh(run: Run) -> Mesh:
    """The run's mesh, with every process group made (on every rank, in one order)."""
    return run.mesh().make_groups()


def _muon(run: Run) -> dict:
    """Muon's settings: AdamW's learning rate carried over by Moonlight's scale (chapter 12); Newton-Schulz
    in the run's precision, so that the comparison with one process stays as tight as the rest."""
    return dict(lr=run.lr, adjust_lr_fn="match_rms_adamw", dtype=run.dtype)


def optimizer(chunks: dict[int, GPT], mesh: Mesh, run: Run):
    """AdamW by chapter 10's ``composition.optimizer`` (ZeRO-1 over the data-parallel group, or plain); Muon
    by chapter 12's ``DistributedMuon`` over it (or, on one data-parallel rank, its single-process form)."""
    if run.optimizer == "adamw":
        return composition.optimizer(chunks, mesh, run, run.lr)
    module = composition.holder(chunks)
    if mesh.size(run.dp_dim) == 1:
        return reference_optimizer(module, run)
    return distributed_muon.DistributedMuon(module, mesh.group(run.dp_dim), adamw=dict(lr=run.lr),
                                            **_muon(run))


def reference_optimizer(model: nn.Module, run: Run):
    """The single process's optimizer: ``torch.optim.AdamW``, or Muon with AdamW for the rest. In bf16 it
    makes ``model`` compute in bf16 (chapter 09's ``Bf16Compute``: its fp32 parameters become the masters)
    and steps the masters with AdamW in fp32, rounding them into the bf16 copies after each step."""
    if run.precision == "bf16":
        return mixed_precision.MastersStep(torch.optim.AdamW(model.parameters(), lr=run.lr),
                                           [mixed_precision.Bf16Compute(model)])
    if run.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=run.lr)
    matrices, rest = optimizers.muon_params(model)
    return optimizers.MuonWithAdamW(optimizers.Muon(matrices, **_muon(run)),
                                    torch.optim.AdamW(rest, lr=run.lr))


def _blocks(run: Run) -> list[tuple[int, int]]:
    """The steps run together by one call of the loop: up to each comparison, the measured step alone."""
    cuts = sorted(set(range(0, run.steps + 1, run.every)) | {MEASURED_STEP, MEASURED_STEP + 1})
    return list(zip(cuts, cuts[1:]))


def train(run: Run, mesh: Mesh, batches_, stage_seconds: dict | None = None, after=None) -> dict:
    """This rank's run: ``run.steps`` optimizer steps on the global batches ``batches_``. Returns the rank and
    where it sits, every step's loss (``None`` before the last stage), its parameters every ``run.every``
    steps, and of step :data:`MEASURED_STEP` its traffic by mesh dimension (the ledger cleared before it)
    and each message it sent (dimension, collective, when, bytes), what it held after backward by kind
    (from live storages; ``None`` for Muon) and its pipeline events (padded by
    ``stage_seconds``); and the seconds the other steps took, on the rank's clock. ``after(step, chunks,
    optimizer)``, if given, is called every ``run.every`` steps (a checkpoint's save)."""
    device = run.rank_device()
    chunks = composition.apply(build(run).to(device), mesh, run)
    opt = optimizer(chunks, mesh, run)
    memory = None
    if run.optimizer == "adamw":  # ZeRO-1's own meter, or one over the plain AdamW or ZeRO-3's shards
        memory = getattr(opt, "memory", None) or LiveMemory(composition.holder(chunks), opt)
    coordinates = mesh.coordinates(dist.get_rank())
    out = {"rank": dist.get_rank(), "where": {name: coordinates.get(name, 0) for name in MESH_ORDER},
           "losses": [], "params": {}, "events": [], "held": None, "seconds": 0.0}
    out["params"][0] = composition.params(chunks)

    def step(x, y, measured=False):
        loss, events = composition.forward_backward(chunks, mesh, run, x, y,
                                                    stage_seconds if measured else None, measured=measured)
        if measured:
            out["events"] = [tuple(e) for e in events]
            out["held"] = memory.held() if memory is not None else None
        return loss

    for start, stop in _blocks(run):
        measured = start == MEASURED_STEP
        if measured:  # every rank starts the measured step together (a barrier moves no data: not booked)
            dist.barrier()
        LEDGER.clear()  # one block's messages at a time
        started = time.perf_counter()
        out["losses"] += train_steps(None, [(x.to(device), y.to(device)) for x, y in batches_[start:stop]],
                                     step=lambda x, y: step(x, y, measured), optimizer=opt)
        out["seconds"] += 0.0 if measured else time.perf_counter() - started
        if measured:
            out["traffic"] = composition.traffic_by_dimension(mesh)
            out["messages"] = composition.messages_by_dimension(mesh)
            out["collectives"] = [(composition.dimension(mesh, m), m.collective, m.at, m.nbytes)
                                  for m in composition.sent_along()]
        if stop % run.every == 0:
            out["params"][stop] = composition.params(chunks)
            if after is not None:
                after(stop, chunks, opt)
    LEDGER.clear()
    return out


def reference_run(run: Run, batches_) -> dict:
    """One process on the same batches, by the same loop: every step's loss, the parameters every
    ``run.every`` steps."""
    model = build(run)
    opt = reference_optimizer(model, run)
    out = {"losses": [], "params": {0: named_params(model)}}
    for start in range(0, run.steps, run.every):
        out["losses"] += train_steps(model, batches_[start:start + run.every], optimizer=opt)
        out["params"][start + run.every] = named_params(model)
    return out


__all__ = ["PRECISIONS", "SCHEDULES", "OPTIMIZERS", "MEASURED_STEP", "TOLERANCES", "PARALLELISM", "MODEL",
           "Run", "model_shape", "chapter_run", "validate",
           "build", "data", "make_mesh", "optimizer", "reference_optimizer", "train", "reference_run"]
