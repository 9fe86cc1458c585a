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

A rank that dies reaches the page at once and by name: :func:`watch_engines` (a thread of
:class:`helpers.ranks.Ranks`) sees its engine's process end and fails the cell's tasks on it with "rank 1
died", where ipyparallel would say "Engine 1 died" only once the controller's heartbeat gave it up (30 s), and
without the rank.
"""

from __future__ import annotations

import os
import re
import signal
import threading

from helpers import ROOT
from helpers.tools.janitor import alive

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
        rank = (info or {}).get("engine_id")  # engine i is rank i (helpers.ranks)
        died = re.match(r"Engine (\d+) died", str(value))  # ipyparallel's own notice has no engine_info
        ranks.append(rank if rank is not None else int(died.group(1)) if died else None)
    lines = []
    for (name, value), (ranks, traceback) in grouped.items():
        known = sorted(r for r in ranks if r is not None)
        who = "an unknown rank" if not known else f"rank {known[0]}" if len(known) == 1 else \
            "ranks " + ", ".join(map(str, known))
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


def fail_tasks(client, rank: int, exception: Exception) -> None:
    """End every task of ``rank`` that ``client`` still waits for with ``exception``, as if the rank had
    raised it (ipyparallel does so for an engine its controller gives up on, but without the rank)."""
    from ipyparallel import error

    try:
        raise exception
    except Exception:
        content = error.wrap_exception({"engine_id": rank, "method": "execute"})

    def fail():
        uuid = client._engines.get(rank)
        for msg_id in list(client._outstanding_dict.get(uuid, ())):
            if msg_id not in client.results:
                msg = client.session.msg("apply_reply", content=content)
                msg["parent_header"]["msg_id"] = msg_id
                msg["metadata"]["engine"] = uuid
                client._handle_apply_reply(msg)
                output = client._output_futures.get(msg_id)  # nor will its output come
                if output is not None and not output.done():
                    output.set_result(None)

    try:
        client._io_loop.add_callback(fail)
    except RuntimeError:  # the client is closed (its loop with it): nobody waits for these tasks
        pass


def watch_engines(stopped: threading.Event, client, pids: list[int], dead: dict[int, int]) -> None:
    """Until ``stopped``: when the engine of rank r (process ``pids[r]``) ends, record it in ``dead``,
    interrupt the other ranks (a cell would wait for them, and they for the dead rank's collectives), and fail
    every task of rank r, then and later."""
    from ipyparallel import error

    while not stopped.wait(0.2):
        for rank, pid in enumerate(pids):
            if rank not in dead:
                if alive(pid):
                    continue
                if stopped.is_set():  # the ranks are being stopped: their engines die on purpose
                    return
                dead[rank] = pid
                for other in set(pids) - {pid}:
                    try:
                        os.kill(other, signal.SIGINT)
                    except ProcessLookupError:
                        pass
            fail_tasks(client, rank, error.EngineError(
                f"rank {rank} died: its engine (pid {pid}) ended while the ranks ran; the process group is "
                f"broken, start the ranks again"))
