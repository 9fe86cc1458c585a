"""ZeRO-1, -2 and -3 (chapter 04): the dim-0 shard layout here, and small runs on two ranks against one process.

The distributed tests start two ranks, train a small GPT in fp64 with each stage over several micro-batches
(gradient accumulation), and compare the gradient shards and the parameters after the steps with the single
process here, which sees the whole global batch at once.
"""

import functools

import ipyparallel as ipp
import pytest
import torch

from helpers.data import get_batch, make_tokens
from helpers.model import GPT, GPTConfig
from helpers.parallel.zero import shard_of, shard_rows

CFG = GPTConfig(vocab_size=17, seq_len=8, n_layers=4, d_model=16, n_heads=4, n_kv_heads=2, d_ff=33)
GLOBAL_BATCH, STEPS = 8, 2
ADAMW = dict(lr=1e-2, weight_decay=0.01)


def test_shards_tile_the_tensor_with_zero_padding():
    full = torch.arange(10 * 3, dtype=torch.float64).view(10, 3)
    shards = [shard_of(full, r, 4) for r in range(4)]
    assert shard_rows(10, 4) == 3 and all(s.shape == (3, 3) for s in shards)
    assert torch.equal(torch.cat(shards)[:10], full)
    assert torch.equal(torch.cat(shards)[10:], torch.zeros(2, 3, dtype=torch.float64))
    assert shard_of(torch.ones(2), 3, 4).tolist() == [0.0]  # a rank past the end holds only padding


@functools.cache
def _single_process():
    """The reference: the whole global batch in one backward, ``STEPS`` AdamW steps."""
    tokens = make_tokens()
    model = GPT(CFG, seed=0).double()
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    first_grads = None
    for step in range(STEPS):
        x, y = get_batch(tokens, step, GLOBAL_BATCH, CFG.seq_len)
        model(x, y)[1].backward()
        if step == 0:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
    return first_grads, {n: p.detach().clone() for n, p in model.named_parameters()}


@ipp.interactive  # sent by value: the engines cannot import this test module
def _sharded_run(cfg, stage, micro_batches, global_batch, steps, adamw, reshard=True, prefetch=False):
    import torch.distributed as dist

    from helpers.parallel import zero
    from helpers.data import get_batch, make_tokens
    from helpers.model import GPT

    rank, world_size = dist.get_rank(), dist.get_world_size()
    tokens = make_tokens()
    model = GPT(cfg, seed=0).double()
    if stage == 3:
        sharded = zero.Zero3(model, list(model.blocks), reshard_after_forward=reshard, prefetch=prefetch, **adamw)
        shard_of_param = sharded.shards
    else:
        sharded = zero.ShardedAdamW(model, stage=stage, **adamw)
        shard_of_param = sharded.shard_of_param
    rows = global_batch // world_size // micro_batches
    grad_shards = None
    for step in range(steps):
        x, y = get_batch(tokens, step, global_batch, cfg.seq_len)
        mine = slice(rank * rows * micro_batches, (rank + 1) * rows * micro_batches)
        x, y = x[mine], y[mine]
        for m in range(micro_batches):
            loss = model(x[m * rows:(m + 1) * rows], y[m * rows:(m + 1) * rows])[1]
            (loss / micro_batches).backward()
        sharded.step()  # ZeRO-1 reduce-scatters here; the step leaves the gradient shards as they are
        if step == 0:
            grad_shards = {n: shard_of_param[p].grad.clone() for n, p in model.named_parameters()}
        sharded.zero_grad()
    if stage == 3:
        gathered = sharded.full_parameters()
        params = {n: gathered[p].clone() for n, p in model.named_parameters()}
    else:
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return grad_shards, params


def _check_against_single_process(results, grads, params, rtol=1e-10):
    for rank, (grad_shards, got_params) in enumerate(results):
        for name, want in grads.items():
            k = shard_rows(want.shape[0], len(results))
            real = grad_shards[name][:max(0, min(k, want.shape[0] - rank * k))]
            torch.testing.assert_close(real, want[rank * k:rank * k + real.shape[0]], rtol=rtol,
                                       atol=rtol * want.abs().max().item(), msg=lambda m: f"{name}, rank {rank}: {m}")
        for name, want in params.items():
            torch.testing.assert_close(got_params[name], want, rtol=rtol, atol=rtol * want.abs().max().item(),
                                       msg=lambda m: f"{name} after {STEPS} steps, rank {rank}: {m}")


@pytest.mark.parametrize("micro_batches", [1, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_every_stage_accumulates_micro_batches_like_one_process(ranks, stage, micro_batches):
    grads, params = _single_process()
    results = ranks.apply(_sharded_run, CFG, stage, micro_batches, GLOBAL_BATCH, STEPS, ADAMW)
    _check_against_single_process(results, grads, params)


@pytest.mark.parametrize("reshard, prefetch", [(False, False), (True, True)], ids=["no-reshard", "prefetch"])
def test_zero3_variants_accumulate_like_one_process(ranks, reshard, prefetch):
    grads, params = _single_process()
    results = ranks.apply(_sharded_run, CFG, 3, 2, GLOBAL_BATCH, STEPS, ADAMW, reshard, prefetch)
    _check_against_single_process(results, grads, params)


@ipp.interactive
def _zero3_memory_and_poison(cfg, global_batch, adamw, poison):
    """ZeRO-3 with every matrix garbage in backward (``poison``), or clean; live parameter bytes at each sample."""
    import torch.distributed as dist

    from helpers.parallel import zero
    from helpers.data import get_batch, make_tokens
    from helpers.model import GPT

    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = GPT(cfg, seed=0).double()
    sharded = zero.Zero3(model, list(model.blocks), **adamw)

    def garbage(block, *_):  # after Zero3's own backward pre-hook: each matrix just gathered becomes noise
        for p in block.parameters():
            if p.dim() == 2:
                p.data.normal_()

    if poison:
        for block in model.blocks:
            block.register_full_backward_pre_hook(garbage)
    x, y = get_batch(make_tokens(), 0, global_batch, cfg.seq_len)
    rows = global_batch // world_size
    with sharded.memory.saving():
        loss = model(x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows])[1]
    end_of_forward = sharded.memory.held()
    loss.backward()
    grads = {n: sharded.shards[p].grad.clone() for n, p in model.named_parameters()}
    root = sum(sharded.unsharded[p].numel() * 8 for p in sharded.units[0])
    return grads, end_of_forward["parameters"], root


def test_zero3_frees_in_forward_and_backward_reads_what_it_gathers_again(ranks):
    clean = ranks.apply(_zero3_memory_and_poison, CFG, GLOBAL_BATCH, ADAMW, False)
    poisoned = ranks.apply(_zero3_memory_and_poison, CFG, GLOBAL_BATCH, ADAMW, True)
    for (grads, held, root), (bad_grads, _, _) in zip(clean, poisoned):
        # after forward only the root is gathered: no block's full weights survive in autograd's saved tensors
        assert held == root, (held, root)
        # block 0's gradients depend on every later block's matrices through backward: garbage there must show
        for name, g in grads.items():
            if name.startswith("blocks.0."):
                assert not torch.equal(g, bad_grads[name]), f"{name}: backward did not read the re-gathered weights"


@ipp.interactive
def _record_calls(cfg, stage, global_batch, adamw):
    import torch.distributed as dist

    from helpers.parallel import zero
    from helpers.data import get_batch, make_tokens
    from helpers.model import GPT

    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = GPT(cfg, seed=0).double()
    sharded = zero.Zero3(model, list(model.blocks), **adamw) if stage == 3 else zero.ShardedAdamW(model, stage, **adamw)
    x, y = get_batch(make_tokens(), 0, global_batch, cfg.seq_len)
    rows = global_batch // world_size
    with zero.collective_calls() as calls:
        model(x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows])[1].backward()
        sharded.step()
    return [(c.collective, c.numel, c.group_ranks) for c in calls]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_collectives_each_stage_calls(ranks, stage):
    model = GPT(CFG, seed=0)
    padded = {n: shard_rows(p.shape[0], 2) * 2 * (p.numel() // p.shape[0]) for n, p in model.named_parameters()}
    blocks = sum(v for n, v in padded.items() if n.startswith("blocks."))
    everything = sum(padded.values())
    gathered = everything if stage < 3 else 2 * blocks + (everything - blocks)
    for calls in ranks.apply(_record_calls, CFG, stage, GLOBAL_BATCH, ADAMW):
        kinds = {name for name, _, _ in calls}
        assert kinds == {"reduce_scatter_single", "all_gather_single"}, kinds
        assert {group for _, _, group in calls} == {(0, 1)}
        assert sum(n for name, n, _ in calls if name == "reduce_scatter_single") == everything
        assert sum(n for name, n, _ in calls if name == "all_gather_single") == gathered
