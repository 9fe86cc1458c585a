"""Where each tensor a rank keeps sits in the single-process GPT's tensors (chapter 15's checkpoint): the
pieces ``helpers.training.checkpoint`` hands to ``torch.distributed.checkpoint`` (DCP).

A rank keeps, for each parameter of its chunks, one tensor (:class:`Held`): the parameter itself, or under
chapter 04's ZeRO-3 its flat shard's slice, rows ``[r·k, (r+1)·k)`` of the tensor-parallel parameter (``k =
ceil(rows / N)`` over the data-parallel group of ``N`` ranks, the last rows zero padding). Each such tensor is
cut into :class:`Box` es, each a rectangle of one reference tensor, from three rules:

- tensor parallelism (chapter 05's :func:`~helpers.parallel.tensor_parallel.shard_plan`): a parameter stacks
  slices of reference tensors along one dimension (``qkv_proj`` is ``q_proj``'s, ``k_proj``'s and ``v_proj``'s
  rows), the slice of tp rank ``t`` starting at ``(t // copies) · size`` (``copies``: the tp ranks holding
  the same slice, a KV head copied or a norm on all);
- expert parallelism (chapter 08): rank ``e`` of the expert-parallel group holds experts ``[e·n, (e+1)·n)``
  of each MoE layer, whole on every tp rank;
- ZeRO-3: the rows ``[r·k, min((r+1)·k, rows))`` of the stacked parameter meet each stacked slice in at most
  one run of rows, which is that slice's box (rows of ``q_proj``, say, or none).

DCP takes a reference tensor's boxes on one rank as a :class:`Boxes` (the protocol DTensor implements in torch
2.13.0: ``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``), which the planners
(:func:`save_planner`, :func:`load_planner`) look up. On saving, a box that ``c`` ranks hold (a norm on every
tp rank, a dense tensor on every data-parallel replica without ZeRO-3) is cut into ``c`` runs of rows, one
written by each (:func:`share`), and DCP refuses a plan whose boxes overlap, leave a hole or overflow a
tensor. On loading, DCP reads every box a rank asks for from whichever files hold it: the resharding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from helpers.parallel import expert_parallel, tensor_parallel
from helpers.parallel.mesh import Mesh
from helpers.parallel.moe import MoEGPT


@dataclass(frozen=True)
class Box:
    """A rectangle of the reference tensor ``name`` (shaped ``whole``) starting at ``offsets``, and where it
    lies in the tensor the rank keeps (``where``, one slice per dimension)."""

    name: str
    whole: tuple[int, ...]
    offsets: tuple[int, ...]
    where: tuple[slice, ...]

    def of(self, kept: torch.Tensor) -> torch.Tensor:
        return kept[self.where]


@dataclass(frozen=True)
class Held:
    """One parameter of this rank: its name in the chunk, the parameter, what the rank keeps of it
    (``kept()``: the parameter, or its ZeRO-3 shard), its boxes, and whether it is a copy (a tied head on the
    last stage) that is read but not written. ``zero3`` is the chunk's ZeRO-3, if it shards it."""

    name: str
    param: nn.Parameter
    boxes: tuple[Box, ...]
    copy: bool = False
    zero3: object = None

    def kept(self) -> torch.Tensor:
        return self.param if self.zero3 is None else self.zero3.shards[self.param]


def _slices(param_shape, dim, plan_parts, tp_rank: int, tp: int, experts):
    """The boxes of a whole tensor-parallel parameter: one per stacked slice. ``experts`` is ``(expert-
    parallel rank, n_experts)`` for an expert parameter (its dim 0 counts experts), else ``None``."""
    out, start = [], 0
    for ref, size, copies in plan_parts:
        whole, offsets = list(param_shape), [0] * len(param_shape)
        where = [slice(None)] * len(param_shape)
        if dim is not None:
            whole[dim] = size * (tp // copies)
            offsets[dim] = (tp_rank // copies) * size
            where[dim] = slice(start, start + size)
            start += size
        if experts is not None:
            e, n_experts = experts
            whole[0], offsets[0] = n_experts, e * param_shape[0]
        out.append(Box(ref, tuple(whole), tuple(offsets), tuple(where)))
    return out


def _rows(box: Box, rows: int, lo: int, hi: int) -> Box | None:
    """``box`` (of a whole parameter of ``rows`` rows) cut to the parameter's rows ``[lo, hi)``, placed in a
    shard whose row 0 is row ``lo``; ``None`` if they do not meet."""
    first = box.where[0].start or 0
    last = box.where[0].stop if box.where[0].stop is not None else rows
    a, b = max(first, lo), min(last, hi)
    if a >= b:
        return None
    offsets = (box.offsets[0] + a - first, *box.offsets[1:])
    return Box(box.name, box.whole, offsets, (slice(a - lo, b - lo), *box.where[1:]))


def _zero3_of(chunk):
    """The chunk's ZeRO-3 (chapter 10's ``composition.optimizer`` sets ``chunk._zero3``), or ``None``."""
    return getattr(chunk, "_zero3", None)


def tp_rank(mesh: Mesh) -> int:
    """This rank's place in its tensor-parallel group (0 without tp)."""
    return dist.get_rank(mesh.group("tp")) if mesh.size("tp") > 1 else 0


def ep_rank(mesh: Mesh, run) -> int:
    """This rank's place in the expert-parallel group, the data-parallel one the experts are folded onto."""
    return dist.get_rank(mesh.group(run.dp_dim)) if mesh.size(run.dp_dim) > 1 else 0


def held(chunks: dict, mesh: Mesh, run) -> list[Held]:
    """Every parameter of this rank's chunks, with the boxes of the reference's tensors it keeps."""
    tp, t_rank, e_rank = mesh.size("tp"), tp_rank(mesh), ep_rank(mesh, run)
    out = []
    for chunk in chunks.values():
        cfg, z3 = chunk.cfg, _zero3_of(chunk)
        plan = tensor_parallel.shard_plan(cfg, tp) if tp > 1 else {}
        for name, p in chunk.named_parameters():
            copy = cfg.tie_embeddings and name == "lm_head.weight"  # the last stage's copy of the embedding
            ref = "tok_emb.weight" if copy else name
            dim, parts = plan.get(ref, (None, ((ref, None, tp),)))
            expert = expert_parallel.is_expert(name)
            experts = (e_rank, cfg.n_experts) if expert and isinstance(chunk, MoEGPT) else None
            boxes = _slices(tuple(p.shape), dim, parts, t_rank, tp, experts)
            sharded = z3 is not None and not expert  # ZeRO-3 shards the dense parameters only
            if sharded:
                k = z3.shards[p].shape[0]
                lo = dist.get_rank(z3.group) * k
                hi = min(lo + k, p.shape[0])
                boxes = [b for b in (_rows(box, p.shape[0], lo, hi) for box in boxes) if b is not None]
            out.append(Held(name, p, tuple(boxes), copy, z3 if sharded else None))
    return out


# ---------------------------------------------------------------------------------------------------------
# DCP's side: a reference tensor's boxes on this rank, and the planners that find them
# ---------------------------------------------------------------------------------------------------------


class Boxes:
    """One reference tensor's boxes on this rank, each a tensor at its offsets: what DCP writes (each box
    one shard of the tensor) or fills (each box the part of the tensor this rank asks for)."""

    def __init__(self, whole, dtype: torch.dtype):
        self.whole, self.dtype, self.parts = torch.Size(whole), dtype, {}

    @property
    def shape(self) -> torch.Size:
        return self.whole

    def size(self) -> torch.Size:
        return self.whole

    def add(self, offsets, tensor: torch.Tensor) -> torch.Tensor:
        """Add a box (the first tensor given at ``offsets`` is kept: a rank asks once for each box)."""
        return self.parts.setdefault(tuple(offsets), tensor)

    def __create_write_items__(self, fqn: str, _obj) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=t.shape),
                              properties=TensorProperties.create_from_tensor(t), size=self.whole))
                for offsets, t in self.parts.items()]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.shape) for o, t in self.parts.items()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.parts[tuple(index.offset)]

    def elements(self) -> int:
        return sum(math.prod(t.shape) for t in self.parts.values())


def share(state: dict) -> None:
    """Cut each box that several ranks keep (a norm on every tp rank, experts on every tp rank, a dense
    tensor on every data-parallel replica without ZeRO-3) into as many runs of rows as ranks keep it, ``ceil(
    rows / c)`` each, the ``j``-th (in rank order) left to the ``j``-th of them: each rank then writes only
    its part, and every part once. Every rank calls it (one all-gather of the boxes' descriptions)."""
    mine = [(key, offsets, tuple(t.shape)) for key, b in state.items() if isinstance(b, Boxes)
            for offsets, t in b.parts.items()]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    holders: dict = {}
    for rank, boxes in enumerate(gathered):
        for box in boxes:
            holders.setdefault(box, []).append(rank)
    me = dist.get_rank()
    for key, b in state.items():
        if not isinstance(b, Boxes):
            continue
        parts, b.parts = b.parts, {}
        for offsets, t in parts.items():
            ranks = holders[(key, offsets, tuple(t.shape))]
            rows = t.shape[0]
            k = -(-rows // len(ranks))
            lo = min(ranks.index(me) * k, rows)
            hi = min(lo + k, rows)
            if hi > lo:
                b.add((offsets[0] + lo, *offsets[1:]), t[lo:hi])


class _Saver(DefaultSavePlanner):
    def lookup_object(self, index: MetadataIndex):
        obj = self.state_dict[index.fqn]
        return obj.__get_tensor_shard__(index) if isinstance(obj, Boxes) else super().lookup_object(index)


class _Loader(DefaultLoadPlanner):
    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        """DCP's (torch 2.13.0's ``_init_state_dict`` sets every value it does not know, a :class:`Boxes`, to
        ``None`` in place): put them back."""
        boxes = {k: v for k, v in state_dict.items() if isinstance(v, Boxes)}
        super().set_up_planner(state_dict, metadata, is_coordinator)
        state_dict.update(boxes)
        self.state_dict.update(boxes)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        return obj.__get_tensor_shard__(index) if isinstance(obj, Boxes) else super().lookup_tensor(index)


def save_planner() -> DefaultSavePlanner:
    """DCP's default planner, finding :class:`Boxes` (each box one rank's after :func:`share`); a plain tensor
    every rank gives (the step counts) is written by rank 0."""
    return _Saver(dedup_save_to_lowest_rank=True)


def load_planner() -> DefaultLoadPlanner:
    """DCP's default planner, finding :class:`Boxes` (the state flat already: not flattened again)."""
    return _Loader(flatten_state_dict=False)


__all__ = ["Box", "Held", "tp_rank", "ep_rank", "held", "Boxes", "share", "save_planner", "load_planner"]
