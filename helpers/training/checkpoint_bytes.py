"""What a checkpoint of a capstone run should weigh, rank by rank (chapter 15), from the model's shapes and
the layout alone: no ranks, and none of ``helpers.training.checkpoint``'s code, so that the bytes each rank
wrote (``checkpoint.bytes_by_rank``) can be checked against it, exactly.

A rank holds, of each parameter of its pipeline chunks (chapter 06's placement), its tensor-parallel slice
(chapter 05's ``shard_state``, which stacks ``q, k, v`` in ``qkv_proj`` and ``gate, up`` in
``gate_up_proj``), of each MoE layer its experts (chapter 08's ``expert_shards``), and under ZeRO-3 only rows
``[r·k, min((r+1)·k, rows))`` of each dense slice (``k = ceil(rows / N)`` over the ``N`` ranks of the
data-parallel group, ``r`` its place in it); with the optimizer, AdamW's two moments of the same elements.

Each stacked part of those rows is held by ``c`` ranks: the tp ranks that hold the same slice (every tp rank
for a norm, a MoE layer's router and experts, learned positions; ``tp // n_kv_heads`` for a copied KV head),
times the data-parallel ranks for a dense tensor without ZeRO-3, times the ``dp_replicate`` replicas when the
data-parallel group does not include them. The ``j``-th of those ranks (in rank order) writes the ``j``-th run
of ``ceil(rows / c)`` of its rows: every rank writes a ``1/c`` of what ``c`` ranks share. A tied head's copy
on the last stage is the embedding's: not written.

Rank 0 also writes the step counts (the step saved after, an int64, and AdamW's, a float64): 16 bytes.
:func:`expected_bytes` counts tensor elements times the run's bytes per element: the checkpoint's files also
hold ``torch.save``'s framing of each box, and rank 0 writes the metadata file; those are not predicted.
"""

from __future__ import annotations

from helpers.parallel import expert_parallel, pipeline_parallel, tensor_parallel
from helpers.parallel.parallel_dims import make_schedule
from helpers.reference import named_params

WHOLE_ON_EVERY_TP_RANK = ("ln1.", "ln2.", "ln_f.", ".mlp.router.", ".mlp.experts.", "pos_emb.")


def _run_of(rows: int, j: int, c: int) -> tuple[int, int]:
    """The ``j``-th of ``c`` runs of ``ceil(rows / c)`` rows: ``[j·k, min((j+1)·k, rows))``, empty past the
    end (ZeRO-3's rows of rank ``j`` of ``c``, or a shared box's part written by its ``j``-th holder)."""
    k = -(-rows // c)
    return min(j * k, rows), min((j + 1) * k, rows)


def _stacked(name: str, rows: int, cfg, tp: int, tp_rank: int) -> list[tuple[int, int, int]]:
    """The rows of a rank's tensor-parallel slice, part by stacked part: ``(rows, tp ranks holding the same
    part, this rank's place among them)``."""
    if any(part in name for part in WHOLE_ON_EVERY_TP_RANK):
        return [(rows, tp, tp_rank)]
    if name.endswith("qkv_proj.weight"):
        c = max(tp // cfg.n_kv_heads, 1)
        q = cfg.n_heads * cfg.head_dim // tp
        kv = (rows - q) // 2
        return [(q, 1, 0), (kv, c, tp_rank % c), (kv, c, tp_rank % c)]
    if name.endswith("gate_up_proj.weight"):
        return [(rows // 2, 1, 0), (rows // 2, 1, 0)]
    return [(rows, 1, 0)]


def expected_bytes(run, optimizer: bool = True) -> dict[int, dict[str, int]]:
    """Each rank's bytes of tensor elements in a checkpoint of ``run`` (parameters, and with ``optimizer``
    AdamW's two moments, in the run's dtype; rank 0's the step counts too): ``{rank: {"elements": ...,
    "tensor_bytes": ...}}``."""
    from helpers.training import capstone  # the run's model, as capstone builds it

    model = capstone.build(run)
    cfg, full = model.cfg, named_params(model)
    mesh = run.mesh(run.world_size)
    tp = run.tp
    replicas = run.dp_replicate if "dp_replicate" not in mesh.parts(run.dp_dim) else 1
    n_chunks = run.pp * run.vpp if run.pp > 1 else 1
    schedule = make_schedule(run.schedule, run.pp, run.m, run.vpp) if run.pp > 1 else None
    copies = 3 if optimizer else 1
    out = {}
    for rank in range(run.world_size):
        c = mesh.coordinates(rank)
        row = next(row for row in mesh.rows(run.dp_dim) if rank in row)
        dp, dp_rank, tp_rank = len(row), row.index(rank), c.get("tp", 0)
        replica = c.get("dp_replicate", 0) if replicas > 1 else 0
        elements = 0
        for index in schedule.chunks_of(c.get("pp", 0)) if schedule else [0]:
            chunk = pipeline_parallel.pipeline_chunk(model, index, n_chunks)
            names = [n for n, _ in chunk.named_parameters()]
            part = {n: full[n] for n in names if n in full}  # a tied head's copy is no reference tensor
            slices = tensor_parallel.shard_state(part, cfg, tp_rank, tp) if tp > 1 else part
            if run.n_experts and dp > 1:
                slices = expert_parallel.expert_shards(slices, cfg, dp_rank, dp)
            for name, t in slices.items():
                expert = expert_parallel.is_expert(name)
                zero3 = run.zero == 3 and dp > 1 and not expert
                lo, hi = _run_of(t.shape[0], dp_rank, dp) if zero3 else (0, t.shape[0])
                per_row = t[0].numel() if t.dim() > 1 else 1
                shared_dp = (dp, dp_rank) if not (zero3 or expert) else (1, 0)
                start = 0
                for rows, c_tp, j_tp in _stacked(name, t.shape[0], cfg, tp, tp_rank):
                    held = max(min(hi, start + rows) - max(lo, start), 0)  # this part's rows the rank holds
                    start += rows
                    holders = replicas * shared_dp[0] * c_tp
                    j = (replica * shared_dp[0] + shared_dp[1]) * c_tp + j_tp  # in rank order
                    a, b = _run_of(held, j, holders)
                    elements += (b - a) * per_row
        steps = (8 + 8 * optimizer) if rank == 0 else 0
        out[rank] = {"elements": copies * elements,
                     "tensor_bytes": copies * elements * run.dtype.itemsize + steps}
    return out


__all__ = ["WHOLE_ON_EVERY_TP_RANK", "expected_bytes"]
