"""Published training runs as data, and chapter 01's calculator run on each of them (chapter 01).

Each :class:`Run` holds what the calculator needs and what the run measured, with its citation; a field the
source does not state is None. Two groups: the runs the time model's two ceilings are fitted on
(``role="fit"``: Narayanan et al. 2021, Table 1, and the Llama 3 paper, Table 4) and every other run, held
out (``role="held-out"``): no constant is ever tuned to those.

The figure compared is the throughput per GPU as its source counts it: Narayanan et al. count the FLOPs of
their eq. 3, which includes the recomputed forward (``counts="hardware"``); Llama 3 reports model FLOPs
(``counts="model"``, its MFU column). A knob the source leaves unstated (micro-batch, virtual stages,
recomputation, ZeRO stage) is taken as the layout search would set it: the fastest choice that fits, as a
framework's user tunes it. :func:`predict` says which were chosen.

Where each number was checked: Narayanan et al.'s shapes, degrees, batches, micro-batches and virtual stages
in Megatron-LM's ``examples/sc21/run_table_1.sh``, and the first and last rows' 44 % and 52 % of 312 TFLOP/s
(137 and 163) in the paper's text; the middle rows' TFLOP/s are read off Table 1, an image, by hand. Llama 3's
GPUs, degrees, tokens per batch and TFLOP/s per GPU in the table of its SC'24 talk, which repeats Table 4.
MT-NLG's shape, degrees and batch in quotations of its sections 2.2-2.4, its TFLOP/s in llm-analysis's
reproduction of section 2.4. BLOOM's layout and batch in its launch script, its throughput on BigScience's
page. torchtitan's rows in ``docs/performance.md`` at commit 0413364.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from helpers.cost import memory_budget, time_model
from helpers.cost.model_size import LLAMA3_8B, LLAMA3_70B, LLAMA3_405B, Batch, ModelShape, step_flops


def _gpt(name: str, layers: int, hidden: int, heads: int, vocab: int = 51200, seq: int = 2048,
         d_ff: int | None = None, positions: bool = True) -> ModelShape:
    """A GPT-2/3-style model as Megatron-LM builds it: LayerNorm, biases, a GELU MLP of 4h, tied
    embeddings."""
    return ModelShape(name, n_layers=layers, d_model=hidden, n_heads=heads, n_kv_heads=heads,
                      d_ff=d_ff or 4 * hidden, vocab_size=vocab, gated=False, tie_embeddings=True,
                      norm="layernorm", linear_bias=True, learned_positions=seq if positions else 0)


@dataclass(frozen=True)
class Run:
    name: str
    model: ModelShape
    cluster: time_model.Cluster
    gpus: int
    seq_len: int
    global_batch: int          # sequences per step
    tp: int
    pp: int
    dp: int
    tflops_per_gpu: float      # what the source reports
    counts: str                # "hardware" (FLOPs with the recomputed forward) or "model"
    citation: str              # bib key
    where: str                 # table, row or section
    role: str                  # "fit" or "held-out"
    cp: int = 1
    ep: int = 1
    micro_batch: int | None = None
    vpp: int | None = None
    zero: int | None = None
    recompute: str | None = None
    sequence_parallel: bool | None = None
    precision: memory_budget.Precision = memory_budget.BF16
    attention: str = "flash"
    memory: float = 80e9       # bytes of one GPU
    note: str = ""

    @property
    def published_mfu(self) -> float:
        """The source's figure as model FLOPs over peak (hardware-counted figures converted with the
        calculator's own FLOP counts at the source's recomputation)."""
        if self.counts == "model":
            return self.tflops_per_gpu * 1e12 / self.cluster.peak_flops
        f = step_flops(self.model, Batch(self.seq_len, 1, self.global_batch), self.recompute or "full")
        return self.tflops_per_gpu * 1e12 * f["model"] / f["total"] / self.cluster.peak_flops


A100 = time_model.A100_SELENE
# Jean Zay's A100 nodes (BLOOM): four NVLink links between GPUs, no NVSwitch (taken as 100 GB/s), and four
# 100 Gb/s Omni-Path links per node shared by its eight GPUs (6.25 GB/s each)
A100_JEAN_ZAY = replace(A100, name="8x A100 80GB per node, NVLink and 4x100 Gb/s Omni-Path (Jean Zay)",
                        intra_bw=100e9, inter_bw=6.25e9)

_N21 = dict(cluster=A100, seq_len=2048, citation="narayanan2021efficient", counts="hardware", role="fit",
            recompute="full", zero=0, sequence_parallel=False, attention="materialized",
            precision=memory_budget.BF16_FP32_GRADS,
            note="Megatron-LM 2021: fp16, fp32 main gradients, full recomputation (eq. 3 counts it), no SP; "
                 "micro-batch and virtual stages from Megatron-LM's examples/sc21/run_table_1.sh")
_ROWS = [  # params, heads, hidden, layers, tp, pp, gpus, batch, micro-batch, vpp, TFLOP/s per GPU (Table 1)
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 16, 1, 137),
    ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 16, 1, 138),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 16, 1, 142), ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 8, 1, 135),
    ("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 4, 1, 138),
    ("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 2, 3, 140),
    ("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 2, 2, 148),
    ("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 1, 2, 155),
    ("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 1, 3, 163),
    ("1008B", 160, 25600, 128, 8, 64, 3072, 3072, 1, 1, 163)]
NARAYANAN_2021 = [Run(f"GPT {p} (Megatron-LM)", _gpt(f"GPT {p}", layers, hidden, heads), gpus=gpus,
                      global_batch=batch, tp=tp, pp=pp, dp=gpus // (tp * pp), micro_batch=mb, vpp=vpp,
                      tflops_per_gpu=tf, where=f"Table 1, row {p}", **_N21)
                  for p, heads, hidden, layers, tp, pp, gpus, batch, mb, vpp, tf in _ROWS]


_L3 = dict(model=LLAMA3_405B, cluster=time_model.H100, tp=8, pp=16, citation="llama3", counts="model",
           role="fit", sequence_parallel=True, note="the paper: FSDP over dp, no recomputation or vpp stated")
LLAMA3 = [Run("Llama 3 405B, 8K, 8,192 GPUs", gpus=8192, seq_len=8192, global_batch=2048, dp=64,
              tflops_per_gpu=430, where="Table 4, row 1", **_L3),
          Run("Llama 3 405B, 8K, 16,384 GPUs", gpus=16384, seq_len=8192, global_batch=2048, dp=128,
              tflops_per_gpu=400, where="Table 4, row 2", **_L3),
          Run("Llama 3 405B, 128K, 16,384 GPUs", gpus=16384, seq_len=131072, global_batch=128, dp=8, cp=16,
              tflops_per_gpu=380, where="Table 4, row 3", **_L3)]

_MTNLG = dict(model=_gpt("MT-NLG 530B", 105, 20480, 128, vocab=50272), cluster=A100, seq_len=2048,
              global_batch=1920, tp=8, pp=35, citation="smith2022mtnlg", counts="hardware", role="held-out",
              recompute="full", vpp=1, sequence_parallel=False, attention="materialized",
              precision=memory_budget.BF16_FP32_GRADS,
              note="DeepSpeed's pipeline (no interleaving) with Megatron's tensor parallelism")
BLOOM = Run("BLOOM 176B", _gpt("BLOOM 176B", 70, 14336, 112, vocab=250880, positions=False), A100_JEAN_ZAY,
            gpus=384, seq_len=2048, global_batch=2048, tp=4, pp=12, dp=8, micro_batch=2, tflops_per_gpu=150,
            counts="hardware", citation="bigscience2022bloom", where="the 176B model's summary page",
            role="held-out", recompute="full", vpp=1, zero=1, sequence_parallel=False,
            attention="materialized",
            note="'about 150 TFLOPs' per GPU; layout, micro-batch 2, full recomputation and bf16 with "
                 "DeepSpeed's ZeRO-1 equivalent from bigscience's train/tr11-176B-ml/tr11-176B-ml.slurm; "
                 "ALiBi")


def model_tflops(model: ModelShape, seq_len: int, tokens_per_s: float) -> float:
    """TFLOP/s of model FLOPs (the calculator's count: no recomputation) at ``tokens_per_s``."""
    f = step_flops(model, Batch(seq_len, 1, 1), "none")["model"] / seq_len
    return f * tokens_per_s / 1e12


_LLAMA2 = "Touvron et al. 2023 (Llama 2), table 1 and the released config"
LLAMA2_13B = ModelShape("Llama-2 13B", n_layers=40, d_model=5120, n_heads=40, n_kv_heads=40, d_ff=13824,
                        vocab_size=32000, source=_LLAMA2)
LLAMA2_70B = ModelShape("Llama-2 70B", n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, d_ff=28672,
                        vocab_size=32000, source=_LLAMA2)
_TT = dict(cluster=A100, gpus=64, tp=1, pp=1, dp=64, zero=3, vpp=1, sequence_parallel=False, counts="model",
           citation="torchtitan_performance", role="held-out", precision=memory_budget.BF16_FP32_GRADS,
           note="torchtitan, FSDP2 over 64 A100 80GB (network not stated: Selene's assumed); tokens per "
                "second per GPU (WPS) converted to model TFLOP/s with the calculator's own FLOP count; "
                "'selective op' checkpointing taken as selective recomputation")
# Left out: the Llama 2 70B row with 'selective op' checkpointing (355 tokens/s): torchtitan's op-level
# selective checkpointing keeps less than the calculator's selective recomputation (Korthikanti et al.'s
# attention core), whose budget for that run does not fit in 80 GB.
_TT_ROWS = [  # model, seq_len, local batch, recomputation, tokens/s per GPU, the table's row
    (LLAMA3_8B, 8192, 1, "selective", 2973, "Llama 3 table, 8B, selective op"),
    (LLAMA3_70B, 8192, 1, "full", 331, "Llama 3 table, 70B, full"),
    (LLAMA2_13B, 4096, 2, "none", 2162, "Llama 2 table, 13B, no checkpointing"),
    (LLAMA2_13B, 4096, 2, "selective", 1904, "Llama 2 table, 13B, selective op"),
    (LLAMA2_70B, 4096, 2, "full", 353, "Llama 2 table, 70B, full")]
TORCHTITAN = [Run(f"torchtitan {m.name}, batch {b}, {'no' if r == 'none' else r} recomputation", model=m,
                  seq_len=s, global_batch=64 * b, micro_batch=b, tflops_per_gpu=model_tflops(m, s, wps),
                  where=where, recompute=r, **_TT)
              for m, s, b, r, wps, where in _TT_ROWS]
HELD_OUT = [Run(f"MT-NLG 530B, {g:,} GPUs", gpus=g, dp=g // 280, tflops_per_gpu=tf,
                where=f"section 2.4 ({g // 8} DGX nodes)", **_MTNLG)
            for g, tf in ((2240, 126), (2800, 121), (3360, 113))] + [BLOOM] + TORCHTITAN
RUNS = NARAYANAN_2021 + LLAMA3 + HELD_OUT


@dataclass
class Prediction:
    run: Run
    candidate: object        # layout_search.Candidate: the layout, its budget, its step time
    chosen: dict             # the knobs the source left unstated, as chosen
    tflops_per_gpu: float    # predicted, counted as the source counts

    @property
    def error(self) -> float:
        """Relative error of the predicted throughput against the published one."""
        return self.tflops_per_gpu / self.run.tflops_per_gpu - 1


def predict(run: Run, assumptions: time_model.Assumptions | None = None, cluster=None) -> Prediction:
    """The calculator's throughput for ``run``: its stated layout, and for each unstated knob the fastest
    choice that fits in the GPU's memory (less the framework allowance of
    :mod:`helpers.cost.memory_budget`)."""
    from helpers.cost import layout_search

    cluster = cluster or run.cluster
    options = dict(micro_batch=[run.micro_batch] if run.micro_batch else [1, 2, 4],
                   vpp=[run.vpp] if run.vpp else layout_search.valid_vpps(run.model, run.pp),
                   zero=[run.zero] if run.zero is not None else [1, 2, 3],
                   recompute=[run.recompute] if run.recompute else list(layout_search.RECOMPUTE),
                   sequence_parallel=([run.sequence_parallel] if run.sequence_parallel is not None
                                      else [True, False]))
    best, need = None, None
    for mb in options["micro_batch"]:
        if run.global_batch % (run.dp * mb):
            continue
        for vpp in options["vpp"]:
            for zero in options["zero"]:
                for sequence_parallel in options["sequence_parallel"]:
                    layout = memory_budget.Layout(dp=run.dp, tp=run.tp, pp=run.pp, cp=run.cp, ep=run.ep,
                                                  vpp=vpp, zero=zero,
                                                  sequence_parallel=sequence_parallel and run.tp > 1)
                    for r in options["recompute"]:
                        act = memory_budget.ActivationModel(attention=run.attention, recompute=r)
                        try:
                            b = memory_budget.budget(run.model, Batch(run.seq_len, mb, run.global_batch),
                                                     layout, run.precision, act, run.gpus)
                        except ValueError:
                            break
                        if not memory_budget.fits(b, run.memory):
                            need = b.total_bytes if need is None else min(need, b.total_bytes)
                            continue
                        t = time_model.step_time(b, cluster, assumptions=assumptions)
                        c = layout_search.Candidate(layout, mb, r, b, t)
                        if best is None or c.step_s < best.step_s:
                            best = c
                        break
    if best is None:
        raise ValueError(f"{run.name}: no variant of the published layout fits in {run.memory / 1e9:.0f} GB "
                         f"(the most frugal needs {need / 1e9:.1f} GB with the framework allowance)")
    flops = best.budget.flops["total" if run.counts == "hardware" else "model"]
    chosen = {k: getattr(best.layout, k, None) if k != "micro_batch" and k != "recompute" else
              getattr(best, k) for k, v in options.items() if len(v) > 1}
    return Prediction(run, best, chosen, flops / best.step_s / run.gpus / 1e12)


def calibration(assumptions: time_model.Assumptions | None = None, runs=None, cluster_for=None) -> list:
    """Every run predicted: a list of :class:`Prediction`. ``cluster_for(run)`` may replace a run's
    cluster (a planted ceiling)."""
    return [predict(r, assumptions, cluster_for(r) if cluster_for else None) for r in (runs or RUNS)]


def within(predictions, bound: float = 0.15) -> float:
    """The share of ``predictions`` within ``bound`` relative error."""
    return sum(abs(p.error) <= bound for p in predictions) / len(predictions)


def fit_ceiling(runs, cluster_of, assumptions=None, lo: float = 0.3, hi: float = 1.0, tol: float = 1e-4):
    """The matmul ceiling (``Cluster.efficiency``) that minimizes the squared log errors of ``runs``, all on
    clusters of one GPU type (``cluster_of(run, ceiling)`` builds a run's cluster with that ceiling): a
    golden-section search over [lo, hi]."""
    import math

    def loss(c):
        return sum(math.log1p(predict(r, assumptions, cluster_of(r, c)).error) ** 2 for r in runs)

    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    x1, x2 = b - g * (b - a), a + g * (b - a)
    f1, f2 = loss(x1), loss(x2)
    while b - a > tol:
        if f1 < f2:
            b, x2, f2 = x2, x1, f1
            x1 = b - g * (b - a)
            f1 = loss(x1)
        else:
            a, x1, f1 = x1, x2, f2
            x2 = a + g * (b - a)
            f2 = loss(x2)
    return (a + b) / 2


def rank_in_search(run: Run, cluster=None, assumptions=None):
    """Where ``run``'s published layout ranks in :func:`helpers.cost.layout_search.search` for its
    model, cluster, GPUs and batch: (rank, layouts kept, the fastest kept layout with the run's degrees and,
    where the source states them, its micro-batch and virtual stages). The search tries micro-batches 1, 2
    and the run's."""
    from helpers.cost import layout_search

    result = layout_search.search(run.model, cluster or run.cluster, run.gpus, run.seq_len, run.global_batch,
                                  precision=run.precision, memory=run.memory, assumptions=assumptions,
                                  micro_batches=tuple(sorted({1, 2, run.micro_batch or 1})))
    fixed = dict(dp=run.dp, tp=run.tp, pp=run.pp, cp=run.cp, ep=run.ep)
    fixed.update({k: v for k, v in (("micro_batch", run.micro_batch), ("vpp", run.vpp)) if v})
    rank, candidate = result.rank_of(**fixed)
    return rank, len(result.ranked), candidate
