"""Context parallelism from scratch (chapter 07): ring attention and Ulysses.

Context parallelism splits the *sequence* of every layer over the ``cp`` ranks of a group; everything but
attention acts on each token alone and needs no communication. Attention needs every key for every query, and
there are two ways to bring them together:

- **Ring attention** (Liu et al. 2023): each rank keeps its queries and passes its key/value block around the
  ring, one step per rank; partial results are merged with the online-softmax rule (Milakov and Gimelshein
  2018), as FlashAttention merges tiles (Dao et al. 2022). :class:`_RingAttention` writes the backward pass by
  hand: the key/value blocks go round once more, and the gradients of each block travel with it until they
  reach their owner.
- **Ulysses** (Jacobs et al. 2023): an all-to-all turns sequence-sharded Q, K, V into head-sharded ones, each rank
  computes whole attention for its heads over the whole sequence, and a second all-to-all turns the output
  back. The head count bounds its degree.

Under causal masking the contiguous layout gives the last rank ``2cp - 1`` times the first's work;
:class:`CPLayout` also provides the zig-zag layout (each rank holds one chunk from the front and the mirrored one
from the back) that evens it out. :func:`cp_gpt_forward` runs the book's GPT on one rank's tokens with either
attention plugged in. Ring messages go through :meth:`helpers.ledger.Ledger.exchange`; the all-to-alls are
booked with :meth:`~helpers.ledger.Ledger.record`; :data:`WORK` counts the (query, key) pairs each rank scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .ledger import LEDGER
from .model import cross_entropy

HEAD_DIM, SEQ_DIM = 1, 2  # q, k, v are (batch, heads, sequence, head_dim), as F.scaled_dot_product_attention
WORK: list[int] = []
"""(query, key) position pairs scored by this rank's ring attention, one entry per block it computed."""


# ---------------------------------------------------------------------------------------------------------
# Which positions each rank holds
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CPLayout:
    """How a sequence of ``seq_len`` tokens is split over ``cp`` ranks.

    ``"contiguous"``: rank ``r`` holds positions ``r·s/cp … (r+1)·s/cp``. ``"zigzag"``: the sequence is cut into
    ``2·cp`` chunks and rank ``r`` holds chunks ``r`` and ``2·cp-1-r``, one early and one late, so that under a
    causal mask every rank scores the same number of pairs (the load-balanced layout of Megatron-LM's context
    parallelism and of Llama 3's training).
    """

    seq_len: int
    cp: int
    kind: str = "contiguous"

    def __post_init__(self):
        if self.cp < 1:
            raise ValueError(f"cp must be at least 1, got {self.cp}")
        if self.kind not in ("contiguous", "zigzag"):
            raise ValueError(f"the layout must be 'contiguous' or 'zigzag', got {self.kind!r}")
        chunks = self.cp if self.kind == "contiguous" else 2 * self.cp
        if self.seq_len % chunks:
            what = f"cp={self.cp}" if self.kind == "contiguous" else f"2*cp={chunks} (the zig-zag chunks)"
            raise ValueError(f"{what} must divide seq_len={self.seq_len}")

    def positions(self, rank: int) -> torch.Tensor:
        """The global positions rank ``rank`` holds, in the order it holds them."""
        if self.kind == "contiguous":
            c = self.seq_len // self.cp
            return torch.arange(rank * c, (rank + 1) * c)
        c = self.seq_len // (2 * self.cp)
        late = 2 * self.cp - 1 - rank
        return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange(late * c, (late + 1) * c)])


def causal_pairs(layout: CPLayout, rank: int) -> int:
    """(query, key) pairs a rank's queries score under a causal mask: position ``p`` sees ``p + 1`` keys."""
    return int((layout.positions(rank) + 1).sum())


def check_heads(n_heads: int, n_kv_heads: int, cp: int) -> None:
    """Ulysses gives each rank ``1/cp`` of the heads: ``cp`` must divide both head counts."""
    for name, n in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
        if n % cp:
            raise ValueError(f"Ulysses: cp={cp} must divide {name}={n}: each rank computes whole heads")


# ---------------------------------------------------------------------------------------------------------
# One block of attention, and the online-softmax merge
# ---------------------------------------------------------------------------------------------------------


def _expand(kv: torch.Tensor, group_size: int) -> torch.Tensor:
    """GQA: each KV head serves ``group_size`` consecutive query heads."""
    return kv.repeat_interleave(group_size, dim=HEAD_DIM)


def _fold(grad: torch.Tensor, group_size: int) -> torch.Tensor:
    """The gradient of :func:`_expand`: sum over the query heads that shared a KV head."""
    b, h, s, d = grad.shape
    return grad.view(b, h // group_size, group_size, s, d).sum(2)


def _scores(q, k, q_pos, k_pos, causal):
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    if causal:
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    return scores


def block_attention(q, k, v, q_pos, k_pos, causal: bool):
    """Softmax attention of queries ``q`` over one block of keys: the block's output and log-sum-exp per row.

    A row that sees no key of the block (causal) gets output 0 and log-sum-exp ``-inf``: it weighs nothing in
    the merge.
    """
    scores = _scores(q, k, q_pos, k_pos, causal)
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0).unsqueeze(-1))
    return p @ v, lse


def merge(out, lse, block_out, block_lse):
    """The online-softmax merge (Milakov and Gimelshein 2018) of two partial results over disjoint keys.

    Each is normalized over its own keys; the merged log-sum-exp is ``log(e^lse + e^block_lse)`` and each part is
    reweighted by its share of it.
    """
    new = torch.logaddexp(lse, block_lse)
    safe = new.masked_fill(new == float("-inf"), 0)  # a row with no key yet stays 0
    return out * torch.exp(lse - safe).unsqueeze(-1) + block_out * torch.exp(block_lse - safe).unsqueeze(-1), new


def block_attention_backward(dout, delta, q, k, v, lse, q_pos, k_pos, causal: bool):
    """Gradients of one block, given the final output's ``lse`` and ``delta = rowsum(dout · out)``.

    With ``P = exp(S - lse)`` the block's share of the final softmax (Dao et al. 2022, algorithm 2):
    ``dV = Pᵀ dO``, ``dS = P ⊙ (dO Vᵀ - delta)``, ``dQ = dS K / √d``, ``dK = dSᵀ Q / √d``.
    """
    scale = q.shape[-1] ** -0.5
    p = torch.exp(_scores(q, k, q_pos, k_pos, causal) - lse.unsqueeze(-1))
    dv = p.transpose(-2, -1) @ dout
    ds = p * (dout @ v.transpose(-2, -1) - delta.unsqueeze(-1))
    return ds @ k * scale, ds.transpose(-2, -1) @ q * scale, dv


# ---------------------------------------------------------------------------------------------------------
# Ring attention
# ---------------------------------------------------------------------------------------------------------


def ring_pass(t: torch.Tensor, group=None) -> torch.Tensor:
    """Send ``t`` to the right neighbour, receive the left neighbour's: one step of the ring."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    received = torch.empty_like(t)
    LEDGER.exchange(t.contiguous(), (rank + 1) % world_size, received, (rank - 1) % world_size, group=group)
    return received


def _blocks(layout: CPLayout, rank: int, causal: bool):
    """For each ring step: the owner of the key block this rank holds, its positions, and the pairs to score."""
    q_pos = layout.positions(rank)
    for step in range(layout.cp):
        owner = (rank - step) % layout.cp
        k_pos = layout.positions(owner)
        pairs = int((k_pos[None, :] <= q_pos[:, None]).sum()) if causal else len(q_pos) * len(k_pos)
        yield step, q_pos, k_pos, pairs


class _RingAttention(torch.autograd.Function):
    """Ring attention (Liu et al. 2023), forward and backward by hand.

    Forward: ``cp`` steps; at each, score this rank's queries against the K/V block it holds, merge with the
    online-softmax rule, and pass the block to the right. Only ``q``, the local ``k``, ``v``, the output and its
    log-sum-exp are saved: the blocks that went by are not kept.

    Backward: the K/V blocks go round again. At step ``j`` a rank computes the gradient of the block it holds
    (that of rank ``r-j``); the accumulated gradient of that block arrives from the left with it, gets this
    rank's term, and moves right, so after ``cp-1`` passes it lands on its owner, who adds its own term. Per
    rank: ``cp-1`` K/V messages forward, ``cp-1`` K/V and ``cp-1`` dK/dV messages backward.
    """

    @staticmethod
    def forward(ctx, q, k, v, layout, causal, group):
        rank = dist.get_rank(group)
        group_size = q.shape[HEAD_DIM] // k.shape[HEAD_DIM]
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)
        kv = torch.stack([k, v])  # one message per step
        with LEDGER.collective("ring attention"):
            for step, q_pos, k_pos, pairs in _blocks(layout, rank, causal):
                if step:
                    kv = ring_pass(kv, group)
                if pairs:  # a block entirely in this rank's future is skipped
                    WORK.append(pairs)
                    block = block_attention(q, _expand(kv[0], group_size), _expand(kv[1], group_size), q_pos,
                                            k_pos, causal)
                    out, lse = merge(out, lse, *block)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.causal, ctx.group = layout, causal, group
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        rank = dist.get_rank(ctx.group)
        group_size = q.shape[HEAD_DIM] // k.shape[HEAD_DIM]
        delta = (dout * out).sum(-1)
        dq = torch.zeros_like(q)
        kv = torch.stack([k, v])
        own = travelling = None
        with LEDGER.collective("ring attention"):
            for step, q_pos, k_pos, pairs in _blocks(ctx.layout, rank, ctx.causal):
                if step:
                    kv = ring_pass(kv, ctx.group)
                dkv = torch.zeros_like(kv)
                if pairs:
                    dq_block, dk, dv = block_attention_backward(dout, delta, q, _expand(kv[0], group_size),
                                                                _expand(kv[1], group_size), lse, q_pos, k_pos,
                                                                ctx.causal)
                    dq += dq_block
                    dkv = torch.stack([_fold(dk, group_size), _fold(dv, group_size)])
                if step == 0:
                    own = dkv  # this rank's term of its own block's gradient: it stays here
                else:  # the block's gradient so far, plus this rank's term, moves on towards the owner
                    travelling = ring_pass(dkv if step == 1 else travelling + dkv, ctx.group)
        dkv = own if travelling is None else own + travelling
        return dq, dkv[0], dkv[1], None, None, None


def ring_attention(q, k, v, layout: CPLayout, causal: bool = True, group=None) -> torch.Tensor:
    """This rank's attention output for its queries ``q`` over the keys of every rank (Liu et al. 2023).

    ``q`` is (batch, n_heads, s/cp, head_dim), ``k`` and ``v`` (batch, n_kv_heads, s/cp, head_dim), at the
    positions ``layout.positions(rank)``.
    """
    if layout.cp != dist.get_world_size(group):
        raise ValueError(f"the layout is for cp={layout.cp} ranks, the group has {dist.get_world_size(group)}")
    return _RingAttention.apply(q, k, v, layout, causal, group)


# ---------------------------------------------------------------------------------------------------------
# Ulysses
# ---------------------------------------------------------------------------------------------------------


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group=None) -> torch.Tensor:
    """Cut ``x`` into ``cp`` pieces along ``scatter_dim``, send piece ``i`` to rank ``i``, and concatenate the
    pieces received along ``gather_dim``, in rank order."""
    world_size = dist.get_world_size(group)
    send = torch.stack(x.chunk(world_size, dim=scatter_dim)).contiguous()
    received = torch.empty_like(send)
    LEDGER.record("all_to_all", send, group)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """Ulysses' all-to-all (Jacobs et al. 2023): sharded along ``gather_dim`` in, along ``scatter_dim`` out.

    Forward with (heads, sequence) turns sequence-sharded Q, K, V into head-sharded ones; with (sequence, heads)
    it turns the output back. Backward is the inverse all-to-all.
    """

    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return all_to_all(grad, gather_dim, scatter_dim, ctx.group), None, None, None


def ulysses_attention(q, k, v, layout: CPLayout, causal: bool = True, group=None) -> torch.Tensor:
    """This rank's attention output for its positions, computed head by head over the whole sequence.

    After the first all-to-all a rank holds ``n_heads/cp`` query heads and their ``n_kv_heads/cp`` KV heads for
    every position, in the order of the ranks' positions; attention on them is ordinary attention.
    """
    world_size = dist.get_world_size(group)
    if layout.cp != world_size:
        raise ValueError(f"the layout is for cp={layout.cp} ranks, the group has {world_size}")
    check_heads(q.shape[HEAD_DIM], k.shape[HEAD_DIM], world_size)
    q, k, v = (_AllToAll.apply(t, HEAD_DIM, SEQ_DIM, group) for t in (q, k, v))
    group_size = q.shape[HEAD_DIM] // k.shape[HEAD_DIM]
    k, v = _expand(k, group_size), _expand(v, group_size)
    if causal and layout.kind != "contiguous":  # the gathered positions are not in order: mask by position
        pos = torch.cat([layout.positions(r) for r in range(world_size)])
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=pos[None, :] <= pos[:, None])
    else:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return _AllToAll.apply(out, SEQ_DIM, HEAD_DIM, group)


# ---------------------------------------------------------------------------------------------------------
# What each sends: the formulas
# ---------------------------------------------------------------------------------------------------------


def ring_bytes(batch: int, seq_len: int, n_kv_heads: int, head_dim: int, cp: int, element_size: int = 4):
    """Bytes each rank sends in one layer's ring attention, forward and backward: ``3(cp-1)`` K/V blocks of
    ``s/cp`` tokens (``cp-1`` forward; ``cp-1`` K/V and ``cp-1`` dK/dV backward)."""
    kv_block = 2 * batch * seq_len / cp * n_kv_heads * head_dim * element_size
    return 3 * (cp - 1) * kv_block


def ulysses_bytes(batch: int, seq_len: int, n_heads: int, n_kv_heads: int, head_dim: int, cp: int,
                  element_size: int = 4):
    """Bytes each rank sends in one layer's Ulysses attention, forward and backward: four all-to-alls each way
    (Q, K, V in; the output back), each sending ``(cp-1)/cp`` of this rank's ``s/cp`` tokens."""
    local = batch * seq_len / cp * (2 * n_heads + 2 * n_kv_heads) * head_dim * element_size
    return 2 * (cp - 1) / cp * local


# ---------------------------------------------------------------------------------------------------------
# The book's GPT on one rank's tokens
# ---------------------------------------------------------------------------------------------------------


def _attention(attn, x, core):
    """The book's attention layer (helpers.model.Attention) with its core replaced by ``core(q, k, v)``."""
    b, t, _ = x.shape
    q = attn.q_proj(x).view(b, t, attn.n_heads, attn.head_dim).transpose(1, 2)
    k = attn.k_proj(x).view(b, t, attn.n_kv_heads, attn.head_dim).transpose(1, 2)
    v = attn.v_proj(x).view(b, t, attn.n_kv_heads, attn.head_dim).transpose(1, 2)
    y = core(q, k, v)
    return attn.o_proj(y.transpose(1, 2).reshape(b, t, attn.n_heads * attn.head_dim))


def cp_gpt_forward(model, idx, targets, positions, core):
    """The book's GPT on this rank's tokens ``idx`` at global ``positions``: logits and this rank's mean loss.

    Weights are whole on every rank; only attention talks to the other ranks, through ``core``. The loss is the
    mean over this rank's tokens: averaging the ranks' gradients (every rank has as many tokens) gives the
    gradient of the mean over the whole sequence.
    """
    x = model.tok_emb(idx) + model.pos_emb(positions)
    for block in model.blocks:
        x = x + _attention(block.attn, block.ln1(x), core)
        x = x + block.mlp(block.ln2(x))
    logits = model.lm_head(model.ln_f(x))
    return logits, cross_entropy(logits, targets)
