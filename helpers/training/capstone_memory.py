"""What one rank of the capstone holds in its measured step, from shapes and the routing (chapter 15).

After backward. ``capstone.train`` reads it from the storages alive (chapter 04's
:class:`~helpers.measure.LiveMemory`, under ZeRO-3 over the rank's chunks and every optimizer of
:class:`~helpers.parallel.composition.ChunksZero3`: each chunk's AdamW over its shards, the experts' plain
AdamW). :func:`predicted` says what it should read, by kind, under ZeRO-3 or DDP (``zero=0``,
``capstone.train``'s own meter), from the model's shapes
(:func:`helpers.training.capstone_bytes.chunk_params`); :func:`differences` gets there from chapter 01's
calculator for the rank's stage (:func:`calculator`), each difference named and computed from shapes:

- where the layers are: the calculator's stage holds contiguous layers with its dense layers first and its
  experts split over tp; the rank holds its interleaved chunks, each MoE layer's experts whole;
- under ZeRO-3: the shards are the optimizer's parameters, so LiveMemory counts them as optimizer states;
  each chunk's root (embeddings, final norm and head) stays gathered for the step, its rows padded to the
  group (``ceil(rows/N)`` per rank), while every block is freed after its backward; the reduce-scatter waits
  for the step, so every dense parameter's full gradient is held until then; the padding rows of every
  shard, with AdamW's two moments;
- AdamW's step counter, one 0-d tensor (the default dtype) per parameter it updates.

At the peak. :func:`activation_peak` is what chapter 06's ``SavedActivations`` should read at the step's
peak: each layer chapter 01's ``layer_activation_bytes`` with what it leaves out (the log-sum-exp in the
run's precision; Ulysses' mask, repeated K/V and copied output), a MoE layer itemised from the single
process's routing (:func:`layer_saved`), and the rank's schedule replayed action by action;
:func:`activation_differences` names what separates it from the calculator's figure.
"""

from __future__ import annotations

import math

import torch

from helpers.cost import memory_budget, pipeline_schedules
from helpers.training import capstone, capstone_bytes
from helpers.training.capstone_bytes import chunk_params, rank_chunks

KINDS = ("parameters", "gradients", "optimizer states")


def _shapes(run: capstone.Run, where: dict) -> dict:
    """The sums the predictions need, over the rank's chunks: dense numbers (``dense``), experts'
    (``experts``), the dense shards with their padding rows (``shards``), the roots' gathered rows
    (``roots``: ``N`` shards each), and the parameters of each kind (``n_dense``, ``n_experts``)."""
    n = run.dp * run.cp
    out = dict.fromkeys(("dense", "experts", "shards", "roots", "n_dense", "n_experts"), 0)
    for c in rank_chunks(run, where["pp"]):
        for p in chunk_params(run, c):
            if p.expert:
                out["experts"] += p.numel
                out["n_experts"] += 1
                continue
            shard = -(-p.shape[0] // n) * math.prod(p.shape[1:])
            out["dense"] += p.numel
            out["n_dense"] += 1
            out["shards"] += shard
            out["roots"] += n * shard if p.unit == "root" else 0
    return out


def _sizes(run: capstone.Run) -> tuple[int, int]:
    """Bytes of one number in the run's precision, and of AdamW's step counter (the default dtype)."""
    return run.dtype.itemsize, torch.get_default_dtype().itemsize


def predicted(run: capstone.Run, where: dict) -> dict[str, int]:
    """What LiveMemory should read on the rank at ``where`` after the measured step's backward, by kind."""
    _check(run)
    e, counter = _sizes(run)
    s = _shapes(run, where)
    counters = counter * (s["n_dense"] + s["n_experts"])
    if run.zero == 0:  # DDP: every parameter whole, its gradient, AdamW's two moments
        whole = s["dense"] + s["experts"]
        return {"parameters": e * whole, "gradients": e * whole, "optimizer states": 2 * e * whole + counters}
    return {"parameters": e * (s["roots"] + s["experts"]),
            "gradients": e * (s["dense"] + s["experts"]),
            "optimizer states": 3 * e * s["shards"] + 2 * e * s["experts"] + counters}


def calculator(run: capstone.Run, where: dict) -> memory_budget.Budget:
    """Chapter 01's budget of the rank's stage, with the run's ZeRO stage (no master copy: AdamW's two
    moments in the run's precision), and LayerNorm's statistics in the run's precision."""
    _check(run)
    e, _ = _sizes(run)
    precision = memory_budget.Precision(run.precision, e, e, 0, 2 * e, e)
    act = memory_budget.ActivationModel(norm_stat_bytes=2 * e)
    return memory_budget.budget(capstone.model_shape(run), run.batch(), run.layout(), precision, act=act,
                                stage=where["pp"], traffic=False)


def differences(run: capstone.Run, where: dict) -> list[tuple[str, str, int]]:
    """``(kind, why, bytes)``: what :func:`predicted` adds to :func:`calculator`'s figures, each named. The
    calculator plus these is the prediction, or this raises (a difference left unnamed)."""
    _check(run)
    e, counter = _sizes(run)
    s, b, n = _shapes(run, where), calculator(run, where), run.dp * run.cp
    dense_calc, experts_calc = _calculator_counts(run, where)
    shard_calc, shard = -(-dense_calc // n), -(-s["dense"] // n)
    placed = e * (s["experts"] - experts_calc)
    placed += e * (shard - shard_calc if run.zero == 3 else s["dense"] - dense_calc)
    out = [(kind, "layers placed by the interleaved schedule, experts whole over tp", k * placed)
           for kind, k in zip(KINDS, (1, 1, 2))]
    if run.zero == 3:
        out += [("parameters", "the shards are the optimizer's parameters: LiveMemory counts them there",
                 -e * shard),
                ("optimizer states", "the shards themselves", e * shard),
                ("parameters", "each chunk's root gathered for the step, rows padded", e * s["roots"]),
                ("gradients", "the reduce-scatter waits for the step: full dense gradients, not a shard",
                 e * (s["dense"] - shard)),
                ("optimizer states", "padding rows of the shards, with AdamW's two moments",
                 3 * e * (s["shards"] - shard))]
    out.append(("optimizer states", "AdamW's step counters, one per parameter",
                counter * (s["n_dense"] + s["n_experts"])))
    total = {k: getattr(b, a) for k, a in zip(KINDS, ("param_bytes", "grad_bytes", "optimizer_bytes"))}
    for kind, _, nbytes in out:
        total[kind] += nbytes
    if total != predicted(run, where):  # the two roads must meet: else a difference is missing
        raise RuntimeError(f"the calculator plus its named differences {total} is not the prediction "
                           f"{predicted(run, where)}")
    return out


# --------------------------------------------------------------------------------------------- activations


def _activation_models(run: capstone.Run):
    e, _ = _sizes(run)
    # ring attention keeps each rank's own K/V heads; without context parallelism the model's attention
    # repeats them to the query heads first
    return (memory_budget.ActivationModel(kv_expanded=run.cp == 1, norm_stat_bytes=2 * e),
            memory_budget.Precision(run.precision, e, e, 0, 2 * e, e))


def layer_saved(run: capstone.Run, where: dict, routing: dict | None, layer: int,
                micro: int) -> tuple[int, int]:
    """Bytes block ``layer`` keeps saved for backward in micro-batch ``micro`` on the rank at ``where``: what
    its backward frees, and what only the block's next forward frees (a MoE layer's auxiliary losses: weighted
    0, they are left out of the loss, and the layer's attributes keep their graph).

    A dense layer is chapter 01's ``layer_activation_bytes`` (ring attention keeps each rank's own K/V heads,
    not expanded; LayerNorm's statistics in the run's precision), with the log-sum-exp of every query row in
    the run's precision, not fp32, and under Ulysses what its attention adds (:func:`_ulysses`). A MoE layer
    is that layer without its MLP part (the second norm, the MLP's input and hidden activations), plus what
    chapter 08's layer saves, itemised from the routing (``capstone_bytes.routed_rows``): on ``T`` tokens with
    ``R = T·top_k`` assignments and ``A`` rows arriving at its experts."""
    cfg, shape, (e, _) = run.model_config(), capstone.model_shape(run), _sizes(run)
    if cfg.norm != "layernorm" or cfg.gated:
        raise ValueError(f"norm={cfg.norm!r}, gated={cfg.gated}: the activations are itemised for the "
                         f"book's GPT (LayerNorm, a GELU MLP)")
    b, s_cp = run.global_batch // (run.dp * run.m), cfg.seq_len // run.cp
    dense = memory_budget.layer_activation_bytes(shape, cfg.seq_len, b, *_activation_models(run), run.tp,
                                                 run.sequence_parallel, run.cp)
    dense += cfg.n_heads * s_cp * b * (e - 4) // run.tp  # the log-sum-exp in the run's precision
    dense += _ulysses(run)
    if not getattr(cfg, "is_moe", lambda _: False)(layer):
        return dense, 0
    split = run.tp if run.sequence_parallel else 1
    T, d, E, k, F = b * s_cp // split, cfg.d_model, cfg.n_experts, cfg.top_k, cfg.d_ff
    mlp = (2 * T * d * e + T * 2 * e) + b * s_cp * F * 2 * e // run.tp  # ln2 and the MLP's input; hidden
    rows = capstone_bytes.routed_rows(run, where, routing, layer, micro)
    R, A = T * k, rows["stay"] + rows["arrive"]
    i64 = torch.int64.itemsize
    moe = (T * d * e + T * 2 * e          # the second norm's input and statistics
           + T * d * e + T * E * e        # the router's input, the softmax's probabilities
           + T * k * i64 + T * k * e + T * e + T * k  # chosen experts, gates and their sum, kept mask (1 B)
           + 2 * R * i64                  # the assignments sorted by expert, and their tokens
           + 2 * A * i64 + A * d * e      # the arrivals' order and its inverse; the rows at the experts
           + 2 * A * F * e                # each row's GELU input and output in its expert
           + R * e + 2 * R * d * e)       # combine: the gates, the rows back and weighted
    aux = E * e + T * E * e + T * e       # load balance's fractions; z-loss's logits and log-sum-exp
    return dense - mlp + moe, aux


def _ulysses(run: capstone.Run) -> int:
    """What Ulysses' attention saves beyond ring attention's, per layer and micro-batch: the causal mask
    over the whole sequence (PyTorch's scaled_dot_product_attention turns the boolean mask into one of the
    run's dtype), K and V repeated to the query heads (ring attention keeps the KV heads), and the attention
    output apart from the output projection's input (the second all-to-all copies it; ring attention's output
    is that input). As this machine's CPU kernel saves them (another kernel may save otherwise)."""
    if run.attention != "ulysses" or run.cp == 1:
        return 0
    cfg, (e, _) = run.model_config(), _sizes(run)
    b, s_cp = run.global_batch // (run.dp * run.m), cfg.seq_len // run.cp
    heads, kv_heads = cfg.n_heads // run.tp, max(cfg.n_kv_heads // run.tp, 1)
    return (cfg.seq_len ** 2 * e + 2 * b * s_cp * cfg.head_dim * e * (heads - kv_heads)
            + b * s_cp * heads * cfg.head_dim * e)


def _peak(run: capstone.Run, where: dict, routing: dict | None):
    """The schedule replayed on the rank: the peak, the (layer, micro-batch) pairs alive then, and the
    layers whose auxiliary graph is."""
    cfg = run.model_config()
    n_chunks = run.pp * run.vpp if run.pp > 1 else 1
    held, lingering, best = {}, {}, (-1, [], [])
    for action in run.pipeline_schedule().actions[where["pp"]]:
        layers = pipeline_schedules.stage_layers(cfg.n_layers, n_chunks)[action.chunk]
        if action.kind == "F":
            for i in layers:
                held[i, action.micro_batch], lingering[i] = layer_saved(run, where, routing, i,
                                                                        action.micro_batch)
        else:
            for i in layers:
                del held[i, action.micro_batch]
        now = sum(held.values()) + sum(lingering.values())
        if now > best[0]:
            best = (now, list(held), [i for i, aux in lingering.items() if aux])
    return best


def activation_peak(run: capstone.Run, where: dict, routing: dict | None = None) -> int:
    """The most bytes saved for backward inside the rank's blocks after any action of its schedule (what
    chapter 06's ``SavedActivations`` reads after each action): each forward adds its chunk's layers
    (:func:`layer_saved`), each backward frees them; a MoE layer's auxiliary graph lives until the layer's
    next forward."""
    return _peak(run, where, routing)[0]


def activation_differences(run: capstone.Run, where: dict, routing: dict | None = None) -> list:
    """``(why, bytes)``: from the calculator's activations of the rank's stage to :func:`activation_peak`,
    each named (they add up to it, or this raises)."""
    cfg, shape, (e, _) = run.model_config(), capstone.model_shape(run), _sizes(run)
    b, s_cp = run.global_batch // (run.dp * run.m), cfg.seq_len // run.cp
    peak, alive, lingering = _peak(run, where, routing)
    one = {moe: memory_budget.layer_activation_bytes(shape, cfg.seq_len, b, *_activation_models(run), run.tp,
                                                     run.sequence_parallel, run.cp, moe=moe)
           for moe in (False, True)}
    is_moe = getattr(cfg, "is_moe", lambda _: False)
    calculator_layers = sum(one[is_moe(i)] for i, _ in alive)
    lse = cfg.n_heads * s_cp * b * (e - 4) // run.tp
    itemised = sum(layer_saved(run, where, routing, i, j)[0] - one[False] - lse - _ulysses(run)
                   for i, j in alive if is_moe(i))
    stage = calculator(run, where).activation_bytes
    out = [("the layers alive at the schedule's peak on the rank's chunks, not the calculator's micro-batches"
            " in flight on its contiguous stage", calculator_layers - stage),
           ("the log-sum-exp of each query row in the run's precision, not fp32", len(alive) * lse),
           ("Ulysses: the whole causal mask, K and V repeated to the query heads, the output copied",
            len(alive) * _ulysses(run)),
           ("the MoE layers' saved tensors from the routing, not the calculator's uniform MoE layer",
            itemised - sum(one[True] - one[False] for i, _ in alive if is_moe(i))),
           ("the MoE layers' auxiliary-loss graphs, alive until each layer's next forward",
            sum(layer_saved(run, where, routing, i, 0)[1] for i in lingering))]
    if stage + sum(n for _, n in out) != peak:
        raise RuntimeError("the calculator's activations and the named differences do not add up to the peak")
    return out


def _calculator_counts(run: capstone.Run, where: dict) -> tuple[int, int]:
    """The calculator's (dense, expert) parameter counts of the rank's stage (``memory_budget``'s own)."""
    return memory_budget._stage_params(capstone.model_shape(run), run.layout())[where["pp"]]


def _check(run: capstone.Run) -> None:
    if run.zero not in (0, 3) or run.optimizer != "adamw" or run.dp * run.cp == 1:
        raise ValueError(f"zero={run.zero}, optimizer={run.optimizer!r}, dp*cp={run.dp * run.cp}: these "
                         f"predictions are DDP's (zero=0) or ZeRO-3's, with AdamW over a data-parallel group "
                         f"of 2 ranks or more")


__all__ = ["KINDS", "predicted", "calculator", "differences", "layer_saved", "activation_peak",
           "activation_differences"]
