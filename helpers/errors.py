"""What a failure shows on the page: its message and the rank that raised it, not a wall of traceback.

A ``%%px`` cell that fails on four ranks would show four full tracebacks, each with the build machine's
absolute paths and the frames of the book's checking code, and the message that matters clipped at the right
edge. With :func:`install` (called by :func:`helpers.ranks.start_ranks` for the notebook's kernel) a failure
reads

    on rank 1: CheckFailed: check 'planted rank mismatch' failed on rank 1: max abs error 1.500e+00 ...
    on ranks 0, 2, 3: RuntimeError: ... Timed out waiting 5000ms ...
        at helpers/parallel/collectives.py:57, in ring_all_reduce

one line per distinct error with the ranks that raised it; for any error but a failed check, the innermost
frame of the book's own code, as a path inside the repository. Errors in the kernel itself show as
``Name: message`` (IPython's ``Minimal`` mode). The build still fails exactly as before, and its log
(``helpers/tools/build.py``) reads the same lines. ``BOOK_FULL_TRACEBACKS=1`` keeps every traceback whole, for
debugging.
"""

from __future__ import annotations

import os
import re

from helpers import ROOT
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_FRAME = re.compile(r"File \"?([^\s\",]+)\"?(?:, line |:)(\d+)(?:,)? in ([\w.<>]+)")


def full_tracebacks() -> bool:
    """True when ``BOOK_FULL_TRACEBACKS=1`` asks for whole tracebacks."""
    return os.environ.get("BOOK_FULL_TRACEBACKS", "") == "1"


def one_line(text) -> str:
    """A message on one line (a collective's timeout spreads over several)."""
    return " ".join(str(text).split())


def innermost_book_frame(traceback_text: str | None) -> str | None:
    """``helpers/x.py:12, in f`` for the last frame of the traceback that lies in the repository, or None."""
    where = None
    for path, line, function in _FRAME.findall(_ANSI.sub("", traceback_text or "")):
        path = os.path.abspath(path)
        if os.path.commonpath([path, ROOT]) == ROOT and "site-packages" not in path:
            where = f"{os.path.relpath(path, ROOT)}:{line}, in {function}"
    return where


def remote_error_lines(error) -> list[str]:
    """The compact rendering of an ipyparallel ``RemoteError`` or ``CompositeError``."""
    errors = getattr(error, "elist", None)
    if errors is None:
        errors = [(error.ename, error.evalue, error.traceback, error.engine_info)]
    grouped: dict[tuple[str, str], tuple[list[int], str]] = {}
    for name, value, traceback, info in errors:
        ranks, _ = grouped.setdefault((name, one_line(value)), ([], traceback))
        ranks.append((info or {}).get("engine_id", -1))  # engine i is rank i (helpers.ranks)
    lines = []
    for (name, value), (ranks, traceback) in grouped.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, sorted(ranks)))
        lines.append(f"on {who}: {name}: {value}")
        where = None if name == "CheckFailed" else innermost_book_frame(traceback)
        if where:
            lines.append(f"    at {where}")
    return lines


def install(shell) -> None:
    """Show failures compactly in this IPython ``shell`` (the notebook's kernel), unless asked not to."""
    if shell is None or full_tracebacks():
        return
    from ipyparallel.error import RemoteError

    RemoteError._render_traceback_ = remote_error_lines
    shell.InteractiveTB.set_mode(mode="Minimal")
