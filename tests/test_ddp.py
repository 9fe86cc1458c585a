"""Buckets: every parameter once, in reverse order, within the cap (the distributed parts run in chapter 03)."""

import torch

from helpers.ddp import build_buckets


def test_buckets_cover_every_parameter_once_in_reverse_order_within_the_cap():
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (10, 300, 20, 20, 5)]
    buckets = build_buckets(params, cap_bytes=4 * 100)
    assert [[p.numel() for p in b] for b in buckets] == [[5, 20, 20], [300], [10]]
    flat = [p for b in buckets for p in b]
    assert flat == list(reversed(params))
    assert all(sum(p.numel() * 4 for p in b) <= 400 for b in buckets if len(b) > 1)
