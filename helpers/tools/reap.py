"""Run a command and end every process it leaves behind: ``python -m helpers.tools.reap -- CMD ...``.

The book's build starts kernels, each kernel starts a controller and engines in their own sessions. If a
kernel is killed, its engines survive it. This wrapper makes itself a child subreaper (Linux
``PR_SET_CHILD_SUBREAPER``), so every orphan of the command is re-parented to it rather than to init; when the
command ends, or the wrapper is interrupted, it ends all remaining descendants, says which (unless it was
interrupted: Ctrl-C leaves a run half done, and the command says ``interrupted``), and exits with the
command's status.

The command also gets a temporary folder of its own (``TMPDIR``), removed when it ends: what third-party code
leaves in the temporary folder (torch's ``torchinductor_*`` cache, torchrun's ``torchelastic_*`` logs,
pytest's ``pytest-of-*``) goes with it. The book's own code removes its temporary files itself; the tests
check that.
"""

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from helpers.tools.janitor import children

PR_SET_CHILD_SUBREAPER = 36


def descendants(pid: int) -> list[int]:
    out = []
    for child in children(pid):
        out.append(child)
        out.extend(descendants(child))
    return out


def describe(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f"{pid} " + f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:120]
    except OSError:
        return str(pid)


def end_descendants(grace_s: float = 3.0, exiting_s: float = 2.0) -> list[str]:
    """SIGTERM every descendant, then SIGKILL what is still there after ``grace_s``.

    Helpers that exit when their parent does (multiprocessing's forkserver and resource tracker see their pipe
    close) get ``exiting_s`` to do so first: they are not "left behind".
    """
    me = os.getpid()
    deadline = time.monotonic() + exiting_s
    while True:
        _reap_zombies()  # orphans that already exited are not "left behind"
        left = descendants(me)
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    ended = [describe(p) for p in left]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in left:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            _reap_zombies()
            left = descendants(me)
            if not left:
                return ended
            time.sleep(0.1)
    _reap_zombies()
    return ended


def _reap_zombies() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        print("usage: python -m helpers.tools.reap -- CMD [ARG ...]", file=sys.stderr)
        return 2
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            print("reap: could not become a subreaper; orphans may survive", file=sys.stderr)
    private_tmp = tempfile.mkdtemp(prefix="book-run-")
    proc = subprocess.Popen(argv, env={**os.environ, "TMPDIR": private_tmp})

    interrupted = []

    def forward(signum, _frame):
        interrupted.append(signum)
        proc.send_signal(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    try:
        status = proc.wait()
        left = end_descendants()
        if left and not interrupted:
            print(f"reap: ended {len(left)} process(es) the command left behind:", file=sys.stderr)
            for line in left:
                print(f"  {line}", file=sys.stderr)
    finally:
        shutil.rmtree(private_tmp, ignore_errors=True)
    return status if status >= 0 else 128 - status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
