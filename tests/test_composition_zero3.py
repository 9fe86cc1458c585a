"""Chapter 10's composition under ZeRO-3 (``zero.Zero3ReduceAtStep``), on 8 ranks, against one process.

``composition.train`` with ``zero=3`` shards every dense parameter over the data-parallel group
(``dp_shard_cp``: data and context parallelism together, as torchtitan's FSDP shards), one ZeRO-3 per
pipeline chunk: its units are the chunk's blocks and a root (embeddings, final norm, head). It runs composed
with tensor parallelism and sequence parallelism, with replicated KV heads (``n_kv_heads=1`` under ``tp=2``),
with a two-stage pipeline under 1F1B and interleaved 1F1B (``vpp=2``: two chunks per rank, two ZeRO-3s, two
micro-batches whose gradients sum before the step's reduce-scatter), with tied embeddings across the stages,
with context parallelism, and on chapter 10's MoE GPT with the experts folded onto ``dp_shard × cp`` (ZeRO-3
shards the dense parameters; each rank's experts are its own and take plain AdamW). Each step's loss
within 1e-12 relative of one process's and every parameter after three AdamW steps within 1e-10 of its
tensor's largest entry (and step 1's gradients, which each replica hands back before the reduce-scatter,
averaged over the replicas), the tolerances of
tests/test_composition.py, for the same reason (fp64, and the grid only reorders sums; ZeRO-3 adds one more
reordering, the reduce-scatter's, and copies, which are exact). Every data-parallel replica's gathered
parameters agree within 1e-12.

The communication pattern is checked from the ledger of step 1: over the data-parallel dimension the rank
ran all-gathers (the root once, each block before its forward and its backward, per micro-batch) and one
reduce-scatter per unit, and no all-reduce; whenever a block is gathered it is the only whole block on the
rank (each chunk of these runs has two, or the rank two chunks of one), so no rank ever holds every unit's
parameters at once; and between steps every parameter's own storage is empty (zero bytes), each rank
holding only its flat shards, ``1/N`` of the rows.
"""

import ipyparallel as ipp
import pytest

from conftest import assert_close_to_scale, seeded_batch, small_config
from helpers.model import GPT
from helpers.parallel.parallel_dims import ParallelDims

LR, STEPS = 1e-2, 3
RUNS = {  # (the run, the model): 8 ranks each
    "dp_shard 4 x tp 2, SP, KV replicated": (
        ParallelDims(dp_shard=4, tp=2, sequence_parallel=True, zero=3), dict(n_heads=4, n_kv_heads=1)),
    "pp 2 x dp_shard 2 x tp 2, SP, 1F1B": (
        ParallelDims(pp=2, dp_shard=2, tp=2, sequence_parallel=True, zero=3, m=2),
        dict(n_layers=4, n_heads=8, n_kv_heads=4)),
    "pp 2 x dp_shard 2 x tp 2, interleaved vpp 2": (
        ParallelDims(pp=2, dp_shard=2, tp=2, sequence_parallel=True, zero=3, m=2, schedule="interleaved",
                     vpp=2), dict(n_layers=4, n_heads=8, n_kv_heads=4)),
    "dp_shard 2 x cp 2 x tp 2": (
        ParallelDims(dp_shard=2, cp=2, tp=2, zero=3), dict(n_heads=8, n_kv_heads=4, seq_len=16)),
    "MoE, pp 2 x dp_shard 2 x cp 2, ep 4 folded": (  # chapter 10's MoE run, on four layers
        ParallelDims(pp=2, dp_shard=2, cp=2, ep=4, m=2, zero=3),
        dict(seq_len=16, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=32, n_experts=8, top_k=2,
             tie_embeddings=False, aux_loss_coef=0.0, z_loss_coef=0.0)),
}


def _config(shape):
    from helpers.parallel.moe import MoEConfig

    return MoEConfig(**{**vars(small_config()), **shape}) if "n_experts" in shape else small_config(**shape)


def _model(cfg):
    from helpers.parallel.moe import MoEGPT

    if hasattr(cfg, "n_experts"):  # fp64: the loop over experts
        return MoEGPT(cfg, seed=0, grouped=False).double()
    return GPT(cfg, seed=0).double()


@ipp.interactive  # sent by value: the engines cannot import this test module
def _trained(model, run, data, lr):
    from helpers.parallel import composition, zero

    made, at_gather = [], []  # the optimizer train() makes (its ZeRO-3s, one per chunk); blocks held
    optimizer, gather = composition.optimizer, zero.Zero3._gather

    def counted(self, i, then=None):  # after each gather: how many blocks of this rank's chunks are whole
        gather(self, i, then)
        at_gather.append(sum(z._gathered(j) for z in made[0].zeros for j in range(1, len(z.units))))
    composition.optimizer = lambda *args, **kw: made.append(optimizer(*args, **kw)) or made[-1]
    zero.Zero3._gather = counted
    try:
        mesh = run.mesh().make_groups()
        out = composition.train(model, mesh, run, data, lr)
    finally:
        composition.optimizer, zero.Zero3._gather = optimizer, gather
    zeros, n = made[0].zeros, mesh.size(run.dp_dim)
    out["most blocks held"] = max(at_gather)
    out["held"] = [z.names[p] for z in zeros for p in z.params if p.untyped_storage().nbytes()]
    out["shard elements"] = sum(flat.numel() for z in zeros for flat in z.flats)
    out["want elements"] = sum(zero.shard_shape(p, n).numel() for z in zeros for p in z.params)
    out["full elements"] = sum(p.numel() for z in zeros for p in z.params)
    out["units"] = [(bool(z.units[0]), len(z.units) - 1) for z in zeros]
    return out


@pytest.mark.parametrize("run, shape", RUNS.values(), ids=RUNS.keys())
def test_zero3_composed_matches_one_process_and_shards(eight, run, shape):
    from helpers.parallel import composition
    from helpers.reference import named_grads, named_params, train_steps

    cfg = _config(shape)
    data = [seeded_batch(cfg, 8, seed=s) for s in range(STEPS)]
    reference = _model(cfg)
    reference(*data[0])[1].backward()
    first_grads = named_grads(reference)
    reference.zero_grad()
    losses = train_steps(reference, data, lr=LR)
    results = eight.apply(_trained, _model(cfg), run, data, LR)

    last = [r for r in results if r["losses"][0] is not None]
    for step, want in enumerate(losses):  # each rank's loss is its own tokens' mean (rows, cp positions)
        got = sum(r["losses"][step] for r in last) / len(last)
        assert got == pytest.approx(want, rel=1e-12), f"step {step}"
    params, others = composition.assemble(results, cfg, "params")
    want = named_params(reference)
    if run.pp > 1 and cfg.tie_embeddings:
        params.pop("lm_head.weight", None)  # the last stage's copy of the tied embedding
    assert_close_to_scale(params, want, 1e-10, f"parameters after {STEPS} AdamW steps:")
    assert len(others) == run.dp_shard * run.cp - 1
    for i, part in enumerate(others):  # every replica gathers the same parameters
        common = [n for n in part if n in params]
        assert_close_to_scale({n: part[n] for n in common}, {n: params[n] for n in common}, 1e-12,
                              f"replica {i + 1}:")

    # step 1's gradients, handed back before the reduce-scatter: each replica's own, summed over tp and the
    # embedding group already; their mean over the replicas is one process's
    grads, others = composition.assemble(results, cfg, "grads")
    mean = {n: sum(part[n] for part in [grads, *others]) / (1 + len(others)) for n in first_grads}
    assert_close_to_scale(mean, first_grads, 1e-10, "step 1's gradients, averaged over the replicas:")

    for r in results:  # between steps, only the shards: no parameter keeps its full storage
        assert r["held"] == [], f"rank holds full parameters after the step: {r['held']}"
        assert r["shard elements"] == r["want elements"] < r["full elements"]
        dp = {(c, numel): count for (dim, c, numel), (count, _) in r["messages"].items()
              if dim in ("dp_shard", "dp_shard_cp")}
        calls = {c: sum(n for (name, _), n in dp.items() if name == c) for c in {c for c, _ in dp}}
        roots = sum(root for root, _ in r["units"])
        blocks = sum(b for _, b in r["units"])
        assert calls == {"all_gather": roots + 2 * blocks * run.m, "reduce_scatter": roots + blocks}, calls
        assert r["most blocks held"] == 1 < blocks, "a block's parameters outlived its forward or backward"


def test_the_composition_refuses_what_zero3_does_not_run():
    from helpers.parallel import composition

    composition.check(ParallelDims(zero=3, pp=2, dp_shard=2, tp=2))
    for change, message in [
        (dict(zero=2), r"zero=2: chapter 10's composition runs DDP \(zero=0\), ZeRO-1 \(zero=1\) or ZeRO-3"),
        (dict(zero=3, pp=2, schedule="zb-h1"), r"zero=3 with schedule='zb-h1'"),
    ]:
        with pytest.raises(ValueError, match=message):
            composition.check(ParallelDims(**change))


@ipp.interactive  # sent by value: the engines cannot import this test module
def _refusal(model, run, data, lr):
    from helpers.parallel import composition

    try:
        composition.train(model, run.mesh().make_groups(), run, data, lr)
    except ValueError as e:
        return str(e)
    return None


def test_zero1_with_experts_is_refused(eight):
    """ZeRO-1 reduce-scatters every gradient over the data-parallel group, where each rank holds other
    experts: it would average different experts' gradients, silently. The composition refuses it and names
    the two choices that are right (the 5D capstone found it)."""
    run, shape = RUNS["MoE, pp 2 x dp_shard 2 x cp 2, ep 4 folded"]
    run = run.replace(zero=1)
    cfg = _config(shape)
    data = [seeded_batch(cfg, 8, seed=0)]
    errors = eight.apply(_refusal, _model(cfg), run, data, LR)
    assert all(e and e.startswith("zero=1 with experts") and "zero=3" in e for e in errors), errors
