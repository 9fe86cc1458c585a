"""The dim-0 shard layout of chapter 04 (the collectives run on ranks in the chapter itself)."""

import torch

from helpers.zero import shard_of, shard_rows


def test_shards_tile_the_tensor_with_zero_padding():
    full = torch.arange(10 * 3, dtype=torch.float64).view(10, 3)
    shards = [shard_of(full, r, 4) for r in range(4)]
    assert shard_rows(10, 4) == 3 and all(s.shape == (3, 3) for s in shards)
    assert torch.equal(torch.cat(shards)[:10], full)
    assert torch.equal(torch.cat(shards)[10:], torch.zeros(2, 3, dtype=torch.float64))
    assert shard_of(torch.ones(2), 3, 4).tolist() == [0.0]  # a rank past the end holds only padding
