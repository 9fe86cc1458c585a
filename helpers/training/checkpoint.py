"""Stop, save, resume elsewhere (chapter 15): a distributed checkpoint of a composed run, written by every
rank with ``torch.distributed.checkpoint`` (DCP, which runs on gloo) and loaded onto another layout.

A checkpoint holds the *reference's* tensors (the single-process GPT's names, ``q_proj`` not ``qkv_proj``,
each MoE layer's experts as one tensor of ``n_experts`` rows), each rank writing only boxes of them that it
keeps: its tensor-parallel slices, its experts, and under ZeRO-3 only its flat shard's rows
(``helpers.training.checkpoint_pieces`` says where each box sits). A box ``c`` ranks keep (a norm on every tp
rank, a parameter on every data-parallel replica without ZeRO-3) is written once, a ``1/c`` of its rows by
each of them.
Loading asks, on the new layout, for the boxes that layout keeps; DCP reads them from whichever files hold
them: that is the resharding.

The optimizer's state goes with the parameters (``optimizer=``): AdamW's two moments of every parameter, cut
like the parameter, and its step count. Plain AdamW keeps them per parameter; chapter 04's ZeRO-1
(``zero.ShardedAdamW``) its rows of each parameter's, all-gathered over the data-parallel group to be saved
whole (and on loading it keeps its rows, and resets its master shards from the loaded parameters); ZeRO-3
(chapter 10's ``composition.ChunksZero3``) its flat shard's rows, saved and loaded as the parameter's, and
plain AdamW for a MoE run's experts. Muon's state is not saved. A tied LM head's copy on the last stage is the
embedding's boxes: it is not written, and is read from ``tok_emb.weight``.

Before DCP reads anything, :func:`load` checks the checkpoint against the layout, on every rank alike: every
file the metadata names is there with its bytes; the names, shapes and dtypes are the model's, none missing
and none extra (DCP alone loads a subset of a checkpoint's names, and casts, without a word); and the saved
boxes cover every element a rank asks for. A failure raises :class:`CheckpointError` naming the file, the
names, the shapes or the dtypes. :func:`files` lists the checkpoint's files, the bytes each rank wrote, the
bytes of tensor elements counted in them, and the boxes in each.
"""

from __future__ import annotations

import io
import math
import os
import re

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from helpers.parallel import composition, zero
from helpers.parallel.mesh import Mesh
from helpers.training.checkpoint_pieces import Boxes, Held, held, load_planner, save_planner, share

MODEL, OPTIM, STEP = "model.", "optim.", "step"
MOMENTS = ("exp_avg", "exp_avg_sq")
METADATA = ".metadata"


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model or the layout loading it, or is incomplete."""


# ---------------------------------------------------------------------------------------------------------
# The optimizer's moments, shaped like what the rank keeps of each parameter
# ---------------------------------------------------------------------------------------------------------


def _optimizer_kind(optimizer) -> str:
    if isinstance(optimizer, zero.ShardedAdamW) and optimizer.stage == 1:
        return "zero1"
    if isinstance(optimizer, composition.ChunksZero3):
        return "zero3"
    if type(optimizer) is torch.optim.AdamW:
        return "adamw"
    raise TypeError(f"checkpoint saves AdamW's, ZeRO-1's and ZeRO-3's state, "
                    f"not {type(optimizer).__name__}'s")


def _owner(optimizer, h: Held):
    """The torch optimizer holding ``h``'s state, and the tensor it is keyed by."""
    kind = _optimizer_kind(optimizer)
    if kind == "adamw":
        return optimizer, h.param
    if kind == "zero1":
        return optimizer.optimizer, optimizer.shard_of_param[h.param]
    if h.zero3 is not None:  # a dense parameter: its ZeRO-3's AdamW, keyed by its shard
        return h.zero3.optimizer, h.kept()
    return optimizer.experts, h.param  # an expert: plain AdamW


def _moments(optimizer, h: Held) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``h``'s AdamW moments, shaped like what the rank keeps of it (ZeRO-1's rows all-gathered), and its
    step count."""
    opt, key = _owner(optimizer, h)
    state = opt.state.get(key, {})
    if not state:
        raise CheckpointError("the optimizer has no state yet: save after its first step, or without it")
    if _optimizer_kind(optimizer) == "zero1":
        rows = h.param.shape[0]
        return {m: zero.all_gather_rows(state[m], rows, optimizer.group) for m in MOMENTS}, state["step"]
    return {m: state[m] for m in MOMENTS}, state["step"]


def _set_moments(optimizer, h: Held, moments: dict[str, torch.Tensor], step: float) -> None:
    """Give ``h`` the loaded moments and step (ZeRO-1: its rows of them, and its master shard)."""
    count = torch.tensor(step, dtype=torch.float64 if torch.get_default_dtype() == torch.float64
                         else torch.float32, device="cpu")  # AdamW keeps its step count on the CPU
    opt, key = _owner(optimizer, h)
    if _optimizer_kind(optimizer) != "zero1":
        opt.state[key] = {"step": count, **{m: moments[m].clone() for m in MOMENTS}}
        return
    rank, world = optimizer.rank, optimizer.world_size
    key.data.copy_(zero.shard_of(h.param.detach(), rank, world))  # the master rows: a view of the flat buffer
    opt.state[key] = {"step": count, **{m: zero.shard_of(moments[m], rank, world) for m in MOMENTS}}


# ---------------------------------------------------------------------------------------------------------
# Save
# ---------------------------------------------------------------------------------------------------------


def _put(state: dict, h: Held, kept: torch.Tensor, prefix: str, suffix: str = "", fresh: bool = False):
    """``h``'s boxes of ``kept`` (a tensor shaped like what the rank keeps of it) into ``state``, each under
    ``prefix`` + its reference tensor's name + ``suffix``; ``fresh``: new tensors for DCP to fill instead."""
    for box in h.boxes:
        boxes = state.setdefault(prefix + box.name + suffix, Boxes(box.whole, kept.dtype))
        part = box.of(kept).detach()
        boxes.add(box.offsets, torch.zeros(part.shape, dtype=part.dtype, device="cpu") if fresh else part)


def save(chunks: dict, mesh: Mesh, run, step: int, path, optimizer=None) -> None:
    """Write the checkpoint of this rank's ``chunks`` (after ``step`` steps) under ``path``: every rank
    calls it; each writes only boxes it keeps (``__<rank>_0.distcp``), rank 0 the metadata too. With
    ``optimizer``, its AdamW moments and step count go with the parameters."""
    state: dict = {STEP: torch.tensor(step, device="cpu")}  # the same on every rank: written once
    count = None
    for h in held(chunks, mesh, run):
        if h.copy:
            continue
        _put(state, h, h.kept(), MODEL)
        if optimizer is not None:
            moments, count = _moments(optimizer, h)
            for m in MOMENTS:
                _put(state, h, moments[m], OPTIM, "." + m)
    if optimizer is not None:
        state[OPTIM + STEP] = count.detach().to("cpu", torch.float64)
    share(state)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(os.fspath(path)), planner=save_planner())


# ---------------------------------------------------------------------------------------------------------
# Check, then load
# ---------------------------------------------------------------------------------------------------------


def metadata(path):
    """The checkpoint's metadata (DCP's ``.metadata``), or a :class:`CheckpointError` saying it is not one."""
    path = os.fspath(path)
    if not os.path.isfile(os.path.join(path, METADATA)):
        raise CheckpointError(f"no checkpoint at {path}: its {METADATA} file is missing")
    return dcp.FileSystemReader(path).read_metadata()


def _listed(names) -> str:
    shown = sorted(set(names))
    return f"{', '.join(shown[:4])}{' …' if len(shown) > 4 else ''}"


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
        size = os.path.getsize(file) if os.path.isfile(file) else None
        if size is None or size < end:
            what = "is missing" if size is None else f"holds {size} bytes, not {end}"
            raise CheckpointError(f"checkpoint {path}: shard file {name} {what}; it held "
                                  f"{len(set(names))} tensors' boxes ({_listed(names)})")


def _uncovered(saved, boxes: Boxes) -> int:
    """How many elements of this rank's ``boxes`` no saved chunk holds (DCP would leave them as they were)."""
    missing = 0
    for offsets, t in boxes.parts.items():
        covered = 0
        for chunk in saved.chunks:
            overlap = [min(o + s, co + cs) - max(o, co)
                       for o, s, co, cs in zip(offsets, t.shape, chunk.offsets, chunk.sizes)]
            covered += math.prod(max(n, 0) for n in overlap)
        missing += math.prod(t.shape) - covered
    return missing


def _check_names(md, state: dict, optimizer, run) -> None:
    """The checkpoint's names, shapes and dtypes are the model's (every rank's names, gathered), and its boxes
    cover what each rank asks for, or a :class:`CheckpointError` on every rank naming what differs."""
    mine = sorted(k for k in state if k.startswith(MODEL))
    problems, dtypes, holes = [], {}, []
    for key, t in sorted(state.items()):
        saved = md.state_dict_metadata.get(key)
        if saved is None:
            continue
        if tuple(getattr(saved, "size", ())) != tuple(t.shape):
            problems.append(f"{key}: the checkpoint's shape {tuple(saved.size)}, "
                            f"the model's {tuple(t.shape)}")
        elif key not in (STEP, OPTIM + STEP) and saved.properties.dtype != t.dtype:  # DCP would cast
            dtypes.setdefault((saved.properties.dtype, t.dtype), []).append(key)
        elif isinstance(t, Boxes) and _uncovered(saved, t):
            holes.append(f"{key} ({_uncovered(saved, t)} of {t.elements()} elements)")
    problems += [f"{len(keys)} tensors saved in {a}, the model's in {b} ({keys[0]}, …)"
                 for (a, b), keys in dtypes.items()]
    if holes:
        problems.append(f"the checkpoint's boxes leave elements unsaved that this layout reads: "
                        f"{_listed(holes)}")
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (mine, problems))
    model = {k for names, _ in gathered for k in names}
    problems = sorted({p for _, ps in gathered for p in ps})
    saved_model = {k for k in md.state_dict_metadata if k.startswith(MODEL)}
    for what, keys in (("missing from the checkpoint", model - saved_model),
                       ("in the checkpoint but not in the model", saved_model - model)):
        if keys:
            problems.insert(0, f"{len(keys)} parameters {what}: {_listed(k[len(MODEL):] for k in keys)}")
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
    md = metadata(path)
    check_files(path)
    hs = held(chunks, mesh, run)
    state: dict = {STEP: torch.zeros((), dtype=torch.int64, device="cpu")}
    for h in hs:  # every box this rank keeps, a tied copy's too (one request per box)
        _put(state, h, h.kept(), MODEL, fresh=True)
        for m in MOMENTS if optimizer is not None else ():
            _put(state, h, h.kept(), OPTIM, "." + m, fresh=True)
    if optimizer is not None:
        state[OPTIM + STEP] = torch.zeros((), dtype=torch.float64, device="cpu")
    _check_names(md, state, optimizer, run)
    try:
        dcp.load(state, storage_reader=dcp.FileSystemReader(os.fspath(path)), planner=load_planner())
    except (Exception, CheckpointException) as err:  # DCP's (a BaseException) carries every rank's traceback
        raise CheckpointError(f"loading the checkpoint at {os.fspath(path)} failed: "
                              f"{_last_line(err)}") from err

    def whole(h: Held, prefix: str, suffix: str = "") -> torch.Tensor:
        """What the rank keeps of ``h``, from the loaded boxes (a ZeRO-3 shard's padding rows zero)."""
        kept = torch.zeros_like(h.kept())
        for box in h.boxes:
            box.of(kept).copy_(state[prefix + box.name + suffix].parts[box.offsets])
        return kept

    with torch.no_grad():
        for h in hs:
            h.kept().copy_(whole(h, MODEL))  # under ZeRO-3, the shard: rows of the flat buffer gathered next
        for h in hs if optimizer is not None else ():
            moments = {m: whole(h, OPTIM, "." + m) for m in MOMENTS}
            _set_moments(optimizer, h, moments, float(state[OPTIM + STEP]))
    return int(state[STEP])


# ---------------------------------------------------------------------------------------------------------
# What the checkpoint holds, file by file
# ---------------------------------------------------------------------------------------------------------


def files(path) -> list[dict]:
    """The checkpoint's files: each one's name, the rank that wrote it (``None``: the metadata), its bytes,
    the bytes of tensor elements in it (counted from the tensors read back from the file; the rest is
    ``torch.save``'s framing of each box), and the boxes in it, ``{name: [(offsets, sizes, the whole
    tensor's size), ...]}``."""
    path, md = os.fspath(path), metadata(path)
    boxes: dict[str, dict] = {}
    data: dict[str, int] = {}
    for index, info in md.storage_data.items():
        file = os.path.join(path, info.relative_path)
        if not os.path.isfile(file):
            continue
        with open(file, "rb") as f:
            f.seek(info.offset)
            t = torch.load(io.BytesIO(f.read(info.length)), weights_only=True)
        data[info.relative_path] = data.get(info.relative_path, 0) + t.numel() * t.element_size()
        offsets = tuple(index.offset) if index.offset is not None else ()
        whole = tuple(getattr(md.state_dict_metadata[index.fqn], "size", ()))
        boxes.setdefault(info.relative_path, {}).setdefault(index.fqn, []).append(
            (offsets, tuple(t.shape), whole))
    out = []
    for name in sorted(os.listdir(path)):
        match = re.fullmatch(r"__(\d+)_\d+\.distcp", name)
        out.append({"file": name, "rank": int(match.group(1)) if match else None,
                    "bytes": os.path.getsize(os.path.join(path, name)), "tensor_bytes": data.get(name, 0),
                    "boxes": boxes.get(name, {})})
    return out


def bytes_by_rank(path) -> dict[int, dict[str, int]]:
    """What each rank wrote (its shard files), by rank: ``{"bytes": ..., "tensor_bytes": ...}``; the
    metadata file (written by rank 0) is not in it: :func:`files` lists it, with rank ``None``."""
    out: dict[int, dict[str, int]] = {}
    for f in files(path):
        if f["rank"] is not None:
            mine = out.setdefault(f["rank"], {"bytes": 0, "tensor_bytes": 0})
            mine["bytes"] += f["bytes"]
            mine["tensor_bytes"] += f["tensor_bytes"]
    return out


def against_expected(path, run) -> list[dict]:
    """For a page: each rank's file, its bytes, the tensor bytes counted in it and ``torch.save``'s framing
    around them, beside the tensor bytes ``checkpoint_bytes.expected_bytes`` derives from the shapes and the
    layout (to match exactly); the last row the metadata file (rank ``None``), which nothing predicts."""
    from helpers.training.checkpoint_bytes import expected_bytes

    expected = expected_bytes(run, optimizer=OPTIM + STEP in metadata(path).state_dict_metadata)
    rows = [{"rank": f["rank"], "file": f["file"], "bytes": f["bytes"], "tensor_bytes": f["tensor_bytes"],
             "framing": f["bytes"] - f["tensor_bytes"],
             "expected": None if f["rank"] is None else expected[f["rank"]]["tensor_bytes"]}
            for f in files(path)]
    return sorted(rows, key=lambda r: (r["rank"] is None, r["rank"] or 0))


__all__ = ["MODEL", "OPTIM", "STEP", "MOMENTS", "CheckpointError", "save", "metadata", "check_files", "load",
           "files", "bytes_by_rank", "against_expected"]
