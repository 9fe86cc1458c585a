"""What a checkpoint of a capstone run should weigh, rank by rank (chapter 15), from the model's shapes and
the layout alone: no ranks, and none of ``helpers.training.checkpoint``'s code, so that the bytes each rank
wrote (``checkpoint.bytes_by_rank``) can be checked against it, exactly.

A rank holds, of each parameter of its pipeline chunks (chapter 06's placement), its tensor-parallel slice
(chapter 05's ``shard_state``), of each MoE layer its experts (chapter 08's ``expert_shards``), and under
ZeRO-3 only rows ``[r·k, min((r+1)·k, rows))`` of each dense slice (``k = ceil(rows / N)`` over the ``N``
ranks of the data-parallel group, ``r`` its place in it); with the optimizer, AdamW's two moments of the same
elements. A tensor several ranks hold is written by the lowest rank holding it:

- a tensor whole on every tp rank (the norms, a MoE layer's router and experts, learned positions) by tp rank
  0; a KV head copied onto ``c = tp // n_kv_heads`` ranks by the first of them (tp rank divisible by ``c``);
- without ZeRO-3, a dense tensor (every data-parallel and context-parallel rank holds it) by dp_shard 0 and
  cp 0; under ZeRO-3 each of those ranks writes its own rows; experts are each rank's own;
- every tensor by dp_replicate 0; a tied head's copy on the last stage not at all (it is the embedding's).

Rank 0 also writes the two step counts (the step saved after, an int64, and AdamW's, a float64): 16 bytes.
:func:`expected_bytes` counts tensor elements times the run's bytes per element: the checkpoint's files also
hold ``torch.save``'s framing of each box, and rank 0 writes the metadata file; those are not predicted.
"""

from __future__ import annotations

from helpers.parallel import expert_parallel, pipeline_parallel, tensor_parallel
from helpers.parallel.parallel_dims import make_schedule
from helpers.reference import named_params

WHOLE_ON_EVERY_TP_RANK = ("ln1.", "ln2.", "ln_f.", ".mlp.router.", ".mlp.experts.", "pos_emb.")


def _rows_held(rows: int, r: int, n: int) -> tuple[int, int]:
    """ZeRO-3's rows of rank ``r`` of ``n``: ``[r·k, min((r+1)·k, rows))``, empty past the end."""
    k = -(-rows // n)
    return min(r * k, rows), min((r + 1) * k, rows)


def _written(name: str, t, cfg, where: dict, tp: int, zero3: tuple[int, int] | None) -> int:
    """Elements of the rank's tensor ``t`` (its tensor-parallel slice, under the parallel model's ``name``)
    that it writes; ``zero3``: its place ``(r, N)`` in the data-parallel group, if ZeRO-3 shards ``t``."""
    per_row = t[0].numel() if t.dim() > 1 else 1
    lo, hi = _rows_held(t.shape[0], *zero3) if zero3 else (0, t.shape[0])
    if any(part in name for part in WHOLE_ON_EVERY_TP_RANK):
        return (hi - lo) * per_row if where["tp"] == 0 else 0
    copies = max(tp // cfg.n_kv_heads, 1)
    if name.endswith("qkv_proj.weight") and copies > 1 and where["tp"] % copies:  # q rows only: kv copied
        q_rows = cfg.n_heads * cfg.head_dim // tp
        return max(min(hi, q_rows) - lo, 0) * per_row
    return (hi - lo) * per_row


def expected_bytes(run, optimizer: bool = True) -> dict[int, dict[str, int]]:
    """Each rank's bytes of tensor elements in a checkpoint of ``run`` (parameters, and with ``optimizer``
    AdamW's two moments, in the run's dtype; rank 0's the step counts too): ``{rank: {"elements": ...,
    "tensor_bytes": ...}}``."""
    model, cfg = _reference(run)
    full = named_params(model)
    mesh = run.mesh(run.world_size)
    tp, dp = run.tp, mesh.size(run.dp_dim)
    n_chunks = run.pp * run.vpp if run.pp > 1 else 1
    schedule = make_schedule(run.schedule, run.pp, run.m, run.vpp) if run.pp > 1 else None
    copies = 3 if optimizer else 1
    out = {}
    for rank in range(run.world_size):
        c = mesh.coordinates(rank)
        where = {name: c.get(name, 0) for name in ("pp", "dp_replicate", "dp_shard", "cp", "tp")}
        dp_rank = next(row for row in mesh.rows(run.dp_dim) if rank in row).index(rank)
        mine = schedule.chunks_of(where["pp"]) if schedule else [0]
        elements = 0
        for index in mine:
            chunk = pipeline_parallel.pipeline_chunk(model, index, n_chunks)
            names = [n for n, _ in chunk.named_parameters()]
            # a tied head's copy on the last chunk is the embedding's: not one of the reference's tensors
            part = {n: full[n] for n in names if n in full}
            slices = tensor_parallel.shard_state(part, cfg, where["tp"], tp) if tp > 1 else part
            if run.n_experts and dp > 1:
                slices = expert_parallel.expert_shards(slices, cfg, dp_rank, dp)
            for name, t in slices.items():
                expert = expert_parallel.is_expert(name)
                zero3 = (dp_rank, dp) if run.zero == 3 and dp > 1 and not expert else None
                replica = where["dp_replicate"] if "dp_replicate" not in mesh.parts(run.dp_dim) else 0
                if replica or (zero3 is None and not expert and dp_rank):
                    continue  # a copy of what a lower rank writes
                elements += _written(name, t, cfg, where, tp, zero3)
        size = run.dtype.itemsize
        out[rank] = {"elements": copies * elements,
                     "tensor_bytes": copies * elements * size + (rank == 0) * (8 + 8 * optimizer)}
    return out


def _reference(run):
    from helpers.training import capstone  # the run's model, as capstone builds it

    model = capstone.build(run)
    return model, model.cfg


__all__ = ["WHOLE_ON_EVERY_TP_RANK", "expected_bytes"]
