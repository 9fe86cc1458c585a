"""A small data set made in code: sums written out as text, one character per token.

The corpus is lines like ``482+39=521`` drawn from a seeded generator, so nothing is downloaded and every
build sees the same tokens. It is learnable (the digits after ``=`` follow from those before it), which lets
later chapters show a loss that falls, and small enough to tokenize in milliseconds.

``get_batch(tokens, step, batch_size, seq_len, seed)`` returns the *global* batch of a step: inputs and
next-token targets of shape (batch_size, seq_len), the same on every rank and in the kernel. A data-parallel
rank takes its own rows of it with :func:`rank_rows`.
"""

from __future__ import annotations

import torch

ALPHABET = "0123456789+=\n"
STOI = {ch: i for i, ch in enumerate(ALPHABET)}


def encode(text: str) -> torch.Tensor:
    return torch.tensor([STOI[ch] for ch in text], dtype=torch.long)


def decode(ids) -> str:
    return "".join(ALPHABET[int(i)] for i in ids)


def sums_text(n_lines: int, seed: int = 0, max_operand: int = 999) -> str:
    """``n_lines`` lines ``a+b=c`` with ``a, b`` uniform in ``[0, max_operand]``."""
    gen = torch.Generator().manual_seed(seed)
    ab = torch.randint(0, max_operand + 1, (n_lines, 2), generator=gen).tolist()
    return "".join(f"{a}+{b}={a + b}\n" for a, b in ab)


def make_tokens(n_lines: int = 4096, seed: int = 0) -> torch.Tensor:
    """The corpus as one long tensor of token ids (vocabulary: ``ALPHABET``, 13 symbols)."""
    return encode(sums_text(n_lines, seed))


def get_batch(tokens: torch.Tensor, step: int, batch_size: int, seq_len: int, seed: int = 0):
    """The global batch for ``step``: ``batch_size`` windows of ``seq_len + 1`` tokens at seeded offsets."""
    if tokens.numel() <= seq_len + 1:
        raise ValueError(f"a corpus of {tokens.numel()} tokens is too short for windows of {seq_len + 1}")
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, tokens.numel() - seq_len - 1, (batch_size,), generator=gen)
    windows = torch.stack([tokens[s:s + seq_len + 1] for s in starts.tolist()])
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def rank_rows(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s equal share of the rows of a global-batch tensor (rows ``[rank*n, (rank+1)*n)``)."""
    if t.shape[0] % world_size:
        raise ValueError(f"a batch of {t.shape[0]} rows does not split evenly over {world_size} ranks")
    rows = t.shape[0] // world_size
    return t[rank * rows:(rank + 1) * rows]
