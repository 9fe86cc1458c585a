"""ZeRO-1, -2 and -3 (chapter 04): the dim-0 shard layout and the gradient shard's accumulation in this
process; small runs of every stage on two ranks against one process.

The layout tests run in this process. The distributed tests start two ranks, train a small GPT in fp64 with
each stage over one or several micro-batches (gradient accumulation), and compare the gradient shards of the
first step and the parameters after the steps with the single process here, which sees the whole global batch
at once: rtol 1e-10 of each tensor's largest entry (fp64 results that differ only in summation order). The
collectives each stage calls, and the bytes ZeRO-3 holds after forward, are compared exactly.
"""

import functools

import ipyparallel as ipp
import pytest
import torch

from conftest import assert_close_to_scale, seeded_batch, small_config
from helpers.model import GPT
from helpers.reference import named_grads, named_params, train_steps
from helpers.parallel.zero import ShardedAdamW, accumulate, shard_of, shard_rows

# odd sizes, so that most parameters need padding rows on two ranks
CFG = small_config(vocab_size=17, n_layers=4, d_model=16, d_ff=33)
GLOBAL_BATCH, STEPS = 8, 2
ADAMW = dict(lr=1e-2, weight_decay=0.01)
RTOL = 1e-10
BATCHES = [seeded_batch(CFG, GLOBAL_BATCH, seed=step) for step in range(STEPS)]


def test_shards_tile_the_tensor_with_zero_padding():
    full = torch.arange(10 * 3, dtype=torch.float64).view(10, 3)
    shards = [shard_of(full, r, 4) for r in range(4)]
    assert shard_rows(10, 4) == 3 and all(s.shape == (3, 3) for s in shards)
    assert torch.equal(torch.cat(shards)[:10], full)
    assert torch.equal(torch.cat(shards)[10:], torch.zeros(2, 3, dtype=torch.float64))
    assert shard_of(torch.ones(2), 3, 4).tolist() == [0.0]  # a rank past the end holds only padding


def test_a_gradient_shard_sums_the_micro_batches():
    shard = torch.nn.Parameter(torch.zeros(3))
    for reduced in (torch.ones(3), 2 * torch.ones(3)):
        accumulate(shard, reduced)
    assert shard.grad.tolist() == [3.0, 3.0, 3.0]  # assigning would keep only the last micro-batch's 2


def test_sharded_adamw_refuses_a_stage_it_does_not_implement():
    with pytest.raises(ValueError, match="ShardedAdamW implements ZeRO stages 1 and 2, not 3"):
        ShardedAdamW(GPT(CFG, seed=0), stage=3)


@functools.cache
def _single_process():
    """The reference: the whole global batch in one backward, ``STEPS`` AdamW steps."""
    model = GPT(CFG, seed=0).double()
    model(*BATCHES[0])[1].backward()
    first_grads = named_grads(model)
    model.zero_grad()
    train_steps(model, BATCHES, optimizer=torch.optim.AdamW(model.parameters(), **ADAMW))
    return first_grads, named_params(model)


@ipp.interactive  # sent by value: the engines cannot import this test module
def _sharded_run(cfg, stage, micro_batches, batches, adamw, reshard=True, prefetch=False):
    import torch.distributed as dist

    from helpers.data import rank_rows
    from helpers.model import GPT
    from helpers.parallel import zero

    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = GPT(cfg, seed=0).double()
    if stage == 3:
        sharded = zero.Zero3(model, list(model.blocks), reshard_after_forward=reshard, prefetch=prefetch,
                             **adamw)
        shard_of_param = sharded.shards
    else:
        sharded = zero.ShardedAdamW(model, stage=stage, **adamw)
        shard_of_param = sharded.shard_of_param
    grad_shards = None
    for step, (x, y) in enumerate(batches):
        xs, ys = rank_rows(x, rank, world_size), rank_rows(y, rank, world_size)
        for xm, ym in zip(xs.chunk(micro_batches), ys.chunk(micro_batches)):
            (model(xm, ym)[1] / micro_batches).backward()
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


def _check_against_single_process(results, what):
    grads, params = _single_process()
    for rank, (grad_shards, got_params) in enumerate(results):
        real, want = {}, {}
        for name, full in grads.items():
            k = shard_rows(full.shape[0], len(results))
            rows = max(0, min(k, full.shape[0] - rank * k))  # the padding rows hold nothing
            real[name], want[name] = grad_shards[name][:rows], full[rank * k:rank * k + rows]
        assert_close_to_scale(real, want, RTOL, f"{what}, gradient shards of step 0, rank {rank}:")
        assert_close_to_scale(got_params, params, RTOL,
                              f"{what}, parameters after {STEPS} steps, rank {rank}:")


@pytest.mark.parametrize("micro_batches", [1, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_every_stage_accumulates_micro_batches_like_one_process(ranks, stage, micro_batches):
    results = ranks.apply(_sharded_run, CFG, stage, micro_batches, BATCHES, ADAMW)
    _check_against_single_process(results, f"ZeRO-{stage}, micro_batches={micro_batches}")


@pytest.mark.parametrize("reshard, prefetch", [(False, False), (True, True)], ids=["no-reshard", "prefetch"])
def test_zero3_variants_accumulate_like_one_process(ranks, reshard, prefetch):
    results = ranks.apply(_sharded_run, CFG, 3, 2, BATCHES, ADAMW, reshard, prefetch)
    _check_against_single_process(results, f"ZeRO-3, reshard={reshard}, prefetch={prefetch}")


@ipp.interactive
def _zero3_memory_and_poison(cfg, x, y, adamw, poison):
    """ZeRO-3 with every matrix garbage in backward (``poison``), or clean; live parameter bytes after
    forward."""
    import torch.distributed as dist

    from helpers.data import rank_rows
    from helpers.model import GPT
    from helpers.parallel import zero

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
    with sharded.memory.saving():
        loss = model(rank_rows(x, rank, world_size), rank_rows(y, rank, world_size))[1]
    end_of_forward = sharded.memory.held()
    loss.backward()
    grads = {n: sharded.shards[p].grad.clone() for n, p in model.named_parameters()}
    root = sum(sharded.unsharded[p].numel() * 8 for p in sharded.units[0])
    return grads, end_of_forward["parameters"], root


def test_zero3_frees_in_forward_and_backward_reads_what_it_gathers_again(ranks):
    x, y = BATCHES[0]
    clean = ranks.apply(_zero3_memory_and_poison, CFG, x, y, ADAMW, False)
    poisoned = ranks.apply(_zero3_memory_and_poison, CFG, x, y, ADAMW, True)
    for (grads, held, root), (bad_grads, _, _) in zip(clean, poisoned):
        # after forward only the root is gathered: no block's full weights survive in autograd's saved tensors
        assert held == root, (held, root)
        # block 0's gradients depend on every later block's matrices through backward: garbage there must show
        for name, g in grads.items():
            if name.startswith("blocks.0."):
                assert not torch.equal(g, bad_grads[name]), \
                    f"{name}: backward did not read the re-gathered weights"


@ipp.interactive
def _record_calls(cfg, stage, x, y, adamw):
    import torch.distributed as dist

    from helpers.data import rank_rows
    from helpers.model import GPT
    from helpers.parallel import zero
    from helpers.measure import TorchCollectives

    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = GPT(cfg, seed=0).double()
    if stage == 3:
        sharded = zero.Zero3(model, list(model.blocks), **adamw)
    else:
        sharded = zero.ShardedAdamW(model, stage, **adamw)
    with TorchCollectives() as ran:  # every torch.distributed operation, as the dispatcher runs it
        model(rank_rows(x, rank, world_size), rank_rows(y, rank, world_size))[1].backward()
        sharded.step()
    # the full buffer of each: an all-gather's output, a reduce-scatter's input
    return [(op, max(numels), ranks) for op, ranks, numels, _ in ran.calls]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_collectives_each_stage_calls(ranks, stage):
    model = GPT(CFG, seed=0)
    padded = {n: shard_rows(p.shape[0], 2) * 2 * (p.numel() // p.shape[0])
              for n, p in model.named_parameters()}
    blocks = sum(v for n, v in padded.items() if n.startswith("blocks."))
    everything = sum(padded.values())
    gathered = everything if stage < 3 else 2 * blocks + (everything - blocks)  # ZeRO-3: each block twice
    for calls in ranks.apply(_record_calls, CFG, stage, *BATCHES[0], ADAMW):
        kinds = {name for name, _, _ in calls}
        assert kinds == {"_reduce_scatter_base_", "_allgather_base_"}, kinds
        assert {group for _, _, group in calls} == {(0, 1)}
        assert sum(n for name, n, _ in calls if name == "_reduce_scatter_base_") == everything
        assert sum(n for name, n, _ in calls if name == "_allgather_base_") == gathered
