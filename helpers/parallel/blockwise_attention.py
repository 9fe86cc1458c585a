"""Attention one block of keys at a time (chapter 07): what each step of ring attention computes.

Ring attention (Liu et al. 2023) scores a rank's queries against one block of keys per step and never holds
the whole sequence's scores. This module is that arithmetic, on one process and with no communication:

- :func:`block_attention`: softmax attention over one block of keys, normalized over that block, with its
  log-sum-exp per query;
- :func:`merge`: the online-softmax rule (Milakov and Gimelshein 2018) that combines two such partial results
  over disjoint keys into the result over both, as FlashAttention merges tiles (Dao et al. 2022);
- :func:`block_attention_backward`: one block's gradients, recomputed from the final output's log-sum-exp
  (Dao et al. 2022, algorithm 2), so that backward keeps no block's probabilities;
- :func:`score_blocks`: which parts of a block a causal ring computes, in halves of the local block, so that
  a part entirely in its queries' future is skipped rather than computed and masked;
- :func:`ring_step` and :func:`ring_step_backward`: one step of the ring on the K/V block a rank holds, part
  by part, with GQA's KV heads repeated for their query heads (:func:`expand_kv`, :func:`fold_kv`).

:class:`CPLayout` says which positions each rank holds (contiguous or zig-zag); it lives here, below the ring
that uses it, so that this module imports nothing of :mod:`helpers.parallel.context_parallel`, which has the
ring's messages and Ulysses. Tensors are
(batch, heads, positions, head_dim), as ``F.scaled_dot_product_attention`` takes them; ``q_pos`` and
``k_pos`` are the global positions of the queries and keys, which the causal mask compares.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from helpers import layout_rules


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

    Each is normalized over its own keys; the merged log-sum-exp is ``log(e^lse + e^block_lse)`` and each part
    is reweighted by its share of it.
    """
    new = torch.logaddexp(lse, block_lse)
    safe = new.masked_fill(new == float("-inf"), 0)  # a row with no key yet stays 0
    merged = out * torch.exp(lse - safe).unsqueeze(-1) + block_out * torch.exp(block_lse - safe).unsqueeze(-1)
    return merged, new


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

    def positions(self, rank: int, device="cpu") -> torch.Tensor:
        """The global positions rank ``rank`` holds, in the order it holds them, on ``device`` (the CPU when
        only their count or values are read; the activations' device when they index or mask them)."""
        if self.kind == "contiguous":
            c = self.seq_len // self.cp
            return torch.arange(rank * c, (rank + 1) * c, device=device)
        c = self.seq_len // (2 * self.cp)
        late = 2 * self.cp - 1 - rank
        return torch.cat([torch.arange(rank * c, (rank + 1) * c, device=device),
                          torch.arange(late * c, (late + 1) * c, device=device)])


def score_blocks(layout: CPLayout, rank: int, owner: int, causal: bool):
    """The parts of ``rank``'s queries × ``owner``'s keys that ring attention computes: (query rows, key
    columns), as slices of the two ranks' blocks.

    Without a mask, the whole block. With the causal mask, every part that holds a key some query sees, in
    halves of the local block, as Transformer Engine, Megatron-LM and ring-flash-attn split the zig-zag ring;
    a part entirely in its queries' future is skipped, not computed and masked.
    """
    n = len(layout.positions(rank))
    whole, first, second = slice(0, n), slice(0, n // 2), slice(n // 2, n)
    if not causal:
        return [(whole, whole)]
    if owner == rank:  # the diagonal: the queries' first half sees none of the keys' second half
        return [(first, first), (second, whole)]
    if layout.kind == "contiguous":  # an earlier rank's keys are all past, a later rank's all future
        return [(whole, whole)] if owner < rank else []
    # zig-zag: an earlier rank's early chunk is in the past of both my chunks and its late chunk in their
    # future; a later rank's whole block is in the future of my early chunk and in the past of my late one
    return [(whole, first)] if owner < rank else [(second, whole)]


def expand_kv(kv: torch.Tensor, n_rep: int) -> torch.Tensor:
    """GQA: each KV head (dim 1) serves ``n_rep`` consecutive query heads."""
    return kv.repeat_interleave(n_rep, dim=1)


def fold_kv(grad: torch.Tensor, n_rep: int) -> torch.Tensor:
    """The gradient of :func:`expand_kv`: the sum over the query heads that shared a KV head."""
    b, h, s, d = grad.shape
    return grad.view(b, h // n_rep, n_rep, s, d).sum(2)


def ring_step(q, kv, out, lse, layout: CPLayout, rank: int, owner: int, causal: bool) -> None:
    """One forward step: ``rank``'s queries over ``owner``'s K/V block (``kv`` = K and V stacked), the parts
    :func:`score_blocks` names, merged into ``out`` and ``lse`` in place."""
    n_rep = q.shape[1] // kv.shape[2]
    q_pos, k_pos = layout.positions(rank, q.device), layout.positions(owner, q.device)
    for rows, cols in score_blocks(layout, rank, owner, causal):
        keys, values = (expand_kv(t, n_rep) for t in kv[..., cols, :])
        block = block_attention(q[..., rows, :], keys, values, q_pos[rows], k_pos[cols], causal)
        out[..., rows, :], lse[..., rows] = merge(out[..., rows, :], lse[..., rows], *block)


def ring_step_backward(dout, delta, q, kv, lse, dq, layout: CPLayout, rank: int, owner: int, causal: bool):
    """One backward step: adds this block's term of ``dq`` in place, and returns ``rank``'s term of the
    gradient of ``owner``'s K/V block (dK and dV stacked)."""
    n_rep = q.shape[1] // kv.shape[2]
    q_pos, k_pos = layout.positions(rank, q.device), layout.positions(owner, q.device)
    dkv = torch.zeros_like(kv)
    for rows, cols in score_blocks(layout, rank, owner, causal):
        keys, values = (expand_kv(t, n_rep) for t in kv[..., cols, :])
        dq_part, dk, dv = block_attention_backward(dout[..., rows, :], delta[..., rows], q[..., rows, :],
                                                   keys, values, lse[..., rows], q_pos[rows], k_pos[cols],
                                                   causal)
        dq[..., rows, :] += dq_part
        dkv[..., cols, :] += torch.stack([fold_kv(dk, n_rep), fold_kv(dv, n_rep)])
    return dkv


__all__ = ["CPLayout", "block_attention", "merge", "block_attention_backward", "score_blocks", "expand_kv",
           "fold_kv", "ring_step", "ring_step_backward"]
