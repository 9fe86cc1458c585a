"""``make bench`` (issue 26): the book's from-scratch implementations against PyTorch's, side by side.

    python -m helpers.tools.bench                 # every row, on 4 gloo ranks
    python -m helpers.tools.bench --chapter 02    # one chapter's rows: 02, 03, 04, 05, 06 or 12

One set of ranks (:func:`helpers.ranks.start_ranks`: every listener on 127.0.0.1, the collective timeout of
:mod:`helpers.dist`, its temporary folder removed and its processes ended by ``stop``) runs every row of
:mod:`helpers.tools.bench_rows`. Each row warms both sides up, then runs them alternately (ours, theirs, ours,
…) on the same seed and data; a run's time is the slowest rank's. For each side the table gives the median
and the interquartile range (IQR) of the runs; the *ratio* is ours over theirs, the median of the ratios of
consecutive pairs (a pair ran under the same load), with the IQR of those ratios as its spread. A row whose
spread contains 1 (``q25 <= 1 <= q75``) says "no measurable difference"; one whose spread excludes 1 says
how many times slower or faster ours is.
The ring's rows add the bus bandwidth of each side, ``2(N-1)/N · bytes / t`` (chapter 02), and the ZeRO rows
the ratio of the model-state bytes each side holds on its fullest rank.

It prints a line per row as it runs, then the table, and writes ``_build/bench/bench.csv`` and
``_build/bench/bench.png``. Nothing here asserts a time: the numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time

from helpers import ROOT
from helpers.timing import NO_DIFFERENCE, compare

SIZES = [2**10 * 4**k for k in range(9)]  # 1 KiB … 64 MiB
GROUPS = {"02": "ring all-reduce", "03": "DDP", "04": "ZeRO", "05": "TP", "06": "PP", "12": "Muon"}
# (chapter, row, ours, theirs, function of bench_rows, its arguments)
STEP_ROWS = [
    ("03", "bucketed DDP step", "data_parallel.bucketed_average", "DistributedDataParallel", "ddp",
     {"version": "bucketed"}),
    ("03", "overlapped DDP step", "data_parallel.OverlappedDDP", "DistributedDataParallel", "ddp",
     {"version": "overlapped"}),
    ("03", "overlapped, DDP's buckets", "OverlappedDDP(buckets=closed_at_cap)", "DistributedDataParallel",
     "ddp", {"version": "overlapped, DDP's buckets"}),
    ("04", "ZeRO-1 step", "zero.ShardedAdamW", "DDP + ZeroRedundancyOptimizer", "zero", {"stage": 1}),
    ("04", "ZeRO-3 step", "zero.Zero3", "FSDP2 fully_shard", "zero", {"stage": 3}),
    ("05", "TP step", "tensor_parallel.parallelize", "tensor.parallel", "tp", {"sequence_parallel": False}),
    ("05", "TP+SP step", "tensor_parallel (SP)", "tensor.parallel (SP)", "tp", {"sequence_parallel": True}),
    ("06", "1F1B step", "run_schedule (1F1B)", "Schedule1F1B", "pp", {"schedule": "1F1B"}),
    ("06", "interleaved 1F1B step", "run_schedule (interleaved)", "ScheduleInterleaved1F1B", "pp",
     {"schedule": "interleaved 1F1B"}),
    ("12", "Muon step", "optimizers.Muon", "torch.optim.Muon", "muon", {"version": "one process"}),
    ("12", "distributed Muon step", "distributed_muon.DistributedMuon", "DDP + torch.optim.Muon", "muon",
     {"version": "distributed"}),
]
FIELDS = ["chapter", "row", "ours", "theirs", "bytes", "runs", "ours_ms", "ours_iqr_ms", "theirs_ms",
          "theirs_iqr_ms", "ratio", "ratio_q25", "ratio_q75", "verdict", "ours_busbw_gbs", "theirs_busbw_gbs",
          "memory_ratio", "note"]


def bus_bandwidth(nbytes: int, seconds: float, world_size: int) -> float:
    """GB/s of an all-reduce of ``nbytes`` in ``seconds``: 2(N-1)/N · bytes / t (what each rank sends)."""
    return 2 * (world_size - 1) / world_size * nbytes / seconds / 1e9


def summarize(chapter: str, row: str, ours: str, theirs: str, result: dict, world_size: int) -> dict:
    """One table row from a bench_rows result."""
    out = {"chapter": chapter, "row": row, "ours": ours, "theirs": theirs, "note": ""}
    out.update(compare(result["ours"], result["theirs"]))
    if "bytes" in result:
        out["bytes"] = result["bytes"]
        out["ours_busbw_gbs"] = bus_bandwidth(result["bytes"], out["ours_ms"] / 1e3, world_size)
        out["theirs_busbw_gbs"] = bus_bandwidth(result["bytes"], out["theirs_ms"] / 1e3, world_size)
    if "note" in result:
        out["note"] = result["note"]
    if "memory" in result:
        mine, pytorch = result["memory"]
        out["memory_ratio"] = mine / pytorch
        out["note"] = f"model states {mine / 1e6:.2f} MB against {pytorch / 1e6:.2f} MB on the fullest rank"
    return out


def plan(chapter: str | None, sizes: list[int]) -> list[tuple]:
    """The rows to run: (chapter, row, ours, theirs, function, arguments)."""
    if chapter is not None and chapter not in GROUPS:
        raise SystemExit(f"--chapter {chapter}: the bench has rows for chapters {', '.join(GROUPS)}")
    rows = [("02", f"ring all-reduce {size_label(n)}", "collectives.ring_all_reduce", "dist.all_reduce",
             "ring", {"nbytes": n}) for n in sizes] + STEP_ROWS
    return [r for r in rows if chapter is None or r[0] == chapter]


def size_label(nbytes: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def run(ranks, rows: list[tuple], timing: dict, log=print) -> list[dict]:
    """Run every row on ``ranks``, a progress line each; a row that cannot run says why instead."""
    from helpers.tools import bench_rows

    table = []
    for i, (chapter, row, ours, theirs, fn, kwargs) in enumerate(rows, start=1):
        started = time.perf_counter()
        if fn is None:
            line = {"chapter": chapter, "row": row, "ours": ours, "theirs": theirs, "note": kwargs["note"]}
        else:
            try:
                result = ranks.apply(getattr(bench_rows, fn), **kwargs, **timing)[0]
                line = summarize(chapter, row, ours, theirs, result, ranks.world_size)
            except Exception as err:  # the row says why; the other rows still run
                reason = " ".join(str(err).split())[:300]
                line = {"chapter": chapter, "row": row, "ours": ours, "theirs": theirs,
                        "note": f"did not run: {reason}"}
        table.append(line)
        took = time.perf_counter() - started
        if "ratio" in line:
            log(f"[{i}/{len(rows)}] {chapter} {row}: ours {line['ours_ms']:.3f} ms, {theirs} "
                f"{line['theirs_ms']:.3f} ms, ratio {line['ratio']:.2f} ({line['runs']} pairs, {took:.1f} s)",
                flush=True)
        else:
            log(f"[{i}/{len(rows)}] {chapter} {row}: {line['note']}", flush=True)
    return table


def _fmt(value, spec: str) -> str:
    return "" if value is None or value == "" else format(value, spec)


def format_table(table: list[dict]) -> str:
    """The table as fixed-width text: one line per row."""
    head = ["ch", "row", "ours ms (IQR)", "PyTorch ms (IQR)", "ratio [q25-q75]", "busbw GB/s ours/PyTorch",
            "memory ratio", "verdict / note"]
    lines = [head]
    for r in table:
        if "ratio" not in r:
            lines.append([r["chapter"], r["row"], "", "", "", "", "", r["note"]])
            continue
        bw = (f"{r['ours_busbw_gbs']:.3g} / {r['theirs_busbw_gbs']:.3g}" if r.get("ours_busbw_gbs") else "")
        lines.append([r["chapter"], r["row"], f"{r['ours_ms']:.3f} ({r['ours_iqr_ms']:.3f})",
                      f"{r['theirs_ms']:.3f} ({r['theirs_iqr_ms']:.3f})",
                      f"{r['ratio']:.2f} [{r['ratio_q25']:.2f}-{r['ratio_q75']:.2f}]", bw,
                      _fmt(r.get("memory_ratio"), ".2f"),
                      "; ".join(x for x in (r["verdict"], r["note"]) if x)])
    widths = [max(len(str(line[c])) for line in lines) for c in range(len(head) - 1)]
    text = ["  ".join(str(v).ljust(w) for v, w in zip(line, widths)) + "  " + line[-1] for line in lines]
    text.insert(1, "-" * len(text[0]))
    return "\n".join(t.rstrip() for t in text)


def write_csv(table: list[dict], path: str) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for r in table:
            writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v)
                             for k, v in r.items() if k in FIELDS})


def draw(table: list[dict], path: str, world_size: int) -> None:
    """Left: the ring's bus bandwidth against gloo's by size; right: every row's ratio with its IQR."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ring = [r for r in table if r.get("ours_busbw_gbs")]
    timed = [r for r in table if "ratio" in r]
    panels = (1 if ring else 0) + (1 if timed else 0)
    if not panels:
        return
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 0.5 + 0.32 * max(len(timed), 8)), squeeze=False)
    axes = list(axes[0])
    if ring:
        ax = axes.pop(0)
        sizes = [r["bytes"] for r in ring]
        ax.plot(sizes, [r["ours_busbw_gbs"] for r in ring], "o-", label="ring_all_reduce (chapter 02)")
        ax.plot(sizes, [r["theirs_busbw_gbs"] for r in ring], "s-", label="dist.all_reduce (gloo)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("bytes per rank")
        ax.set_ylabel(f"bus bandwidth, GB/s ({world_size} ranks)")
        ax.legend()
    if timed:
        ax = axes.pop(0)
        ratios = [r["ratio"] for r in timed]
        err = [[r["ratio"] - r["ratio_q25"] for r in timed], [r["ratio_q75"] - r["ratio"] for r in timed]]
        colors = ["0.6" if r["verdict"] == NO_DIFFERENCE else "tab:blue" for r in timed]
        ax.barh([r["row"] for r in timed], ratios, xerr=err, color=colors, capsize=2)
        ax.axvline(1.0, color="k", lw=0.8)
        ax.invert_yaxis()
        ax.set_xlabel("time, ours / PyTorch's (bars: IQR; grey: no measurable difference)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None, ranks=None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m helpers.tools.bench", description=__doc__.split("\n")[0])
    parser.add_argument("--chapter",
                        help="one chapter's rows: " + ", ".join(f"{k} {v}" for k, v in GROUPS.items()))
    parser.add_argument("--world-size", type=int, default=4, help="gloo ranks (default 4)")
    parser.add_argument("--sizes", help="ring message sizes in bytes, comma-separated (default 1 KiB…64 MiB)")
    parser.add_argument("--repeats", type=int, help="timed pairs per row (default: as many as fill --budget)")
    parser.add_argument("--budget", type=float, default=6.0, help="seconds of timed runs per row (default 6)")
    parser.add_argument("--out", default=os.path.join(ROOT, "_build", "bench"),
                        help="where the CSV and PNG go (default _build/bench)")
    args = parser.parse_args(argv)
    chapter = args.chapter
    if chapter is not None:
        chapter = chapter.zfill(2) if chapter.isdigit() else chapter
        if chapter not in GROUPS:  # one line and status 2, as run_chapter refuses a chapter
            print(f"--chapter {args.chapter}: the bench has rows for chapters {', '.join(GROUPS)}",
                  file=sys.stderr)
            raise SystemExit(2)
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else SIZES
    rows = plan(chapter, sizes)
    timing = {"budget_s": args.budget} if args.repeats is None else {"repeats": args.repeats}
    started = time.perf_counter()
    own = ranks is None
    if own:
        from helpers.ranks import start_ranks

        print(f"starting {args.world_size} gloo ranks …", flush=True)
        ranks = start_ranks(args.world_size, activate=False)
    try:
        print(f"{len(rows)} rows on {ranks.world_size} ranks, {len(os.sched_getaffinity(0))} cores; each: a "
              f"warm-up, then ours and PyTorch's alternately", flush=True)
        table = run(ranks, rows, timing)
    finally:
        if own:
            ranks.stop()
    os.makedirs(args.out, exist_ok=True)
    write_csv(table, os.path.join(args.out, "bench.csv"))
    draw(table, os.path.join(args.out, "bench.png"), ranks.world_size)
    print()
    print(format_table(table))
    print(f"\nratio: ours / PyTorch's time, the median of alternating pairs, [its interquartile range]; "
          f"'{NO_DIFFERENCE}' when that range contains 1, else slower or faster")
    print(f"wrote {os.path.join(args.out, 'bench.csv')} and bench.png; {time.perf_counter() - started:.0f} s "
          f"in all")
    failed = [r for r in table if r["note"].startswith("did not run")]
    if failed and any("check" in r["note"] for r in failed):
        raise SystemExit(f"{len(failed)} rows did not run, a check among them: see the table")
    return table


if __name__ == "__main__":
    main(sys.argv[1:])
