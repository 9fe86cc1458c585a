"""Stop, save, resume elsewhere (chapter 15): a distributed checkpoint of a composed run, written by every
rank with ``torch.distributed.checkpoint`` (DCP, which runs on gloo) and loaded onto another layout.

A checkpoint holds the *reference's* tensors (the single-process GPT's names, ``q_proj`` not ``qkv_proj``),
each rank writing only the slices it holds. A rank describes each slice to DCP as a ``DTensor`` on a small
``DeviceMesh`` of its tensor-parallel row, made without process groups (only the ranks' coordinates are
needed): chapter 05's :func:`~helpers.parallel.tensor_parallel.shard_plan` says which reference tensors a
parameter stacks, along which dimension, and how many ranks hold the same slice (a KV head copied onto
``tp // n_kv_heads`` ranks, a norm on all ``tp``), so the mesh is ``(tp // copies) x copies`` with
``Shard(dim), Replicate()`` on it. Pipeline stages hold disjoint names; the data-parallel and context-parallel
replicas hold the same slices, and DCP's save planner keeps one copy of each. Loading asks, on the new layout,
for the slices that layout needs; DCP reads them from whichever files hold them: that is the resharding.

The optimizer's state goes with the parameters (``optimizer=``): AdamW's two moments of every parameter, cut
like the parameter, and its step count. Chapter 04's ZeRO-1 (``zero.ShardedAdamW``) holds its rows of each
tensor-parallel parameter's moments: they are all-gathered over the data-parallel group to be saved as the
plain moments, and a ZeRO-1 optimizer loading them keeps its rows (and resets its master shards from the
loaded parameters). Muon's state is not saved. A tied LM head's copy on the last stage is the embedding's
slice: it is not written, and is read from ``tok_emb.weight``. Experts (chapter 08) are not handled yet.

Before DCP reads anything, :func:`load` checks the checkpoint against the layout, on every rank alike: every
file the metadata names is there with its bytes, and the names, shapes and dtypes are the model's, none
missing and none extra (DCP alone loads a subset of a checkpoint's names, and casts, without a word). A
failure raises :class:`CheckpointError` naming the file, the names, the shapes or the dtypes.
:func:`files` lists the checkpoint's files, the bytes each rank wrote and the slices in each.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from helpers.parallel import tensor_parallel, zero
from helpers.parallel.mesh import Mesh
from helpers.parallel.moe import MoEGPT

MODEL, OPTIM, STEP = "model.", "optim.", "step"
MOMENTS = ("exp_avg", "exp_avg_sq")
METADATA = ".metadata"


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model or the layout loading it, or is incomplete."""


@dataclass(frozen=True)
class Piece:
    """One reference tensor's slice inside one of this rank's parameters: its name, the dimension it is cut
    along (``None``: held whole), its size along it, and how many tensor-parallel ranks hold that slice."""

    name: str
    dim: int | None
    size: int | None
    copies: int


@dataclass(frozen=True)
class Entry:
    """One parameter of this rank: its name in the chunk, the parameter, the slices it stacks along
    ``dim`` (chapter 05's plan), and whether it is a copy (a tied head) that is read but not written."""

    name: str
    param: nn.Parameter
    dim: int | None
    pieces: tuple[Piece, ...]
    copy: bool = False

    def split(self, t: torch.Tensor) -> list[torch.Tensor]:
        """``t`` (shaped like the parameter) cut into its pieces."""
        if self.dim is None:
            return [t]
        return list(t.split([p.size for p in self.pieces], self.dim))


def entries(chunks: dict, mesh: Mesh) -> list[Entry]:
    """This rank's parameters, each with the reference slices it holds (chapter 05's plan)."""
    tp = mesh.size("tp")
    out = []
    for chunk in chunks.values():
        if isinstance(chunk, MoEGPT):
            raise NotImplementedError("checkpoint: a MoE GPT's experts (chapter 08) are not handled yet")
        cfg = chunk.cfg
        plan = tensor_parallel.shard_plan(cfg, tp) if tp > 1 else {}
        for name, p in chunk.named_parameters():
            copy = cfg.tie_embeddings and name == "lm_head.weight"  # the last stage's copy of the embedding
            ref = "tok_emb.weight" if copy else name
            dim, parts = plan.get(ref, (None, ((ref, None, tp),)))
            pieces = tuple(Piece(r, dim, n, c) for r, n, c in parts)
            out.append(Entry(name, p, dim, pieces, copy))
    return out


def tp_row(mesh: Mesh) -> list[int]:
    """The global ranks of this rank's tensor-parallel row, in order (a row of one without tp)."""
    me = dist.get_rank()
    return next(row for row in mesh.rows("tp") if me in row)


_MESHES: dict = {}


def _device_mesh(row: tuple[int, ...], copies: int, device_type: str) -> DeviceMesh:
    """``row`` as a ``(len(row) // copies) x copies`` DeviceMesh, without process groups (DCP only needs
    each rank's coordinates from it)."""
    key = (row, copies, device_type)
    if key not in _MESHES:
        grid = torch.tensor(row, device="cpu").reshape(len(row) // copies, copies)  # ranks' numbers
        # _init_backend=False (a private argument of torch 2.13.0's DeviceMesh): describe the ranks' grid
        # without making process groups, which DCP does not need and every rank would otherwise have to join
        _MESHES[key] = DeviceMesh(device_type, grid, _init_backend=False)
    return _MESHES[key]


def _dtensor(local: torch.Tensor, piece: Piece, row: list[int]) -> DTensor:
    """``local`` as its slice of the reference tensor ``piece.name``."""
    tp = len(row)
    shape = list(local.shape)
    if piece.dim is None:
        placements = [Replicate(), Replicate()]
        dmesh = _device_mesh(tuple(row), tp, local.device.type)
    else:
        placements = [Shard(piece.dim), Replicate()]
        dmesh = _device_mesh(tuple(row), piece.copies, local.device.type)
        shape[piece.dim] *= tp // piece.copies
    stride = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        stride[d] = stride[d + 1] * shape[d + 1]
    return DTensor.from_local(local.contiguous(), dmesh, placements, shape=torch.Size(shape),
                              stride=tuple(stride), run_check=False)


# ---------------------------------------------------------------------------------------------------------
# The optimizer's moments, as plain per-parameter tensors
# ---------------------------------------------------------------------------------------------------------


def _optimizer_kind(optimizer) -> str:
    if isinstance(optimizer, zero.ShardedAdamW) and optimizer.stage == 1:
        return "zero1"
    if type(optimizer) is torch.optim.AdamW:
        return "adamw"
    raise TypeError(f"checkpoint saves AdamW's and ZeRO-1's state, not {type(optimizer).__name__}'s")


def _moments(optimizer, param: nn.Parameter) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``param``'s AdamW moments, shaped like it (ZeRO-1's rows all-gathered), and its step count."""
    if _optimizer_kind(optimizer) == "adamw":
        state = optimizer.state.get(param, {})
    else:
        state = optimizer.optimizer.state.get(optimizer.shard_of_param[param], {})
    if not state:
        raise CheckpointError("the optimizer has no state yet: save after its first step, or without it")
    if _optimizer_kind(optimizer) == "adamw":
        return {m: state[m] for m in MOMENTS}, state["step"]
    rows = param.shape[0]
    return {m: zero.all_gather_rows(state[m], rows, optimizer.group) for m in MOMENTS}, state["step"]


def _set_moments(optimizer, param: nn.Parameter, moments: dict[str, torch.Tensor], step: float) -> None:
    """Give ``param`` the loaded moments and step (ZeRO-1: its rows of them, and its master shard)."""
    count = torch.tensor(step, dtype=torch.float64 if torch.get_default_dtype() == torch.float64
                         else torch.float32, device="cpu")  # AdamW keeps its step count on the CPU
    if _optimizer_kind(optimizer) == "adamw":
        optimizer.state[param] = {"step": count, **{m: moments[m].clone() for m in MOMENTS}}
        return
    rank, world = optimizer.rank, optimizer.world_size
    shard = optimizer.shard_of_param[param]
    shard.data.copy_(zero.shard_of(param.detach(), rank, world))  # the master rows: a view of the flat buffer
    optimizer.optimizer.state[shard] = {"step": count,
                                        **{m: zero.shard_of(moments[m], rank, world) for m in MOMENTS}}


# ---------------------------------------------------------------------------------------------------------
# Save
# ---------------------------------------------------------------------------------------------------------


def _not_zero3(chunks: dict) -> None:
    """Chapter 04's ZeRO-3 keeps a parameter as this rank's rows of a flat buffer and frees its full
    storage between uses, so there is nothing whole to slice: refused, on every rank alike, not saved
    empty."""
    if any(getattr(chunk, "_zero3", None) is not None for chunk in chunks.values()):
        raise CheckpointError("zero=3: ZeRO-3 frees each parameter's full storage between uses and keeps "
                              "only its flat shard, which this checkpoint does not describe; save a run "
                              "with zero=0 or zero=1")


def save(chunks: dict, mesh: Mesh, run, step: int, path, optimizer=None) -> None:
    """Write the checkpoint of this rank's ``chunks`` (after ``step`` steps) under ``path``: every rank
    calls it; each writes only its slices (``__<rank>_0.distcp``), rank 0 the metadata too. With
    ``optimizer``, its AdamW moments and step count go with the parameters."""
    _not_zero3(chunks)
    row = tp_row(mesh)
    state: dict = {STEP: torch.tensor(step, device="cpu")}  # the same on every rank: written once
    count = None
    for e in entries(chunks, mesh):
        if e.copy:
            continue
        for piece, local in zip(e.pieces, e.split(e.param.detach())):
            state[MODEL + piece.name] = _dtensor(local, piece, row)
        if optimizer is not None:
            moments, count = _moments(optimizer, e.param)
            for m in MOMENTS:
                for piece, local in zip(e.pieces, e.split(moments[m])):
                    state[f"{OPTIM}{piece.name}.{m}"] = _dtensor(local, piece, row)
    if optimizer is not None:
        state[OPTIM + STEP] = count.detach().to("cpu", torch.float64)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(os.fspath(path)))


# ---------------------------------------------------------------------------------------------------------
# Check, then load
# ---------------------------------------------------------------------------------------------------------


def metadata(path):
    """The checkpoint's metadata (DCP's ``.metadata``), or a :class:`CheckpointError` saying it is not one."""
    path = os.fspath(path)
    if not os.path.isfile(os.path.join(path, METADATA)):
        raise CheckpointError(f"no checkpoint at {path}: its {METADATA} file is missing")
    return dcp.FileSystemReader(path).read_metadata()


def check_files(path) -> None:
    """Every file the metadata names is there and holds the bytes it should, or a :class:`CheckpointError`
    naming the file and what it held."""
    path, md = os.fspath(path), metadata(path)
    wanted: dict[str, tuple[int, list[str]]] = {}
    for index, info in md.storage_data.items():
        end, names = wanted.get(info.relative_path, (0, []))
        wanted[info.relative_path] = (max(end, info.offset + info.length), names + [index.fqn])
    for name, (end, names) in sorted(wanted.items()):
        file = os.path.join(path, name)
        held = os.path.getsize(file) if os.path.isfile(file) else None
        if held is None or held < end:
            what = "is missing" if held is None else f"holds {held} bytes, not {end}"
            shown = sorted(set(names))
            raise CheckpointError(f"checkpoint {path}: shard file {name} {what}; it held "
                                  f"{len(shown)} tensors' slices ({', '.join(shown[:4])}"
                                  f"{' …' if len(shown) > 4 else ''})")


def _check_names(md, state: dict, optimizer, run) -> None:
    """The checkpoint's names, shapes and dtypes are the model's (every rank's names, gathered), or a
    :class:`CheckpointError` on every rank naming what differs."""
    mine = {k: tuple(v.shape) for k, v in state.items() if k.startswith(MODEL)}
    problems, dtypes = [], {}
    for key, t in sorted(state.items()):
        saved = md.state_dict_metadata.get(key)
        if saved is None:
            continue
        if tuple(getattr(saved, "size", ())) != tuple(t.shape):
            problems.append(f"{key}: the checkpoint's shape {tuple(saved.size)}, "
                            f"the model's {tuple(t.shape)}")
        elif key not in (STEP, OPTIM + STEP) and saved.properties.dtype != t.dtype:  # DCP would cast
            dtypes.setdefault((saved.properties.dtype, t.dtype), []).append(key)
    problems += [f"{len(keys)} tensors saved in {a}, the model's in {b} ({keys[0]}, …)"
                 for (a, b), keys in dtypes.items()]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (sorted(mine), problems))
    model = {k for names, _ in gathered for k in names}
    problems = sorted({p for _, ps in gathered for p in ps})
    saved_model = {k for k in md.state_dict_metadata if k.startswith(MODEL)}
    for what, keys in (("missing from the checkpoint", model - saved_model),
                       ("in the checkpoint but not in the model", saved_model - model)):
        if keys:
            shown = sorted(k[len(MODEL):] for k in keys)
            problems.insert(0, f"{len(keys)} parameters {what}: {', '.join(shown[:4])}"
                            f"{' …' if len(shown) > 4 else ''}")
    if optimizer is not None and OPTIM + STEP not in md.state_dict_metadata:
        problems.insert(0, "no optimizer state: the checkpoint was saved without optimizer=")
    if problems:
        raise CheckpointError(f"the checkpoint is not this model's (loading onto {run.degrees()}): "
                              + "; ".join(problems))


def _last_line(err: BaseException) -> str:
    """The last line of DCP's message (its error, after every rank's traceback)."""
    lines = [line for line in str(err).splitlines() if line.strip()]
    return lines[-1] if lines else type(err).__name__


def load(chunks: dict, mesh: Mesh, run, path, optimizer=None) -> int:
    """Load the checkpoint at ``path`` into this rank's ``chunks`` (and ``optimizer``'s state, if given),
    whatever the layout that saved it; every rank calls it, ``run`` its description (named in the errors).
    Returns the step it was saved after."""
    _not_zero3(chunks)
    md = metadata(path)
    check_files(path)
    row = tp_row(mesh)
    es = entries(chunks, mesh)
    buffers: dict = {}  # name: the DTensor DCP fills, one per name (a tied copy shares the embedding's)

    def ask(key: str, like: torch.Tensor, piece: Piece) -> torch.Tensor:
        if key not in buffers:
            buffers[key] = _dtensor(torch.zeros_like(like), piece, row)
        return buffers[key]

    state: dict = {STEP: torch.zeros((), dtype=torch.int64, device="cpu")}
    for e in es:
        for piece, local in zip(e.pieces, e.split(e.param.detach())):
            state[MODEL + piece.name] = ask(MODEL + piece.name, local, piece)
            for m in MOMENTS if optimizer is not None else ():
                key = f"{OPTIM}{piece.name}.{m}"
                state[key] = ask(key, local, piece)
    if optimizer is not None:
        state[OPTIM + STEP] = torch.zeros((), dtype=torch.float64, device="cpu")
    _check_names(md, state, optimizer, run)
    try:
        dcp.load(state, storage_reader=dcp.FileSystemReader(os.fspath(path)))
    except (Exception, CheckpointException) as err:  # DCP's (a BaseException) carries every rank's traceback
        raise CheckpointError(f"loading the checkpoint at {os.fspath(path)} failed: "
                              f"{_last_line(err)}") from err

    def whole(e: Entry, prefix: str, suffix: str = "") -> torch.Tensor:
        parts = [state[f"{prefix}{p.name}{suffix}"].to_local() for p in e.pieces]
        return parts[0] if e.dim is None else torch.cat(parts, e.dim)

    with torch.no_grad():
        for e in es:
            e.param.copy_(whole(e, MODEL))
        for e in es if optimizer is not None else ():
            moments = {m: whole(e, OPTIM, "." + m) for m in MOMENTS}
            _set_moments(optimizer, e.param, moments, float(state[OPTIM + STEP]))
    return int(state[STEP])


# ---------------------------------------------------------------------------------------------------------
# What the checkpoint holds, file by file
# ---------------------------------------------------------------------------------------------------------


def files(path) -> list[dict]:
    """The checkpoint's files: each one's name, the rank that wrote it (``None``: the metadata), its bytes,
    the bytes of the tensors' elements in it (the rest is ``torch.save``'s framing of each slice), and the
    slices in it, ``{name: (offsets, sizes, the whole tensor's size)}``."""
    path, md = os.fspath(path), metadata(path)
    slices: dict[str, dict] = {}
    data: dict[str, int] = {}
    for index, info in md.storage_data.items():
        saved = md.state_dict_metadata[index.fqn]
        chunks = getattr(saved, "chunks", None)
        offsets = tuple(index.offset) if index.offset is not None else ()
        sizes = next((tuple(c.sizes) for c in chunks or () if tuple(c.offsets) == offsets), None)
        whole = tuple(getattr(saved, "size", ()))
        slices.setdefault(info.relative_path, {})[index.fqn] = (offsets, sizes, whole)
        if sizes is not None:
            data[info.relative_path] = (data.get(info.relative_path, 0)
                                        + math.prod(sizes) * saved.properties.dtype.itemsize)
    out = []
    for name in sorted(os.listdir(path)):
        match = re.fullmatch(r"__(\d+)_\d+\.distcp", name)
        out.append({"file": name, "rank": int(match.group(1)) if match else None,
                    "bytes": os.path.getsize(os.path.join(path, name)), "tensor_bytes": data.get(name, 0),
                    "slices": slices.get(name, {})})
    return out


def bytes_by_rank(path) -> dict[int, dict[str, int]]:
    """What each rank wrote (its shard files), by rank: ``{"bytes": ..., "tensor_bytes": ...}``."""
    out: dict[int, dict[str, int]] = {}
    for f in files(path):
        if f["rank"] is not None:
            mine = out.setdefault(f["rank"], {"bytes": 0, "tensor_bytes": 0})
            mine["bytes"] += f["bytes"]
            mine["tensor_bytes"] += f["tensor_bytes"]
    return out


__all__ = ["MODEL", "OPTIM", "STEP", "MOMENTS", "CheckpointError", "Piece", "Entry", "entries", "tp_row",
           "save", "metadata", "check_files", "load", "files", "bytes_by_rank"]
