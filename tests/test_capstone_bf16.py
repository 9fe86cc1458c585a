"""The 5D capstone run in mixed precision (issue 38, item 2): the run of ``tests/test_capstone_5d.py`` on 16
ranks with ``precision="bf16"`` (bf16 parameters and activations, fp32 masters stepped by AdamW in fp32,
gradients reduced in fp32: ``helpers.training.mixed_precision.Bf16Compute``), against the fp64 single process.

Checks, in this order, so that a planted fault fails its own first:

- dtypes, from the tensors themselves: every parameter a module's forward reads is bf16 (a global forward
  hook); the activations and parameters the ranks exchange (sequence-parallel gathers, ZeRO-3's gathers,
  ring attention's blocks, pipeline sends, expert all-to-alls) are bf16, and every gradient reduction (DDP's
  all-reduces or ZeRO-3's reduce-scatters over the data-parallel group, the all-reduces over tp and between
  the tied embedding's stages; also the vocabulary-parallel loss's sums) is fp32, as the ledger booked the
  buffers passed (:func:`kinds`); the masters are fp32 and hold bits their bf16 copies lack; under ZeRO-3 no
  full dense parameter is held after the step (the masters keep no storage, the bf16 copies are freed);
- each loss computed in fp32 (the cross-entropy's tensor and the last chunk's, seen by the forward hook: the
  cross-entropy promotes the logits) and returned as a Python float;
- every step's loss within ``precision_bound``'s bound of the fp64 one process's (derived there from
  ``u = 2^-8``, evaluated on the fp64 process, never on this run).

The dense parameters go through ZeRO-3 (``mixed_precision.Zero3Masters``: fp32 shards, bf16 all-gathers,
fp32 reduce-scatters) with ring attention, or through DDP with Ulysses; the experts are whole on each rank,
fp32 masters beside bf16 copies.
Four faults are planted and replayed: DDP's all-reduce, or ZeRO-3's reduce-scatter, on a bf16 wire (each fails
the dtype check), the masters rounded to bf16 after each step, i.e. no fp32 masters (fails the masters' check;
its loss gap stays inside the bound over 10 steps, measured: bf16's rounding of steps of ``lr = 1e-2`` is too
small to show so soon), and the masters never written into the bf16 copies (the model stops learning: the gap
exceeds the bound from step 1). Two more breaks were replayed by hand and fail their checks: ZeRO-3 gathering
fp32 parameters (the dtype check) and ZeRO-3 keeping its gathered copies after the step (the ZeRO-3 check);
and a bf16 cross-entropy fails the loss check.

Measured on this machine (2 cores shared, load average 50-130 while measuring): 16 ranks, 10 steps, seconds
per step 0.8-2.1 in bf16 and 0.8-1.9 in fp64 for both layouts (no speed-up on CPU at this size: the step is
Python and messages); the gap to fp64 is 2e-4 to 2e-2 a step (largest at step 1), the bound 0.06-0.5. The
same bf16 recipe on chapter 15's dense 8-rank run (pp 2, dp 2, tp 2 with SP) stays within its bound with
ZeRO-0, -1 and -3 (gaps 8e-5 to 5e-3), bit for bit the same losses in the three.
"""

import time

import ipyparallel as ipp
import pytest
import torch

from helpers.training import capstone, capstone_checks, precision_bound

FIVE_D = dict(precision="bf16", steps=10, every=5)  # chapter 15's run (capstone.chapter_run), in bf16


def five_d(**changes) -> capstone.Run:
    return capstone.chapter_run(**{**FIVE_D, **changes})


@pytest.fixture(scope="module")
def fp64():
    """The fp64 single process of the run, and the bound at each of its steps (both independent of the bf16
    code: ``torch.optim.AdamW`` on the fp64 model)."""
    run = five_d(precision="fp64")
    want = capstone.reference_run(run, capstone.data(run))
    bound = precision_bound.bounds(capstone.build(run), capstone.data(run), run.lr)
    return want, bound


INVALID = {
    "Muon": (dict(optimizer="muon"), r"precision='bf16' with optimizer='muon'"),
    "ZB-H1": (dict(schedule="zb-h1", vpp=1), r"precision='bf16' with schedule='zb-h1'"),
    "a precision the book lacks": (dict(precision="fp16"), r"precision='fp16' is not one of"),
}


@pytest.mark.parametrize("change, message", INVALID.values(), ids=INVALID.keys())
def test_an_impossible_bf16_run_is_refused(change, message):
    with pytest.raises(ValueError, match=message):
        five_d(**change)


def test_adams_step_bound_holds_and_is_reached():
    """``U_k`` against torch's Adam (no eps, no decay) on random gradients: never above; at step 1 exactly 1
    (the step is lr · sign(g)); a gradient that grows reaches it within 1e-9."""
    assert precision_bound.adam_step_bound(1) == 1.0
    torch.manual_seed(0)
    for k in range(1, 11):
        grads = torch.randn(k, 1000, dtype=torch.float64) * torch.rand(k, 1, dtype=torch.float64) * 10
        w = torch.tensor([0.1 * 0.9 ** (k - j) for j in range(1, k + 1)], dtype=torch.float64)
        v = torch.tensor([0.001 * 0.999 ** (k - j) for j in range(1, k + 1)], dtype=torch.float64)
        worst = (w / v)[:, None] * torch.ones(1, 1000, dtype=torch.float64)  # g_j ∝ w_j / v_j: the equality
        for g_seq in (grads, worst):
            p = torch.zeros(1000, dtype=torch.float64, requires_grad=True)
            opt = torch.optim.Adam([p], lr=1.0, eps=0.0)
            for g in g_seq:
                before = p.detach().clone()
                p.grad = g.clone()
                opt.step()
            step = (p.detach() - before).abs().max().item()
            assert step <= precision_bound.adam_step_bound(k) + 1e-12, (k, step)
        assert step == pytest.approx(precision_bound.adam_step_bound(k), abs=1e-9), k


def test_the_single_process_in_bf16_stays_within_the_bound(fp64):
    """``capstone.reference_run`` in bf16 (the side-by-side curve): bf16 copies, fp32 masters, its loss a
    float within the bound at every step; its parameters (the masters) fp32."""
    run = five_d()
    want, bound = fp64
    got = capstone.reference_run(run, capstone.data(run))
    assert all(type(loss) is float for loss in got["losses"])
    assert {t.dtype for t in got["params"][run.steps].values()} == {torch.float32}
    for step, (g, w, b) in enumerate(zip(got["losses"], want["losses"], bound)):
        assert abs(g - w) <= b["bound"], (step, abs(g - w), b["bound"])
    print("one process in bf16, gaps:", [f"{abs(g - w):.1e}" for g, w in zip(got["losses"], want["losses"])])


@ipp.interactive  # sent by value: the engines cannot import this test module
def _train(run, plant=None):
    import torch
    from torch import nn

    from helpers.parallel import comms, composition, data_parallel, expert_parallel, zero
    from helpers.parallel.ledger import LEDGER
    from helpers.training import capstone, mixed_precision

    saved, read, booked, losses = [], set(), [], set()

    def patch(owner, name, new):
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, new)

    def reading(module, args, out):  # the dtypes of the parameters each forward reads, and of the losses
        read.update(str(p.dtype) for p in module.parameters(recurse=False))
        if isinstance(out, tuple) and len(out) == 2 and out[1] is not None:  # a last chunk's (logits, loss)
            losses.update(str(t.dtype) for t in (out[1], getattr(module, "lm_loss", out[1])))
    clear = LEDGER.clear

    def keeping(*args, **kwargs):  # every block's bookings, before the loop clears them
        booked.extend((m.collective, m.dtype, m.group_ranks) for m in LEDGER.messages
                      if m.direction == "send")
        clear(*args, **kwargs)
    patch(LEDGER, "clear", keeping)
    params = composition.params

    def unbooked(chunks):  # the parameters gathered for the checks (in fp32, under ZeRO-3): not the run's
        held = len(LEDGER.messages)
        out = params(chunks)
        del LEDGER.messages[held:]
        return out
    patch(composition, "params", unbooked)
    if plant == "bf16 reduction":  # DDP's all-reduce on a bf16 wire
        def bf16_average(buckets, group=None):
            world_size = torch.distributed.get_world_size(group)
            for bucket in buckets:
                flat = data_parallel._flatten([p.grad for p in bucket])
                comms.all_reduce(flat, group, wire_dtype=torch.bfloat16)
                data_parallel._unflatten_into(flat / world_size, bucket)
        patch(data_parallel, "bucketed_average", bf16_average)
        patch(expert_parallel, "bucketed_average", bf16_average)  # finish_gradients' (every MoE GPT chunk)
    if plant == "no fp32 masters":  # the masters rounded to bf16 after each step: AdamW on bf16 values
        step = mixed_precision.MastersStep.step

        def rounded(self):
            step(self)
            with torch.no_grad():
                for compute in self.computes:
                    for master in compute.masters:
                        master.copy_(master.bfloat16())
        patch(mixed_precision.MastersStep, "step", rounded)
    if plant == "no write-back":
        patch(mixed_precision.Bf16Compute, "write_back", lambda self: None)
    if plant == "bf16 reduce-scatter":  # ZeRO-3's gradients cast to bf16 for the wire
        scatter = zero.reduce_scatter_flat
        patch(zero, "reduce_scatter_flat", lambda grads, group=None: scatter([g.bfloat16() for g in grads],
                                                                             group).float())
    apply, made = composition.apply, []

    def keeping_chunks(*args, **kwargs):
        made.append(apply(*args, **kwargs))
        return made[-1]
    patch(composition, "apply", keeping_chunks)
    hook = nn.modules.module.register_module_forward_hook(reading)
    try:
        out = capstone.train(run, capstone.make_mesh(run), capstone.data(run))
    finally:
        hook.remove()
        for owner, name, old in reversed(saved):
            if owner is LEDGER:
                del LEDGER.clear  # the instance's patch: the class's method again
            else:
                setattr(owner, name, old)
    out["read"], out["booked"], out["loss dtypes"] = sorted(read), booked, sorted(losses)
    out["stored"] = {"dense": 0}  # bytes of storage of the dense parameters after the run (ZeRO-3's frees)
    for chunk in made[-1].values():
        for name, master in composition.Dense(chunk).named_parameters():
            out["stored"]["dense"] += 1
            for kind, t in (("masters", master), ("bf16 copies", chunk._bf16.compute[master])):
                out["stored"][kind] = out["stored"].get(kind, 0) + t.untyped_storage().nbytes()
    return out


def kinds(booked, run) -> dict[str, set]:
    """The dtypes of a rank's bookings by what they move. Reduced: every all-reduce (the gradients over the
    data-parallel group (DDP) and over tp (sequence parallelism's), the tied embedding's between the stages,
    the vocabulary-parallel loss's sums) and the data-parallel group's reduce-scatters (ZeRO-3's). Exchanged:
    the rest, but the experts' row counts (``moe_counts``, integers): sequence parallelism's gathers and
    scatters over tp, ZeRO-3's parameter gathers, ring attention's blocks, the pipeline's sends, the experts'
    all-to-alls."""
    mesh = run.mesh(16)
    out = {"reduced": set(), "exchanged": set(), "reduced over": set()}
    for collective, dtype, ranks in booked:
        dimension = mesh.dimension_of(ranks) if ranks else None
        if collective == "all_reduce" or (collective == "reduce_scatter" and dimension == run.dp_dim):
            out["reduced"].add(dtype)
            out["reduced over"].add(dimension)
        elif collective != "moe_counts":
            out["exchanged"].add(dtype)
    return out


def check(results, run, want, bound) -> list[float]:
    """The checks of the module's docstring, in its order; returns each step's gap."""
    for r in results:
        assert r["read"] == ["torch.bfloat16"], \
            f"dtype: rank {r['rank']}'s forward read parameters of {r['read']}"
    for r in results:
        k = kinds(r["booked"], run)
        assert k["reduced"] == {"torch.float32"}, \
            f"dtype: rank {r['rank']} reduced gradients in {sorted(k['reduced'])}"
        assert {run.dp_dim, "tp"} <= k["reduced over"], \
            f"dtype: rank {r['rank']} reduced over {k['reduced over']} only"
        assert k["exchanged"] == {"torch.bfloat16"}, \
            f"dtype: rank {r['rank']} exchanged activations or parameters in {sorted(k['exchanged'])}"
    for r in results:
        masters = r["params"][run.steps]
        assert {str(t.dtype) for t in masters.values()} == {"torch.float32"}, "dtype: masters not fp32"
        finer = sum(int((t != t.bfloat16().float()).sum()) for t in masters.values())
        assert finer > 0, f"masters: rank {r['rank']}'s fp32 masters hold nothing a bf16 copy could not"
    for r in results:  # ZeRO-3: no full fp32 master (4 bytes: a zero expanded to the gradient's shape), no
        if run.zero == 3:  # gathered bf16 copy after the step; DDP: every one of both, whole
            stored = r["stored"]
            assert stored["bf16 copies"] == 0 and stored["masters"] <= 4 * stored["dense"], \
                f"zero3: rank {r['rank']} holds {r['stored']} bytes of full dense parameters after the step"
    for r in results:  # the cross-entropy's tensor (MoEGPT's lm_loss) and the chunk's loss fp32; floats back
        mine = [loss for loss in r["losses"] if loss is not None]
        assert all(type(loss) is float for loss in mine), f"loss: rank {r['rank']} returned {mine}"
        assert r["loss dtypes"] in ([], ["torch.float32"]) and bool(mine) == bool(r["loss dtypes"]), \
            f"loss: rank {r['rank']} computed its loss in {r['loss dtypes']}"
    got = capstone_checks.losses(results)
    gaps = [abs(g - w) for g, w in zip(got, want["losses"])]
    for step, (gap, b) in enumerate(zip(gaps, bound)):
        assert gap <= b["bound"], \
            f"bound: step {step}'s loss is {gap:.3g} from one process's, over {b['bound']:.3g}"
    return gaps


@pytest.mark.parametrize("attention, zero", [("ring", 3), ("ulysses", 0)])
def test_the_5d_run_in_bf16_stays_within_the_bound(sixteen, fp64, attention, zero):
    """The dense parameters sharded by ZeRO-3 (fp32 shards, bf16 gathers, fp32 reduce-scatters) with ring
    attention, or reduced by DDP (fp32 all-reduces of the masters' gradients) with Ulysses."""
    run = five_d(attention=attention, zero=zero)
    want, bound = fp64
    started = time.perf_counter()
    results = sixteen.apply(_train, run)
    wall = time.perf_counter() - started
    per_step = max(r["seconds"] for r in results) / (run.steps - 1)
    print(f"5D run in bf16 ({attention}, zero={zero}): {wall:.1f} s for {run.steps} steps on 16 ranks, "
          f"seconds per step {per_step:.2f}")
    gaps = check(results, run, want, bound)
    for step, (gap, b) in enumerate(zip(gaps, bound)):
        print(f"step {step}: loss {want['losses'][step]:.4f}, gap {gap:.2e}, bound {b['bound']:.3f} "
              f"(forward {b['forward']:.3f}, drift {b['drift']:.3f})")
    assert {r["where"]["cp"] for r in results} == {0, 1} and len(results) == 16


PLANTED = {"bf16 reduction": r"^dtype: rank \d+ reduced gradients in \['torch.bfloat16'",
           "no fp32 masters": r"^masters: ", "no write-back": r"^bound: step 1's loss",
           "bf16 reduce-scatter": r"^dtype: rank \d+ reduced gradients in \['torch.bfloat16'"}


@pytest.mark.parametrize("plant, message", PLANTED.items(), ids=PLANTED.keys())
def test_a_planted_precision_fault_fails(sixteen, fp64, plant, message):
    """On the DDP run (zero=0), whose all-reduce and write-back the first three change; the last on ZeRO-3."""
    run = five_d(zero=3 if plant == "bf16 reduce-scatter" else 0)
    want, bound = fp64
    results = sixteen.apply(_train, run, plant)
    with pytest.raises(AssertionError, match=message):
        check(results, run, want, bound)
    got = capstone_checks.losses(results)
    print(plant, "gaps", [f"{abs(g - w):.2e}" for g, w in zip(got, want["losses"])])
