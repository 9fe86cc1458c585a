"""Context parallelism from scratch (chapter 07): ring attention and Ulysses.

Context parallelism splits the *sequence* of every layer over the ``cp`` ranks of a group; everything but
attention acts on each token alone and needs no communication. Attention needs every key for every query, and
there are two ways to bring them together:

- **Ring attention** (Liu et al. 2023): each rank keeps its queries and passes its key/value block around the
  ring, one step per rank; partial results are merged with the online-softmax rule (Milakov and Gimelshein
  2018), as FlashAttention merges tiles (Dao et al. 2022). The arithmetic of one step is in
  :mod:`helpers.parallel.blockwise_attention`. :class:`_RingAttention` writes the backward pass by hand: the
  key/value blocks go round once more, and the gradients of each block travel with it to their owner.
- **Ulysses** (Jacobs et al. 2023): an all-to-all turns sequence-sharded Q, K, V into head-sharded ones, each
  rank computes whole attention for its heads over the whole sequence, and a second all-to-all turns the
  output back. The head count bounds its degree.

Under causal masking the contiguous layout gives the last rank about ``2cp - 1`` times the first's work;
:class:`CPLayout` also provides the zig-zag layout (each rank holds one chunk from the front and the mirrored
one from the back) that evens it out, provided each ring step computes only the half-blocks
:func:`~helpers.parallel.blockwise_attention.score_blocks` names: a block computed whole and then masked costs
as much as an unmasked one. Each ring step posts the next block's transfer before it computes and waits after
(:class:`RingTransfer`); :data:`EVENTS` records the order.

The book's GPT becomes context-parallel by a transformation: :func:`parallelize` sets every block's attention
core, :func:`shard_sequence` gives a rank its tokens and their positions (which the model's forward takes),
:func:`average_gradients` averages the ranks' gradients. Messages go through :mod:`helpers.parallel.comms`:
the ring's are *counted* in the ledger, one per tensor sent or received; the all-to-alls are torch's,
*booked* (the formula's bytes for the buffer passed); :class:`helpers.measure.TorchCollectives` sees which
torch collectives really ran, on which group, with which sizes.
"""

from __future__ import annotations

import contextlib
import functools
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from helpers import layout_rules
from helpers.parallel import comms
from helpers.parallel.blockwise_attention import CPLayout, expand_kv, ring_step, ring_step_backward

HEAD_DIM, SEQ_DIM = 1, 2  # q, k, v are (batch, heads, sequence, head_dim), as F.scaled_dot_product_attention


# ---------------------------------------------------------------------------------------------------------
# Which positions each rank holds: CPLayout (in blockwise_attention, whose ring step reads it)
# ---------------------------------------------------------------------------------------------------------


def causal_pairs(layout: CPLayout, rank: int) -> int:
    """(query, key) pairs a rank's queries score under a causal mask: position ``p`` sees ``p + 1`` keys."""
    return int((layout.positions(rank) + 1).sum())


def check_heads(n_heads: int, n_kv_heads: int, cp: int) -> None:
    """Ulysses gives each rank ``1/cp`` of the heads: ``cp`` must divide both head counts."""
    layout_rules.ulysses(cp, n_heads, n_kv_heads)


# ---------------------------------------------------------------------------------------------------------
# Ring attention
# ---------------------------------------------------------------------------------------------------------


EVENTS: list[tuple[str, int, str, float]] = []
"""This rank's ring, in order: ``(what, step, event, time.perf_counter())``; ``what`` is a transfer
("forward K/V", "backward K/V", "backward dK/dV") with events "posted" and "arrived", or a pass ("forward",
"backward") with events "compute" and "computed"."""


def _event(what: str, step: int, event: str) -> None:
    EVENTS.append((what, step, event, time.perf_counter()))


@contextlib.contextmanager
def _computing(what: str, step: int):
    _event(what, step, "compute")
    yield
    _event(what, step, "computed")


class RingTransfer:
    """One ring step in flight: ``t`` sent to the right neighbour, the left neighbour's block received.

    Both messages are posted at once (``comms.send_recv``, so no rank waits for another to post) and counted
    in chapter 02's ledger; :meth:`wait` returns the received block. Posting the next block's transfer before
    computing the current one, and waiting after, is the double buffering that lets the transfer run while the
    rank computes (Liu et al. 2023).
    """

    def __init__(self, t: torch.Tensor, what: str, step: int, group=None, tag: int = 0):
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        self.pending = comms.send_recv(t, (rank + 1) % world_size, (rank - 1) % world_size, group, tag=tag,
                                       label="ring attention", phase=what, step=step, async_op=True)
        self.what, self.step = what, step
        _event(what, step, "posted")

    def wait(self) -> torch.Tensor:
        received = self.pending.wait()
        _event(self.what, self.step, "arrived")
        return received


class _RingAttention(torch.autograd.Function):
    """Ring attention (Liu et al. 2023), forward and backward by hand, each transfer hidden behind a block."""

    @staticmethod
    def forward(ctx, q, k, v, layout, causal, group):
        """``cp`` steps: post the K/V block this rank holds to the right, attend to it (``ring_step``), wait
        for the left neighbour's. Saved: ``q``, the local ``k``, ``v``, the output and its log-sum-exp."""
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        out, lse = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype,
                                                                 device=q.device)
        kv = torch.stack([k, v])  # one message per step
        for step in range(world_size):
            incoming = RingTransfer(kv, "forward K/V", step, group) if step + 1 < world_size else None
            with _computing("forward", step):
                ring_step(q, kv, out, lse, layout, rank, (rank - step) % world_size, causal)
            if incoming is not None:
                kv = incoming.wait()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.causal, ctx.group = layout, causal, group
        return out

    @staticmethod
    def backward(ctx, dout):
        """The K/V blocks go round again. At step ``j`` a rank computes its term of the gradient of the block
        it holds (rank ``r-j``'s); the block's gradient so far arrives from the left, gets this term and
        moves right, so after ``cp-1`` passes it lands on its owner, who adds its own."""
        q, k, v, out, lse = ctx.saved_tensors
        layout, causal, group = ctx.layout, ctx.causal, ctx.group
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        delta, dq, kv = (dout * out).sum(-1), torch.zeros_like(q), torch.stack([k, v])
        own = travelling = None
        for step in range(world_size):
            incoming = RingTransfer(kv, "backward K/V", step, group) if step + 1 < world_size else None
            owner = (rank - step) % world_size
            with _computing("backward", step):
                dkv = ring_step_backward(dout, delta, q, kv, lse, dq, layout, rank, owner, causal)
            if step == 0:
                own = dkv  # this rank's term of its own block's gradient: it stays here
            else:  # the block's gradient so far came from the left; with this rank's term it moves on, tag 1
                so_far = travelling.wait() if travelling is not None else 0
                travelling = RingTransfer(so_far + dkv, "backward dK/dV", step, group, tag=1)
            if incoming is not None:
                kv = incoming.wait()
        dkv = own if travelling is None else own + travelling.wait()
        return dq, dkv[0], dkv[1], None, None, None


def _check_group(layout: CPLayout, group) -> int:
    world_size = dist.get_world_size(group)
    if layout.cp != world_size:
        raise ValueError(f"the layout is for cp={layout.cp} ranks, the group has {world_size}")
    return world_size


def ring_attention(q, k, v, layout: CPLayout, causal: bool = True, group=None) -> torch.Tensor:
    """This rank's attention output for its queries ``q`` over the keys of every rank (Liu et al. 2023).

    ``q`` is (batch, n_heads, s/cp, head_dim), ``k`` and ``v`` (batch, n_kv_heads, s/cp, head_dim), at the
    positions ``layout.positions(rank)``.
    """
    _check_group(layout, group)
    return _RingAttention.apply(q, k, v, layout, causal, group)


# ---------------------------------------------------------------------------------------------------------
# Ulysses
# ---------------------------------------------------------------------------------------------------------


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group=None) -> torch.Tensor:
    """Cut ``x`` into ``cp`` pieces along ``scatter_dim``, send piece ``i`` to rank ``i``, and concatenate the
    pieces received along ``gather_dim``, in rank order."""
    pieces = torch.stack(x.chunk(dist.get_world_size(group), dim=scatter_dim))
    received = comms.all_to_all(pieces, group, label="all_to_all")
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
    world_size = _check_group(layout, group)
    check_heads(q.shape[HEAD_DIM], k.shape[HEAD_DIM], world_size)
    q, k, v = (_AllToAll.apply(t, HEAD_DIM, SEQ_DIM, group) for t in (q, k, v))
    n_rep = q.shape[HEAD_DIM] // k.shape[HEAD_DIM]
    k, v = expand_kv(k, n_rep), expand_kv(v, n_rep)
    if causal and layout.kind != "contiguous":  # the gathered positions are not in order: mask by position
        pos = torch.cat([layout.positions(r, q.device) for r in range(world_size)])
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=pos[None, :] <= pos[:, None])
    else:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return _AllToAll.apply(out, SEQ_DIM, HEAD_DIM, group)


# ---------------------------------------------------------------------------------------------------------
# The book's GPT, context-parallel
# ---------------------------------------------------------------------------------------------------------


class CPCore(functools.partial):
    """``Attention.core`` for ring or Ulysses attention; a deep copy of the model (a pipeline stage) shares
    it, as a process group cannot be copied."""

    def __deepcopy__(self, memo):
        return self


def parallelize(model, layout: CPLayout, group=None, attention: str = "ring"):
    """Make the book's GPT context-parallel over ``group``, in place, and return it: every block's attention
    core becomes causal ring or Ulysses attention with ``layout``; weights stay whole. Works on a pipeline
    stage, and before or after tensor parallelism (the core attends over the heads a rank holds)."""
    attentions = {"ring": ring_attention, "ulysses": ulysses_attention}
    if attention not in attentions:
        raise ValueError(f"attention={attention!r} is not one of {', '.join(map(repr, attentions))}")
    _check_group(layout, group)
    if attention == "ulysses":
        check_heads(model.cfg.n_heads, model.cfg.n_kv_heads, layout.cp)
    for block in model.blocks:
        block.attn.core = CPCore(attentions[attention], layout=layout, causal=True, group=group)
    return model


def shard_sequence(x: torch.Tensor, y: torch.Tensor, layout: CPLayout, group=None):
    """This rank's columns of the inputs ``x`` and targets ``y`` (batch, seq_len), and their global positions,
    which the model's forward takes as ``positions``: the learned embedding's rows, or the angles of the
    rotary tables, so that each rank rotates its queries and keys at its own offsets (not from 0)."""
    if x.shape[1] != layout.seq_len or y.shape != x.shape:
        raise ValueError(f"inputs {tuple(x.shape)}, targets {tuple(y.shape)}: the layout is for "
                         f"sequences of {layout.seq_len}")
    positions = layout.positions(dist.get_rank(group), x.device)
    return x[:, positions], y[:, positions], positions


def average_gradients(model, group=None) -> None:
    """Each gradient averaged over the group: each rank's loss is the mean over its tokens, and every rank has
    as many, so the mean of the ranks' gradients is the gradient of the mean over the whole sequence."""
    world_size = dist.get_world_size(group)
    for p in model.parameters():
        if p.grad is not None:
            comms.all_reduce(p.grad, group).div_(world_size)


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

