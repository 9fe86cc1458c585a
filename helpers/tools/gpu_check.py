"""``make gpu-check``: every chapter on the backend ``BOOK_BACKEND`` names, as a table of what ran.

Under ``BOOK_BACKEND=nccl`` each chapter runs as ``make chapter`` runs it, its ranks one per GPU
(:func:`helpers.dist.device`: rank ``r`` on ``cuda:r``). NCCL refuses two ranks of one communicator on one GPU
("Duplicate GPU detected"), so ranks are never folded onto fewer GPUs: a chapter that needs more ranks than
the machine has GPUs is skipped, and its row says so. Under gloo (the default) the same command runs the same
chapters on the CPU and prints the same table, which is how its plumbing is tested where there is no GPU.

``python -m helpers.tools.gpu_check [NN ...]`` (``make gpu-check CH="03 04"``: a subset; a comma works too)
prints one row per chapter as it ends, then the whole table: chapter, ranks, result, seconds. Each chapter's
output goes to ``_build/gpu_check/NN.log``; a failed row names its last error line. The exit status is 1 if a
chapter failed, 2 for a bad chapter or setting (refused in one line before anything runs), else 0.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass

from helpers import ROOT
from helpers.tools.px_script import BadValue, chapters, notebook_path

START = re.compile(r"start_ranks\(\s*(\w+)")


def ranks_needed(path: str) -> int:
    """The most ranks the notebook starts (``start_ranks(4)``, or ``start_ranks(world_size)`` after
    ``world_size = 4``); 0 for a chapter that runs in its kernel alone."""
    with open(path) as f:
        text = f.read()
    counts = []
    for arg in START.findall(text):
        if arg.isdigit():
            counts.append(int(arg))
            continue
        assigned = re.findall(rf"^{arg}\s*=\s*(\d+)\s*$", text, flags=re.M)
        if not assigned:
            raise ValueError(f"{os.path.basename(path)}: start_ranks({arg}) and no '{arg} = N' to read N")
        counts.append(int(assigned[0]))
    return max(counts, default=0)


@dataclass
class Row:
    chapter: str
    ranks: int
    result: str  # passed, failed, skipped
    seconds: float | None = None
    note: str = ""


def skip_reason(ranks: int, backend: str, n_gpus: int) -> str:
    """Why the chapter cannot run here, or '' if it can."""
    if backend == "nccl" and ranks > n_gpus:
        return (f"needs {ranks} ranks, one per GPU (NCCL refuses two ranks of one communicator on one GPU); "
                f"this machine has {n_gpus}")
    return ""


def placement(ranks: int, backend: str) -> str:
    if ranks == 0:
        return "kernel only"
    return f"{ranks}, one per GPU" if backend == "nccl" else f"{ranks} on the CPU"


def run_one(chapter: str, path: str, log_dir: str) -> tuple[bool, float, str]:
    """Run ``make chapter``'s module on one chapter; whether it passed, its seconds, its last error line."""
    log = os.path.join(log_dir, f"{chapter}.log")
    started = time.monotonic()
    with open(log, "w") as out:
        done = subprocess.run([sys.executable, "-m", "helpers.tools.run_chapter", path], cwd=ROOT,
                              stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    seconds = time.monotonic() - started
    if done.returncode == 0:
        return True, seconds, ""
    with open(log) as f:
        lines = [line.strip() for line in f if line.strip() and "executed notebook" not in line]
    errors = [line for line in lines if re.match(r"^[A-Za-z_][\w.]*(Error|Failed|Exception)\b", line)]
    last = (errors or lines or ["no output"])[-1]
    return False, seconds, f"{last[:100]} (log: {os.path.relpath(log, ROOT)})"


def table(rows: list[Row], backend: str) -> str:
    head = ["chapter", "ranks", "result", "seconds"]
    body = [[r.chapter, placement(r.ranks, backend), r.result + (f": {r.note}" if r.note else ""),
             "" if r.seconds is None else f"{r.seconds:.1f}"] for r in rows]
    widths = [max(len(line[i]) for line in [head] + body) for i in range(3)]

    def fmt(line):
        return "  ".join(cell.ljust(w) for cell, w in zip(line[:3], widths)) + "  " + line[3].rjust(7)

    return "\n".join([fmt(head)] + [fmt(line) for line in body])


def parse_chapters(argv: list[str]) -> list[tuple[str, str]]:
    """``(name, notebook)`` of each chapter named (``03 04``, ``03,04``, or a notebook's path), checked; every
    chapter if none is named."""
    names = [name for arg in argv for name in arg.replace(",", " ").split()] or chapters()
    found = []
    for name in names:
        path = notebook_path(name)
        label = os.path.basename(path)[:-3] if os.path.exists(name) else os.path.basename(path)[:2]
        found.append((label, path))
    return found


def main(argv: list[str]) -> int:
    from helpers import dist as book_dist

    try:
        todo = parse_chapters(argv)
        backend = book_dist.backend()
        book_dist.collective_timeout()
    except (BadValue, ValueError) as err:
        print(err, file=sys.stderr)
        return 2
    n_gpus = 0
    if backend == "nccl":
        import torch

        n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n_gpus == 0:
            print("BOOK_BACKEND=nccl: no GPU here (torch.cuda.is_available() is False); run it on a GPU "
                  "machine, or with BOOK_BACKEND=gloo to check its plumbing on the CPU", file=sys.stderr)
            return 2
    log_dir = os.path.join(ROOT, "_build", "gpu_check")
    os.makedirs(log_dir, exist_ok=True)
    where = f"{n_gpus} GPUs" if backend == "nccl" else "the CPU"
    print(f"gpu-check: BOOK_BACKEND={backend}, {len(todo)} chapter{'' if len(todo) == 1 else 's'} on {where}",
          flush=True)
    rows = []
    for chapter, path in todo:
        ranks = ranks_needed(path)
        reason = skip_reason(ranks, backend, n_gpus)
        if reason:
            row = Row(chapter, ranks, "skipped", note=reason)
        else:
            passed, seconds, note = run_one(chapter, path, log_dir)
            row = Row(chapter, ranks, "passed" if passed else "failed", seconds, note)
        rows.append(row)
        print(table([row], backend).splitlines()[1], flush=True)
    print()
    print(table(rows, backend))
    failed = [r.chapter for r in rows if r.result == "failed"]
    skipped = [r.chapter for r in rows if r.result == "skipped"]
    print(f"{len(rows) - len(failed) - len(skipped)} passed, {len(failed)} failed, {len(skipped)} skipped"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
