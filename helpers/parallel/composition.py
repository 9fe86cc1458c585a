"""Chapters 03-08 composed on one device mesh (chapter 10): the glue, and nothing but the glue.

A run is one :class:`helpers.parallel.parallel_dims.ParallelDims` (its mesh made by ``run.mesh()``).
Every parallelism here is the chapter's own module, imported: :func:`apply` transforms the one reference GPT
in the book's order (``pipeline_parallel.pipeline_chunk`` for each chunk the run's schedule places on this
rank, then ``tensor_parallel.parallelize`` and ``context_parallel.parallelize``, then
``expert_parallel.parallelize`` on a MoE GPT), each given its group from the
:class:`helpers.parallel.mesh.Mesh`, and returns one module per chunk. :func:`forward_backward` takes a global
batch, keeps this rank's rows (its place along ``dp``) and columns (its context-parallel positions), runs
chapter 06's executor on the run's schedule (GPipe, 1F1B, interleaved with any ``vpp``, ZB-H1; or one
forward and backward without pipeline), and :func:`reduce_gradients` sums or averages
each gradient over the group that holds the other parts of it:

- over ``tp``: the sequence-parallel norms' partial gradients and replicated KV heads' copies (chapter 05);
- over the pipeline's embedding group: a tied embedding's two copies (chapter 06, inside ``run_schedule``);
- over the data-parallel group ``dp_shard_cp`` (data and context parallelism together, as torchtitan's FSDP
  shards over ``dp_shard × cp``): DDP's bucketed all-reduce (chapter 03), or the reduce-scatter of ZeRO-1 or
  ZeRO-3 inside :func:`optimizer`'s step (chapter 04); with experts, chapter 08's ``finish_gradients`` over
  the expert-parallel group, which is folded onto those same ranks.

Under ZeRO-3 each chunk is chapter 04's ZeRO-3 over the data-parallel group (``zero.Zero3ReduceAtStep``), its
units the chunk's blocks and a root (the embeddings, the final norm and head it holds): a block is gathered
before each forward and each backward and freed after, the root for the step. The reduce-scatter waits for
the step, as ``torch.distributed.pipelining`` makes FSDP2 wait for the last micro-batch: the full gradients
are first summed over ``tp`` and the embedding group, so each reduction completes before the next one cuts
it.

With ``run.precision == "bf16"`` each chunk computes in bf16 around fp32 masters (chapter 09's
``mixed_precision.Bf16Compute``): the reductions above all find fp32 gradients, and ZeRO-3 is its
``Zero3Masters`` (fp32 shards, bf16 all-gathers).

:func:`state` is what a rank hands back for the checks, :func:`assemble` puts the ranks' tensors back under
the reference's names, and :func:`traffic_by_dimension` splits the ledger's bytes by the mesh dimension of the
group each collective ran on.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from helpers.cost import pipeline_schedules
from helpers.data import rank_rows
from helpers.parallel import (context_parallel, data_parallel, expert_parallel, pipeline_parallel,
                              tensor_parallel, zero)
from helpers.parallel.ledger import LEDGER
from helpers.parallel.mesh import MESH_ORDER, Mesh
from helpers.parallel.moe import MoEGPT
from helpers.parallel.parallel_dims import ParallelDims, make_schedule
from helpers.reference import named_grads, named_params, train_steps
from helpers.training import mixed_precision


def _rank(mesh: Mesh, name: str) -> int:
    return dist.get_rank(mesh.group(name)) if mesh.size(name) > 1 else 0


def layout(cfg, mesh: Mesh, run: ParallelDims) -> context_parallel.CPLayout:
    """Chapter 07's layout of the sequence over the ``cp`` ranks."""
    return context_parallel.CPLayout(cfg.seq_len, mesh.size("cp"), run.cp_layout)


def schedule(mesh: Mesh, run: ParallelDims) -> pipeline_schedules.Schedule:
    """Chapter 06's schedule of the run over the mesh's ``pp`` ranks: GPipe, 1F1B, interleaved or ZB-H1."""
    return make_schedule(run.schedule, mesh.size("pp"), run.m, run.vpp)


def _same_degrees(mesh: Mesh, run: ParallelDims) -> None:
    """A run's groups are its mesh's (``run.mesh()``): refuse a mesh of other degrees."""
    held = {name: size for name, size in zip(mesh.names, mesh.shape) if size > 1}
    if held != run.degrees():
        raise ValueError(f"the run's degrees {run.degrees()} are not its mesh's {held}: build the mesh "
                         f"from the run (run.mesh().make_groups())")


def apply(model, mesh: Mesh, run: ParallelDims) -> dict:
    """This rank's chunks of ``model``, ``{chunk index: chunk}``: with a pipeline, the chunks its schedule
    places here (one, or ``vpp`` interleaved), each a copy; each made tensor-, context- and expert-parallel in
    place, in the order of book/conventions.md."""
    _same_degrees(mesh, run)
    chunks = {0: model}
    if mesh.size("pp") > 1:
        s = schedule(mesh, run)
        chunks = {c: pipeline_parallel.pipeline_chunk(model, c, s.n_chunks)
                  for c in s.chunks_of(_rank(mesh, "pp"))}
    for chunk in chunks.values():
        if mesh.size("tp") > 1:
            tensor_parallel.parallelize(chunk, mesh.group("tp"), run.sequence_parallel)
        if mesh.size("cp") > 1:
            context_parallel.parallelize(chunk, layout(model.cfg, mesh, run), mesh.group("cp"), run.attention)
        if isinstance(model, MoEGPT):
            expert_parallel.parallelize(chunk, mesh.group(run.dp_dim))
        if run.precision == "bf16":  # bf16 copies for forward and backward; the chunk's own stay fp32
            chunk._bf16 = mixed_precision.Bf16Compute(chunk)
    return chunks


def holder(chunks: dict) -> nn.Module:
    """One module holding a rank's chunks, for its optimizer."""
    return next(iter(chunks.values())) if len(chunks) == 1 else nn.ModuleList(chunks.values())


def my_batch(x: torch.Tensor, y: torch.Tensor, cfg, mesh: Mesh, run: ParallelDims):
    """This rank's rows (its index along ``dp``) and columns (its ``cp`` positions) of a global batch, and
    those positions (``None`` without context parallelism)."""
    dp = mesh.size("dp")
    xs, ys = rank_rows(x, _rank(mesh, "dp"), dp), rank_rows(y, _rank(mesh, "dp"), dp)
    if mesh.size("cp") == 1:
        return xs, ys, None
    return context_parallel.shard_sequence(xs, ys, layout(cfg, mesh, run), mesh.group("cp"))


def forward_backward(chunks: dict, mesh: Mesh, run: ParallelDims, x: torch.Tensor, y: torch.Tensor,
                     stage_seconds: dict | None = None, measured: bool = False):
    """One step's gradients on this rank, reduced over every group that shares them. Returns the loss of this
    rank's tokens (the mean over its micro-batches; ``None`` on a rank without the last chunk) and the
    pipeline's events (chapter 06's ``run_schedule``: ``stage_seconds`` pads each action to a fixed time, and
    only a ``measured`` step has its saved activations measured)."""
    cfg = next(iter(chunks.values())).cfg
    xs, ys, positions = my_batch(x, y, cfg, mesh, run)
    for chunk in chunks.values():  # bf16: the pipeline receives in the dtype of the chunks' parameters
        if getattr(chunk, "_bf16", None) is not None:
            chunk._bf16.to_compute()
    if mesh.size("pp") == 1:
        (chunk,) = chunks.values()
        loss, events = chunk(xs, ys, positions=positions)[1], []
        loss.backward()
    else:
        s, group = schedule(mesh, run), mesh.group("pp")
        tokens = xs.shape[1] // (mesh.size("tp") if run.sequence_parallel else 1)  # this rank's, sent on
        tied = pipeline_parallel.embedding_group(s.placement, group) if cfg.tie_embeddings else None
        losses, events = pipeline_parallel.run_schedule(
            s, chunks, xs, ys, group=group, positions=positions, embedding_group=tied,
            activation_shape=(xs.shape[0] // run.m, tokens, cfg.d_model), stage_seconds=stage_seconds,
            record_saved=measured)
        loss = torch.stack(list(losses.values())).mean() if losses else None
    for chunk in chunks.values():
        reduce_gradients(chunk, mesh, run)
    return loss, events


def reduce_gradients(chunk, mesh: Mesh, run: ParallelDims) -> None:
    """The reductions a composition needs after backward: over ``tp`` what tensor parallelism holds twice,
    then over the data-parallel group (DDP or, for ZeRO-1 and ZeRO-3, nothing here: the optimizer's step
    reduce-scatters)."""
    if mesh.size("tp") > 1:
        if run.sequence_parallel:
            tensor_parallel.allreduce_sequence_parallel_grads(chunk, mesh.group("tp"))
        tensor_parallel.allreduce_replicated_kv_grads(chunk, mesh.group("tp"))
    if mesh.size(run.dp_dim) == 1:
        return
    if isinstance(chunk, MoEGPT) and run.zero == 3:  # the dense ones wait for ZeRO-3's reduce-scatter
        for name, p in chunk.named_parameters():  # finish_gradients' division of the experts' sums
            if expert_parallel.is_expert(name):
                p.grad /= mesh.size(run.dp_dim)
    elif isinstance(chunk, MoEGPT):  # experts' gradients already summed by the all-to-all's backward
        expert_parallel.finish_gradients(chunk, mesh.group(run.dp_dim))
    elif run.zero == 0:
        buckets = data_parallel.build_buckets(list(chunk.parameters()), run.cap_bytes)
        data_parallel.bucketed_average(buckets, mesh.group(run.dp_dim))


def check(run: ParallelDims) -> None:
    """What the composition adds to a run's own rules: the data-parallel group reduces by DDP, ZeRO-1 or
    ZeRO-3 (the dense parameters: each rank's experts are its own), and every activation is kept
    (recomputation is the calculator's, chapter 01)."""
    if run.recompute != "none":
        raise ValueError(f"recompute={run.recompute!r}: chapter 10's composition keeps every activation "
                         f"(recompute='none'); chapter 01's calculator models recomputation")
    if run.zero == 2:
        raise ValueError("zero=2: chapter 10's composition runs DDP (zero=0), ZeRO-1 (zero=1) or ZeRO-3 "
                         "(zero=3); ZeRO-2's reduce-scatter in backward would cut each gradient before "
                         "composition.reduce_gradients completes the tensor-parallel ones, and deferred to "
                         "the step it is ZeRO-1")
    if run.precision == "bf16" and run.schedule == "zb-h1" and run.pp > 1:
        raise ValueError("precision='bf16' with schedule='zb-h1': the zero-bubble weight step sets each "
                         "gradient itself (pipeline_parallel.backward_weight), so the hooks that add the "
                         "bf16 gradients into the fp32 masters' never run")
    if run.zero == 3 and run.schedule == "zb-h1" and run.pp > 1:
        raise ValueError("zero=3 with schedule='zb-h1': the zero-bubble weight step sets each gradient "
                         "itself (pipeline_parallel.backward_weight), so ZeRO-3's post-accumulate hooks "
                         "never see a block's backward end and its gathered parameters outlive it")


class Dense:
    """A module seen without chapter 08's experts (its parameters and their names only; the rest is the
    module's): what ZeRO-3 shards. Each rank's experts are its own, whole, not copies to shard."""

    def __init__(self, module: nn.Module):
        self.module = module

    def named_parameters(self):
        return [(n, p) for n, p in self.module.named_parameters() if not expert_parallel.is_expert(n)]

    def parameters(self):
        return [p for _, p in self.named_parameters()]

    def __getattr__(self, name):
        return getattr(self.module, name)


class ChunksZero3:
    """ZeRO-3 on a rank's chunks: one chapter-04 ``zero.Zero3ReduceAtStep`` per chunk (the optimizer of each
    holds the chunk's shards), stepped together; each step reduce-scatters every unit's gradients first. A MoE
    GPT's experts take plain AdamW (``experts``)."""

    def __init__(self, zeros: list[zero.Zero3ReduceAtStep], experts: list[nn.Parameter], lr: float):
        self.zeros = zeros
        self.experts = torch.optim.AdamW(experts, lr=lr) if experts else None

    def step(self) -> None:
        for z in self.zeros:
            z.step()
        if self.experts:
            self.experts.step()

    def zero_grad(self) -> None:
        for z in self.zeros:
            z.zero_grad()
        if self.experts:
            self.experts.zero_grad()

    def _optimizers(self) -> list:
        return [z.optimizer for z in self.zeros] + ([self.experts] if self.experts else [])

    @property
    def param_groups(self) -> list:  # what chapter 04's LiveMemory reads of an optimizer: all of them, as one
        return [g for o in self._optimizers() for g in o.param_groups]

    @property
    def state(self) -> dict:
        return {p: s for o in self._optimizers() for p, s in o.state.items()}


def optimizer(chunks: dict, mesh: Mesh, run: ParallelDims, lr: float):
    """AdamW on this rank's chunks; with ``run.zero == 1`` chapter 04's ZeRO-1 over the data-parallel group
    (it reduce-scatters the gradients, steps its rows, all-gathers the parameters); with ``run.zero == 3``
    chapter 04's ZeRO-3 on each chunk (:class:`ChunksZero3`), which frees the full parameters at once."""
    computes = [chunk._bf16 for chunk in chunks.values() if getattr(chunk, "_bf16", None) is not None]
    if computes:  # the same optimizers over the fp32 masters, each step rounded into the bf16 copies
        return mixed_precision.MastersStep(_optimizer(chunks, mesh, run, lr), computes)
    return _optimizer(chunks, mesh, run, lr)


def _optimizer(chunks: dict, mesh: Mesh, run: ParallelDims, lr: float):
    module = holder(chunks)
    if run.zero == 1 and mesh.size(run.dp_dim) > 1:
        if any(expert_parallel.is_expert(name) for name, _ in module.named_parameters()):
            raise ValueError(f"zero=1 with experts: ZeRO-1 reduce-scatters every gradient over {run.dp_dim}, "
                             f"where each rank holds other experts, so it would average different experts' "
                             f"gradients; use zero=0 (DDP) or zero=3 (which shards only the dense ones)")
        return zero.ShardedAdamW(module, 1, mesh.group(run.dp_dim), lr=lr)
    if run.zero == 3 and mesh.size(run.dp_dim) > 1:
        for chunk in chunks.values():  # each chunk keeps its ZeRO-3, which can gather it (params)
            if getattr(chunk, "_bf16", None) is not None:  # fp32 shards, bf16 copies gathered
                bf16 = chunk._bf16
                chunk._zero3 = mixed_precision.Zero3Masters(
                    mixed_precision.Copies(Dense(chunk), bf16),
                    [mixed_precision.Copies(Dense(b), bf16) for b in chunk.blocks.values()],
                    mesh.group(run.dp_dim), lr=lr)
            else:
                chunk._zero3 = zero.Zero3ReduceAtStep(Dense(chunk), [Dense(b) for b in chunk.blocks.values()],
                                                      mesh.group(run.dp_dim), lr=lr)
            chunk._zero3.memory.recording = False  # chapter 04 measures memory; a training loop need not
        experts = [p for name, p in module.named_parameters() if expert_parallel.is_expert(name)]
        return ChunksZero3([chunk._zero3 for chunk in chunks.values()], experts, lr)
    return torch.optim.AdamW(module.parameters(), lr=lr)


def train(model, mesh: Mesh, run: ParallelDims, data, lr: float) -> dict:
    """This rank's part of ``model``, trained with AdamW on the global batches ``data`` (one step each) by the
    book's loop. Kept for the checks: the first step's gradients (before ZeRO-1's own reduction), that step's
    traffic by mesh dimension (the ledger cleared before it), every step's loss and the parameters after. The
    model and the batches go to the run's device first."""
    check(run)
    on = run.rank_device()  # the CPU under gloo, this rank's GPU under nccl
    chunks = apply(model.to(on), mesh, run)
    data = [(xs.to(on), ys.to(on)) for xs, ys in data]
    opt = optimizer(chunks, mesh, run, lr)

    def step(xs, ys):
        return forward_backward(chunks, mesh, run, xs, ys)[0]
    LEDGER.clear()
    first = step(*data[0])
    booked = len(LEDGER.messages)
    out = state(chunks, mesh)
    del LEDGER.messages[booked:]  # under ZeRO-3, gathering the parameters for the checks: not the step's
    opt.step()
    opt.zero_grad()
    out["traffic"], out["messages"] = traffic_by_dimension(mesh), messages_by_dimension(mesh)
    rest = train_steps(None, data[1:], step=step, optimizer=opt)
    out["losses"] = [None if first is None else float(first.detach())] + rest
    out["params"] = params(chunks)
    return out


def params(chunks: dict) -> dict[str, torch.Tensor]:
    """This rank's parameters under the reference's names, every chunk's, on the CPU. Under ZeRO-3 each
    chunk's are gathered first (one all-gather per unit over the data-parallel group: every rank calls it)."""
    out = {}
    for chunk in chunks.values():
        if getattr(chunk, "_zero3", None) is not None:
            full = chunk._zero3.full_parameters()
            copy = chunk._bf16.compute if getattr(chunk, "_bf16", None) is not None else {}  # bf16: by copy
            out.update({name: full.get(copy.get(p, p), p).detach().cpu().clone()
                        for name, p in chunk.named_parameters()})
        else:
            out.update({name: t.cpu() for name, t in named_params(chunk).items()})
    return out


def state(chunks: dict, mesh: Mesh, grads: bool = True) -> dict:
    """What a rank hands back for the checks: where it sits, its parameters and (if any) gradients, all on the
    CPU."""
    where = mesh.coordinates(dist.get_rank())
    out = {"where": {name: where.get(name, 0) for name in MESH_ORDER}, "params": params(chunks)}
    if grads:
        out["grads"] = {name: g.cpu() for chunk in chunks.values() for name, g in named_grads(chunk).items()}
    return out


def assemble(results: list[dict], cfg, key: str) -> tuple[dict, list[dict]]:
    """The reference's tensors (``key``: "params" or "grads") put together from every rank's :func:`state`:
    each stage's TP shards joined (chapter 05's ``unshard_state``) and its experts concatenated over the
    expert-parallel ranks (chapter 08's ``unshard_experts``). Returns the whole from the first data-parallel
    replica and, for the checks that they agree, the same from every other one (keys present on that
    replica)."""
    def replica(r):
        return r["where"]["dp_replicate"], r["where"]["dp_shard"], r["where"]["cp"]

    moe = hasattr(cfg, "n_experts")
    wholes = {}
    for stage in sorted({r["where"]["pp"] for r in results}):
        mine = [r for r in results if r["where"]["pp"] == stage]
        for rep in sorted({replica(r) for r in mine}):
            shards = sorted((r for r in mine if replica(r) == rep), key=lambda r: r["where"]["tp"])
            tensors = [r[key] for r in shards]
            part = tensor_parallel.unshard_state(tensors, cfg) if len(tensors) > 1 else dict(tensors[0])
            if moe:  # every replica holds other experts: the whole is over the replicas, in their order
                # (each tp rank holds its replica's experts whole: tp rank 0's stand for them)
                part = {n: t for n, t in part.items() if not expert_parallel.is_expert(n)}
                experts = expert_parallel.unshard_experts([r[key] for r in sorted(mine, key=replica)
                                                           if r["where"]["tp"] == 0])
                part.update({n: t for n, t in experts.items() if expert_parallel.is_expert(n)})
            wholes.setdefault(rep, {}).update(part)
    first, *others = [wholes[rep] for rep in sorted(wholes)]
    return first, others


def traffic_by_dimension(mesh: Mesh, ledger=LEDGER) -> dict[str, int]:
    """Bytes this rank sent in the ledger's messages, by the mesh dimension of the group each ran on
    (:meth:`helpers.parallel.mesh.Mesh.dimension_of`; a group of one rank sends nothing). Expert
    parallelism's all-to-alls (chapter 08's ``moe_`` labels) run on the data-parallel ranks it is folded onto:
    they count as ``ep``."""
    out: dict[str, int] = {}
    for ranks, (sent, _) in ledger.by_group().items():
        if len(ranks) > 1:
            name = mesh.dimension_of(ranks) or "other"
            out[name] = out.get(name, 0) + sent
    moe = sum(m.nbytes for m in ledger.messages if m.direction == "send" and m.collective.startswith("moe_"))
    if moe:
        folded = mesh.dimension_of(next(m.group_ranks for m in ledger.messages
                                        if m.collective.startswith("moe_")))
        out[folded] -= moe
        out["ep"] = moe
    return out


def messages_by_dimension(mesh: Mesh, ledger=LEDGER) -> dict[tuple[str, str, int], tuple[int, int]]:
    """What :func:`traffic_by_dimension` adds up, one entry per (dimension, collective, elements of the
    buffer): how many such calls or messages this rank sent, and their bytes."""
    out: dict = {}
    for m in sent_along(ledger):
        dim = dimension(mesh, m)
        count, sent = out.get((dim, m.collective, m.numel), (0, 0))
        out[(dim, m.collective, m.numel)] = (count + 1, sent + m.nbytes)
    return out


def sent_along(ledger=LEDGER) -> list:
    """The ledger's sends over a group of more than one rank: what moved along some mesh dimension."""
    return [m for m in ledger.messages if m.direction == "send" and m.group_ranks and len(m.group_ranks) > 1]


def dimension(mesh: Mesh, message) -> str:
    """The mesh dimension a ledger message moved along: its group's, or ``ep`` for chapter 08's all-to-alls
    (``moe_`` labels), which run on the data-parallel ranks expert parallelism is folded onto."""
    if message.collective.startswith("moe_"):
        return "ep"
    return mesh.dimension_of(message.group_ranks) or "other"


__all__ = ["layout", "schedule", "apply", "holder", "my_batch", "forward_backward",
           "reduce_gradients", "check", "Dense", "ChunksZero3", "optimizer", "train", "params", "state",
           "messages_by_dimension", "sent_along", "dimension", "assemble", "traffic_by_dimension"]
