"""ZeRO-1, -2 and -3 (chapter 04): the dim-0 shard layout, the flat buffers one collective moves (copy-in,
copy-out, shards as views) and the gradient shard's accumulation in this process; small runs of every stage on
two ranks against one process.

The layout tests run in this process, exactly. The distributed tests start two ranks, train a small GPT in
fp64 with each stage over one or several micro-batches (gradient accumulation), ZeRO-1 and -2 with one bucket
and with several, and compare the gradient shards of the first step and the parameters after the steps with
the single process here, which sees the whole global batch at once: rtol 1e-10 of each tensor's largest entry
(fp64 results that differ only in summation order). The collectives each stage calls (one per bucket or unit,
in order, of the padded sizes), and the bytes ZeRO-3 holds after forward, are compared exactly.
"""

import functools

import ipyparallel as ipp
import pytest
import torch

from conftest import assert_close_to_scale, seeded_batch, small_config
from helpers.model import GPT
from helpers.reference import named_grads, named_params, train_steps
from helpers.parallel.data_parallel import build_buckets
from helpers.parallel.zero import (ShardedAdamW, accumulate, accumulate_flat, flat_shards, pack_rows,
                                   shard_of, shard_rows, unpack_rows)

# odd sizes, so that most parameters need padding rows on two ranks
CFG = small_config(vocab_size=17, n_layers=4, d_model=16, d_ff=33)
GLOBAL_BATCH, STEPS = 8, 2
ADAMW = dict(lr=1e-2, weight_decay=0.01)
RTOL = 1e-10
CAP_BYTES = 2048  # ZeRO-1 and -2's bucket cap in the runs with several buckets
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


def _odd_tensors(dtype=torch.float64):
    """Tensors whose rows mostly do not divide by 4, one of them 1-D and one with fewer rows than ranks."""
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=g, dtype=dtype) for shape in [(10, 3), (7,), (2, 5), (8, 2, 3)]]


def test_the_copy_in_puts_each_ranks_rows_of_every_tensor_side_by_side():
    tensors = _odd_tensors()
    packed = pack_rows(tensors, 4)
    for r in range(4):
        assert torch.equal(packed[r], torch.cat([shard_of(t, r, 4).reshape(-1) for t in tensors])), \
            f"row {r} of the packed buffer is not rank {r}'s shards side by side"


def test_the_copy_out_undoes_the_copy_in_and_leaves_zero_padding_rows():
    tensors = _odd_tensors()
    fulls = [torch.full((shard_rows(t.shape[0], 4) * 4, *t.shape[1:]), float("nan"), dtype=t.dtype)
             for t in tensors]
    unpack_rows(pack_rows(tensors, 4), fulls, 4)
    for i, (t, full) in enumerate(zip(tensors, fulls)):
        assert torch.equal(full[:t.shape[0]], t), f"tensor {i} of shape {tuple(t.shape)} did not come back"
        assert not full[t.shape[0]:].any(), f"tensor {i}: padding rows not zero"


def test_the_shards_are_views_of_one_flat_buffer_laid_out_as_the_copy_in():
    tensors = _odd_tensors()
    for r in range(4):
        flat, shards = flat_shards(tensors, r, 4)
        assert torch.equal(flat, pack_rows(tensors, 4)[r])  # what rank r sends: row r of the gathered buffer
        for i, (t, shard) in enumerate(zip(tensors, shards)):
            assert isinstance(shard, torch.nn.Parameter) and torch.equal(shard, shard_of(t, r, 4))
            assert shard.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr(), \
                f"rank {r}, shard {i}: not a view of the flat buffer"
        with torch.no_grad():
            shards[-1].fill_(7.0)  # an optimizer's in-place update lands in the buffer the all-gather sends
        assert flat[-shards[-1].numel():].eq(7.0).all()


def test_one_flat_buffer_refuses_parameters_of_two_dtypes():
    mixed = [torch.zeros(4, 2), torch.zeros(4, 2, dtype=torch.float64)]
    message = "one flat buffer holds one dtype; these parameters have torch.float32, torch.float64"
    with pytest.raises(ValueError, match=message):
        flat_shards(mixed, 0, 2)


def test_a_groups_first_reduced_buffer_becomes_the_gradients_and_later_ones_add():
    shards = [torch.nn.Parameter(torch.zeros(2, 3)), torch.nn.Parameter(torch.zeros(4))]
    first, second = torch.arange(10.0), torch.ones(10)
    accumulate_flat(shards, first)
    assert all(s.grad.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() for s in shards)
    accumulate_flat(shards, second)
    assert torch.equal(torch.cat([s.grad.reshape(-1) for s in shards]), torch.arange(10.0) + 1)


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
def _sharded_run(cfg, stage, micro_batches, batches, adamw, reshard=True, prefetch=False, cap_bytes=None):
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
        cap = {} if cap_bytes is None else {"cap_bytes": cap_bytes}
        sharded = zero.ShardedAdamW(model, stage=stage, **cap, **adamw)
        shard_of_param = sharded.shard_of_param
    grad_shards = None
    seen = []  # what the update saw: ZeRO-1 frees its averaged rows once the update has used them
    sharded.optimizer.register_step_pre_hook(lambda *_: seen.append({n: shard_of_param[p].grad.clone()
                                                                     for n, p in model.named_parameters()}))
    for step, (x, y) in enumerate(batches):
        xs, ys = rank_rows(x, rank, world_size), rank_rows(y, rank, world_size)
        for xm, ym in zip(xs.chunk(micro_batches), ys.chunk(micro_batches)):
            (model(xm, ym)[1] / micro_batches).backward()
        sharded.step()  # ZeRO-1 reduce-scatters here
        if step == 0:
            grad_shards = seen[0]
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


@pytest.mark.parametrize("micro_batches", [1, 4])
@pytest.mark.parametrize("stage", [1, 2])
def test_zero1_and_2_with_several_buckets_accumulate_like_one_process(ranks, stage, micro_batches):
    assert len(build_buckets(list(GPT(CFG, seed=0).double().parameters()), CAP_BYTES)) > 3
    results = ranks.apply(_sharded_run, CFG, stage, micro_batches, BATCHES, ADAMW, cap_bytes=CAP_BYTES)
    _check_against_single_process(results, f"ZeRO-{stage}, {CAP_BYTES}-byte buckets, {micro_batches} micro")


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
def _record_calls(cfg, stage, x, y, adamw, cap_bytes=None):
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
        cap = {} if cap_bytes is None else {"cap_bytes": cap_bytes}
        sharded = zero.ShardedAdamW(model, stage, **cap, **adamw)
    with TorchCollectives() as ran:  # every torch.distributed operation, as the dispatcher runs it
        model(rank_rows(x, rank, world_size), rank_rows(y, rank, world_size))[1].backward()
        sharded.step()
    # the full buffer of each: an all-gather's output, a reduce-scatter's input
    return [(op, max(numels), ranks) for op, ranks, numels, _ in ran.calls]


def _expected_calls(stage, cap_bytes):
    """A step's (all-gathers, reduce-scatters): the padded size of each bucket or unit, in order."""
    from helpers.parallel.zero import CAP_BYTES as DEFAULT

    model = GPT(CFG, seed=0).double()
    padded = {p: shard_rows(p.shape[0], 2) * 2 * (p.numel() // p.shape[0]) for p in model.parameters()}
    if stage < 3:
        sizes = [sum(padded[p] for p in bucket)
                 for bucket in build_buckets(list(model.parameters()), cap_bytes or DEFAULT)]
        return sizes, sizes
    blocks = [sum(padded[p] for p in block.parameters()) for block in model.blocks]
    root = sum(padded.values()) - sum(blocks)
    return [root, *blocks, *blocks[::-1]], [*blocks[::-1], root]


@pytest.mark.parametrize("stage, cap_bytes", [(1, None), (1, CAP_BYTES), (2, CAP_BYTES), (3, None)],
                         ids=["zero1-one-bucket", "zero1-buckets", "zero2-buckets", "zero3"])
def test_each_stage_calls_one_collective_per_bucket_or_unit(ranks, stage, cap_bytes):
    gathers, scatters = _expected_calls(stage, cap_bytes)
    if (stage, cap_bytes) == (1, None):
        assert len(gathers) == 1  # the default cap: the whole model in one bucket
    else:
        assert len(gathers) > 3
    for calls in ranks.apply(_record_calls, CFG, stage, *BATCHES[0], ADAMW, cap_bytes):
        assert {group for _, _, group in calls} == {(0, 1)}
        assert [n for name, n, _ in calls if name == "_allgather_base_"] == gathers
        got = [n for name, n, _ in calls if name == "_reduce_scatter_base_"]
        # ZeRO-2's buckets go in the order backward completes them
        assert (sorted(got) == sorted(scatters)) if stage == 2 else (got == scatters), (got, scatters)
        assert len(calls) == len(gathers) + len(scatters)  # and no other collective


@ipp.interactive
def _unused_parameter(stage):
    import torch
    import torch.distributed as dist

    from helpers.parallel import zero

    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(3, 2))
    sharded = zero.ShardedAdamW(model, stage, cap_bytes=1)
    model[0](torch.ones(1, 3)).sum().backward()  # model[1] gets no gradient
    try:
        sharded.step()
    except ValueError as err:
        dist.barrier()
        return str(err)
    return None


@pytest.mark.parametrize("stage", [1, 2])
def test_a_parameter_without_gradient_is_named(ranks, stage):
    message = (f"ZeRO-{stage}: backward left no gradient for 1.weight, 1.bias, so their buckets cannot be "
               f"reduce-scattered")
    assert ranks.apply(_unused_parameter, stage) == [message, message]
