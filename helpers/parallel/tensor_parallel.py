"""Tensor and sequence parallelism from scratch (chapter 05): the layers, in Megatron-LM's names, and
:func:`parallelize`, which makes the book's GPT tensor-parallel in place.

Tensor parallelism (Shoeybi et al. 2019) splits every weight matrix of a transformer layer over the ``tp``
ranks of a group, so that each rank stores and multiplies ``1/tp`` of it. The operators between the layers,
``f`` and ``g`` and their sequence-parallel forms, are in :mod:`helpers.parallel.tensor_parallel_comms`:

- :class:`ColumnParallelLinear` splits a weight along its outputs: each rank computes some output features
  from the full input, which enters through ``f`` (identity forward, all-reduce backward).
- :class:`RowParallelLinear` splits a weight along its inputs: each rank multiplies its slice of the features
  and the partial products are summed by ``g`` (all-reduce forward, identity backward).
- :class:`ParallelAttention` splits by heads (query heads and their KV heads together), :class:`ParallelMLP`
  by hidden units: :mod:`helpers.model`'s ``Attention`` and ``MLP`` with parallel projections and their own
  forward. A column-parallel layer followed by a row-parallel one needs one all-reduce forward, one backward.
- :class:`VocabParallelEmbedding` and :func:`vocab_parallel_cross_entropy` split the vocabulary; the loss is
  computed without ever gathering the full logits.

Sequence parallelism (Korthikanti et al. 2022) also splits the norms and residual stream along the sequence:
``g`` becomes a reduce-scatter and ``f`` an all-gather, the same bytes, ``1/tp`` of those activations per
rank; backward gathers each column-parallel layer's input again (:class:`_SequenceParallelLinear`), since only
this rank's slice of it is kept. The norms and the position embedding (:class:`SequenceParallelEmbedding`)
then see only their rank's tokens, and :func:`allreduce_sequence_parallel_grads` sums their gradients.

With more ranks than KV heads (``tp`` a multiple of ``n_kv_heads``), each KV head is copied onto the
``tp // n_kv_heads`` ranks whose query heads use it, as vLLM's ``QKVParallelLinear`` does, rather than
refused; the copies' gradients are summed over those ranks by :func:`allreduce_replicated_kv_grads`.
(Megatron-LM copies no weights: up to core v0.15 it refuses such a ``tp``; from v0.16 it all-gathers the QKV
activations instead.)

Each layer takes its rank and ``tp`` from its process group and cuts its shard from the weights it replaces.
:func:`shard_plan` says how each parameter of the parallel model is cut from the reference's;
:func:`shard_state` cuts a rank's tensors by it, :func:`unshard_state` puts the ranks' shards back together.
Every collective is a call of :mod:`helpers.parallel.comms`, booked in the ledger.
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from helpers import layout_rules
from helpers.model import GPT, MLP, Attention, GPTConfig
from helpers.parallel import comms
from helpers.parallel.tensor_parallel_comms import (SEQ_DIM, allreduce_replicated_kv_grads,
                                                    allreduce_sequence_parallel_grads,
                                                    copy_to_tensor_parallel_region,
                                                    reduce_from_tensor_parallel_region,
                                                    reduce_scatter_to_sequence_parallel_region)


# ---------------------------------------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------------------------------------


def _mine(weight: torch.Tensor, dim: int, group, what: str, replicas: int = 1) -> torch.Tensor:
    """This rank's block of ``weight`` along ``dim``: rank ``r`` of ``tp`` holds the ``r``-th of ``tp`` equal
    blocks (a copy: a shard owns its storage); with ``replicas`` ranks holding each block (a KV head when
    ``tp > n_kv_heads``), the ``r // replicas``-th of ``tp / replicas``."""
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    blocks = tp // replicas  # the distinct blocks
    if tp % replicas or weight.shape[dim] % blocks:
        raise ValueError(f"tp={tp} must divide {what} ({weight.shape[dim]})" if replicas == 1 else
                         f"tp={tp} must be {replicas} times a divisor of {what} ({weight.shape[dim]})")
    n = weight.shape[dim] // blocks
    return weight.detach().narrow(dim, (rank // replicas) * n, n).clone()


class _SequenceParallelLinear(torch.autograd.Function):
    """All-gather the sequence, then multiply, keeping only this rank's slice of the input for backward.

    Storing the gathered input would cost ``tp`` times the slice, and Korthikanti et al. 2022 count every
    activation of a sequence-parallel layer divided by ``tp``; so, as Megatron does, backward gathers the
    input again to form the weight's gradient, and the input's gradient is reduce-scattered back to the
    sequence slices. One weight may hold several column-parallel layers stacked (Q, K and V): each gets its
    own output tensor, so that only what attention keeps stays alive.
    """

    @staticmethod
    def forward(ctx, x, weight, sizes, group):
        ctx.save_for_backward(x, weight)
        ctx.sizes, ctx.group = sizes, group
        gathered = comms.all_gather(x, SEQ_DIM, group)
        return tuple(F.linear(gathered, w) for w in weight.split(sizes))

    @staticmethod
    def backward(ctx, *grads):
        x, weight = ctx.saved_tensors
        gathered = comms.all_gather(x, SEQ_DIM, ctx.group)  # again: it was not kept
        grad = torch.cat(grads, dim=-1)  # autograd passes zeros for an output that was not used
        grad_input = comms.reduce_scatter(grad @ weight, SEQ_DIM, ctx.group)
        grad_weight = grad.reshape(-1, grad.shape[-1]).t() @ gathered.reshape(-1, gathered.shape[-1])
        return grad_input, grad_weight, None, None


class ColumnParallelLinear(nn.Module):
    """``Y = X Aᵀ`` with ``A``'s rows (the output features) split over the ranks: rank ``r`` holds rows
    ``r·out/tp … (r+1)·out/tp`` and returns those output features (Shoeybi et al. 2019).

    Given several full weights of layers that share the input (Q, K and V), it stacks this rank's rows of each
    in one weight and returns one tensor per layer; ``replicas`` gives, for each, how many ranks hold the same
    rows (1: split). With ``sequence_parallel`` the input is this rank's slice of the sequence and is
    all-gathered first.
    """

    def __init__(self, *weights: torch.Tensor, group=None, sequence_parallel: bool = False, replicas=None):
        super().__init__()
        shards = [_mine(w, 0, group, "the output features of a column-parallel layer", n)
                  for w, n in zip(weights, replicas or [1] * len(weights))]
        self.sizes = tuple(len(shard) for shard in shards)
        self.weight = nn.Parameter(torch.cat(shards))
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, x):
        if self.sequence_parallel:
            out = _SequenceParallelLinear.apply(x, self.weight, self.sizes, self.group)
        else:
            x = copy_to_tensor_parallel_region(x, self.group)
            out = tuple(F.linear(x, w) for w in self.weight.split(self.sizes))
        return out[0] if len(out) == 1 else out


class RowParallelLinear(nn.Module):
    """``Y = X Aᵀ`` with ``A``'s columns (the input features) split over the ranks: rank ``r`` multiplies its
    slice of the features, and the partial products are summed over the ranks (Shoeybi et al. 2019), or, with
    ``sequence_parallel``, summed and scattered along the sequence (Korthikanti et al. 2022)."""

    def __init__(self, weight: torch.Tensor, group=None, sequence_parallel: bool = False):
        super().__init__()
        self.weight = nn.Parameter(_mine(weight, 1, group, "the input features of a row-parallel layer"))
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, x):
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(partial, self.group)
        return reduce_from_tensor_parallel_region(partial, self.group)


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows (the vocabulary) are split over the ranks (Shoeybi et al. 2019, section 3).

    Each rank looks up the tokens of its vocabulary range and writes zeros for the others; summing over the
    ranks (or, with ``sequence_parallel``, reduce-scattering along the sequence) gives every token its row.
    """

    def __init__(self, weight: torch.Tensor, group=None, sequence_parallel: bool = False):
        super().__init__()
        self.weight = nn.Parameter(_mine(weight, 0, group, "the vocabulary"))
        self.vocab_start = dist.get_rank(group) * len(self.weight)
        self.vocab_end = self.vocab_start + len(self.weight)
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, idx):
        elsewhere = (idx < self.vocab_start) | (idx >= self.vocab_end)
        local = (idx - self.vocab_start).masked_fill(elsewhere, 0)
        partial = F.embedding(local, self.weight).masked_fill(elsewhere.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(partial, self.group)
        return reduce_from_tensor_parallel_region(partial, self.group)


class SequenceParallelEmbedding(nn.Module):
    """The position embedding under sequence parallelism: the rows of this rank's slice of the positions it is
    given, since the residual stream holds only those. Each rank's gradient holds its positions' rows: it is
    marked to be summed with the norms'."""

    def __init__(self, weight: nn.Parameter, group=None):
        super().__init__()
        self.weight, self.group = weight, group
        weight.sequence_parallel = True

    def forward(self, positions):
        return F.embedding(_mine(positions, -1, self.group, "the positions"), self.weight)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy of logits split along the vocabulary, without gathering them (Shoeybi et al. 2019,
    section 3).

    Per token, three all-reduces of one number: the largest logit (for a stable exponential), the sum of the
    exponentials, and the logit of the target, which lies in one rank's range. Backward needs no
    communication: ``softmax - onehot(target)`` restricted to this rank's vocabulary.
    """

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group):
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # at least fp32
        largest = comms.all_reduce(logits.max(dim=-1).values, group, op="max")
        shifted = logits - largest.unsqueeze(-1)
        mine = (targets >= vocab_start) & (targets < vocab_start + logits.shape[-1])
        local = (targets - vocab_start).masked_fill(~mine, 0)
        target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        target_logit = comms.all_reduce(target_logit, group)
        exp = shifted.exp()
        sum_exp = comms.all_reduce(exp.sum(dim=-1), group)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), mine, local)
        return sum_exp.log() - target_logit  # per token: log Σ exp(z) - z_target

    @staticmethod
    def backward(ctx, grad):
        softmax, mine, local = ctx.saved_tensors
        onehot = torch.zeros_like(softmax).scatter_(-1, local.unsqueeze(-1),
                                                    mine.unsqueeze(-1).to(softmax.dtype))
        return (softmax - onehot) * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits, targets, group=None) -> torch.Tensor:
    """The mean cross-entropy of ``logits`` split along the vocabulary over ``group``: rank ``r`` holds the
    ``r``-th slice (``helpers.model.cross_entropy``, vocabulary-parallel)."""
    vocab_start = dist.get_rank(group) * logits.shape[-1]
    return _VocabParallelCrossEntropy.apply(logits, targets, vocab_start, group).mean()


# ---------------------------------------------------------------------------------------------------------
# The book's GPT, tensor-parallel: the reference's attention and MLP with parallel projections
# ---------------------------------------------------------------------------------------------------------


class ParallelAttention(Attention):
    """``Attention`` with this rank's ``n_heads/tp`` query heads and the ``n_kv_heads/tp`` KV heads they use:
    Q, K and V in one column-parallel weight, ``o_proj`` row-parallel; the forward, and the attention
    ``core``, are the layer's own. With ``tp > n_kv_heads``, rank ``r`` holds a copy of KV head
    ``r // kv_replicas``, the one its query heads use, and so do the other ``kv_replicas - 1`` ranks."""

    def __init__(self, attn: Attention, group=None, sequence_parallel: bool = False):
        nn.Module.__init__(self)  # not Attention's: it would build the full projections
        self.head_dim, self.rope_theta, self.core = attn.head_dim, attn.rope_theta, attn.core
        n_kv_heads = attn.k_proj.weight.shape[0] // attn.head_dim
        self.kv_replicas = max(dist.get_world_size(group) // n_kv_heads, 1)  # ranks holding each KV head
        self.qkv_proj = ColumnParallelLinear(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight,
                                             group=group, sequence_parallel=sequence_parallel,
                                             replicas=(1, self.kv_replicas, self.kv_replicas))
        self.o_proj = RowParallelLinear(attn.o_proj.weight, group, sequence_parallel)

    def project(self, x):
        return self.qkv_proj(x)


class ParallelMLP(MLP):
    """``MLP`` with this rank's ``d_ff/tp`` hidden units: column-parallel, then row-parallel; the forward is
    the MLP's own."""

    def __init__(self, mlp: MLP, group=None, sequence_parallel: bool = False):
        nn.Module.__init__(self)  # not MLP's: it would build the full projections
        self.gated, split = mlp.gated, dict(group=group, sequence_parallel=sequence_parallel)
        if mlp.gated:  # gate and up share the input: one weight, as Megatron's linear_fc1
            self.gate_up_proj = ColumnParallelLinear(mlp.gate_proj.weight, mlp.up_proj.weight, **split)
        else:
            self.up_proj = ColumnParallelLinear(mlp.up_proj.weight, **split)
        self.down_proj = RowParallelLinear(mlp.down_proj.weight, **split)

    def project(self, x):
        return self.gate_up_proj(x) if self.gated else self.up_proj(x)


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
            if type(getattr(block, part)) is not want:  # a MoE layer, or one split already
                raise ValueError(f"tensor_parallel.parallelize: blocks.{name}.{part} is a "
                                 f"{type(getattr(block, part)).__name__}, not helpers.model.{want.__name__} "
                                 f"(a MoE layer is split by expert parallelism)")
    split = dict(group=group, sequence_parallel=sequence_parallel)
    for block in model.blocks:
        block.attn, block.mlp = ParallelAttention(block.attn, **split), ParallelMLP(block.mlp, **split)
        if sequence_parallel:
            _mark_sequence_parallel(block.ln1, block.ln2)
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
           "vocab_parallel_cross_entropy", "ParallelAttention", "ParallelMLP", "check_layout", "parallelize",
           "from_reference", "allreduce_sequence_parallel_grads", "allreduce_replicated_kv_grads",
           "shard_plan", "shard_state", "unshard_state"]
