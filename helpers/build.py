"""Build a book with jupyter-book and end the log with what went wrong: ``python -m helpers.build [DIR]``.

jupyter-book prints a failing cell's traceback in the middle of a long log and ends it with "Look above for the
cause". This wrapper streams the log unchanged, and when the build fails it repeats, as the last lines, each
notebook that failed and the errors raised in it (a ``CheckFailed`` with its numbers, a rank's exception, a
timeout), and every Sphinx warning (``-W`` turns them into errors).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
GENERIC = ("ExecutionError", "CellExecutionError", "RuntimeError: ", "SphinxError", "Exception occurred")
ERROR_LINE = re.compile(r"^(?:\[\d+:\w+\]\s*)?[A-Za-z_.]*(?:Error|Failed|Exception|Timeout\w*)\b:?.*")


def summarize(log: str) -> list[str]:
    """The lines worth repeating at the end of a failed build's log."""
    failed, errors, warnings = [], [], []
    for line in (ANSI.sub("", raw).rstrip() for raw in log.splitlines()):
        if line.startswith("myst_nb.core.execute.base.ExecutionError: "):
            failed.append(line.split(": ", 1)[1])
        elif re.search(r"(WARNING|ERROR):", line) and "Kernel is running over TCP" not in line:
            warnings.append(line)
        elif ERROR_LINE.match(line) and not line.startswith(GENERIC) and not line.startswith(" "):
            errors.append(line)
    out = []
    for path in dict.fromkeys(failed):
        out.append(f"notebook failed: {path}")
    out += [f"  {e}" for e in dict.fromkeys(errors)]
    out += [f"warning: {w}" for w in dict.fromkeys(warnings)]
    return out


def main(argv: list[str]) -> int:
    source = argv[0] if argv else "."
    jupyter_book = os.path.join(os.path.dirname(sys.executable), "jupyter-book")
    cmd = [jupyter_book, "build", source, "-W", "-n", "--keep-going", *argv[1:]]
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
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
