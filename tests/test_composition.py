"""Tensor, pipeline and context parallelism applied to one GPT at once, on 8 ranks, against one process.

The 8 ranks form a 2 x 2 x 2 mesh in torchtitan's order, ``(pp, cp, tp)`` with tensor parallelism innermost,
and each dimension's groups are the grid's rows along it (chapter 10's ``helpers.parallel.mesh.Mesh``). Every
rank takes the one reference GPT and applies the three transformations of chapters 05-07 to it: keep its
pipeline stage's blocks, swap in the tensor-parallel layers, set the attention core (ring or Ulysses) and give
the first stage its tokens' positions. One 1F1B step on two micro-batches then runs through chapter 06's
executor. Compared with the single process, in fp64 (the grid reorders sums three ways; fp64 keeps the
comparison tight): each micro-batch's loss on the last stage, averaged over the CP ranks, within 1e-12
relative, and every gradient, averaged over CP and put together from the TP shards of each stage, within 1e-10
of its tensor's largest entry. Tensor and context parallelism are applied in both orders; cutting a pipeline
chunk from a model already tensor-parallel is refused with the order to follow. Chapter 10's composition
(``helpers.parallel.composition.train``) on ``(pp, dp_shard, tp)``, ZeRO-1 with sequence parallelism, matches
one process's losses and parameters after two AdamW steps (fp64, the same tolerances).
"""

import ipyparallel as ipp
import pytest

from conftest import assert_close_to_scale, seeded_batch, small_config
from helpers.model import GPT
from helpers.parallel import tensor_parallel
from helpers.reference import named_grads

# 8 query heads over 4 KV heads: tp=2 leaves 4 and 2 per rank, which Ulysses' cp=2 splits again
CFG = small_config(n_heads=8, n_kv_heads=4, tie_embeddings=False)
ROWS, M = 4, 2


@ipp.interactive  # sent by value: the engines cannot import this test module
def _composed(cfg, x, y, m, attention, kind, sequence_parallel, tp_first):
    import torch.distributed as dist

    from helpers.model import GPT
    from helpers.parallel import context_parallel, pipeline_parallel, tensor_parallel
    from helpers.cost import pipeline_schedules
    from helpers.parallel.mesh import Mesh
    from helpers.reference import named_grads

    mesh = Mesh((2, 2, 2), ("pp", "cp", "tp")).make_groups(("pp", "cp", "tp"))  # chapter 10's mesh
    pp_group, cp_group, tp_group = mesh.group("pp"), mesh.group("cp"), mesh.group("tp")
    stage = dist.get_rank(pp_group)
    layout = context_parallel.CPLayout(cfg.seq_len, dist.get_world_size(cp_group), kind)
    chunk = pipeline_parallel.pipeline_chunk(GPT(cfg, seed=0).double(), stage, 2)
    if tp_first:
        tensor_parallel.parallelize(chunk, tp_group, sequence_parallel)
        context_parallel.parallelize(chunk, layout, cp_group, attention)
    else:
        context_parallel.parallelize(chunk, layout, cp_group, attention)
        tensor_parallel.parallelize(chunk, tp_group, sequence_parallel)
    xs, ys, positions = context_parallel.shard_sequence(x, y, layout, cp_group)
    tokens = xs.shape[1] // (dist.get_world_size(tp_group) if sequence_parallel else 1)
    losses, _ = pipeline_parallel.run_schedule(
        pipeline_schedules.one_f_one_b(2, m), {stage: chunk}, xs, ys, group=pp_group, positions=positions,
        activation_shape=(xs.shape[0] // m, tokens, cfg.d_model))
    if sequence_parallel:
        tensor_parallel.allreduce_sequence_parallel_grads(chunk, tp_group)
    context_parallel.average_gradients(chunk, cp_group)
    try:  # the other order: a tensor-parallel model holds its group, which a chunk's copy cannot copy
        pipeline_parallel.pipeline_chunk(tensor_parallel.parallelize(GPT(cfg, seed=0), tp_group), stage, 2)
        refused = "not refused"
    except ValueError as err:
        refused = str(err)
    return {"pp": stage, "cp": dist.get_rank(cp_group), "tp": dist.get_rank(tp_group), "refused": refused,
            "losses": {int(i): float(v) for i, v in losses.items()}, "grads": named_grads(chunk)}


@pytest.mark.parametrize("attention, kind, sequence_parallel, tp_first", [
    ("ring", "zigzag", True, True),
    ("ulysses", "contiguous", False, False),
    ("ring", "contiguous", False, True),
], ids=["ring-zigzag-sp", "ulysses-cp-first", "ring-contiguous"])
def test_tp_pp_and_cp_on_one_gpt_match_one_process(eight, attention, kind, sequence_parallel, tp_first):
    x, y = seeded_batch(CFG, ROWS)
    reference = GPT(CFG, seed=0).double()
    micro = [reference(xs, ys)[1].item() for xs, ys in zip(x.chunk(M), y.chunk(M))]
    reference(x, y)[1].backward()
    want = named_grads(reference)

    results = eight.apply(_composed, CFG, x, y, M, attention, kind, sequence_parallel, tp_first)
    last = [r for r in results if r["pp"] == 1]
    for i, expected in enumerate(micro):  # each CP rank's loss is its own tokens' mean: average them
        for tp in (0, 1):
            got = sum(r["losses"][i] for r in last if r["tp"] == tp) / 2
            assert got == pytest.approx(expected, rel=1e-12), f"micro-batch {i}, tp rank {tp}"
    assert all(not r["losses"] for r in results if r["pp"] == 0)
    refused = [r["refused"] for r in results]
    assert all("cut the chunks first, then apply tensor" in message for message in refused), refused[0]

    grads = {}
    for stage in (0, 1):
        for cp in (0, 1):
            shards = sorted((r for r in results if r["pp"] == stage and r["cp"] == cp), key=lambda r: r["tp"])
            whole = tensor_parallel.unshard_state([r["grads"] for r in shards], CFG)
            if cp == 0:
                grads.update(whole)
            else:  # the CP ranks' averaged gradients agree
                assert_close_to_scale(whole, {n: grads[n] for n in whole}, 1e-12, f"stage {stage}, cp 1:")
    assert_close_to_scale(grads, want, 1e-10, f"{attention}, {kind}, sp={sequence_parallel}, gradients:")


@ipp.interactive
def _trained(cfg, data, lr, shape=(2, 2, 2), names=("pp", "dp_shard", "tp"), zero=1, sequence_parallel=True):
    from helpers.model import GPT
    from helpers.parallel import composition
    from helpers.parallel.parallel_dims import ParallelDims

    run = ParallelDims(**dict(zip(names, shape)), m=2, zero=zero, sequence_parallel=sequence_parallel)
    return composition.train(GPT(cfg, seed=0).double(), run.mesh().make_groups(), run, data, lr)


def test_composition_train_on_pp_dp_tp_with_zero1_and_sp_matches_one_process(eight):
    from helpers.parallel import composition
    from helpers.reference import named_params, train_steps

    cfg = small_config(n_heads=8, n_kv_heads=4)  # tied embeddings: the pipeline's embedding group too
    data = [seeded_batch(cfg, 8, seed=s) for s in range(2)]
    reference = GPT(cfg, seed=0).double()
    losses = train_steps(reference, data, lr=1e-2)
    results = eight.apply(_trained, cfg, data, 1e-2)
    last = [r for r in results if r["losses"][0] is not None]
    assert len(last) == 4  # stage 1: dp 2 x tp 2
    for step, want in enumerate(losses):
        got = sum(r["losses"][step] for r in last) / len(last)
        assert got == pytest.approx(want, rel=1e-12), f"step {step}"
    params, others = composition.assemble(results, cfg, "params")
    assert_close_to_scale(params, named_params(reference), 1e-10, "parameters after 2 AdamW steps:")
    assert len(others) == 1
    assert_close_to_scale(others[0], {n: params[n] for n in others[0]}, 1e-12, "the other dp replica:")


@pytest.mark.parametrize("zero", [0, 1], ids=["ddp", "zero1"])
def test_composition_train_with_cp_in_the_data_parallel_group_matches_one_process(eight, zero):
    """On ``(dp_shard, cp, tp)`` the gradients are averaged over ``dp_shard_cp``: the CP ranks of one row
    of the batch hold the gradients of their own positions only, so averaging over ``dp_shard`` alone (the CP
    ranks left out of the data-parallel group) leaves every rank's parameters off one process's. Every rank
    is compared, not only the first replica: a CP rank is a replica of its row's other CP rank."""
    from helpers.parallel import composition
    from helpers.reference import named_params, train_steps

    cfg = small_config(n_heads=8, n_kv_heads=4, seq_len=16)
    data = [seeded_batch(cfg, 8, seed=s) for s in range(2)]
    reference = GPT(cfg, seed=0).double()
    losses = train_steps(reference, data, lr=1e-2)
    results = eight.apply(_trained, cfg, data, 1e-2, (2, 2, 2), ("dp_shard", "cp", "tp"), zero, False)
    for step, want in enumerate(losses):  # each rank's loss is its own tokens' mean: the mean of all 8
        got = sum(r["losses"][step] for r in results) / len(results)
        assert got == pytest.approx(want, rel=1e-12), f"step {step}"
    params, others = composition.assemble(results, cfg, "params")
    assert len(others) == 3  # (dp_shard, cp) = (0, 1), (1, 0), (1, 1)
    for i, part in enumerate([params, *others]):
        assert_close_to_scale(part, named_params(reference), 1e-10, f"replica {i}, parameters after 2 steps:")
