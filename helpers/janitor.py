"""Kill a notebook's engines and controller when the notebook's kernel dies.

``python -m helpers.janitor [--remove DIR] KERNEL_PID PID...`` polls twice a second. If the kernel is
gone (killed, or restarted from JupyterLab, so its atexit handlers never ran) it kills the other PIDs and
their children, removes ``DIR`` (the ranks' rendezvous folder, which the kernel would have removed) and exits;
if the other PIDs are all gone first (the kernel stopped them), it just exits.

:func:`helpers.ranks.start_ranks` starts it beside the engines, from a notebook's kernel: it is harness, not a
``make`` tool. The reaper (:mod:`helpers.tools.reap`) uses its :func:`children`.
"""

import os
import shutil
import signal
import sys
import time


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux /proc; an empty list elsewhere)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def kill_tree(pid: int) -> None:
    for child in children(pid):
        kill_tree(child)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def main(argv: list[str]) -> int:
    remove = None
    if argv[:1] == ["--remove"]:
        remove, argv = argv[1], argv[2:]
    kernel, targets = int(argv[0]), [int(p) for p in argv[1:]]
    while True:
        targets = [p for p in targets if alive(p)]
        kernel_alive = alive(kernel)
        if not kernel_alive:
            for pid in targets:
                kill_tree(pid)
        if not kernel_alive or not targets:
            if not kernel_alive and remove is not None:
                shutil.rmtree(remove, ignore_errors=True)
            return 0
        time.sleep(0.5)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
