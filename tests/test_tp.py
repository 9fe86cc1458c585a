"""Tensor and sequence parallelism (chapter 05): layouts, shards, and one small run on two ranks.

The layout and shard tests run in this process; sharding and unsharding give back every tensor bit for bit.
The distributed test starts two ranks, runs a tensor-parallel (and a sequence-parallel) forward and backward
of a small GPT on each, and compares what they return with the single process here, within fp32 rounding:
each rank's vocabulary slice of the logits within 1e-6 absolute, the loss within 1e-6 relative, and every
unsharded gradient within rtol 1e-6 of its tensor's largest entry. Without the all-reduce of the norms'
gradients, sequence parallelism leaves one rank's gradient of the final norm more than 1e-3 (relative) from
the reference in some entry, and the two ranks' shares sum to it (rtol 1e-5, atol 1e-7).
"""

from dataclasses import replace

import ipyparallel as ipp
import pytest
import torch

from conftest import assert_close_to_scale, seeded_batch, small_config
from helpers.model import GPT
from helpers.parallel import tensor_parallel

CFG = small_config()
ROWS = 4  # the global batch; every rank runs all of it
RTOL = 1e-6


@pytest.mark.parametrize("cfg, tp_size, names", [
    (CFG, 3, "n_heads=4"),
    (replace(CFG, n_heads=8, n_kv_heads=2), 4, "n_kv_heads=2"),
    (replace(CFG, d_ff=63), 2, "d_ff=63"),
    (replace(CFG, vocab_size=17), 2, "vocab_size=17"),
    (replace(CFG, seq_len=7), 2, "seq_len=7"),
])
def test_a_bad_layout_names_the_broken_constraint(cfg, tp_size, names):
    sequence_parallel = "seq_len" in names
    with pytest.raises(ValueError, match=f"tp={tp_size} must divide {names}"):
        tensor_parallel.check_layout(cfg, tp_size, sequence_parallel)
    with pytest.raises(ValueError, match=f"tp={tp_size} must divide {names}"):
        tensor_parallel.TensorParallelGPT(cfg, 0, tp_size, sequence_parallel=sequence_parallel)


def test_a_good_layout_passes():
    tensor_parallel.check_layout(CFG, 2, sequence_parallel=True)
    tensor_parallel.check_layout(CFG, 1)


@pytest.mark.parametrize("cfg", [CFG, replace(CFG, tie_embeddings=False), replace(CFG, gated=True)])
@pytest.mark.parametrize("tp_size", [1, 2])
def test_sharding_then_unsharding_gives_back_every_tensor_bit_for_bit(cfg, tp_size):
    reference = GPT(cfg, seed=0)
    full = dict(reference.named_parameters())
    shards = [tensor_parallel.shard_state(full, cfg, r, tp_size) for r in range(tp_size)]
    again = tensor_parallel.unshard_state(shards, cfg)
    assert sorted(again) == sorted(full)
    for name, tensor in full.items():
        assert torch.equal(again[name], tensor), name


@pytest.mark.parametrize("cfg", [CFG, replace(CFG, tie_embeddings=False), replace(CFG, gated=True)])
def test_each_rank_holds_its_slice_under_the_plans_names(cfg):
    reference = GPT(cfg, seed=0)
    for rank in range(2):
        model = tensor_parallel.from_reference(reference, rank, 2)
        params = dict(model.named_parameters())
        assert sorted(params) == sorted(tensor_parallel.shard_plan(cfg, 2))
        q_rows = cfg.n_heads * cfg.head_dim // 2
        qkv = params["blocks.0.attn.qkv_proj.weight"]
        assert torch.equal(qkv[:q_rows],
                           reference.blocks[0].attn.q_proj.weight[rank * q_rows:(rank + 1) * q_rows])
        cols = cfg.d_ff // 2
        assert torch.equal(params["blocks.1.mlp.down_proj.weight"],
                           reference.blocks[1].mlp.down_proj.weight[:, rank * cols:(rank + 1) * cols])
        if cfg.tie_embeddings:
            assert model.lm_head.weight is model.tok_emb.weight


@ipp.interactive  # sent by value: the engines cannot import this test module
def _tensor_parallel_step(cfg, x, y, sequence_parallel, sync_norms):
    import torch.distributed as dist

    from helpers.model import GPT
    from helpers.parallel import tensor_parallel

    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = tensor_parallel.from_reference(GPT(cfg, seed=0), rank, world_size,
                                           sequence_parallel=sequence_parallel)
    logits, loss = model(x, y)
    loss.backward()
    if sync_norms:
        tensor_parallel.allreduce_sequence_parallel_grads(model)
    return logits.detach(), loss.item(), tensor_parallel.named_grads(model)


@pytest.mark.parametrize("cfg", [CFG, replace(CFG, gated=True, tie_embeddings=False)],
                         ids=["tied", "gated-untied"])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_two_ranks_match_the_single_process(ranks, cfg, sequence_parallel):
    x, y = seeded_batch(cfg, ROWS)
    reference = GPT(cfg, seed=0)
    logits, loss = reference(x, y)
    loss.backward()
    results = ranks.apply(_tensor_parallel_step, cfg, x, y, sequence_parallel, True)
    per_rank = cfg.vocab_size // 2
    for rank, (got_logits, got_loss, _) in enumerate(results):
        want = logits[..., rank * per_rank:(rank + 1) * per_rank]
        torch.testing.assert_close(got_logits, want.detach(), rtol=0, atol=1e-6)
        assert got_loss == pytest.approx(loss.item(), rel=1e-6)
    grads = tensor_parallel.unshard_state([g for _, _, g in results], cfg)
    want = {n: p.grad for n, p in reference.named_parameters()}
    what = f"gated={cfg.gated}, tie_embeddings={cfg.tie_embeddings}, sequence_parallel={sequence_parallel}"
    assert_close_to_scale(grads, want, RTOL, f"{what}, unsharded gradients:")


def test_sequence_parallel_without_the_norm_all_reduce_is_wrong(ranks):
    x, y = seeded_batch(CFG, ROWS)
    reference = GPT(CFG, seed=0)
    reference(x, y)[1].backward()
    results = ranks.apply(_tensor_parallel_step, CFG, x, y, True, False)
    partial = [g["ln_f.weight"] for _, _, g in results]
    want = reference.ln_f.weight.grad
    assert not torch.allclose(partial[0], want, rtol=1e-3, atol=0)
    torch.testing.assert_close(partial[0] + partial[1], want, rtol=1e-5, atol=1e-7)  # the ranks' shares
