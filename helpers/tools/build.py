"""Build a book with jupyter-book, its log ending with what failed: ``python -m helpers.tools.build [DIR]``.


jupyter-book prints a failing cell's traceback in the middle of a long log and ends it with "Look above for
the cause". This wrapper streams the log unchanged, and when the build fails it repeats, as the last lines,
each notebook that failed and the errors raised in it (a ``CheckFailed`` with its numbers, a rank's exception,
a timeout), and every Sphinx warning (``-W`` turns them into errors).

The engines of every notebook are forked from one server started for the whole build, or the caller's
(:mod:`helpers.forkserver`), so torch is imported once per build rather than once per rank. The build ends
with where each notebook's time went: its kernel's start, starting ranks, cells on the ranks (``%%px``),
cells that draw, and the rest (single-process runs, calculators, checks), from an IPython start-up file that
times every cell in the build's own IPython folder (``IPYTHONDIR``, temporary, removed at the end).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

from helpers import forkserver

JB_FLAGS = ("-W", "-n", "--keep-going")  # warnings (a failed notebook among them) are errors; report them all
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
NOISE = re.compile(r"Traceback \(most recent call last\)|^nbclient\.exceptions\.CellExecutionError|"
                   r"^myst_nb\.core\.execute|^RuntimeError:\s*$|^SphinxError|^Exception occurred")
EXECUTING = re.compile(r"^(\S+\.(?:md|ipynb)): Executing notebook using")
FAILED = re.compile(r"^(\S+\.(?:md|ipynb)): WARNING: Executing notebook failed")
SAVED = re.compile(r"^(\S+\.(?:md|ipynb)): WARNING: Notebook exception traceback saved")
EXECUTED = re.compile(r"^(\S+\.(?:md|ipynb)): Executed notebook in ([0-9.]+) seconds")
RANK_HEADER = re.compile(r"^\[(\d+):(?:execute|apply)\]:?\s*$")
ON_RANKS = re.compile(r"^on (ranks? [\d, ]+): (.+)")  # helpers.errors' compact form of a rank's error
ERROR_LINE = re.compile(r"^(?:\[\d+:\w+\]\s*)?[A-Za-z_.]*(?:Error|Failed|Exception|Timeout\w*)\b:?.*")


def summarize(log: str) -> list[str]:
    """The lines worth repeating at the end of a failed build's log, each error with its notebook and rank."""
    errors, warnings = [], []
    # myst-nb logs "X: Executing notebook" as it starts each one, but a failed notebook's traceback only
    # later, after "X: WARNING: Executing notebook failed" and before "X: WARNING: Notebook exception
    # traceback saved". An error outside such a block (a dead kernel stops the build at once) belongs to the
    # last one started.
    started, notebook, rank = "?", "?", None
    for line in (ANSI.sub("", raw).rstrip() for raw in log.splitlines()):
        if executing := EXECUTING.match(line):
            started = notebook = os.path.relpath(executing.group(1))
            rank = None
        elif failed := FAILED.match(line):
            notebook, rank = os.path.relpath(failed.group(1)), None
            warnings.append(line)
        elif SAVED.match(line):
            notebook, rank = started, None
            warnings.append(line)
        elif header := RANK_HEADER.match(line):
            rank = header.group(1)
        elif on_ranks := ON_RANKS.match(line):
            errors.append(f"{notebook}: on {on_ranks.group(1)}: {on_ranks.group(2)}")
        elif re.search(r"(WARNING|ERROR):", line) and "Kernel is running over TCP" not in line:
            warnings.append(line)
        elif ERROR_LINE.match(line) and not NOISE.search(line):
            errors.append(f"{notebook}: " + (f"on rank {rank}: {line}" if rank is not None else line))
            rank = None
    out = [f"  {e}" for e in dict.fromkeys(errors)]
    out += [f"warning: {w}" for w in dict.fromkeys(warnings)]
    return out


# Runs in every kernel of the build: one line per cell, appended to a file of that kernel's own.
CELL_TIMER = """
def _book_cell_times():  # a function, so that nothing is left in the notebook's namespace
    import json, os, re, time

    name = f"{os.getppid()}-{time.time_ns():020d}-{os.getpid()}.jsonl"  # by parent, then by start
    path = os.path.join(os.environ["BOOK_CELL_TIMES"], name)
    started = []

    def kind(source):
        if "start_ranks(" in source:
            return "start ranks"
        if source.lstrip().startswith("%%px"):
            return "on ranks"
        if re.search(r"\\bplt\\.|\\.subplots\\(|savefig|\\bfig\\b", source):
            return "figures"
        return "single process"

    def post(result):
        seconds = time.monotonic() - started.pop()
        if started:  # a cell run inside another (%%px --local runs its body so): the outer one counts
            return
        with open(path, "a") as f:
            f.write(json.dumps([kind(result.info.raw_cell or ""), seconds]) + "\\n")

    get_ipython().events.register("pre_run_cell", lambda info: started.append(time.monotonic()))
    get_ipython().events.register("post_run_cell", post)


_book_cell_times()
del _book_cell_times
"""
KINDS = ("start ranks", "on ranks", "single process", "figures")


def breakdown(lines: list[str], stamps: list[float], times_dir: str, builder: int) -> list[str]:
    """Each executed notebook's seconds, from the log's "Executing" line to its "Executed" line as this
    process read them (jupyter-book runs unbuffered), split by kind of cell; the rest is its kernel's start
    and stop.

    The notebooks' kernels are the children of the ``builder`` process (a kernel a notebook starts itself is
    not), and they run one after the other: the n-th one started is the n-th notebook executed.
    """
    executed, started = [], {}
    for line, stamp in zip(lines, stamps):
        line = ANSI.sub("", line)
        if m := EXECUTING.match(line):
            started[m.group(1)] = stamp
        elif (m := EXECUTED.match(line)) and m.group(1) in started:
            executed.append((os.path.relpath(m.group(1)), stamp - started[m.group(1)]))
    kernels = sorted(f for f in os.listdir(times_dir) if f.startswith(f"{builder}-"))
    out = [f"  {'seconds':>7}  {'kernel':>6}  " + "  ".join(f"{k:>14}" for k in KINDS) + "  notebook"]
    for i, (notebook, total) in enumerate(executed):
        by_kind = dict.fromkeys(KINDS, 0.0)
        if i < len(kernels):
            with open(os.path.join(times_dir, kernels[i])) as f:
                for kind, seconds in map(json.loads, f):
                    by_kind[kind] += seconds
        rest = total - sum(by_kind.values())
        out.append(f"  {total:7.1f}  {rest:6.1f}  " + "  ".join(f"{by_kind[k]:14.1f}" for k in KINDS)
                   + f"  {notebook}")
    out.append(f"  {sum(s for _, s in executed):7.1f}  in all")
    return out


def main(argv: list[str]) -> int:
    source = argv[0] if argv else "."
    jupyter_book = os.path.join(os.path.dirname(sys.executable), "jupyter-book")
    cmd = [jupyter_book, "build", source, *JB_FLAGS, *argv[1:]]
    started = time.monotonic()
    work = tempfile.mkdtemp(prefix="book-build-")
    try:
        startup = os.path.join(work, "ipython", "profile_default", "startup")
        os.makedirs(startup)
        with open(os.path.join(startup, "00-book-cell-times.py"), "w") as f:
            f.write(CELL_TIMER)
        os.makedirs(os.path.join(work, "times"))
        # a server already shared by the caller (a test session building a book) serves this build too
        shared = os.environ.get(forkserver.ENV)
        server = None if forkserver.reachable(shared) else forkserver.start(work).wait()
        path = shared if server is None else server.path
        env = {**os.environ, "PYTHONUNBUFFERED": "1", forkserver.ENV: path,
               "IPYTHONDIR": os.path.join(work, "ipython"), "BOOK_CELL_TIMES": os.path.join(work, "times")}
        try:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    bufsize=1, env=env)
            lines, stamps = [], []
            for line in proc.stdout:
                sys.stdout.write(line)
                lines.append(line)
                stamps.append(time.monotonic())
            status = proc.wait()
        finally:
            if server is not None:
                server.stop()
        table = breakdown(lines, stamps, os.path.join(work, "times"), proc.pid)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    elapsed = time.monotonic() - started
    if status != 0:
        print(f"\n==== the book build failed (exit status {status}, {elapsed:.0f} s) ====")
        for line in summarize("".join(lines)) or ["(no error line found: read the log above)"]:
            print(line)
    else:
        print(f"book built in {elapsed:.0f} s")
    print("where the notebooks' time went (the rest of the build is Sphinx's):")
    print("\n".join(table))
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
