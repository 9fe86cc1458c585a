"""The capstone in five dimensions (issue 38, item 1): a MoE GPT on 16 ranks, pp=2 × dp_shard=2 × cp=2 × tp=2,
the experts folded onto dp_shard × cp (ep=4, as torchtitan folds them), sequence parallelism, interleaved 1F1B
with vpp=2 and ring (or Ulysses) attention, in fp64, matching one process (``capstone.reference_run``) at
every step's loss and in every parameter at the end, within ``capstone.TOLERANCES["fp64"]``.

The model is chapter 08's MoE layer in every other block (blocks 1 and 3 of 4: with vpp=2 each of the 4
pipeline chunks holds one block, so two chunks are dense), DDP over the data-parallel group (ZeRO-1 over it
would average different ranks' experts: refused by ``capstone.validate``), experts whole on every tp rank,
each routing its own slice of the sequence.

Before the comparison with one process, three checks each name one dimension, so that a planted fault fails
first the check of its own dimension:

- cp: the positions each rank trains on are chapter 07's zigzag, chunk ``r`` then chunk ``2·cp-1-r``, by hand;
- ep: every row that arrived at a rank's experts is a copy of a token of its expert-parallel group that chose
  one of them (chapter 08's ``dispatch_arrivals`` and ``identify_rows``, on every MoE layer's last forward);
- tp: what sequence parallelism sums over tp (the norms, the MoE layers) is bit for bit the same on every tp
  rank after training.

Three faults are planted, each caught first by its own check, and each failing the comparison with one process
too: tokens sent to the next expert rank, the zigzag's two chunks in reverse order, the sequence-parallel
gradient all-reduce skipped.

Measured on this machine (2 cores shared with other jobs, load average 7-24 while measuring): 16 engines start
in 3.4-11.7 s; a step of this run takes 0.84-1.8 s on the 16 ranks (the test prints it, ``seconds per step``),
the single process 0.1-0.2 s; the whole module about 30-40 s. With ``n_layers=4`` every chunk is one block, so
the MoE layers (blocks 1 and 3) both sit on pipeline rank 1 (interleaving places chunk c on rank c mod pp),
which alone sends ``ep`` bytes, and chunks 0 and 2 are dense: the path where ``expert_parallel.parallelize``
leaves a MoE GPT's dense chunk as it is. ``n_layers=8`` puts one MoE layer in every chunk, at about twice the
step time (1.7 s at load 18).
"""

import time

import ipyparallel as ipp
import pytest

from helpers.training import capstone, capstone_checks

FIVE_D = dict(pp=2, dp_shard=2, cp=2, tp=2, ep=4, n_experts=8, top_k=2, moe_every=2, n_layers=4,
              schedule="interleaved", vpp=2, m=2, zero=0, sequence_parallel=True, attention="ring")


def five_d(**changes) -> capstone.Run:
    return capstone.chapter_run(**{**FIVE_D, **changes})


@pytest.fixture(scope="module")
def sixteen():
    from helpers.ranks import start_ranks

    started = time.perf_counter()
    r = start_ranks(16, timeout_s=120, activate=False)
    print(f"16 ranks started in {time.perf_counter() - started:.1f} s")
    yield r
    r.stop()


INVALID = {
    "ZeRO-1 with experts": (dict(zero=1), r"zero=1 with experts: ZeRO-1 over dp_shard_cp would average"),
    "ep not the data-parallel group": (dict(ep=2), r"ep=2: .* folds the experts onto the whole data-parallel "
                                                   r"group dp_shard_cp of 4 ranks"),
    "ep not dividing the experts": (dict(n_experts=6), r"ep=4 must divide n_experts=6"),
    "ep without experts": (dict(n_experts=0), r"ep=4 > 1 but the book's GPT has no experts"),
    "Muon with experts": (dict(optimizer="muon"), r"optimizer='muon'"),
    "MoE more sparse than the model is deep": (dict(moe_every=5), r"moe_every=5 must be in 1..n_layers=4"),
}


@pytest.mark.parametrize("change, message", INVALID.values(), ids=INVALID.keys())
def test_an_impossible_moe_run_is_refused(change, message):
    with pytest.raises(ValueError, match=message):
        five_d(**change)


def test_the_5d_run_validates_on_16_ranks():
    run = five_d()
    capstone.validate(run, world_size=16)
    assert run.degrees() == {"pp": 2, "dp_shard": 2, "cp": 2, "tp": 2} and run.ep == 4
    model = capstone.build(run)
    assert [type(b.mlp).__name__ for b in model.blocks] == ["MLP", "MoELayer", "MLP", "MoELayer"]


@ipp.interactive  # sent by value: the engines cannot import this test module
def _train(run, plant=None):
    import torch
    import torch.distributed as dist

    from helpers.parallel import blockwise_attention, context_parallel, expert_parallel
    from helpers.parallel import tensor_parallel
    from helpers.reference import named_params
    from helpers.training import capstone, capstone_checks

    Layer = expert_parallel.ExpertParallelMoE
    saved, seen, positions = [], {}, []

    def patch(owner, name, new):
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, new)

    forward, shard_sequence = Layer.forward, context_parallel.shard_sequence

    def recording_forward(self, x):  # the layer's input, for the ep check of its last forward
        seen[self] = x.detach().reshape(-1, x.shape[-1])
        return forward(self, x)

    def recording_shard(*args, **kwargs):
        out = shard_sequence(*args, **kwargs)
        positions.append(out[2].tolist())
        return out

    patch(Layer, "forward", recording_forward)
    patch(context_parallel, "shard_sequence", recording_shard)
    if plant == "ep":  # every expert's rows sent to the next expert-parallel rank's expert of the same place
        compute = Layer.compute_experts

        def shifted(self, rows, counts):
            n = len(counts) // dist.get_world_size(self.group)
            k = sum(counts[-n:])
            moved = torch.cat([rows[len(rows) - k:], rows[:len(rows) - k]])  # the last rank's rows first
            out = compute(self, moved, counts[-n:] + counts[:-n])
            return torch.cat([out[k:], out[:k]])
        patch(Layer, "compute_experts", shifted)
    if plant == "cp":  # the zigzag's late chunk held first
        zigzag = blockwise_attention.CPLayout.positions

        def reversed_blocks(self, rank, device="cpu"):
            p = zigzag(self, rank, device)
            return torch.cat([p[len(p) // 2:], p[:len(p) // 2]]) if self.kind == "zigzag" else p
        patch(blockwise_attention.CPLayout, "positions", reversed_blocks)
    if plant == "sp":  # the norms' (and MoE layers') partial gradients left unsummed over tp
        patch(tensor_parallel, "allreduce_sequence_parallel_grads", lambda *args, **kwargs: None)
    try:
        mesh = capstone.make_mesh(run)
        out = capstone.train(run, mesh, capstone.data(run))
        out["positions"] = positions[-1] if positions else None
        shards = capstone_checks.reference_shards(named_params(capstone.build(run)), run, mesh)
        out["unlike_reference_shards"] = [n for n, t in out["params"][0].items()
                                          if not torch.equal(t, shards[n])]
        out["misrouted"] = []
        group = mesh.group(run.dp_dim)
        for i, layer in enumerate(seen):  # the same layers, in the same order, on every rank of the group
            tokens = [torch.empty_like(seen[layer]) for _ in range(dist.get_world_size(group))]
            dist.all_gather(tokens, seen[layer], group=group)
            expert = [torch.empty_like(layer.stats["expert"]) for _ in tokens]
            dist.all_gather(expert, layer.stats["expert"].contiguous(), group=group)
            mask = layer.stats["kept_mask"].to(torch.uint8)  # gloo gathers no booleans
            kept = [torch.empty_like(mask) for _ in tokens]
            dist.all_gather(kept, mask, group=group)
            want = expert_parallel.dispatch_arrivals(torch.cat(expert), torch.cat(kept).bool(), run.n_experts,
                                                     dist.get_rank(group))
            got = expert_parallel.identify_rows(layer.stats["arrived"], torch.cat(tokens))
            if not torch.equal(got, want):
                out["misrouted"].append(i)
        return out
    finally:
        for owner, name, old in reversed(saved):
            setattr(owner, name, old)


def zigzag_by_hand(rank: int, cp: int, seq_len: int) -> list[int]:
    c = seq_len // (2 * cp)
    return list(range(rank * c, (rank + 1) * c)) + list(range((2 * cp - 1 - rank) * c, (2 * cp - rank) * c))


def check(results, run, want) -> None:
    """The checks of the module's docstring, in its order, then the comparison with one process."""
    import torch

    for r in results:
        assert r["positions"] == zigzag_by_hand(r["where"]["cp"], run.cp, run.seq_len), \
            f"cp: rank {r['rank']} holds positions {r['positions']}, not the zigzag's"
    for r in results:
        assert not r["misrouted"], f"ep: rank {r['rank']}'s experts received rows of tokens that did not " \
                                   f"choose them (MoE layers {r['misrouted']} of its last forward)"
    summed = ("ln1.", "ln2.", "ln_f.", ".mlp.router.", ".mlp.experts.")
    for r in results:
        twin = next(o for o in results if o["where"] == {**r["where"], "tp": 0})
        for name, t in r["params"][run.steps].items():
            if any(s in name for s in summed):
                assert torch.equal(t, twin["params"][run.steps][name]), \
                    f"tp: {name} differs between tp ranks 0 and {r['where']['tp']} (rank {r['rank']}): its " \
                    f"sequence-parallel gradient was not summed over tp"
    compare(results, run, want)


def compare(results, run, want) -> None:
    """Every step's loss, and the parameters every ``run.every`` steps, against one process."""
    diff = capstone_checks.differences(results, want, run)
    tol = capstone.TOLERANCES[run.precision]
    for step, (d, w) in enumerate(zip(diff["loss"], want["losses"])):
        assert d / w <= tol["loss"], f"loss of step {step}: {d / w:.2e} relative to one process"
    for step, d in diff["params"].items():
        assert d <= tol["params"], f"parameters after step {step}: {d:.2e} relative to one process"


@pytest.mark.parametrize("attention, zero", [("ring", 3), ("ulysses", 0)])
def test_the_5d_run_matches_one_process(sixteen, attention, zero):
    """The dense parameters sharded by ZeRO-3 (the issue's FSDP) with ring attention, or reduced by DDP with
    Ulysses; the experts by chapter 08's finish_gradients either way."""
    run = five_d(steps=4, every=2, attention=attention, zero=zero)
    started = time.perf_counter()
    results = sixteen.apply(_train, run)
    wall = time.perf_counter() - started
    want = capstone.reference_run(run, capstone.data(run))
    per_step = max(r["seconds"] for r in results) / (run.steps - 1)
    print(f"5D run ({attention}): {wall:.1f} s for {run.steps} steps on 16 ranks, "
          f"seconds per step {per_step:.2f}")
    assert len(results) == 16 and {r["where"]["cp"] for r in results} == {0, 1}
    for r in results:  # each rank started from its slice of the one model (capstone_checks.reference_shards)
        assert not r["unlike_reference_shards"], (r["rank"], r["unlike_reference_shards"])
    sent_along = set().union(*(r["traffic"] for r in results))  # the measured step's bytes, by dimension
    assert sent_along == {"pp", "dp_shard_cp", "cp", "tp", "ep"}, sent_along
    check(results, run, want)


PLANTED = {"ep": r"^ep: ", "cp": r"^cp: ", "sp": r"^tp: "}


@pytest.mark.parametrize("plant, message", PLANTED.items(), ids=PLANTED.keys())
def test_a_planted_fault_fails_its_dimension_first(sixteen, plant, message):
    run = five_d(steps=2, every=2)
    results = sixteen.apply(_train, run, plant)
    want = capstone.reference_run(run, capstone.data(run))
    with pytest.raises(AssertionError, match=message):
        check(results, run, want)
    with pytest.raises(AssertionError, match=r"^(loss of step|parameters after step) "):  # and not only there
        compare(results, run, want)
