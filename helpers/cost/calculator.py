"""Chapter 01's calculator as a command line: memory per GPU, traffic per step, step time, MFU (chapter 01).

    python -m helpers.cost.calculator --model llama3-70b --gpus 64 --tp 8 --pp 4
    python -m helpers.cost.calculator --model mixtral-8x7b --gpus 64 --tp 2 --pp 4 --ep 8 --zero 1 --json
    python -m helpers.cost.calculator --layers 32 --hidden 4096 --heads 32 --kv-heads 8 --ffn 14336 \
        --vocab 128256
    python -m helpers.cost.calculator --model llama3-70b --gpus 64 --search

Nothing here is a model of its own: :func:`run` reads the choices into chapter 01's objects
(:mod:`helpers.cost.model_size`, :mod:`helpers.cost.memory_budget`, :mod:`helpers.cost.time_model`) and the
layout search of chapter 10 (:mod:`helpers.cost.layout_search`), and reports what they compute, as a
dictionary; the text and ``--json`` are two ways of printing it, and the book's page "Try the calculator" runs
this very function in the reader's browser (Pyodide). Bad input is one line naming the rule it breaks, in the
words of :mod:`helpers.layout_rules`, and exit status 2. Imports no torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from helpers.cost import memory_budget, model_size, time_model
from helpers.cost.calculator_presets import CHAPTERS, GPUS, PRECISIONS, PRESETS
from helpers.cost.memory_budget import ActivationModel, Layout
from helpers.cost.model_size import Batch, ModelShape

GB = 1e9
# the custom shape's flags and the ModelShape field each sets
SHAPE_FLAGS = {"layers": "n_layers", "hidden": "d_model", "heads": "n_heads", "kv_heads": "n_kv_heads",
               "ffn": "d_ff", "vocab": "vocab_size", "experts": "n_experts", "top_k": "top_k"}


class InputError(ValueError):
    """A choice the calculator cannot take: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints its usage and exits; the calculator says one line
        raise InputError(message)


def _whole(least: int):
    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < least:
            raise argparse.ArgumentTypeError(f"must be a whole number of at least {least}, got {text!r}")
        return value
    return convert


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m helpers.cost.calculator", description=__doc__.split("\n\n")[0],
                allow_abbrev=False)
    p.add_argument("--model", choices=sorted(PRESETS), help="a preset; the shape flags below change it")
    shape = p.add_argument_group("a custom shape (or changes to a preset)")
    for flag, least in (("layers", 1), ("hidden", 1), ("heads", 1), ("kv-heads", 1), ("ffn", 1), ("vocab", 1),
                        ("experts", 0), ("top-k", 0)):
        shape.add_argument(f"--{flag}", type=_whole(least))
    cluster = p.add_argument_group("the cluster")
    cluster.add_argument("--gpu", choices=sorted(GPUS), default="h100")
    cluster.add_argument("--gpus", type=_whole(1), default=8, help="GPUs in the job (the world size)")
    cluster.add_argument("--gpus-per-node", type=_whole(1), default=8)
    batch = p.add_argument_group("the batch")
    batch.add_argument("--seq", type=_whole(1), default=4096, help="tokens per sequence")
    batch.add_argument("--global-batch", type=_whole(1), default=512, help="sequences per optimizer step")
    batch.add_argument("--micro-batch", type=_whole(1), default=1, help="sequences per micro-batch")
    layout = p.add_argument_group("the layout (dp defaults to gpus / (tp·pp·cp))")
    for flag in ("tp", "pp", "vpp", "cp", "ep"):
        layout.add_argument(f"--{flag}", type=_whole(1), default=1)
    layout.add_argument("--dp", type=_whole(1))
    layout.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=1, help="ZeRO stage over dp·cp")
    layout.add_argument("--sp", dest="sequence_parallel", action="store_true",
                        help="sequence parallelism (needs tp > 1)")
    layout.add_argument("--recompute", choices=("none", "selective", "full"), default="none")
    layout.add_argument("--precision", choices=list(PRECISIONS), default="bf16")
    out = p.add_argument_group("what to print")
    out.add_argument("--search", action="store_true",
                     help="rank every layout that fits and print the fastest: the search chooses the "
                          "degrees, vpp, SP, ZeRO, micro-batch and recomputation; model, GPUs, batch and "
                          "precision are as given")
    out.add_argument("--top", type=_whole(1), default=5, help="layouts --search prints")
    out.add_argument("--json", action="store_true", help="the same numbers as JSON")
    return p


def model_of(args) -> tuple[ModelShape, dict]:
    """The preset (changed by any shape flag given) or the custom shape, and what is published about it."""
    given = {field: getattr(args, flag) for flag, field in SHAPE_FLAGS.items()
             if getattr(args, flag) is not None}
    if args.model:
        preset = PRESETS[args.model]
        published = {"total": preset.published_total, "active": preset.published_active, "cite": preset.cite,
                     "source": preset.shape.source, "note": preset.note}
        if not given:
            return preset.shape, published
        return replace(preset.shape, name=f"{preset.shape.name}, changed", **given), {}
    missing = [f"--{f.replace('_', '-')}" for f in ("layers", "hidden", "heads", "ffn", "vocab")
               if SHAPE_FLAGS[f] not in given]
    if missing:
        raise InputError(f"give --model (one of {', '.join(sorted(PRESETS))}) or a whole custom shape: "
                         f"{' '.join(missing)} missing")
    given.setdefault("n_kv_heads", given["n_heads"])
    if given.get("n_experts") and not given.get("top_k"):
        raise InputError(f"top_k must be in 1..n_experts={given['n_experts']}: give --top-k with --experts")
    return ModelShape("custom model", **given), {}


def config(argv: list[str]) -> dict:
    """Every choice read into chapter 01's objects; raises InputError or ValueError on a broken rule."""
    args = parser().parse_args(argv)
    model, published = model_of(args)
    gpu = GPUS[args.gpu]
    cluster = replace(gpu.cluster, gpus_per_node=args.gpus_per_node)
    n = args.tp * args.pp * args.cp
    if args.dp is None and args.gpus % n:
        raise InputError(f"world size {args.gpus} is not a multiple of tp*pp*cp = {args.tp}*{args.pp}*"
                         f"{args.cp} = {n}: dp would not be whole")
    layout = Layout(dp=args.dp or args.gpus // n, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep,
                    vpp=args.vpp, zero=args.zero, sequence_parallel=args.sequence_parallel)
    return dict(args=args, model=model, published=published, gpu=gpu, cluster=cluster, layout=layout,
                batch=Batch(args.seq, args.micro_batch, args.global_batch),
                precision=PRECISIONS[args.precision],
                act=ActivationModel(recompute=args.recompute))


def _link(kind: str, layout: Layout, cluster) -> str:
    if kind == "ep":  # an all-to-all spans the nodes its ranks are on
        return "NVLink" if layout.tp * layout.cp * layout.ep <= cluster.gpus_per_node else "NVLink+network"
    return "NVLink" if time_model._link(kind, layout, cluster)[0] == cluster.intra_bw else "network"


def _model_json(model: ModelShape, published: dict) -> dict:
    out = {"name": model.name, "layers": model.n_layers, "hidden": model.d_model, "heads": model.n_heads,
           "kv_heads": model.n_kv_heads, "ffn": model.d_ff, "vocab": model.vocab_size,
           "experts": model.n_experts, "top_k": model.top_k, "params": model_size.count_params(model).total,
           "active_params": model_size.active_params(model)}
    if published:  # a model is not the world: the published size beside the count, and the gap
        out["published"] = {**published, "gap": out["params"] / published["total"] - 1,
                            "active_gap": out["active_params"] / published["active"] - 1}
    return out


def evaluate(c: dict) -> dict:
    """One layout: the budget of one GPU of its busiest stage, its traffic and its step time."""
    model, L, cluster, gpu = c["model"], c["layout"], c["cluster"], c["gpu"]
    b = memory_budget.budget(model, c["batch"], L, c["precision"], c["act"], world_size=c["args"].gpus)
    t = time_model.step_time(b, cluster)
    memory = {k: {"bytes": v, "chapter": CHAPTERS[k]} for k, v in b.breakdown().items()}
    memory["overheads"] = {"bytes": int(memory_budget.FRAMEWORK_ALLOWANCE), "chapter": CHAPTERS["overheads"]}
    total = b.total_bytes + int(memory_budget.FRAMEWORK_ALLOWANCE)
    traffic = {k: {"bytes": v, "link": _link(k, L, cluster), "seconds": t.comm_s[k],
                   "exposed_seconds": t.exposed_s.get(k, 0.0), "chapter": CHAPTERS[k]}
               for k, v in b.sent.items()}
    if "dp" in t.exposed_s:  # the dense and the expert reductions hide together: one exposed figure
        for k in traffic:
            traffic[k]["exposed_seconds"] = t.exposed_s["dp"] if k == "dp" else traffic[k]["exposed_seconds"]
        if "dp" not in traffic:
            traffic["dp (experts)"]["exposed_seconds"] = t.exposed_s["dp"]
    step = {"compute": t.compute_s, "bubble": t.bubble_s,
            **{f"{k} traffic (exposed)": v for k, v in t.exposed_s.items()}}
    step_chapters = {"compute": CHAPTERS["compute"], "bubble": CHAPTERS["bubble"],
                     **{f"{k} traffic (exposed)": CHAPTERS[k] for k in t.exposed_s}}
    return {"memory": memory, "memory_total": total, "gpu_memory": gpu.memory, "fits": total <= gpu.memory,
            "micro_batches": b.micro_batches, "traffic": traffic, "step": step,
            "step_chapters": step_chapters, "step_seconds": t.step_s, "mfu": t.mfu,
            "matmul_efficiency": t.matmul_efficiency}


def _layout_json(L: Layout, c: dict) -> dict:
    return {"dp": L.dp, "tp": L.tp, "pp": L.pp, "vpp": L.vpp, "cp": L.cp, "ep": L.ep, "zero": L.zero,
            "sequence_parallel": L.sequence_parallel, "recompute": c["act"].recompute,
            "precision": c["args"].precision}


def search(c: dict, top: int) -> list[dict]:
    """The ``top`` fastest layouts that fit (chapter 10's search), each with why it ranks where it does."""
    from helpers.cost import layout_search

    a = c["args"]
    result = layout_search.search(c["model"], c["cluster"], a.gpus, a.seq, a.global_batch, c["precision"],
                                  memory=c["gpu"].memory)
    rows = []
    for cand in result.ranked[:top]:
        rows.append({"layout": {**_layout_json(cand.layout, c), "recompute": cand.recompute,
                                "micro_batch": cand.micro_batch},
                     "describe": cand.describe(), "step_seconds": cand.step_s, "mfu": cand.time.mfu,
                     "memory_total": cand.budget.total_bytes + int(result.allowance),
                     "why": layout_search.why(cand, result.best)})
    return rows


def run(argv: list[str]) -> dict:
    """Everything the calculator says about ``argv`` (the command line's words), as plain data."""
    c = config(argv)
    a, gpu = c["args"], c["gpu"]
    out = {"model": _model_json(c["model"], c["published"]),
           "cluster": {"gpu": a.gpu, "name": c["cluster"].name, "gpus": a.gpus,
                       "gpus_per_node": a.gpus_per_node,
                       "memory": gpu.memory, "ceiling_fitted": gpu.fitted, "cite": gpu.cite},
           "batch": {"seq": a.seq, "global_batch": a.global_batch, "micro_batch": a.micro_batch},
           "layout": _layout_json(c["layout"], c)}
    if a.search:
        out["search"] = search(c, a.top)
    else:
        out.update(evaluate(c))
    return out


# --------------------------------------------------------------------------------------------- text

def _gb(x: float) -> str:
    return f"{x / GB:9.2f}"


def text(r: dict) -> str:
    """The report :func:`run` returns, as the command line prints it (GB are 10^9 bytes)."""
    m, cl, b, L = r["model"], r["cluster"], r["batch"], r["layout"]
    pub = m.get("published")
    size = f"{m['params'] / 1e9:.2f} B parameters"
    if m["experts"]:
        size += f", {m['active_params'] / 1e9:.2f} B active"
    if pub:
        size += f"; published {pub['total'] / 1e9:g} B ({pub['gap']:+.1%})"
        if m["experts"]:
            size += f", {pub['active'] / 1e9:g} B active ({pub['active_gap']:+.1%})"
        size += f" [{pub['cite']}]"
    lines = [f"{m['name']} ({size})" + (f"\n  {pub['note']}" if pub and pub["note"] else ""),
             f"on {cl['gpus']} x {cl['gpu'].upper()} ({cl['name']}), {cl['memory'] / GB:.0f} GB each"
             + ("" if cl["ceiling_fitted"] else "; matmul ceiling borrowed from the H100, not fitted"),
             f"batch {b['global_batch']} sequences of {b['seq']} tokens, micro-batch {b['micro_batch']}"]
    if "search" in r:
        lines.append(f"\nthe {len(r['search'])} fastest layouts that fit (chapter 10's search):")
        for i, row in enumerate(r["search"], 1):
            lines.append(f"{i:2d}. {row['describe']}, {L['precision']}")
            lines.append(f"    step {row['step_seconds']:.2f} s, MFU {row['mfu']:.1%}, "
                         f"{row['memory_total'] / GB:.1f} GB per GPU: {row['why']}")
        return "\n".join(lines)
    lines.append(f"layout dp={L['dp']} tp={L['tp']} pp={L['pp']} vpp={L['vpp']} cp={L['cp']} ep={L['ep']}, "
                 f"ZeRO-{L['zero']}, SP {'on' if L['sequence_parallel'] else 'off'}, "
                 f"recompute {L['recompute']}, "
                 f"{L['precision']}; {r['micro_batches']} micro-batches per step")
    lines += ["", f"{'memory per GPU (busiest pipeline stage)':44s}       GB  chapter"]
    for k, v in r["memory"].items():
        lines.append(f"  {k:42s}{_gb(v['bytes'])}  {v['chapter']}")
    verdict = "fits" if r["fits"] else "DOES NOT FIT"
    lines.append(f"  {'total':42s}{_gb(r['memory_total'])}  of {r['gpu_memory'] / GB:.0f} GB: {verdict}")
    if r["traffic"]:
        lines += ["", f"{'traffic per GPU per step':26s}  sent GB  link              s  exposed s  chapter"]
        for k, v in r["traffic"].items():
            lines.append(f"  {k:24s}{_gb(v['bytes'])}  {v['link']:14s}{v['seconds']:7.2f}"
                         f"{v['exposed_seconds']:11.2f}  {v['chapter']}")
    lines += ["", f"{'step time':44s}        s"]
    for k, v in r["step"].items():
        lines.append(f"  {k:42s}{v:9.2f}")
    lines.append(f"  {'step':42s}{r['step_seconds']:9.2f}")
    lines.append(f"MFU {r['mfu']:.1%} (the step's matmuls at {r['matmul_efficiency']:.1%} of peak)")
    return "\n".join(lines)


def page(words: str) -> str:
    """What the page "Try the calculator" calls in the reader's browser: the command line's words (a JSON
    list) in, :func:`run`'s report (or ``{"error": the one line}``) out, as JSON."""
    try:
        return json.dumps(run(json.loads(words)))
    except ValueError as e:
        return json.dumps({"error": str(e)})


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        report = run(argv)
    except ValueError as e:  # InputError and every rule of chapter 01's objects: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=1) if "--json" in argv else text(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
