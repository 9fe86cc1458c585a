"""Build a book with jupyter-book, its log ending with what failed: ``python -m helpers.tools.build [DIR]``.


jupyter-book prints a failing cell's traceback in the middle of a long log and ends it with "Look above for
the cause". This wrapper streams the log unchanged, and when the build fails it repeats, as the last lines,
each notebook that failed and the errors raised in it (a ``CheckFailed`` with its numbers, a rank's exception,
a timeout), and every Sphinx warning (``-W`` turns them into errors).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

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


def main(argv: list[str]) -> int:
    source = argv[0] if argv else "."
    jupyter_book = os.path.join(os.path.dirname(sys.executable), "jupyter-book")
    cmd = [jupyter_book, "build", source, *JB_FLAGS, *argv[1:]]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    lines = []
    for line in proc.stdout:
        sys.stdout.write(line)
        lines.append(line)
    status = proc.wait()
    elapsed = time.monotonic() - started
    if status != 0:
        print(f"\n==== the book build failed (exit status {status}, {elapsed:.0f} s) ====")
        for line in summarize("".join(lines)) or ["(no error line found: read the log above)"]:
            print(line)
    else:
        print(f"book built in {elapsed:.0f} s")
    for line in lines:  # each notebook's execution time, as myst-nb logged it
        if timed := EXECUTED.match(ANSI.sub("", line)):
            print(f"  {float(timed.group(2)):6.1f} s  {os.path.relpath(timed.group(1))}")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
