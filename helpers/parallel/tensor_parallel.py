"""Tensor and sequence parallelism applied to the book's GPT (chapter 05): :func:`parallelize` swaps the
layers of :mod:`helpers.parallel.tensor_parallel_layers` into the model in place, and :func:`shard_plan` says
how each parameter of the parallel model is cut from the reference's.

Attention is split by heads (query heads and their KV heads together), the MLP by hidden units: each stays
the reference's module (:mod:`helpers.model`'s ``Attention`` and ``MLP``, with their attributes, attention
``core`` and forward), and only its projections are swapped, Q, K and V for one column-parallel ``qkv_proj``
and ``o_proj`` for a row-parallel one (:func:`parallelize_attention`), gate and up for one ``gate_up_proj``
(:func:`parallelize_mlp`), as Megatron-LM's ``linear_qkv`` and ``linear_fc1``; one weight for the projections
that share an input means one ``f`` for them, not three.

With more ranks than KV heads (``tp`` a multiple of ``n_kv_heads``), each KV head is copied onto the
``tp // n_kv_heads`` ranks whose query heads use it, as vLLM's ``QKVParallelLinear`` does, rather than
refused; the copies' gradients are summed over those ranks by :func:`allreduce_replicated_kv_grads`.
(Megatron-LM copies no weights: up to core v0.15 it refuses such a ``tp``; from v0.16 it all-gathers the QKV
activations instead.)
Under sequence parallelism (Korthikanti et al. 2022) the norms and the position embedding see only their
rank's tokens, and :func:`allreduce_sequence_parallel_grads` sums their gradients. A MoE layer (chapter 08)
stays whole on every rank (its experts are split by expert parallelism, not by tensor parallelism): without
sequence parallelism every rank computes it on the same tokens; with it, each rank routes its own slice of
the sequence, and the layer's gradients, partial sums, are summed as the norms' are.

:func:`shard_state` cuts a rank's tensors by the plan, :func:`unshard_state` puts the ranks' shards back
together. Every collective is a call of :mod:`helpers.parallel.comms`, booked in the ledger.
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.distributed as dist
from torch import nn

from helpers import layout_rules
from helpers.model import GPT, MLP, Attention, GPTConfig
from helpers.parallel.moe import MoELayer
from helpers.parallel.tensor_parallel_comms import (allreduce_replicated_kv_grads,
                                                    allreduce_sequence_parallel_grads)
from helpers.parallel.tensor_parallel_layers import (ColumnParallelLinear, RowParallelLinear,
                                                     SequenceParallelEmbedding, VocabParallelEmbedding,
                                                     vocab_parallel_cross_entropy)


# ---------------------------------------------------------------------------------------------------------
# The book's GPT, tensor-parallel: the reference's attention and MLP with parallel projections
# ---------------------------------------------------------------------------------------------------------


def parallelize_attention(attn: Attention, group=None, sequence_parallel: bool = False) -> Attention:
    """Swap ``attn``'s projections, in place, for this rank's ``n_heads/tp`` query heads and the
    ``n_kv_heads/tp`` KV heads they use: Q, K and V in one column-parallel ``qkv_proj``, ``o_proj``
    row-parallel. With ``tp > n_kv_heads``, rank ``r`` holds a copy of KV head ``r // kv_replicas``, the one
    its query heads use, and so do the other ``kv_replicas - 1`` ranks."""
    n_kv_heads = attn.k_proj.weight.shape[0] // attn.head_dim
    attn.kv_replicas = max(dist.get_world_size(group) // n_kv_heads, 1)  # ranks holding each KV head
    qkv_proj = ColumnParallelLinear(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight,
                                    group=group, sequence_parallel=sequence_parallel,
                                    replicas=(1, attn.kv_replicas, attn.kv_replicas))
    o_proj = RowParallelLinear(attn.o_proj.weight, group, sequence_parallel)
    del attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj  # o_proj too: re-added after qkv_proj, in order
    attn.qkv_proj, attn.o_proj = qkv_proj, o_proj
    return attn


def parallelize_mlp(mlp: MLP, group=None, sequence_parallel: bool = False) -> MLP:
    """Swap ``mlp``'s projections, in place, for this rank's ``d_ff/tp`` hidden units: column-parallel (gate
    and up in one ``gate_up_proj``: they share the input), then row-parallel ``down_proj``."""
    split = dict(group=group, sequence_parallel=sequence_parallel)
    down_proj = RowParallelLinear(mlp.down_proj.weight, **split)
    if mlp.gated:
        gate_up_proj = ColumnParallelLinear(mlp.gate_proj.weight, mlp.up_proj.weight, **split)
        del mlp.gate_proj, mlp.up_proj, mlp.down_proj
        mlp.gate_up_proj, mlp.gate_proj = gate_up_proj, None
    else:
        up_proj = ColumnParallelLinear(mlp.up_proj.weight, **split)
        del mlp.up_proj, mlp.down_proj
        mlp.up_proj = up_proj
    mlp.down_proj = down_proj
    return mlp


def check_layout(cfg: GPTConfig, tp: int, sequence_parallel: bool = False) -> None:
    """Raise a ValueError naming the broken constraint if ``cfg`` cannot be split over ``tp`` ranks."""
    layout_rules.tensor_parallel(tp, cfg.n_heads, cfg.n_kv_heads, cfg.d_ff, cfg.vocab_size,
                                 seq_len=cfg.seq_len if sequence_parallel else None)


def _mark_sequence_parallel(*modules: nn.Module) -> None:
    for p in (p for module in modules for p in module.parameters()):
        p.sequence_parallel = True  # Megatron's mark: its gradient is summed over the ranks


def parallelize(model: GPT, group=None, sequence_parallel: bool = False) -> GPT:
    """Make ``model`` (a GPT, or a pipeline stage of one) tensor-parallel over ``group``, in place: each layer
    becomes its parallel form, holding this rank's shards of its weights; the norms stay whole, an attention
    ``core`` already set is kept. What it cannot split is refused before anything changes. Apply it to a
    pipeline's chunks, not before the split: a chunk is a deep copy, and a process group cannot be copied."""
    check_layout(model.cfg, dist.get_world_size(group), sequence_parallel)
    for name, block in model.blocks.items():
        for part, want in (("attn", Attention), ("mlp", MLP)):
            module = getattr(block, part)
            if part == "mlp" and type(module) is MoELayer:  # kept whole: split by expert parallelism
                continue
            if type(module) is not want:  # an expert-parallel MoE layer
                raise ValueError(f"tensor_parallel.parallelize: blocks.{name}.{part} is a "
                                 f"{type(module).__name__}, not helpers.model.{want.__name__} "
                                 f"(apply tensor parallelism before expert parallelism)")
            if any(isinstance(m, (ColumnParallelLinear, RowParallelLinear)) for m in module.children()):
                raise ValueError(f"tensor_parallel.parallelize: blocks.{name}.{part} is tensor-parallel "
                                 f"already")
    split = dict(group=group, sequence_parallel=sequence_parallel)
    for block in model.blocks:
        parallelize_attention(block.attn, **split)
        moe = type(block.mlp) is MoELayer
        if not moe:
            parallelize_mlp(block.mlp, **split)
        if sequence_parallel:
            _mark_sequence_parallel(block.ln1, block.ln2, *([block.mlp] if moe else []))
    tied = None not in (model.tok_emb, model.lm_head) and model.lm_head.weight is model.tok_emb.weight
    if model.tok_emb is not None:
        model.tok_emb = VocabParallelEmbedding(model.tok_emb.weight, **split)
        if sequence_parallel and model.pos_emb is not None:  # rotary positions have no table to split
            model.pos_emb = SequenceParallelEmbedding(model.pos_emb.weight, group)
    if model.lm_head is not None:
        model.lm_head = ColumnParallelLinear(model.lm_head.weight, **split)
        if tied:
            model.lm_head.weight = model.tok_emb.weight  # both hold this rank's vocabulary rows
        model.loss_fn = functools.partial(vocab_parallel_cross_entropy, group=group)
        if sequence_parallel:
            _mark_sequence_parallel(model.ln_f)
    return model


def from_reference(reference: GPT, group=None, sequence_parallel: bool = False) -> GPT:
    """This rank's tensor-parallel copy of ``reference``, which stays as it is."""
    return parallelize(copy.deepcopy(reference), group, sequence_parallel)


# ---------------------------------------------------------------------------------------------------------
# From the reference's weights to the ranks' shards, and back
# ---------------------------------------------------------------------------------------------------------


def shard_plan(cfg: GPTConfig, tp: int) -> dict[str, tuple[int | None, tuple[tuple[str, int, int], ...]]]:
    """For each parameter of a GPT after :func:`parallelize`: the dimension it is split along (``None``: every
    rank holds all of it), and the reference parameters it stacks, each with the size of one rank's slice and
    the number of ranks that hold that same slice (1 if split; ``tp // n_kv_heads`` for a replicated KV head;
    ``tp`` if not split). A norm without bias (RMSNorm) and rotary positions add no entry."""
    check_layout(cfg, tp)
    d, hd, V = cfg.d_model, cfg.head_dim, cfg.vocab_size
    plan = {"tok_emb.weight": (0, (("tok_emb.weight", V // tp, 1),))}
    if cfg.rope_theta is None:
        plan["pos_emb.weight"] = (None, (("pos_emb.weight", cfg.seq_len, tp),))
    norms = ("weight", "bias") if cfg.norm == "layernorm" else ("weight",)
    kv_replicas = max(tp // cfg.n_kv_heads, 1)
    q, kv = cfg.n_heads * hd // tp, cfg.n_kv_heads * hd * kv_replicas // tp
    for i in range(cfg.n_layers):
        p = f"blocks.{i}."
        for name in (p + norm + "." + w for norm in ("ln1", "ln2") for w in norms):
            plan[name] = (None, ((name, d, tp),))
        plan[p + "attn.qkv_proj.weight"] = (0, ((p + "attn.q_proj.weight", q, 1),
                                                (p + "attn.k_proj.weight", kv, kv_replicas),
                                                (p + "attn.v_proj.weight", kv, kv_replicas)))
        plan[p + "attn.o_proj.weight"] = (1, ((p + "attn.o_proj.weight", q, 1),))
        f = cfg.d_ff // tp
        if getattr(cfg, "is_moe", lambda _: False)(i):  # a MoE layer: whole on every rank
            for name in ("router.weight", "experts.up_proj.weight", "experts.down_proj.weight"):
                plan[p + "mlp." + name] = (None, ((p + "mlp." + name, cfg.n_experts, tp),))
            continue
        if cfg.gated:
            plan[p + "mlp.gate_up_proj.weight"] = (0, ((p + "mlp.gate_proj.weight", f, 1),
                                                       (p + "mlp.up_proj.weight", f, 1)))
        else:
            plan[p + "mlp.up_proj.weight"] = (0, ((p + "mlp.up_proj.weight", f, 1),))
        plan[p + "mlp.down_proj.weight"] = (1, ((p + "mlp.down_proj.weight", f, 1),))
    for name in ("ln_f." + w for w in norms):
        plan[name] = (None, ((name, d, tp),))
    if not cfg.tie_embeddings:
        plan["lm_head.weight"] = (0, (("lm_head.weight", V // tp, 1),))
    return plan


def shard_state(full: dict[str, torch.Tensor], cfg: GPTConfig, rank: int, tp: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s tensors, under the parallel model's names, cut from the reference's ``full``
    (all of the model's tensors, or some of them)."""
    shards = {}
    for name, (dim, parts) in shard_plan(cfg, tp).items():
        if parts[0][0] not in full:  # a part of the model only (one block, say)
            continue
        if dim is None:
            shards[name] = full[parts[0][0]].detach().clone()
        else:
            shards[name] = torch.cat([full[ref].detach().narrow(dim, rank // copies * n, n)
                                      for ref, n, copies in parts], dim)
    return shards


def unshard_state(shards: list[dict[str, torch.Tensor]], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """The reference's tensors, put together from every rank's ``shards`` (in rank order).

    A replicated tensor is taken from rank 0: whether the ranks agree on it is a check of its own. A
    replicated KV head is taken from the first rank holding it, and its copies must be equal, bit for bit.
    """
    tp, full = len(shards), {}
    for name, (dim, parts) in shard_plan(cfg, tp).items():
        if name not in shards[0]:
            continue
        if dim is None:
            full[parts[0][0]] = shards[0][name]
            continue
        pieces = [s[name].split([n for _, n, _ in parts], dim) for s in shards]
        for i, (ref, _, copies) in enumerate(parts):
            for r in range(tp):
                if not torch.equal(pieces[r][i], pieces[r // copies * copies][i]):
                    raise ValueError(f"{ref}: ranks {r // copies * copies} and {r} hold copies of the same "
                                     f"KV head that differ (were the copies' gradients summed?)")
            full[ref] = torch.cat([pieces[r][i] for r in range(0, tp, copies)], dim)
    return full


__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "SequenceParallelEmbedding",
           "vocab_parallel_cross_entropy", "parallelize_attention", "parallelize_mlp", "check_layout",
           "parallelize", "from_reference", "allreduce_sequence_parallel_grads",
           "allreduce_replicated_kv_grads", "shard_plan", "shard_state", "unshard_state"]
