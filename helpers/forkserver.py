"""Engines forked from a process that has imported torch once: ranks start in a fraction of the time.

An ipyparallel engine is a Python process that imports IPython and ipyparallel, and then torch when it
joins the process group: about 3.5 s of one core each, measured here (torch's import alone takes 2.7 s). Four
engines on two cores spend most of a chapter's start importing the same modules four times over. This server
imports them once, then forks one engine per request. The child starts with those modules loaded and with
nothing else: the server runs no user code and creates no thread, event loop or socket besides its own
listener, so the fork copies no lock held by a thread that the child would not have. The child takes the
requester's environment and working directory, and runs the ordinary engine (``ipyparallel.engine.app``).

A server is started by :func:`start` and reached through a Unix socket (a file, not a network listener) in a
folder of the starter's. The book's build and the test suite each start one for their whole run and name it
in ``BOOK_FORKSERVER``; :func:`helpers.ranks.start_ranks` uses that one when it is set and reachable, and
otherwise starts a server of its own for its set of ranks, stopped with them. Helpers' own modules are not
preloaded: a forked engine imports them from disk, so a change to them is always what runs.

The server ends when it is terminated, when the process that started it ends, or when its socket file is
removed; it kills the engines it forked that are still alive as it goes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

ENV = "BOOK_FORKSERVER"
# torch.distributed.tensor and torch._dynamo too: reference.named_params reads DTensors on every rank of ten
# chapters, and a process's first torch.optim optimizer imports torch._dynamo; each import took seconds of a
# loaded machine on every rank (0.9 s and 1.7 s alone, here). Neither starts a thread.
PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor", "torch._dynamo", "numpy",
           "ipyparallel.engine.app")
SOCKET_NAME = "forkserver.sock"
REQUEST = {"argv": list, "env": dict, "cwd": str, "log": str}  # what a request holds, and of which type


def _engine(conn: socket.socket, listener: socket.socket, request: dict) -> None:
    """In the forked child: become an engine, as the request says. Never returns."""
    code = 1
    try:
        conn.close()
        listener.close()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.setsid()  # its own session, as ipyparallel's launcher starts engines
        null = os.open(os.devnull, os.O_RDONLY)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        from ipyparallel.engine.app import main

        sys.argv = ["ipengine", *request["argv"]]
        main(request["argv"])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def serve(path: str) -> None:
    """Preload, listen on ``path`` and fork an engine for each request, until told to stop."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    parent, children = os.getppid(), set()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".new")
    listener.listen(16)
    os.rename(path + ".new", path)  # the socket appears only once it accepts requests
    listener.settimeout(0.2)

    def stop(*_):
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    while os.getppid() == parent and os.path.exists(path):
        for pid in list(children):  # reap the engines that have ended
            try:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    children.discard(pid)
            except ChildProcessError:
                children.discard(pid)
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        with conn:
            try:
                conn.settimeout(10)
                data = _read(conn)
                if not data:  # a probe (reachable) sends nothing
                    continue
                try:
                    request = json.loads(data)
                    missing = [k for k, kind in REQUEST.items() if not isinstance(request.get(k), kind)]
                    if missing:
                        raise ValueError(f"a request needs {', '.join(missing)}")
                    pid = os.fork()
                    if pid == 0:
                        _engine(conn, listener, request)
                    children.add(pid)
                    answer = {"pid": pid}
                except Exception as e:  # a bad request is answered, and the server goes on
                    answer = {"error": f"{type(e).__name__}: {e}"}
                conn.sendall(json.dumps(answer).encode())
            except OSError:  # the requester went away
                pass
    stop()


def _read(conn: socket.socket) -> bytes:
    chunks = []
    while chunk := conn.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def spawn(path: str, argv: list[str], env: dict[str, str], cwd: str, log: str, timeout_s: float = 30) -> int:
    """Ask the server at ``path`` for an engine; its process id."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout_s)
        conn.connect(path)
        conn.sendall(json.dumps({"argv": argv, "env": env, "cwd": cwd, "log": log}).encode())
        conn.shutdown(socket.SHUT_WR)
        answer = json.loads(_read(conn))
    if "error" in answer:
        raise RuntimeError(f"the fork server could not start an engine: {answer['error']}")
    return answer["pid"]


def reachable(path: str | None) -> bool:
    """Whether a server answers at ``path``."""
    if not path or not os.path.exists(path):
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(1)
            conn.connect(path)
        return True
    except OSError:
        return False


class Server:
    """A running server: ``path`` is its socket, ``process`` the server; ``stop()`` ends both."""

    def __init__(self, folder: str | None = None):
        self._own_folder = folder is None
        self.folder = tempfile.mkdtemp(prefix="book-forkserver-") if folder is None else folder
        self.path = os.path.join(self.folder, SOCKET_NAME)
        self.process = subprocess.Popen([sys.executable, "-m", "helpers.forkserver", self.path],
                                        stdin=subprocess.DEVNULL, start_new_session=True)

    def wait(self, timeout_s: float = 60) -> "Server":
        """Return once the server accepts requests (it imports torch first)."""
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(self.path):
            if self.process.poll() is not None:
                raise RuntimeError(f"the fork server exited with status {self.process.returncode} before "
                                   f"it was ready")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"the fork server was not ready within {timeout_s:.0f} s")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._own_folder:
            import shutil

            shutil.rmtree(self.folder, ignore_errors=True)


def start(folder: str | None = None) -> Server:
    """Start a server (in ``folder``, or a temporary folder it removes when stopped); it is ready when
    ``.wait()`` returns."""
    return Server(folder)


if __name__ == "__main__":
    serve(sys.argv[1])
