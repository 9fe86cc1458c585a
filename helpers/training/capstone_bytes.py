"""What one rank of the capstone sends in its measured step, by mesh dimension, from shapes (chapter 15).

The ledger (chapter 02) books every torch collective from the buffer it was given and counts the book's own
point-to-point messages; :func:`helpers.parallel.composition.traffic_by_dimension` adds them up by the mesh
dimension of each group. :func:`predicted` is the other side of that comparison: for one rank, given by its
coordinates, the bytes each parallelism should send in step ``capstone.MEASURED_STEP``, item by item
(:func:`items`), each from the model's shapes through a formula the book already names:

- **pp**: chapter 06's ``expected_p2p_bytes`` (one activation forward and one gradient back per micro-batch
  and chunk boundary between ranks), plus a ring all-reduce of the tied embedding's gradient between the
  ranks holding the first and the last chunk (the pipeline group itself when ``pp == 2``);
- **dp_shard_cp** (torchtitan's FSDP group): under ZeRO-3 a ring all-gather of each unit's shards (a block's
  ``2m`` times, before every micro-batch's forward and again before its backward; a chunk's root, its
  embeddings or final norm and head, once, held for the step) and one reduce-scatter per unit, deferred to
  the step; each parameter's rows padded to a multiple of the group (ZeRO's ``ceil(rows/N)``); the experts
  are not sharded. Under DDP (``zero=0``), one ring all-reduce of the dense gradients (buckets add up: a
  ring's bytes are linear in the buffer);
- **cp**: chapter 07's ``ring_bytes`` or ``ulysses_bytes`` per layer and micro-batch, on this rank's heads;
- **tp**: chapter 01's ``tensor_parallel_traffic`` for the dense layers, half its per-layer term (attention
  only) for a MoE layer, whose experts are whole on every tp rank; the LM head only on the last chunk; the
  vocabulary-parallel cross-entropy's three all-reduces of one number per token; one all-reduce per chunk of
  what sequence parallelism sums (norms, positions, the MoE layers' router and experts); and the replicated KV
  heads' all-reduce when ``tp`` exceeds them;
- **ep**: per MoE layer and micro-batch, the split sizes (one int64 per other rank and local expert), then
  dispatch and combine forward and their reverse all-to-alls backward: twice the rows that leave this rank
  and twice the rows that arrive, ``d_model`` numbers each. Which rows leave and arrive is the routing, taken
  from the single process (:func:`expected_routing`: its router on the tokens each rank of the
  expert-parallel group holds, :func:`rank_tokens`), never from the distributed layer's counters.

:func:`calculator` is chapter 01's figure for the same step (``memory_budget.budget(...).sent`` of the
rank's stage) under these names; :data:`CALCULATOR_DIFFERENCES` says why the two differ, dimension by
dimension.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from helpers.cost import memory_budget, pipeline_schedules, time_model
from helpers.parallel.context_parallel import ring_bytes, ulysses_bytes
from helpers.parallel.mesh import FLATTENED
from helpers.training import capstone


def whole(nbytes: float) -> int:
    """A formula's bytes as an integer: a ring moves ``(N-1)/N`` of buffers that ``N`` divides here, so a
    fraction means a buffer the formulas above do not describe (uneven chunks)."""
    if abs(nbytes - round(nbytes)) > 1e-6:
        raise ValueError(f"{nbytes} bytes is not a whole number: a buffer the ranks do not divide evenly")
    return int(round(nbytes))


@dataclass(frozen=True)
class Param:
    """One parameter as a rank of the run holds it: its name in the parallel model, shape, ZeRO-3 unit
    (``"root"`` or ``"block i"``), whether sequence parallelism sums its gradient over tp, whether it is an
    expert's (this rank's ``n_experts/ep`` of them)."""

    name: str
    shape: tuple[int, ...]
    unit: str
    sp_summed: bool = False
    expert: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def chunk_params(run: capstone.Run, chunk: int) -> list[Param]:
    """The parameters of pipeline chunk ``chunk`` on one tensor- and expert-parallel rank, from the model's
    configuration and chapter 05's cuts (heads, hidden units and vocabulary over ``tp``), chapter 08's
    (experts over ``ep``)."""
    cfg, tp, sp = run.model_config(), run.tp, run.sequence_parallel
    n_chunks = run.pp * run.vpp if run.pp > 1 else 1
    d, hd = cfg.d_model, cfg.head_dim
    kv = cfg.n_kv_heads * hd * max(tp // cfg.n_kv_heads, 1) // tp
    norm = ("weight", "bias") if cfg.norm == "layernorm" else ("weight",)
    out = []
    if chunk == 0:
        out.append(Param("tok_emb.weight", (cfg.vocab_size // tp, d), "root"))
        if cfg.rope_theta is None:
            out.append(Param("pos_emb.weight", (cfg.seq_len, d), "root", sp and tp > 1))
    for i in pipeline_schedules.stage_layers(cfg.n_layers, n_chunks)[chunk]:
        unit, p = f"block {i}", f"blocks.{i}."
        out += [Param(f"{p}{ln}.{w}", (d,), unit, sp and tp > 1) for ln in ("ln1", "ln2") for w in norm]
        out += [Param(p + "attn.qkv_proj.weight", (cfg.n_heads * hd // tp + 2 * kv, d), unit),
                Param(p + "attn.o_proj.weight", (d, cfg.n_heads * hd // tp), unit)]
        if getattr(cfg, "is_moe", lambda _: False)(i):
            marked = sp and tp > 1
            local = cfg.n_experts // run.ep
            out += [Param(p + "mlp.router.weight", (cfg.n_experts, d), unit, marked),
                    Param(p + "mlp.experts.up_proj.weight", (local, d * cfg.d_ff), unit, marked, True),
                    Param(p + "mlp.experts.down_proj.weight", (local, d * cfg.d_ff), unit, marked, True)]
        else:
            up = ("gate_up_proj", 2) if cfg.gated else ("up_proj", 1)
            out += [Param(f"{p}mlp.{up[0]}.weight", (up[1] * cfg.d_ff // tp, d), unit),
                    Param(p + "mlp.down_proj.weight", (d, cfg.d_ff // tp), unit)]
    if chunk == n_chunks - 1:
        out += [Param(f"ln_f.{w}", (d,), "root", sp and tp > 1) for w in norm]
        if not cfg.tie_embeddings or n_chunks > 1:  # a tied head on another chunk is its own copy
            out.append(Param("lm_head.weight", (cfg.vocab_size // tp, d), "root"))
    return out


def rank_chunks(run: capstone.Run, pp_rank: int) -> list[int]:
    """The chunks chapter 06's schedule places on pipeline rank ``pp_rank``."""
    return run.pipeline_schedule().chunks_of(pp_rank) if run.pp > 1 else [0]


def _sizes(run: capstone.Run) -> dict:
    cfg = run.model_config()
    micro_batch = run.global_batch // (run.dp * run.m)
    e = run.dtype.itemsize
    s_cp = cfg.seq_len // run.cp  # the positions one cp rank holds
    return dict(cfg=cfg, b=micro_batch, e=e, s_cp=s_cp,
                x=micro_batch * s_cp * cfg.d_model * e)  # chapter 01's x: one micro-batch's activation


def items(run: capstone.Run, where: dict, routing: dict | None = None) -> list[tuple[str, str, int]]:
    """What the rank at ``where`` (its coordinates: ``pp, dp_shard, cp, tp``) sends in one step, as
    ``(dimension, item, bytes)``. ``routing`` is :func:`expected_routing`'s (needed with ``ep > 1``)."""
    z = _sizes(run)
    cfg, m, e = z["cfg"], run.m, z["e"]
    chunks = rank_chunks(run, where["pp"])
    n_chunks = run.pp * run.vpp if run.pp > 1 else 1
    params = {c: chunk_params(run, c) for c in chunks}
    layers = {c: pipeline_schedules.stage_layers(cfg.n_layers, n_chunks)[c] for c in chunks}
    is_moe = getattr(cfg, "is_moe", lambda _: False)
    out = []
    if run.pp > 1:
        boundary = z["b"] * z["s_cp"] // (run.tp if run.sequence_parallel else 1) * cfg.d_model * e
        sent = pipeline_schedules.expected_p2p_bytes(run.pipeline_schedule(), where["pp"], boundary)[0]
        out.append(("pp", "activations and their gradients (expected_p2p_bytes)", sent))
        first, last = 0 in chunks, n_chunks - 1 in chunks
        if cfg.tie_embeddings and first != last:
            tied = cfg.vocab_size // run.tp * cfg.d_model * e
            out.append(("pp" if run.pp == 2 else "other", "tied embedding's gradient, ring all-reduce",
                        whole(time_model.ring_all_reduce_bytes(tied, 2))))
    n, dp = run.dp * run.cp, data_parallel_dimension(run)  # the group that shards the dense parameters
    if n > 1:
        for c in chunks:
            dense = [p for p in params[c] if not p.expert]
            if run.zero == 3:
                for unit in dict.fromkeys(p.unit for p in dense):
                    shard = sum(-(-p.shape[0] // n) * math.prod(p.shape[1:]) for p in dense if p.unit == unit)
                    gathers = 1 if unit == "root" else 2 * m
                    padded = n * shard * e  # the gathered buffer: every rank's shard, padding rows included
                    out.append((dp, f"chunk {c} {unit}: {gathers} all-gathers of its shards",
                                whole(gathers * time_model.ring_all_gather_bytes(padded, n))))
                    out.append((dp, f"chunk {c} {unit}: reduce-scatter at the step",
                                whole(time_model.ring_all_gather_bytes(padded, n))))
            elif run.zero == 0:
                numel = sum(p.numel for p in dense)
                out.append((dp, f"chunk {c}: all-reduce of the dense gradients",
                            whole(time_model.ring_all_reduce_bytes(numel * e, n))))
            else:
                raise ValueError(f"zero={run.zero}: the 5D run's formulas cover zero=0 and zero=3")
    if run.cp > 1:
        heads, kv_heads = cfg.n_heads // run.tp, max(cfg.n_kv_heads // run.tp, 1)  # this rank's
        for c in chunks:
            if run.attention == "ring":
                one = ring_bytes(z["b"], cfg.seq_len, kv_heads, cfg.head_dim, run.cp, e)
            else:
                one = ulysses_bytes(z["b"], cfg.seq_len, heads, kv_heads, cfg.head_dim, run.cp, e)
            out.append(("cp", f"chunk {c}: {run.attention} attention, {len(layers[c])} layers x {m} "
                        f"micro-batches", whole(len(layers[c]) * m * one)))
    if run.tp > 1:
        out += _tp_items(run, z, chunks, n_chunks, params, layers, is_moe)
    if run.ep > 1 and getattr(cfg, "n_experts", 0):
        if routing is None:
            raise ValueError("ep > 1: give the routing (expected_routing) to predict the all-to-alls")
        out += _ep_items(run, z, where, chunks, layers, is_moe, routing)
    return out


def data_parallel_dimension(run: capstone.Run) -> str:
    """The name ``traffic_by_dimension`` gives the data-parallel group (``run.dp_dim``): its one part of
    more than one rank (``dp_shard`` without context parallelism), or the flattened name."""
    parts = [p for p in FLATTENED.get(run.dp_dim, (run.dp_dim,)) if getattr(run, p) > 1]
    return parts[0] if len(parts) == 1 else run.dp_dim


def _tp_items(run, z, chunks, n_chunks, params, layers, is_moe) -> list:
    cfg, m, e, x, tp, sp = z["cfg"], run.m, z["e"], z["x"], run.tp, run.sequence_parallel
    out = []

    def formula(n_layers, embedding):
        return time_model.tensor_parallel_traffic(x, tp, sp, n_layers, m, embedding=embedding)[0]
    head = formula(0, False)  # the LM head's term alone
    attention_only = (formula(1, False) - head) / 2  # a MoE layer: attention's f and g, not the MLP's
    for c in chunks:
        dense = sum(not is_moe(i) for i in layers[c])
        moe = len(layers[c]) - dense
        sent = formula(dense, c == 0) - (0 if c == n_chunks - 1 else head) + moe * attention_only
        out.append(("tp", f"chunk {c}: tensor_parallel_traffic, {dense} dense + {moe} MoE layers"
                    f"{', embedding' if c == 0 else ''}{', head' if c == n_chunks - 1 else ''}", whole(sent)))
        if c == n_chunks - 1:  # max, target logit, sum of exponentials: at least fp32 (chapter 05)
            loss = torch.promote_types(run.dtype, torch.float32).itemsize
            one = time_model.ring_all_reduce_bytes(z["b"] * z["s_cp"] * loss, tp)
            out.append(("tp", f"chunk {c}: vocabulary-parallel cross-entropy, 3 x {m} all-reduces",
                        whole(3 * m * one)))
        summed = sum(p.numel for p in params[c] if p.sp_summed)
        if summed:
            out.append(("tp", f"chunk {c}: all-reduce of the sequence-parallel gradients ({summed} numbers)",
                        whole(time_model.ring_all_reduce_bytes(summed * e, tp))))
        if tp > cfg.n_kv_heads:  # chapter 05: one buffer of n_kv_heads slots, K and V rows of every layer
            copies = cfg.n_kv_heads * len(layers[c]) * 2 * cfg.head_dim * cfg.d_model * e
            out.append(("tp", f"chunk {c}: replicated KV heads' gradients",
                        whole(time_model.ring_all_reduce_bytes(copies, tp))))
    return out


def ep_index(run: capstone.Run, where: dict) -> int:
    """The rank's place in the expert-parallel group, folded onto ``dp_shard × cp`` (dp_shard slower)."""
    return where["dp_shard"] * run.cp + where["cp"]


def rank_tokens(run: capstone.Run, where: dict, micro: int) -> tuple[list[int], list[int]]:
    """The (rows, positions) of the global batch whose tokens the rank at ``where`` routes in micro-batch
    ``micro``, in the layer's order (row by row): its rows along ``dp`` (chapter 03's equal consecutive
    shares), the micro-batch's rows of those, its context-parallel positions (chapter 07's zigzag, by hand:
    chunk ``r`` then chunk ``2·cp-1-r``, or the contiguous slice), and under sequence parallelism its
    ``1/tp`` of them (consecutive)."""
    b, s = run.global_batch // (run.dp * run.m), run.seq_len
    dp_index = where.get("dp_replicate", 0) * run.dp_shard + where["dp_shard"]
    first = dp_index * (run.global_batch // run.dp) + micro * b
    rows = list(range(first, first + b))
    r = where["cp"]
    if run.cp_layout == "zigzag":
        c = s // (2 * run.cp)
        late = 2 * run.cp - 1 - r
        positions = list(range(r * c, (r + 1) * c)) + list(range(late * c, (late + 1) * c))
    else:
        positions = list(range(r * s // run.cp, (r + 1) * s // run.cp))
    if run.sequence_parallel and run.tp > 1:
        k = len(positions) // run.tp
        positions = positions[where["tp"] * k:(where["tp"] + 1) * k]
    return rows, positions


def routed_rows(run: capstone.Run, where: dict, routing: dict, layer: int, micro: int) -> dict[str, int]:
    """Rows of MoE layer ``layer`` in micro-batch ``micro`` for the rank at ``where``, from the single
    process's routing of every expert-parallel rank's tokens (:func:`rank_tokens`): ``leave`` (its tokens'
    assignments to other ranks' experts), ``arrive`` (other ranks' tokens' assignments to its experts) and
    ``stay`` (its own tokens' assignments to its own experts). No capacity: every assignment is kept."""
    n_local, me = run.n_experts // run.ep, ep_index(run, where)
    out = dict(leave=0, arrive=0, stay=0)
    for k in range(run.ep):
        rows, positions = rank_tokens(run, dict(where, dp_shard=k // run.cp, cp=k % run.cp), micro)
        owner = routing[layer][rows][:, positions] // n_local  # (rows, positions, top_k): the expert's rank
        if k == me:
            out["leave"] += int((owner != me).sum())
            out["stay"] += int((owner == me).sum())
        else:
            out["arrive"] += int((owner == me).sum())
    return out


def _ep_items(run, z, where, chunks, layers, is_moe, routing) -> list:
    cfg, e, ep = z["cfg"], z["e"], run.ep
    out = []
    for c in chunks:
        for i in (i for i in layers[c] if is_moe(i)):
            rows = [routed_rows(run, where, routing, i, micro) for micro in range(run.m)]
            leave, arrive = sum(r["leave"] for r in rows), sum(r["arrive"] for r in rows)
            int64 = torch.int64.itemsize
            counts = run.m * (ep - 1) * (cfg.n_experts // ep) * int64
            out.append(("ep", f"block {i}: split sizes, {run.m} all-to-alls of int64 counts", counts))
            out.append(("ep", f"block {i}: dispatch and combine's backward, {leave} rows leaving",
                        2 * leave * cfg.d_model * e))
            out.append(("ep", f"block {i}: combine and dispatch's backward, {arrive} rows arriving",
                        2 * arrive * cfg.d_model * e))
    return out


def predicted(run: capstone.Run, where: dict, routing: dict | None = None) -> dict[str, int]:
    """:func:`items` added up by mesh dimension (the names of ``composition.traffic_by_dimension``)."""
    out: dict[str, int] = {}
    for dim, _, nbytes in items(run, where, routing):
        out[dim] = out.get(dim, 0) + nbytes
    return out


def expected_routing(run: capstone.Run, batches_) -> dict[int, torch.Tensor]:
    """``{block: (global_batch, seq_len, top_k) experts}``: what the single process's routers choose for
    every token of the measured step's batch, after training the steps before it by the book's loop (the
    reference of ``capstone.reference_run``). Each router's choice is recomputed here from its weights and
    the layer's input (top-k of the softmax, DeepSeek's bias added to choose), not read from the layer."""
    from helpers.parallel.moe import MoELayer
    from helpers.reference import train_steps

    model = capstone.build(run)
    train_steps(model, batches_[:capstone.MEASURED_STEP], optimizer=capstone.reference_optimizer(model, run))
    inputs, hooks = {}, []
    for name, block in model.blocks.items():
        if isinstance(block.mlp, MoELayer):
            hooks.append(block.mlp.register_forward_pre_hook(
                lambda _, args, i=int(name): inputs.__setitem__(i, args[0].detach())))
    x, y = batches_[capstone.MEASURED_STEP]
    try:
        with torch.no_grad():
            model(x, y)
    finally:
        for h in hooks:
            h.remove()
    out = {}
    for i, h in inputs.items():
        layer = model.blocks[str(i)].mlp
        logits = h.to(torch.promote_types(h.dtype, torch.float32)) @ layer.router.weight.t().to(h.dtype)
        choice = logits.softmax(-1) + layer.expert_bias.to(logits.dtype)
        out[i] = choice.topk(run.top_k, dim=-1).indices
    return out


def calculator(run: capstone.Run) -> dict[int, dict[str, float]]:
    """Chapter 01's calculator's bytes for one step of each pipeline stage (``budget(...).sent``), in its own
    names (``dp`` is the dense parameters' group: ``parallel_dims.layout_dimension`` maps the mesh's names to
    these)."""
    shape, e = capstone.model_shape(run), run.dtype.itemsize
    precision = memory_budget.Precision(run.precision, e, e, 0, 2 * e, e)  # AdamW's moments, no master copy
    return {stage: memory_budget.budget(shape, run.batch(), run.layout(), precision, stage=stage).sent
            for stage in range(run.pp)}


CALCULATOR_DIFFERENCES = {
    "pp": "the calculator charges an interior stage 2·vpp·m boundaries; a rank sends only across the "
          "boundaries of its chunks whose neighbour is on another rank (the first chunk has no previous one, "
          "the last no next), plus the tied embedding's all-reduce, which the calculator does not model",
    "dp": "the calculator's ZeRO-3 gathers every parameter for each micro-batch's forward and "
                   "backward and reduce-scatters each micro-batch (3m passes); here a block is gathered 2m "
                   "times, the root once, and the reduce-scatter waits for the step (2m+1 passes for a "
                   "block, 2 for the root), rows padded to the group; under DDP both are one all-reduce",
    "cp": "the calculator has ring attention's formula only (Ulysses' bytes equal it on this model by "
          "coincidence), on the busiest contiguous stage's layers",
    "tp": "the calculator charges every layer four all-reduces (its experts are tensor-parallel), every "
          "stage the LM head, and no cross-entropy or sequence-parallel gradient all-reduce; here a MoE "
          "layer keeps its experts whole on every tp rank (attention's two only), and its experts' "
          "gradients are summed over tp with the norms'",
    "ep": "the calculator assumes uniform routing ((ep-1)/ep of the rows leave, as many arrive), charges "
          "every stage the MoE layers of the busiest, and leaves out the exchange of split sizes; here the "
          "rows that leave and arrive are the router's",
}
"""Why chapter 01's calculator and :func:`predicted` differ, by dimension (the calculator's names: ``dp`` is
the data-parallel group, ``dp_shard_cp`` here)."""


__all__ = ["Param", "chunk_params", "rank_chunks", "items", "data_parallel_dimension", "ep_index",
           "rank_tokens", "routed_rows", "predicted", "expected_routing", "calculator",
           "CALCULATOR_DIFFERENCES", "whole"]
