"""Tensor and sequence parallelism from scratch (chapter 05): the layers, in Megatron-LM's names.

Tensor parallelism (Shoeybi et al. 2019) splits every weight matrix of a transformer layer over the ``tp``
ranks of a group, so that each rank stores and multiplies ``1/tp`` of it. The operators between the layers,
``f`` and ``g`` and their sequence-parallel forms, are in :mod:`helpers.parallel.tensor_parallel_comms`:

- :class:`ColumnParallelLinear` splits a weight along its outputs: each rank computes some output features
  from the full input, which enters through ``f`` (identity forward, all-reduce backward).
- :class:`RowParallelLinear` splits a weight along its inputs: each rank multiplies its slice of the features
  and the partial products are summed by ``g`` (all-reduce forward, identity backward).
- Attention splits by heads (query heads and their KV heads together) and the MLP by hidden units: a
  column-parallel layer followed by a row-parallel one needs one all-reduce forward and one backward.
- :class:`VocabParallelEmbedding` and :func:`vocab_parallel_cross_entropy` split the vocabulary; the loss is
  computed without ever gathering the full logits.

Sequence parallelism (Korthikanti et al. 2022) also splits the norms and residual stream along the sequence:
``g`` becomes a reduce-scatter and ``f`` an all-gather, the same bytes, ``1/tp`` of those activations per
rank; backward gathers each column-parallel layer's input again (:class:`_SequenceParallelLinear`), since only
this rank's slice of it is kept. The norms and the position embedding then see only their rank's tokens, and
:func:`allreduce_sequence_parallel_grads` sums their gradients.

:class:`TensorParallelGPT` is :class:`helpers.model.GPT` made of these layers; :func:`from_reference` builds
one rank's copy from the reference's weights (:func:`shard_state`), and :func:`unshard_state` puts the ranks'
shards (of parameters or gradients) back together under the reference's names. Every collective is booked in
:data:`helpers.parallel.ledger.LEDGER`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from helpers import layout_rules
from helpers.model import GPTConfig
from helpers.parallel.ledger import LEDGER
from helpers.parallel.tensor_parallel_comms import (SEQ_DIM, _all_gather, _all_reduce, _reduce_scatter,
                                                    copy_to_tensor_parallel_region,
                                                    reduce_from_tensor_parallel_region,
                                                    reduce_scatter_to_sequence_parallel_region)


# ---------------------------------------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------------------------------------


def _divide(n: int, tp: int, what: str) -> int:
    if n % tp:
        raise ValueError(f"tp={tp} must divide {what} ({n})")
    return n // tp


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
        gathered = _all_gather(x, SEQ_DIM, group)
        return tuple(F.linear(gathered, w) for w in weight.split(sizes))

    @staticmethod
    def backward(ctx, *grads):
        x, weight = ctx.saved_tensors
        gathered = _all_gather(x, SEQ_DIM, ctx.group)  # again: it was not kept
        grad = torch.cat(grads, dim=-1)  # autograd passes zeros for an output that was not used
        grad_input = _reduce_scatter(grad @ weight, SEQ_DIM, ctx.group)
        grad_weight = grad.reshape(-1, grad.shape[-1]).t() @ gathered.reshape(-1, gathered.shape[-1])
        return grad_input, grad_weight, None, None


class ColumnParallelLinear(nn.Module):
    """``Y = X Aᵀ`` with ``A``'s rows (the output features) split over the ranks: rank ``r`` holds rows
    ``r·out/tp … (r+1)·out/tp`` and returns those output features (Shoeybi et al. 2019).

    ``sizes`` stacks several layers that share the input in one weight (Q, K and V), each split over the
    ranks; the forward then returns one tensor per layer. With ``sequence_parallel`` the input is this rank's
    slice of the sequence and is all-gathered first.
    """

    def __init__(self, in_features: int, out_features: int | tuple[int, ...], tp: int, group=None,
                 sequence_parallel: bool = False):
        super().__init__()
        sizes = (out_features,) if isinstance(out_features, int) else tuple(out_features)
        self.sizes = tuple(_divide(n, tp, "the output features of a column-parallel layer") for n in sizes)
        self.weight = nn.Parameter(torch.empty(sum(self.sizes), in_features))
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

    def __init__(self, in_features: int, out_features: int, tp: int, group=None,
                 sequence_parallel: bool = False):
        super().__init__()
        per_rank = _divide(in_features, tp, "the input features of a row-parallel layer")
        self.weight = nn.Parameter(torch.empty(out_features, per_rank))
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

    def __init__(self, vocab_size: int, dim: int, rank: int, tp: int, group=None, sequence_parallel=False):
        super().__init__()
        per_rank = _divide(vocab_size, tp, "the vocabulary")
        self.vocab_start, self.vocab_end = rank * per_rank, (rank + 1) * per_rank
        self.weight = nn.Parameter(torch.empty(per_rank, dim))
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, idx):
        elsewhere = (idx < self.vocab_start) | (idx >= self.vocab_end)
        local = (idx - self.vocab_start).masked_fill(elsewhere, 0)
        partial = F.embedding(local, self.weight).masked_fill(elsewhere.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(partial, self.group)
        return reduce_from_tensor_parallel_region(partial, self.group)


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
        largest = logits.max(dim=-1).values
        LEDGER.record("all_reduce", largest, group)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - largest.unsqueeze(-1)
        mine = (targets >= vocab_start) & (targets < vocab_start + logits.shape[-1])
        local = (targets - vocab_start).masked_fill(~mine, 0)
        target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        target_logit = _all_reduce(target_logit, group)
        exp = shifted.exp()
        sum_exp = _all_reduce(exp.sum(dim=-1), group)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), mine, local)
        return sum_exp.log() - target_logit  # per token: log Σ exp(z) - z_target

    @staticmethod
    def backward(ctx, grad):
        softmax, mine, local = ctx.saved_tensors
        onehot = torch.zeros_like(softmax).scatter_(-1, local.unsqueeze(-1),
                                                    mine.unsqueeze(-1).to(softmax.dtype))
        return (softmax - onehot) * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits, targets, vocab_start: int, group=None) -> torch.Tensor:
    """Per-token cross-entropy of ``logits`` (this rank's vocabulary slice, starting at ``vocab_start``)."""
    return _VocabParallelCrossEntropy.apply(logits, targets, vocab_start, group)


# ---------------------------------------------------------------------------------------------------------
# The book's GPT, tensor-parallel
# ---------------------------------------------------------------------------------------------------------


def check_layout(cfg: GPTConfig, tp: int, sequence_parallel: bool = False) -> None:
    """Raise a ValueError naming the broken constraint if ``cfg`` cannot be split over ``tp`` ranks."""
    layout_rules.tensor_parallel(tp, cfg.n_heads, cfg.n_kv_heads, cfg.d_ff, cfg.vocab_size,
                                 seq_len=cfg.seq_len if sequence_parallel else None)


def _norm(cfg: GPTConfig, sequence_parallel: bool) -> nn.LayerNorm:
    norm = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
    for p in norm.parameters():
        p.sequence_parallel = sequence_parallel  # Megatron's mark: its gradient is summed over the ranks
    return norm


class ParallelAttention(nn.Module):
    """Causal attention with this rank's ``n_heads/tp`` query heads and the ``n_kv_heads/tp`` KV heads they
    use."""

    def __init__(self, cfg: GPTConfig, tp: int, group=None, sequence_parallel=False):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads // tp, cfg.n_kv_heads // tp, cfg.head_dim
        q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.qkv_proj = ColumnParallelLinear(cfg.d_model, (q, kv, kv), tp, group, sequence_parallel)
        self.o_proj = RowParallelLinear(q, cfg.d_model, tp, group, sequence_parallel)

    def forward(self, x):
        q, k, v = self.qkv_proj(x)
        b, t, _ = q.shape
        q = q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        n_rep = self.n_heads // self.n_kv_heads  # query heads per KV head
        k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class ParallelMLP(nn.Module):
    """``down(gelu(up(x)))`` with ``d_ff/tp`` hidden units per rank: column-parallel, then row-parallel."""

    def __init__(self, cfg: GPTConfig, tp: int, group=None, sequence_parallel=False):
        super().__init__()
        self.gated = cfg.gated
        if cfg.gated:  # gate and up share the input: one weight, as Megatron's linear_fc1
            self.gate_up_proj = ColumnParallelLinear(cfg.d_model, (cfg.d_ff, cfg.d_ff), tp, group,
                                                     sequence_parallel)
        else:
            self.up_proj = ColumnParallelLinear(cfg.d_model, cfg.d_ff, tp, group, sequence_parallel)
        self.down_proj = RowParallelLinear(cfg.d_ff, cfg.d_model, tp, group, sequence_parallel)

    def forward(self, x):
        if self.gated:
            gate, up = self.gate_up_proj(x)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.gelu(self.up_proj(x)))


class ParallelBlock(nn.Module):
    def __init__(self, cfg: GPTConfig, tp: int, group=None, sequence_parallel=False):
        super().__init__()
        self.ln1 = _norm(cfg, sequence_parallel)
        self.attn = ParallelAttention(cfg, tp, group, sequence_parallel)
        self.ln2 = _norm(cfg, sequence_parallel)
        self.mlp = ParallelMLP(cfg, tp, group, sequence_parallel)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TensorParallelGPT(nn.Module):
    """Rank ``rank``'s part of :class:`helpers.model.GPT` over a tensor-parallel group of ``tp`` ranks.

    ``forward(idx, targets)`` returns this rank's slice of the logits (its vocabulary range, the whole
    sequence) and the mean cross-entropy. With ``sequence_parallel`` the residual stream between the parallel
    layers holds only this rank's ``seq_len/tp`` positions.
    """

    def __init__(self, cfg: GPTConfig, rank: int, tp: int, group=None, sequence_parallel: bool = False):
        super().__init__()
        check_layout(cfg, tp, sequence_parallel)
        self.cfg, self.rank, self.tp = cfg, rank, tp
        self.group, self.sequence_parallel = group, sequence_parallel
        self.tok_emb = VocabParallelEmbedding(cfg.vocab_size, cfg.d_model, rank, tp, group, sequence_parallel)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.pos_emb.weight.sequence_parallel = sequence_parallel
        self.blocks = nn.ModuleList(ParallelBlock(cfg, tp, group, sequence_parallel)
                                    for _ in range(cfg.n_layers))
        self.ln_f = _norm(cfg, sequence_parallel)
        self.lm_head = ColumnParallelLinear(cfg.d_model, cfg.vocab_size, tp, group, sequence_parallel)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight  # both hold this rank's vocabulary rows

    def forward(self, idx, targets=None):
        t = idx.shape[1]
        x = self.tok_emb(idx)
        start, length = (self.rank * t // self.tp, t // self.tp) if self.sequence_parallel else (0, t)
        x = x + self.pos_emb(torch.arange(start, start + length, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        loss = vocab_parallel_cross_entropy(logits, targets, self.tok_emb.vocab_start, self.group)
        return logits, loss.mean()


def allreduce_sequence_parallel_grads(model: nn.Module, group=None) -> None:
    """Sum over the ranks the gradients of the parameters marked ``sequence_parallel`` (norms, positions).

    Each rank's norm saw only its slice of the sequence, so its gradient is a partial sum; one all-reduce of
    all of them, flattened, completes it (Megatron's ``_allreduce_layernorm_grads``).
    """
    params = [p for p in model.parameters() if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if not params:
        return
    flat = _all_reduce(torch.cat([p.grad.reshape(-1) for p in params]), group)
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        p.grad.copy_(g.view_as(p.grad))


# ---------------------------------------------------------------------------------------------------------
# From the reference's weights to the ranks' shards, and back
# ---------------------------------------------------------------------------------------------------------


def shard_plan(cfg: GPTConfig, tp: int) -> dict[str, tuple[int | None, tuple[tuple[str, int], ...]]]:
    """For each parameter of :class:`TensorParallelGPT`: the dimension it is split along (``None``: every rank
    holds all of it), and the reference parameters it stacks, each with the size of one rank's slice."""
    check_layout(cfg, tp)
    d, hd, V = cfg.d_model, cfg.head_dim, cfg.vocab_size
    plan = {"tok_emb.weight": (0, (("tok_emb.weight", V // tp),)),
            "pos_emb.weight": (None, (("pos_emb.weight", cfg.seq_len),))}
    for i in range(cfg.n_layers):
        p = f"blocks.{i}."
        for norm in ("ln1", "ln2"):
            plan[p + norm + ".weight"] = (None, ((p + norm + ".weight", d),))
            plan[p + norm + ".bias"] = (None, ((p + norm + ".bias", d),))
        q, kv = cfg.n_heads * hd // tp, cfg.n_kv_heads * hd // tp
        plan[p + "attn.qkv_proj.weight"] = (0, ((p + "attn.q_proj.weight", q), (p + "attn.k_proj.weight", kv),
                                                (p + "attn.v_proj.weight", kv)))
        plan[p + "attn.o_proj.weight"] = (1, ((p + "attn.o_proj.weight", cfg.n_heads * hd // tp),))
        f = cfg.d_ff // tp
        if cfg.gated:
            plan[p + "mlp.gate_up_proj.weight"] = (0, ((p + "mlp.gate_proj.weight", f),
                                                       (p + "mlp.up_proj.weight", f)))
        else:
            plan[p + "mlp.up_proj.weight"] = (0, ((p + "mlp.up_proj.weight", f),))
        plan[p + "mlp.down_proj.weight"] = (1, ((p + "mlp.down_proj.weight", f),))
    plan["ln_f.weight"] = (None, (("ln_f.weight", d),))
    plan["ln_f.bias"] = (None, (("ln_f.bias", d),))
    if not cfg.tie_embeddings:
        plan["lm_head.weight"] = (0, (("lm_head.weight", V // tp),))
    return plan


def shard_state(full: dict[str, torch.Tensor], cfg: GPTConfig, rank: int, tp: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s tensors, under :class:`TensorParallelGPT`'s names, cut from the reference's ``full``
    (all of the model's tensors, or some of them)."""
    shards = {}
    for name, (dim, parts) in shard_plan(cfg, tp).items():
        if parts[0][0] not in full:  # a part of the model only (one block, say)
            continue
        if dim is None:
            shards[name] = full[parts[0][0]].detach().clone()
        else:
            shards[name] = torch.cat([full[ref].detach().narrow(dim, rank * n, n) for ref, n in parts], dim)
    return shards


def unshard_state(shards: list[dict[str, torch.Tensor]], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """The reference's tensors, put together from every rank's ``shards`` (in rank order).

    A replicated tensor is taken from rank 0: whether the ranks agree on it is a check of its own.
    """
    tp, full = len(shards), {}
    for name, (dim, parts) in shard_plan(cfg, tp).items():
        if name not in shards[0]:
            continue
        if dim is None:
            full[parts[0][0]] = shards[0][name]
            continue
        pieces = [s[name].split([n for _, n in parts], dim) for s in shards]
        for i, (ref, _) in enumerate(parts):
            full[ref] = torch.cat([pieces[r][i] for r in range(tp)], dim)
    return full


def from_reference(reference: nn.Module, rank: int, tp: int, group=None,
                   sequence_parallel: bool = False) -> TensorParallelGPT:
    """This rank's :class:`TensorParallelGPT`, holding its shards of the weights of ``reference`` (a GPT)."""
    model = TensorParallelGPT(reference.cfg, rank, tp, group, sequence_parallel)
    dtype = next(reference.parameters()).dtype
    model.to(dtype)
    shards = shard_state(dict(reference.named_parameters()), reference.cfg, rank, tp)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(shards[name])
    return model


def named_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "vocab_parallel_cross_entropy", "ParallelAttention", "ParallelMLP", "ParallelBlock",
           "TensorParallelGPT", "check_layout", "allreduce_sequence_parallel_grads", "shard_plan",
           "shard_state", "unshard_state", "from_reference", "named_grads"]
