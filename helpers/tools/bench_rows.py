"""The rows of ``make bench`` (issue 26), run on every rank: the book's from-scratch code and PyTorch's, on
the same model, seed and data, timed alternately, and checked once against each other.

Each row function runs on every rank of the default group and returns the same dict on every rank: ``ours``
and ``theirs``, the seconds of each timed run in the order they ran (each the slowest rank's), and what else
the row measures (``bytes`` of a message, ``memory``: each side's model-state bytes on its fullest rank).
The timing is :func:`helpers.timing.alternate`'s (chapter 04's too): a warm-up run of each, then ``ours,
theirs, ours, …``, every run started together on every rank. The models and sizes are the chapters' own
(chapter 02's ring, 03's DDP, 04's ZeRO, 05's tensor parallelism, 06's pipelines, 12's Muon); the page is
:mod:`helpers.tools.bench`.

Before a row returns, its two sides' results after the timed runs (the all-reduced buffer, the gradients,
the parameters) are compared with :func:`helpers.checks.check_close`: a bench never times a wrong
implementation.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from helpers.checks import check_close
from helpers.data import get_batch, make_tokens
from helpers.model import GPT, GPTConfig, cross_entropy
from helpers.reference import named_grads, named_params
from helpers.timing import alternate
from helpers.tools.bench_timing import batch_rows, model_state_bytes

# The chapters' sizes: chapter 03's model, batch and bucket cap; 04's model (fp32 here, fp64 there) and AdamW;
# 05's and 06's models, micro-batches and schedules.
DDP_CFG = dict(n_layers=4, d_model=128, n_heads=8, n_kv_heads=4, d_ff=512)
DDP_BATCH, CAP_BYTES = 16, 256 * 1024
ZERO_CFG = dict(n_layers=4, d_model=64, n_heads=4, n_kv_heads=2, d_ff=198, vocab_size=61)
ZERO_BATCH, ADAMW = 16, dict(lr=1e-3, weight_decay=0.01)
TP_CFG = dict(vocab_size=16, seq_len=32, n_layers=2, d_model=64, n_heads=8, n_kv_heads=4, d_ff=256)
TP_BATCH = 8
PP_CFG = dict(vocab_size=16, seq_len=16, n_layers=8, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64)
PP_BATCH, PP_M, PP_V = 16, 8, 2


# ------------------------------------------------------------------------------------------------ chapter 02


def ring(nbytes: int, **timing) -> dict:
    """Chapter 02's ring all-reduce against ``dist.all_reduce`` on ``nbytes`` of fp32, into a new buffer."""
    from helpers.parallel.collectives import ring_all_reduce

    x = torch.randn(max(1, nbytes // 4), generator=torch.Generator().manual_seed(dist.get_rank()))
    out = {}

    def ours():
        out["ours"] = ring_all_reduce(x)

    def theirs():
        out["theirs"] = x.clone()  # ring_all_reduce returns a new buffer too
        dist.all_reduce(out["theirs"])

    ours_s, theirs_s = alternate(ours, theirs, **timing)
    check_close(f"bench: ring all-reduce against dist.all_reduce, {nbytes} bytes", out["ours"], out["theirs"],
                rtol=1e-6, quiet=True)  # fp32 sums of N terms in another order
    return {"ours": ours_s, "theirs": theirs_s, "bytes": x.numel() * 4}


# ------------------------------------------------------------------------------------------------ chapter 03


def ddp(version: str, **timing) -> dict:
    """Chapter 03's ``bucketed`` or ``overlapped`` data parallelism against ``DistributedDataParallel`` with
    the same bucket cap (its other settings PyTorch's defaults): a step is forward, backward and the
    gradients' synchronisation. Both keep their gradient buffers from step to step, zeroed in place, as
    chapter 03's timing keeps them (there they accumulate)."""
    from torch.nn.parallel import DistributedDataParallel

    from helpers.parallel import data_parallel

    cfg = GPTConfig(**DDP_CFG)
    xs, ys = batch_rows(DDP_BATCH, cfg.seq_len)
    mine, pytorch = GPT(cfg, seed=0), GPT(cfg, seed=0)
    if version == "bucketed":
        buckets = data_parallel.build_buckets(list(mine.parameters()), CAP_BYTES)

        def sync():
            data_parallel.bucketed_average(buckets)
    elif version in ("overlapped", "overlapped, DDP's buckets"):
        buckets = (None if version == "overlapped" else closed_at_cap(list(mine.parameters()), CAP_BYTES))
        trainer = data_parallel.OverlappedDDP(mine, CAP_BYTES, buckets=buckets)
        buckets, sync = trainer.buckets, trainer.finish
    else:
        raise ValueError(f"version {version!r}: bucketed, overlapped, or overlapped, DDP's buckets")
    wrapped = DistributedDataParallel(pytorch, bucket_cap_mb=CAP_BYTES / 2**20)

    def ours():
        mine.zero_grad(set_to_none=False)
        mine(xs, ys)[1].backward()
        sync()

    def theirs():
        pytorch.zero_grad(set_to_none=False)
        wrapped(xs, ys)[1].backward()

    ours_s, theirs_s = alternate(ours, theirs, **timing)
    check_close(f"bench: {version} DDP against DistributedDataParallel, gradients", named_grads(mine),
                named_grads(pytorch), rtol=1e-5, quiet=True)  # fp32, averaged in another order
    theirs_buckets = wrapped._get_ddp_logging_data().get("rebuilt_bucket_sizes", "").count(",") + 1
    return {"ours": ours_s, "theirs": theirs_s, "note": f"{len(buckets)} buckets against {theirs_buckets}"}


def closed_at_cap(params: list[torch.nn.Parameter], cap_bytes: int) -> list[list[torch.nn.Parameter]]:
    """Buckets as DDP makes them: in reverse order, each closed once it *reaches* ``cap_bytes`` (so it may
    pass the cap by its last parameter), where :func:`~helpers.parallel.data_parallel.build_buckets` keeps
    each under the cap and so makes more of them."""
    buckets, current, size = [], [], 0
    for p in reversed(params):
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= cap_bytes:
            buckets.append(current)
            current, size = [], 0
    return buckets + ([current] if current else [])


# ------------------------------------------------------------------------------------------------ chapter 04


def zero(stage: int, **timing) -> dict:
    """Chapter 04's ZeRO-1 (``ShardedAdamW``) against ``ZeroRedundancyOptimizer`` with the gradients averaged
    by ``DistributedDataParallel``, as PyTorch's documentation pairs them (its parameters packed into one
    bucket per rank, ``parameters_as_bucket_view``, so each rank's are broadcast at once), or its ZeRO-3
    (``Zero3``) against FSDP2 ``fully_shard`` of every block and the root: a step is forward, backward and
    AdamW, torch's fused AdamW on both sides (one kernel for all of a rank's tensors, where the loop over
    them would charge ZeRO's per-parameter shards a Python call each: four times ZeroRedundancyOptimizer's
    whole parameters on four ranks). Our side's memory samples, chapter 04's instrument, are off.
    ``memory``: each side's model-state bytes after a step.

    Both sides train on one batch again and again, so their fp32 rounding differences grow with the number of
    timed steps, which the budget decides: the check is made on a second pair, built the same way, after
    three steps of each."""
    from helpers.parallel import zero as book_zero

    if stage not in (1, 3):
        raise ValueError(f"stage {stage}: 1 or 3")
    cfg = GPTConfig(**ZERO_CFG)
    xs, ys = batch_rows(ZERO_BATCH, cfg.seq_len)
    adamw = dict(ADAMW, fused=True)

    def pair():
        """Both sides from the same seed: the models, our ZeRO, PyTorch's optimizer and a step of each."""
        mine, pytorch = GPT(cfg, seed=0), GPT(cfg, seed=0)
        if stage == 1:
            from torch.distributed.optim import ZeroRedundancyOptimizer
            from torch.nn.parallel import DistributedDataParallel

            sharded = book_zero.ShardedAdamW(mine, stage=1, **adamw)
            forward = DistributedDataParallel(pytorch)
            optimizer = ZeroRedundancyOptimizer(pytorch.parameters(), optimizer_class=torch.optim.AdamW,
                                                parameters_as_bucket_view=True, **adamw)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            sharded = book_zero.Zero3(mine, list(mine.blocks), **adamw)
            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            for block in pytorch.blocks:
                fully_shard(block, mesh=mesh)
            forward = fully_shard(pytorch, mesh=mesh)
            optimizer = torch.optim.AdamW(pytorch.parameters(), **adamw)

        sharded.memory.recording = False

        def ours():
            sharded.zero_grad()
            mine(xs, ys)[1].backward()
            sharded.step()

        def theirs():
            optimizer.zero_grad(set_to_none=True)
            forward(xs, ys)[1].backward()
            optimizer.step()

        return mine, sharded, pytorch, optimizer, ours, theirs

    mine, sharded, pytorch, optimizer, ours, theirs = pair()
    ours_s, theirs_s = alternate(ours, theirs, **timing)
    theirs_optimizer = optimizer.optim if stage == 1 else optimizer  # ZeRO: this rank's AdamW, over its own
    memory = (model_state_bytes(mine, sharded.optimizer), model_state_bytes(pytorch, theirs_optimizer))

    mine, sharded, pytorch, _, ours, theirs = pair()
    shards = sharded.shards if stage == 1 else list(sharded.shards.values())
    seen = []  # the rows' averaged gradients as the last update saw them (ZeRO-1 frees them after it)
    sharded.optimizer.register_step_pre_hook(lambda *_: seen.append([s.grad.clone() for s in shards]))
    for _ in range(3):
        ours()
        theirs()
    grads = {name: book_zero.all_gather_rows(grad, p.shape[0]).view(p.shape)
             for (name, p), grad in zip(mine.named_parameters(), seen[-1])}
    params = (named_params(mine) if stage == 1 else
              {sharded.names[p]: full for p, full in sharded.full_parameters().items()})
    label = f"bench: ZeRO-{stage} against {'ZeroRedundancyOptimizer' if stage == 1 else 'FSDP2'}"
    check_close(f"{label}, the last step's averaged gradients", grads, named_grads(pytorch), rtol=1e-5,
                quiet=True)  # fp32, averaged in another order, after a few steps
    check_close(f"{label}, parameters after every step", params, named_params(pytorch), rtol=1e-4,
                quiet=True)  # fp32 AdamW steps on the same data: rounding differences, a few steps of them
    return {"ours": ours_s, "theirs": theirs_s, "memory": memory}


# ------------------------------------------------------------------------------------------------ chapter 05


def tp(sequence_parallel: bool, **timing) -> dict:
    """Chapter 05's tensor parallelism (with sequence parallelism) against ``tensor.parallel`` with
    ``loss_parallel``: a step is forward and backward of the whole model on one micro-batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from helpers.parallel import composition, tensor_parallel
    from helpers.parallel.parallel_dims import ParallelDims
    from helpers.parallel.tensor_parallel_torch import torch_tensor_parallel

    cfg = GPTConfig(**TP_CFG)
    x, y = get_batch(make_tokens(), 0, TP_BATCH, cfg.seq_len)  # every rank the whole micro-batch
    run = ParallelDims(tp=dist.get_world_size(), sequence_parallel=sequence_parallel, precision="fp32")
    (mine,) = composition.apply(GPT(cfg, seed=0), run.mesh().make_groups(), run).values()  # tp: the world
    pytorch = torch_tensor_parallel(cfg, init_device_mesh("cpu", (dist.get_world_size(),)), sequence_parallel)

    def ours():
        mine.zero_grad(set_to_none=True)
        mine(x, y)[1].backward()
        if sequence_parallel:
            tensor_parallel.allreduce_sequence_parallel_grads(mine)

    def theirs():
        pytorch.zero_grad(set_to_none=True)
        with loss_parallel():
            pytorch(x, y)[1].backward()

    ours_s, theirs_s = alternate(ours, theirs, **timing)
    want = tensor_parallel.shard_state(named_grads(pytorch), cfg, dist.get_rank(), dist.get_world_size())
    check_close(f"bench: {'SP' if sequence_parallel else 'TP'} against tensor.parallel, gradients",
                named_grads(mine), want, rtol=1e-5, quiet=True)  # fp32, reduced in another order
    return {"ours": ours_s, "theirs": theirs_s}


# ------------------------------------------------------------------------------------------------ chapter 06


def pp(schedule: str, **timing) -> dict:
    """Chapter 06's ``run_schedule`` of 1F1B or interleaved 1F1B against ``Schedule1F1B`` or
    ``ScheduleInterleaved1F1B`` on the same chunks (built once, as a training loop would): a step is one
    global batch in ``PP_M`` micro-batches, the tied embedding's gradients summed."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    from helpers.parallel import composition, pipeline_parallel
    from helpers.parallel.parallel_dims import ParallelDims

    p, rank = dist.get_world_size(), dist.get_rank()
    v = {"1F1B": 1, "interleaved 1F1B": PP_V}[schedule]
    run = ParallelDims(pp=p, schedule="1f1b" if v == 1 else "interleaved", vpp=v, m=PP_M, precision="fp32")
    s = run.pipeline_schedule()
    cfg = GPTConfig(**PP_CFG)
    x, y = get_batch(make_tokens(), 0, PP_BATCH, cfg.seq_len)
    mine = composition.apply(GPT(cfg, seed=0), run.mesh().make_groups(), run)  # pp: the world, in rank order
    embedding = pipeline_parallel.embedding_group(s.placement)
    indices = pipeline_parallel.torch_stage_indices("loop", rank, p, v)
    model = GPT(cfg, seed=0)
    pytorch = {c: pipeline_parallel.pipeline_chunk(model, c, s.n_chunks) for c in indices}
    stages = [PipelineStage(pytorch[c], c, s.n_chunks, torch.device("cpu")) for c in indices]
    cls = Schedule1F1B if v == 1 else ScheduleInterleaved1F1B
    torch_schedule = cls(stages[0] if v == 1 else stages, n_microbatches=PP_M, loss_fn=cross_entropy)
    torch_embedding = pipeline_parallel.embedding_group(
        [next(r for r in range(p) if c in pipeline_parallel.torch_stage_indices("loop", r, p, v))
         for c in range(s.n_chunks)])

    def ours():
        for chunk in mine.values():
            chunk.zero_grad(set_to_none=True)
        pipeline_parallel.run_schedule(s, mine, x, y, embedding_group=embedding, record_saved=False)

    def theirs():
        for chunk in pytorch.values():
            chunk.zero_grad(set_to_none=True)
        args = (x,) if 0 in pytorch else ()
        torch_schedule.step(*args, **({"target": y} if s.n_chunks - 1 in pytorch else {}))
        pipeline_parallel.allreduce_embedding_grads(pytorch, torch_embedding)

    ours_s, theirs_s = alternate(ours, theirs, **timing)
    check_close(f"bench: {schedule} against torch.distributed.pipelining, this rank's gradients",
                {n: g for c in mine.values() for n, g in named_grads(c).items()},
                {n: g for c in pytorch.values() for n, g in named_grads(c).items()},
                rtol=1e-5, quiet=True)  # fp32 gradients summed over micro-batches in another order
    return {"ours": ours_s, "theirs": theirs_s}


# ------------------------------------------------------------------------------------------------ chapter 12

# Chapter 12's distributed model (Llama style), fp32 here, and its optimizers' settings; Newton–Schulz in bf16
# on both sides, as torch.optim.Muon runs it.
MUON_CFG = dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=192)
MUON_BATCH, MUON_ARGS, MUON_ADAMW = 8, dict(lr=0.02, momentum=0.95, weight_decay=0.1), dict(lr=3e-3,
                                                                                           weight_decay=0.01)


def muon(version: str, **timing) -> dict:
    """Chapter 12's Muon against ``torch.optim.Muon``, AdamW on the rest of the parameters on both sides.

    ``"one process"``: each rank times the optimizer step alone (``optimizers.Muon`` and ``AdamW`` against
    ``torch.optim.Muon`` and ``torch.optim.AdamW``), on the gradients of one backward over the whole batch.
    ``"distributed"``: a data-parallel step, forward, backward and update: ``DistributedMuon`` (gradients
    reduce-scattered by owner, each matrix orthogonalised on its owner, the results all-gathered, ZeRO-1 AdamW
    for the rest) against ``DistributedDataParallel`` with ``torch.optim.Muon`` on every rank, which
    orthogonalises every matrix on every rank: PyTorch has no distributed Muon of its own.
    """
    from torch.nn.parallel import DistributedDataParallel

    from helpers.training import distributed_muon, optimizers

    cfg = GPTConfig.llama_style(**MUON_CFG)
    mine, pytorch = GPT(cfg, seed=0), GPT(cfg, seed=0)
    matrices, rest = optimizers.muon_params(pytorch)
    theirs_optimizer = optimizers.MuonWithAdamW(torch.optim.Muon(matrices, **MUON_ARGS),
                                                torch.optim.AdamW(rest, **MUON_ADAMW))
    if version == "one process":
        x, y = get_batch(make_tokens(), 0, MUON_BATCH, cfg.seq_len)
        for model in (mine, pytorch):
            model(x, y)[1].backward()
        matrices, rest = optimizers.muon_params(mine)
        ours_optimizer = optimizers.MuonWithAdamW(optimizers.Muon(matrices, **MUON_ARGS),
                                                  optimizers.AdamW(rest, **MUON_ADAMW))
        ours, theirs = ours_optimizer.step, theirs_optimizer.step  # the same gradients at every step
    elif version == "distributed":
        xs, ys = batch_rows(MUON_BATCH, cfg.seq_len)
        ours_optimizer = distributed_muon.DistributedMuon(mine, mode="reduce_scatter", adamw=MUON_ADAMW,
                                                          **MUON_ARGS)
        ddp = DistributedDataParallel(pytorch)

        def ours():
            ours_optimizer.zero_grad()
            mine(xs, ys)[1].backward()
            ours_optimizer.step()

        def theirs():
            theirs_optimizer.zero_grad()
            ddp(xs, ys)[1].backward()
            theirs_optimizer.step()
    else:
        raise ValueError(f"version {version!r}: 'one process' or 'distributed'")
    if version == "distributed":
        # Compared after the first step, before the timed runs: AdamW turns the rounding differences of tiny
        # gradient entries (averaged in another order) into whole steps of lr, which later steps compound
        # (chapter 03). Within 1e-2 of each tensor's largest entry: the two averages round to other bf16
        # values inside Newton-Schulz, whose five steep iterations move an update entry by up to a tenth
        # (measured here: 2e-4 on entries of about 2.5e-3). Chapter 12 checks the same code in fp64 at 1e-10.
        ours()
        theirs()
        check_close("bench: distributed Muon against DDP and torch.optim.Muon, parameters after a step",
                    named_params(mine), named_params(pytorch), rtol=1e-2, quiet=True)
    ours_s, theirs_s = alternate(ours, theirs, **timing)
    if version == "one process":  # chapter 12's Muon follows torch's order of operations exactly
        check_close("bench: Muon against torch.optim.Muon, parameters after every step", named_params(mine),
                    named_params(pytorch), rtol=0.0, quiet=True)
    return {"ours": ours_s, "theirs": theirs_s}
