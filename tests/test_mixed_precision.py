"""Chapter 09's mixed-precision training: the loss scaler against torch.amp.GradScaler, the found-inf flag
agreed across data-parallel ranks, bf16 training's fp32 reduction against one process, and the FP8 all-gather.

- one process: ``LossScaler`` takes GradScaler's decisions (scale and skipped steps) on a run whose fp16
  gradients overflow several times, some one good step into an interval (growth interval 3, initial scale
  2^20), and the parameters come out bit for bit; on chosen events (inf, NaN, overflows mid-interval) its
  whole sequence of scales is GradScaler's; unscaling twice in a step and updating before unscaling are
  refused;
- two ranks: the found-inf flag of one rank's shard is every rank's with ``data_parallel=True``, and only its
  own without; ``sharded_fp16_step`` (ZeRO-2's flat partition) takes the decisions and reaches the parameters
  of the all-reduced GradScaler step bit for bit; bf16 training with its fp32 gradient buffer all-reduced in
  fp32 equals one process accumulating the same micro-batches (bit for bit: a sum of two bf16 numbers is exact
  in fp32), while a bf16 all-reduce does not;
- two ranks: the FP8 all-gather of dim-0 shards (rows that do not divide, so the last shard is padded)
  dequantizes to one process's quantized tensor bit for bit, with ``uint8`` buffers and half the bf16 bytes.
"""

import ipyparallel as ipp
import pytest
import torch

from conftest import seeded_batch, small_config
from helpers.model import GPT
from helpers.training.mixed_precision import LossScaler, MasterWeightsAdamW, accumulated_step, fp16_loss

CFG = small_config(vocab_size=64, seq_len=16)


INIT_SCALE, GROWTH_INTERVAL = 2.0 ** 20, 3


def _grad_scaler_run(model, data, growth_interval):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=growth_interval)
    log = []
    for x, y in data:
        scale = scaler.get_scale()
        scaler.scale(fp16_loss(model, x, y)).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        log.append((scale, scaler.get_scale() < scale))
    return log


def test_loss_scaler_takes_grad_scalers_decisions_and_parameters():
    data = [seeded_batch(CFG, 8, seed=step) for step in range(10)]
    theirs = GPT(CFG, seed=0)
    want = _grad_scaler_run(theirs, data, growth_interval=GROWTH_INTERVAL)
    ours = GPT(CFG, seed=0)
    optimizer = torch.optim.AdamW(ours.parameters(), lr=1e-3)
    scaler = LossScaler(init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    got = []
    for x, y in data:
        scale = scaler.scale.item()
        scaler.scale_loss(fp16_loss(ours, x, y)).backward()
        stepped = scaler.step(optimizer, [p.grad for p in ours.parameters()])
        scaler.update()
        optimizer.zero_grad()
        got.append((scale, not stepped))
    assert sum(skip for _, skip in want) >= 2, f"the run must overflow several times: {want}"
    assert got == want
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.equal(p, q), f"{name} differs from GradScaler's run"


def test_loss_scaler_follows_grad_scaler_on_inf_nan_and_overflows_mid_interval():
    events = ["ok", "inf", "ok", "nan", "ok", "ok", "ok", "ok", "ok", "inf", "ok", "ok", "nan", "ok", "ok"]
    ours = LossScaler(init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    theirs = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    param = torch.nn.Parameter(torch.zeros(3))
    got, want = [], []
    for event in events + ["ok"]:
        value = {"ok": 1.0, "inf": float("inf"), "nan": float("nan")}[event]
        got.append(ours.scale.item())
        ours.unscale_([torch.tensor([1.0, value, 1.0])])
        ours.update()
        want.append(theirs.get_scale())
        theirs.scale(torch.ones(()))
        param.grad = torch.tensor([1.0, value, 1.0])
        theirs.step(torch.optim.SGD([param], lr=0.0))
        theirs.update()
    assert got == want
    assert len(set(want)) >= 4, f"the events must make the scale back off and grow: {want}"


def test_loss_scaler_defaults_and_misuse():
    default, mine = torch.amp.GradScaler("cpu"), LossScaler()
    assert [mine.scale.item(), mine.growth_factor, mine.backoff_factor, mine.growth_interval] == [
        default.get_scale(), default.get_growth_factor(), default.get_backoff_factor(),
        default.get_growth_interval()]
    g = torch.ones(3)
    with pytest.raises(RuntimeError, match="before unscale_"):
        mine.update()
    mine.unscale_([g])
    with pytest.raises(RuntimeError, match="twice"):
        mine.unscale_([g])
    with pytest.raises(ValueError, match="bf16 model"):
        MasterWeightsAdamW(GPT(CFG, seed=0))


@ipp.interactive  # sent by value: the engines cannot import this test module
def _on_ranks(cfg, data, bf16_data):
    import torch
    import torch.distributed as dist

    from helpers.model import GPT
    from helpers.parallel import comms, zero
    from helpers.parallel.ledger import LEDGER
    from helpers.training import fp8_gather, mixed_precision

    rank, world_size = dist.get_rank(), dist.get_world_size()
    out = {}
    for agree in (True, False):  # an overflow in rank 0's shard only
        scaler = mixed_precision.LossScaler(data_parallel=agree)
        out[f"found, agree={agree}"] = scaler.unscale_([torch.full((2,), float("inf") if rank == 0 else 1.0)])
    torch.set_num_threads(1)

    def sharded(agree):
        model = GPT(cfg, seed=0)
        shard = mixed_precision.flat_shard(model)
        optimizer = torch.optim.AdamW([shard], lr=1e-3)
        scaler = mixed_precision.LossScaler(init_scale=2.0 ** 20, growth_interval=3, data_parallel=agree)
        log = []
        for x, y in data:
            scale = scaler.scale.item()
            stepped = mixed_precision.sharded_fp16_step(model, shard, optimizer, scaler, x[rank::world_size],
                                                        y[rank::world_size])
            log.append((scale, not stepped))
        return log, [p.detach().clone() for p in model.parameters()]

    model = GPT(cfg, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 20, growth_interval=3)
    log = []
    for x, y in data:
        scale = grad_scaler.get_scale()
        grad_scaler.scale(mixed_precision.fp16_loss(model, x[rank::world_size], y[rank::world_size])
                          / world_size).backward()
        flat = comms.all_reduce(torch.cat([p.grad.flatten() for p in model.parameters()]))
        for p, g in zip(model.parameters(), flat.split([p.numel() for p in model.parameters()])):
            p.grad = g.view(p.shape)
        grad_scaler.step(optimizer)
        grad_scaler.update()
        optimizer.zero_grad()
        log.append((scale, grad_scaler.get_scale() < scale))
    out["reference"] = (log, [p.detach().clone() for p in model.parameters()])
    out["agreed"], out["alone"] = sharded(True), sharded(False)

    for wire in (torch.float32, torch.bfloat16):
        model = GPT(cfg, seed=0).to(torch.bfloat16)
        optimizer = mixed_precision.MasterWeightsAdamW(model, lr=1e-2)
        for x, y in bf16_data:
            mixed_precision.accumulated_step(model, optimizer, [(x[rank::world_size], y[rank::world_size])],
                                             data_parallel=True, wire_dtype=wire)
        out[f"bf16 masters, {wire}"] = [m.detach().clone() for m in optimizer.masters]

    odd = torch.randn(7, 5, generator=torch.Generator().manual_seed(3)) * 3  # rank 1's 4 rows end in padding
    shard = zero.shard_of(odd, rank, world_size)
    LEDGER.clear()
    out["fp8"] = fp8_gather.fp8_gathered_weights(shard, 7)
    out["fp8 booked"] = [(m.dtype, m.nbytes) for m in LEDGER.booked("all_gather")]
    LEDGER.clear()
    comms.all_gather(shard.bfloat16(), 0)
    out["bf16 booked"] = [(m.dtype, m.nbytes) for m in LEDGER.booked("all_gather")]
    out["single"] = fp8_gather.single_process_weights(odd)
    return out


@pytest.fixture(scope="module")
def results(ranks):
    data = [seeded_batch(CFG, 8, seed=step) for step in range(8)]
    bf16_data = [seeded_batch(CFG, 4, seed=100 + step) for step in range(3)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank: the same bits for the same micro-batch
    try:
        model = GPT(CFG, seed=0).to(torch.bfloat16)
        optimizer = MasterWeightsAdamW(model, lr=1e-2)
        for x, y in bf16_data:
            accumulated_step(model, optimizer, [(x[r::2], y[r::2]) for r in range(2)])
    finally:
        torch.set_num_threads(threads)
    return ranks.apply(_on_ranks, CFG, data, bf16_data), [m.detach() for m in optimizer.masters]


def test_found_inf_is_agreed_across_ranks(results):
    per_rank, _ = results
    assert [r["found, agree=True"].item() for r in per_rank] == [1.0, 1.0]
    assert [r["found, agree=False"].item() for r in per_rank] == [1.0, 0.0]


def test_sharded_fp16_step_matches_all_reduced_grad_scaler(results):
    per_rank, _ = results
    want_log, want_params = per_rank[0]["reference"]
    assert sum(skip for _, skip in want_log) >= 2, f"the run must overflow several times: {want_log}"
    for rank, r in enumerate(per_rank):
        assert r["reference"][0] == want_log
        assert r["agreed"][0] == want_log, f"rank {rank}"
        assert all(torch.equal(a, b) for a, b in zip(r["agreed"][1], want_params)), f"rank {rank}"
    assert per_rank[0]["alone"][0] != per_rank[1]["alone"][0], "ranks deciding alone should part"


def test_bf16_training_reduced_in_fp32_equals_one_process(results):
    per_rank, want = results
    for rank, r in enumerate(per_rank):
        assert all(torch.equal(a, b) for a, b in zip(r["bf16 masters, torch.float32"], want)), f"rank {rank}"
        assert not all(torch.equal(a, b) for a, b in zip(r["bf16 masters, torch.bfloat16"], want))


def test_fp8_all_gather_is_bit_for_bit_and_half_the_bytes(results):
    per_rank, _ = results
    for rank, r in enumerate(per_rank):
        assert torch.equal(r["fp8"], r["single"]), f"rank {rank}"
        (dtype, fp8_bytes), = r["fp8 booked"]
        (_, bf16_bytes), = r["bf16 booked"]
        assert dtype == "torch.uint8" and 2 * fp8_bytes == bf16_bytes
