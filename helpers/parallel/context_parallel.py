"""Context parallelism from scratch (chapter 07): ring attention and Ulysses.

Context parallelism splits the *sequence* of every layer over the ``cp`` ranks of a group; everything but
attention acts on each token alone and needs no communication. Attention needs every key for every query, and
there are two ways to bring them together:

- **Ring attention** (Liu et al. 2023): each rank keeps its queries and passes its key/value block around the
  ring, one step per rank; partial results are merged with the online-softmax rule (Milakov and Gimelshein
  2018), as FlashAttention merges tiles (Dao et al. 2022). The arithmetic of one step, a block of attention,
  the merge and a block's backward, is in :mod:`helpers.parallel.blockwise_attention`. :class:`_RingAttention`
  writes the backward pass by hand: the key/value blocks go round once more, and the gradients of each block
  travel with it until they reach their owner.
- **Ulysses** (Jacobs et al. 2023): an all-to-all turns sequence-sharded Q, K, V into head-sharded ones, each
  rank computes whole attention for its heads over the whole sequence, and a second all-to-all turns the
  output back. The head count bounds its degree.

Under causal masking the contiguous layout gives the last rank about ``2cp - 1`` times the first's work;
:class:`CPLayout` also provides the zig-zag layout (each rank holds one chunk from the front and the mirrored
one from the back) that evens it out, provided each ring step computes only the half-blocks
:func:`~helpers.parallel.blockwise_attention.score_blocks` names: a block computed whole and then masked costs
as much as an unmasked one. Each ring step posts the next block's transfer before it computes and waits after
(:class:`RingTransfer`); :data:`EVENTS` records the order. :func:`cp_gpt_forward` runs the book's GPT on one
rank's tokens with either attention plugged in.

Ring messages are *counted* in chapter 02's ledger, one :class:`~helpers.parallel.ledger.Message` per tensor
sent or received. The all-to-alls are torch collectives, *booked* with
:meth:`~helpers.parallel.ledger.Ledger.record` (the formula's bytes for the buffer passed);
:class:`TorchCollectives` sees which torch collectives really ran, on which group, with which sizes.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import layout_rules
from helpers.model import cross_entropy
from helpers.parallel.blockwise_attention import (block_attention, block_attention_backward, merge,
                                                  score_blocks)
from helpers.parallel.ledger import LEDGER, Message

HEAD_DIM, SEQ_DIM = 1, 2  # q, k, v are (batch, heads, sequence, head_dim), as F.scaled_dot_product_attention


# ---------------------------------------------------------------------------------------------------------
# Which positions each rank holds
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CPLayout:
    """How a sequence of ``seq_len`` tokens is split over ``cp`` ranks.

    ``"contiguous"``: rank ``r`` holds positions ``r·s/cp … (r+1)·s/cp``. ``"zigzag"``: the sequence is cut
    into ``2·cp`` chunks and rank ``r`` holds chunks ``r`` and ``2·cp-1-r``, one early and one late, so that
    under a causal mask every rank scores the same number of pairs (the load-balanced layout of Megatron-LM's
    context parallelism and of Llama 3's training).
    """

    seq_len: int
    cp: int
    kind: str = "contiguous"

    def __post_init__(self):
        if self.kind not in ("contiguous", "zigzag"):
            raise ValueError(f"the layout must be 'contiguous' or 'zigzag', got {self.kind!r}")
        layout_rules.context_parallel(self.cp, self.seq_len, zigzag=self.kind == "zigzag")

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
    layout_rules.ulysses(cp, n_heads, n_kv_heads)


# ---------------------------------------------------------------------------------------------------------
# GQA: each KV head serves n_rep query heads
# ---------------------------------------------------------------------------------------------------------


def _expand(kv: torch.Tensor, n_rep: int) -> torch.Tensor:
    """GQA: each KV head serves ``n_rep`` consecutive query heads."""
    return kv.repeat_interleave(n_rep, dim=HEAD_DIM)


def _fold(grad: torch.Tensor, n_rep: int) -> torch.Tensor:
    """The gradient of :func:`_expand`: sum over the query heads that shared a KV head."""
    b, h, s, d = grad.shape
    return grad.view(b, h // n_rep, n_rep, s, d).sum(2)


# ---------------------------------------------------------------------------------------------------------
# Ring attention
# ---------------------------------------------------------------------------------------------------------


EVENTS: list[tuple[str, int, str, float]] = []
"""This rank's ring, in order: ``(what, step, event, time.perf_counter())``; ``what`` is a transfer
("forward K/V", "backward K/V", "backward dK/dV") with events "posted" and "arrived", or a pass ("forward",
"backward") with events "compute" and "computed"."""


@contextlib.contextmanager
def _computing(what: str, step: int):
    EVENTS.append((what, step, "compute", time.perf_counter()))
    yield
    EVENTS.append((what, step, "computed", time.perf_counter()))


class RingTransfer:
    """One ring step in flight: ``t`` sent to the right neighbour, the left neighbour's block received.

    Both messages are posted at once (``batch_isend_irecv``, so no rank waits for another to post) and counted
    in chapter 02's ledger; :meth:`wait` returns the received block. Posting the next block's transfer before
    computing the current one, and waiting after, is the double buffering that lets the transfer run while the
    rank computes (Liu et al. 2023).
    """

    def __init__(self, t: torch.Tensor, what: str, step: int, group=None, tag: int = 0):
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        self.right, self.left = (rank + 1) % world_size, (rank - 1) % world_size
        self.sent, self.received = t.contiguous(), torch.empty_like(t)
        self.what, self.step = what, step
        ops = [dist.P2POp(dist.isend, self.sent, _global(self.right, group), group=group, tag=tag),
               dist.P2POp(dist.irecv, self.received, _global(self.left, group), group=group, tag=tag)]
        self.works = dist.batch_isend_irecv(ops)
        nbytes = self.sent.numel() * self.sent.element_size()
        LEDGER.messages += [Message("ring attention", what, step, "send", self.right, nbytes),
                            Message("ring attention", what, step, "recv", self.left, nbytes)]
        EVENTS.append((what, step, "posted", time.perf_counter()))

    def wait(self) -> torch.Tensor:
        if self.works:  # a gloo work waited for a second time waits for a message that never comes
            try:
                for work in self.works:
                    work.wait()
            except RuntimeError as err:
                raise RuntimeError(f"{self.what}, step {self.step}: the transfer (send to {self.right}, "
                                   f"receive from {self.left}) did not complete: {err}") from None
            self.works = []
            EVENTS.append((self.what, self.step, "arrived", time.perf_counter()))
        return self.received


def _global(rank: int, group) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


class _RingAttention(torch.autograd.Function):
    """Ring attention (Liu et al. 2023), forward and backward by hand, each transfer overlapped with a block.

    Forward: ``cp`` steps; at each, post the transfer of the K/V block this rank holds to the right, score its
    queries against that block (only the parts :func:`score_blocks` names), merge with the online-softmax
    rule, then wait for the left neighbour's block. Only ``q``, the local ``k``, ``v``, the output and its
    log-sum-exp are saved: the blocks that went by are not kept.

    Backward: the K/V blocks go round again, posted as in forward. At step ``j`` a rank computes its term of
    the gradient of the block it holds (that of rank ``r-j``); the block's gradient so far arrives from the
    left, gets this term, and moves right while the next block is computed, so after ``cp-1`` passes it lands
    on its owner, who adds its own. Per rank: ``cp-1`` K/V messages forward, ``cp-1`` K/V and ``cp-1`` dK/dV
    messages backward.
    """

    @staticmethod
    def forward(ctx, q, k, v, layout, causal, group):
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        n_rep = q.shape[HEAD_DIM] // k.shape[HEAD_DIM]
        q_pos = layout.positions(rank)
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)
        kv = torch.stack([k, v])  # one message per step
        for step in range(world_size):
            owner = (rank - step) % world_size
            incoming = RingTransfer(kv, "forward K/V", step, group) if step + 1 < world_size else None
            k_pos = layout.positions(owner)
            with _computing("forward", step):
                for rows, cols in score_blocks(layout, rank, owner, causal):
                    keys, values = (_expand(t, n_rep) for t in kv[..., cols, :])
                    block = block_attention(q[..., rows, :], keys, values, q_pos[rows], k_pos[cols], causal)
                    out[..., rows, :], lse[..., rows] = merge(out[..., rows, :], lse[..., rows], *block)
            if incoming is not None:
                kv = incoming.wait()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.causal, ctx.group = layout, causal, group
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        layout, causal, group = ctx.layout, ctx.causal, ctx.group
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        n_rep = q.shape[HEAD_DIM] // k.shape[HEAD_DIM]
        q_pos = layout.positions(rank)
        delta = (dout * out).sum(-1)
        dq = torch.zeros_like(q)
        kv = torch.stack([k, v])
        own = travelling = None
        for step in range(world_size):
            owner = (rank - step) % world_size
            incoming = RingTransfer(kv, "backward K/V", step, group) if step + 1 < world_size else None
            k_pos = layout.positions(owner)
            dkv = torch.zeros_like(kv)
            with _computing("backward", step):
                for rows, cols in score_blocks(layout, rank, owner, causal):
                    keys, values = (_expand(t, n_rep) for t in kv[..., cols, :])
                    dq_part, dk, dv = block_attention_backward(dout[..., rows, :], delta[..., rows],
                                                               q[..., rows, :], keys, values, lse[..., rows],
                                                               q_pos[rows], k_pos[cols], causal)
                    dq[..., rows, :] += dq_part
                    dkv[..., cols, :] += torch.stack([_fold(dk, n_rep), _fold(dv, n_rep)])
            if step == 0:
                own = dkv  # this rank's term of its own block's gradient: it stays here
            else:  # the block's gradient so far came from the left; with this rank's term it moves on, tag 1
                so_far = travelling.wait() if travelling is not None else 0
                travelling = RingTransfer(so_far + dkv, "backward dK/dV", step, group, tag=1)
            if incoming is not None:
                kv = incoming.wait()
        dkv = own if travelling is None else own + travelling.wait()
        return dq, dkv[0], dkv[1], None, None, None


def ring_attention(q, k, v, layout: CPLayout, causal: bool = True, group=None) -> torch.Tensor:
    """This rank's attention output for its queries ``q`` over the keys of every rank (Liu et al. 2023).

    ``q`` is (batch, n_heads, s/cp, head_dim), ``k`` and ``v`` (batch, n_kv_heads, s/cp, head_dim), at the
    positions ``layout.positions(rank)``.
    """
    if layout.cp != dist.get_world_size(group):
        raise ValueError(f"the layout is for cp={layout.cp} ranks, the group has "
                         f"{dist.get_world_size(group)}")
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

    Forward with (heads, sequence) turns sequence-sharded Q, K, V into head-sharded ones; with (sequence,
    heads) it turns the output back. Backward is the inverse all-to-all.
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

    After the first all-to-all a rank holds ``n_heads/cp`` query heads and their ``n_kv_heads/cp`` KV heads
    for every position, in the order of the ranks' positions; attention on them is ordinary attention.
    """
    world_size = dist.get_world_size(group)
    if layout.cp != world_size:
        raise ValueError(f"the layout is for cp={layout.cp} ranks, the group has {world_size}")
    check_heads(q.shape[HEAD_DIM], k.shape[HEAD_DIM], world_size)
    q, k, v = (_AllToAll.apply(t, HEAD_DIM, SEQ_DIM, group) for t in (q, k, v))
    n_rep = q.shape[HEAD_DIM] // k.shape[HEAD_DIM]
    k, v = _expand(k, n_rep), _expand(v, n_rep)
    if causal and layout.kind != "contiguous":  # the gathered positions are not in order: mask by position
        pos = torch.cat([layout.positions(r) for r in range(world_size)])
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=pos[None, :] <= pos[:, None])
    else:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return _AllToAll.apply(out, SEQ_DIM, HEAD_DIM, group)


class TorchCollectives(TorchDispatchMode):
    """Every ``torch.distributed`` operation run inside the ``with`` block, as PyTorch's dispatcher sees it.

    A booking in the ledger says what the book's code meant to call; this sees what ran, however it was called
    (``dist.all_to_all_single``, an imported name, a library). ``calls`` holds one ``(operation, group ranks,
    elements of each tensor argument, element size)`` per call, in order: ``("alltoall_base_", (0, 1, 2, 3),
    (4096, 4096), 8)`` is an ``all_to_all_single`` of 4,096 fp64 numbers over four ranks.
    """

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, tuple[int, ...], tuple[int, ...], int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            flat = [a for arg in args for a in (arg if isinstance(arg, (list, tuple)) else [arg])]
            tensors = [a for a in flat if isinstance(a, torch.Tensor)]
            groups = [dist.ProcessGroup.unbox(a) for a in flat if isinstance(a, torch.ScriptObject)
                      and a._type().qualified_name().endswith("ProcessGroup")]
            ranks = tuple(dist.get_process_group_ranks(groups[0])) if groups else ()
            self.calls.append((func.overloadpacket.__name__, ranks, tuple(t.numel() for t in tensors),
                               tensors[0].element_size() if tensors else 0))
        return func(*args, **(kwargs or {}))


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

    Weights are whole on every rank; only attention talks to the other ranks, through ``core``. The loss is
    the mean over this rank's tokens: averaging the ranks' gradients (every rank has as many tokens) gives the
    gradient of the mean over the whole sequence.
    """
    x = model.tok_emb(idx) + model.pos_emb(positions)
    for block in model.blocks:
        x = x + _attention(block.attn, block.ln1(x), core)
        x = x + block.mlp(block.ln2(x))
    logits = model.lm_head(model.ln_f(x))
    return logits, cross_entropy(logits, targets)
