"""Chapter 11's weight synchronisation, planned and applied in one process: from a trainer's dim-0 shards
(chapter 04) to chapter 05's tensor-parallel layout, for every parameter of the GPT, odd sizes included."""

import pytest
import torch

from helpers.model import GPT, GPTConfig
from helpers.parallel import tensor_parallel
from helpers.parallel.zero import shard_of, shard_rows
from helpers.reference import named_params
from helpers.training import weight_sync

# (config, trainer ranks, tp): rows the trainers do not divide (padding), KV heads split and copied
CASES = {
    "layernorm, tied, odd rows over 2 trainers": (GPTConfig(vocab_size=18, seq_len=8, d_model=15, n_heads=3,
                                                            n_kv_heads=3, d_ff=21), 2, 3),
    "layernorm, odd vocabulary, 4 trainers": (GPTConfig(vocab_size=15, seq_len=8, d_model=15, n_heads=3,
                                                        n_kv_heads=1, d_ff=21), 4, 3),
    "llama, GQA split over tp=2, 3 trainers": (GPTConfig.llama_style(vocab_size=14, seq_len=8, d_model=16,
                                                                     n_heads=4, n_kv_heads=2, d_ff=24), 3, 2),
    "llama, KV heads copied (tp=4 > 2), 5 trainers": (GPTConfig.llama_style(vocab_size=12, seq_len=8,
                                                                            d_model=24, n_heads=4,
                                                                            n_kv_heads=2, d_ff=36), 5, 4),
}


@pytest.mark.parametrize("label", CASES)
def test_plan_applied_equals_shard_state(label):
    cfg, n_trainers, tp = CASES[label]
    full = named_params(GPT(cfg, seed=0).double())
    assert any(w.shape[0] % n_trainers for w in full.values()), "the case must pad some shard"
    got = weight_sync.apply_locally(full, cfg, n_trainers, tp)  # starts from NaN: a missed entry shows
    for i in range(tp):
        want = tensor_parallel.shard_state(full, cfg, i, tp)
        assert sorted(got[i]) == sorted(want) == sorted(tensor_parallel.shard_plan(cfg, tp))
        for name, w in want.items():
            assert torch.equal(got[i][name], w), f"{label}: inference rank {i}, {name}"


@pytest.mark.parametrize("label", CASES)
def test_pieces_stay_inside_one_trainer_shard_and_cover_each_slice_once(label):
    cfg, n_trainers, tp = CASES[label]
    shapes, targets = weight_sync.reference_shapes(cfg), weight_sync.target_shapes(cfg, tp)
    pieces = weight_sync.plan(cfg, n_trainers, tp)
    covered = {i: {name: torch.zeros(shape, dtype=torch.int64) for name, shape in targets.items()}
               for i in range(tp)}
    for (t, i), these in pieces.items():
        for p in these:
            k = shard_rows(shapes[p.source][0], n_trainers)
            assert p.k == k and t * k <= p.rows[0] < p.rows[1] <= min((t + 1) * k, shapes[p.source][0])
            dst = covered[i][p.target][p.at[0]:p.at[0] + p.shape[0]]
            (dst if p.cols is None else dst[:, p.at[1]:p.at[1] + p.shape[1]]).add_(1)
    for i in range(tp):
        for name, hits in covered[i].items():
            assert bool((hits == 1).all()), f"{label}: rank {i}'s {name} not covered exactly once"


def test_row_parallel_takes_rows_from_every_trainer_and_column_parallel_from_the_overlapping_ones():
    cfg, n_trainers, tp = CASES["llama, GQA split over tp=2, 3 trainers"]
    pieces = weight_sync.plan(cfg, n_trainers, tp)
    senders = {(p.target, i): set() for (t, i), these in pieces.items() for p in these}
    for (t, i), these in pieces.items():
        for p in these:
            senders[(p.target, i)].add(t)
    assert senders[("blocks.0.attn.o_proj.weight", 0)] == {0, 1, 2}  # cut along dim 1: every row
    assert senders[("blocks.0.mlp.down_proj.weight", 1)] == {0, 1, 2}
    assert senders[("lm_head.weight", 0)] == {0, 1}  # rows 0-6 of 14; trainer shards of 5 rows


def test_a_tp_degree_that_does_not_divide_the_kv_heads_is_named():
    cfg = GPTConfig.llama_style(vocab_size=12, seq_len=8, d_model=24, n_heads=6, n_kv_heads=2, d_ff=36)
    with pytest.raises(ValueError, match=r"tensor-parallel layout: tp=3 must divide n_kv_heads=2 or be a "
                                         r"multiple of it"):
        weight_sync.plan(cfg, 2, 3)
    cfg = GPTConfig.llama_style(vocab_size=12, seq_len=8, d_model=48, n_heads=12, n_kv_heads=4, d_ff=48)
    with pytest.raises(ValueError, match=r"tp=6 must divide n_kv_heads=4 or be a multiple"):
        weight_sync.plan(cfg, 2, 6)


def test_mismatched_group_sizes_and_a_missing_parameter_are_named():
    cfg, n_trainers, tp = CASES["llama, GQA split over tp=2, 3 trainers"]
    full = named_params(GPT(cfg, seed=0))
    pieces = weight_sync.plan(cfg, n_trainers, tp)
    other = {name: shard_of(w, 0, 2) for name, w in full.items()}  # sharded over 2 trainers, not 3
    with pytest.raises(ValueError, match="the trainer group has another size than the plan's"):
        weight_sync.pack(pieces[(0, 0)], other)
    state = {name: shard_of(w, 0, 3) for name, w in full.items() if name != "blocks.1.attn.k_proj.weight"}
    with pytest.raises(KeyError, match="has no parameter 'blocks.1.attn.k_proj.weight'"):
        weight_sync.pack(pieces[(0, 0)], state)
    with pytest.raises(ValueError, match="at least one rank"):
        weight_sync.plan(cfg, 0, tp)
