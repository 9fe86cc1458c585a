"""Rank and size from the group: tensor, expert and pipeline parallelism on two groups of 2 inside 4 ranks.

On a mesh a parallelism's group is never the whole world, so a module that read its position from the global
rank would cut the wrong shard, or talk to a rank outside its group. Here ranks 0-1 form one group and ranks
2-3 another; each group runs TP, then EP, then a 2-stage pipeline on a batch of its own (the two groups' data
differ, so an exchange between them shows), with nothing but the group passed in. Each group's result is
compared with the single process on that group's batch: losses within 1e-6 relative, gradients within 1e-6 of
each tensor's largest entry (fp32 rounding; the pipeline's loss too, being the mean of its micro-batches').
"""

from dataclasses import asdict

import ipyparallel as ipp
import pytest

from conftest import assert_close_to_scale, seeded_batch, small_config
from helpers.model import GPT
from helpers.parallel import expert_parallel, moe, tensor_parallel
from helpers.reference import named_grads

CFG = small_config(tie_embeddings=False)  # untied: no embedding group to make on top of the two groups
MOE = moe.MoEConfig(**asdict(small_config(d_ff=32)), n_experts=4, top_k=2, capacity_factor=1.0)
ROWS = 4
RTOL = 1e-6


@pytest.fixture(scope="module")
def four():
    from helpers.ranks import start_ranks

    r = start_ranks(4, timeout_s=30, activate=False)
    yield r
    r.stop()


def batch_of(group: int, cfg=CFG):
    return seeded_batch(cfg, ROWS, seed=group)


@ipp.interactive  # sent by value: the engines cannot import this test module
def _on_two_groups(cfg, moe_cfg, batches):
    import torch.distributed as dist

    from helpers.model import GPT
    from helpers.parallel import expert_parallel, moe, pipeline_parallel, tensor_parallel
    from helpers.cost import pipeline_schedules
    from helpers.reference import named_grads

    made = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group, in one order
    index = dist.get_rank() // 2
    group = made[index]
    x, y = batches[index]
    out = {"group": index}

    model = tensor_parallel.parallelize(GPT(cfg, seed=0), group)
    _, loss = model(x, y)
    loss.backward()
    out["tp"] = (loss.item(), named_grads(model))

    model = expert_parallel.from_reference(moe.MoEGPT(moe_cfg, seed=0, segments=2), group)
    mine = slice(dist.get_rank(group) * len(x) // 2, (dist.get_rank(group) + 1) * len(x) // 2)
    xm, ym = batches[index + 2]
    _, loss = model(xm[mine], ym[mine])
    loss.backward()
    expert_parallel.finish_gradients(model, group)
    out["ep"] = (loss.item(), named_grads(model))

    stage = dist.get_rank(group)
    chunk = pipeline_parallel.pipeline_chunk(GPT(cfg, seed=0), stage, 2)
    losses, _ = pipeline_parallel.run_schedule(pipeline_schedules.one_f_one_b(2, 2), {stage: chunk}, x, y,
                                               group=group)
    out["pp"] = (sorted((int(i), float(v)) for i, v in losses.items()), named_grads(chunk))
    return out


def test_tp_ep_and_pp_work_on_two_groups_of_two_with_only_the_group_passed(four):
    batches = [batch_of(0), batch_of(1), batch_of(0, MOE), batch_of(1, MOE)]
    results = four.apply(_on_two_groups, CFG, MOE, batches)
    for index in (0, 1):
        mine = [r for r in results if r["group"] == index]
        assert len(mine) == 2
        x, y = batches[index]

        reference = GPT(CFG, seed=0)
        _, loss = reference(x, y)
        loss.backward()
        want = named_grads(reference)
        for r in mine:
            assert r["tp"][0] == pytest.approx(loss.item(), rel=RTOL)
        grads = tensor_parallel.unshard_state([r["tp"][1] for r in mine], CFG)
        assert_close_to_scale(grads, want, RTOL, f"TP on group {index}, gradients:")

        micro = [reference(xs, ys)[1].item() for xs, ys in zip(x.chunk(2), y.chunk(2))]
        last = mine[1]["pp"]
        assert [i for i, _ in last[0]] == [0, 1] and mine[0]["pp"][0] == []
        for (_, got), expected in zip(last[0], micro):
            assert got == pytest.approx(expected, rel=RTOL)
        stages = {**mine[0]["pp"][1], **mine[1]["pp"][1]}
        assert_close_to_scale(stages, want, RTOL, f"PP on group {index}, gradients:")

        xm, ym = batches[index + 2]
        single = moe.MoEGPT(MOE, seed=0, segments=2)
        _, loss = single(xm, ym)
        loss.backward()
        assert sum(r["ep"][0] for r in mine) / 2 == pytest.approx(loss.item(), rel=RTOL)
        grads = expert_parallel.unshard_experts([r["ep"][1] for r in mine])
        assert_close_to_scale(grads, named_grads(single), RTOL, f"EP on group {index}, gradients:")
