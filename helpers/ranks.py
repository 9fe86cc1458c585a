"""Ranks in a notebook: N ipyparallel engines, each one rank of one ``torch.distributed`` process group.

``ranks = start_ranks(4)`` starts a controller (listening on 127.0.0.1 only, on ports below the range the
system assigns by itself: see :mod:`helpers.controller`) and four engines, joins them into
one process group through a rendezvous file, and makes them the target of ``%%px``. The view behind ``%%px``
is *blocking*: a cell waits for every rank, and an exception on any rank is raised in the notebook (a
non-blocking view would print it and carry on, and a failed check would not fail the build).

Three things make sure no engine outlives the notebook:

- the collective timeout (see :mod:`helpers.dist`) is shorter than a cell's timeout, so a rank stuck in a
  collective raises instead of hanging the cell;
- ``ranks.stop()`` runs when the kernel exits (atexit), and when ``start_ranks`` is called again;
- a small janitor process (:mod:`helpers.janitor`) kills the engines and the controller if the kernel
  dies without running atexit (killed, or restarted from JupyterLab).

Two things go wrong while a cell runs, and each ends the cell within seconds:

- the stop button: ``%%px`` asks each engine's nanny to signal its engine, and these engines run without one
  (a process per engine, seconds of every start on two cores). The ranks signal their engines' processes
  themselves (:meth:`Ranks.interrupt`); ranks still busy after ``INTERRUPT_GRACE_S`` (inside a collective,
  where Python sees no signal until it returns) are restarted, and the cell says which way it went;
- a rank that dies (killed, out of memory): a thread watches the engines' processes and fails the cell at
  once, naming the rank, instead of after the controller's 30 s heartbeat and a collective's timeout.

Nothing else outlives it either: the rendezvous file and the IPython profile the controller and engines write
into (connection files, logs, the engine-state file) live in one temporary folder per set of ranks, and
whoever ends the ranks (``stop``, a failed start, or the janitor) removes that folder.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from helpers import ROOT
from helpers import dist as book_dist
from helpers import errors as book_errors
from helpers import controller, forkserver

_current: "Ranks | None" = None
REGISTRATION_TIMEOUT_S = 60  # how long an engine waits for the controller to register it (see start_ranks)
INTERRUPT_GRACE_S = 3.0  # how long interrupted ranks get to stop before they are restarted


class Interrupted(Exception):
    """A cell on the ranks stopped by an interrupt (the stop button)."""


class Ranks:
    """A running set of ranks: the engines in rank order, and ways to talk to them from the kernel."""

    def __init__(self, cluster, client, world_size: int, run_dir: str, janitor: subprocess.Popen,
                 server: "forkserver.Server | None" = None):
        self.cluster = cluster
        self._server = server  # these ranks' own fork server, if they have one
        self.client = client
        self.world_size = world_size
        self.backend = book_dist.backend()
        self.run_dir = run_dir  # the rendezvous file and the cluster's IPython profile; removed by stop()
        self._janitor = janitor
        self.view = client[list(range(world_size))]  # engine id i is rank i (see start_ranks)
        self.view.block = True
        self.pids = self.view.apply_sync(os.getpid)
        self._kernel_threads = None  # the kernel's torch threads before these ranks took the cores
        self.timeout_s = book_dist.collective_timeout()  # start_ranks sets the one it used
        self.dead: dict[int, int] = {}  # rank -> pid of an engine that died
        # ipyparallel asks a nanny to signal an engine (%%px on an interrupt); these engines have none
        client.send_signal = self.interrupt
        self._watching = threading.Event()
        threading.Thread(target=book_errors.watch_engines, args=(self._watching, client, list(self.pids),
                                                                 self.dead), daemon=True).start()

    def _busy(self) -> list[int]:
        """The ranks with a task running (or queued)."""
        uuids = {uuid: rank for rank, uuid in self.client._engines.items()}
        return sorted(rank for uuid, tasks in list(self.client._outstanding_dict.items())
                      if (rank := uuids.get(uuid)) is not None and tasks)

    def interrupt(self, sig="SIGINT", targets=None, block=None) -> None:
        """Send ``sig`` to the ranks' engines and wait ``INTERRUPT_GRACE_S`` for their cell to stop; restart
        the ranks if some did not. Raises :class:`Interrupted`, saying which it was (``%%px`` calls this on
        an interrupt, in place of the client's ``send_signal``)."""
        sig = getattr(signal, sig) if isinstance(sig, str) else sig
        ranks = range(self.world_size) if targets is None or targets == "all" else \
            [targets] if isinstance(targets, int) else list(targets)
        for rank in ranks:
            try:
                os.kill(self.pids[rank], sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + INTERRUPT_GRACE_S
        while (busy := self._busy()) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not busy:
            raise Interrupted("the ranks stopped the cell; they keep what ran before the interrupt")
        message = (f"{_ranks_word(busy)} still busy {INTERRUPT_GRACE_S:.0f} s after the interrupt (inside a "
                   f"collective): the ranks were restarted, empty; run the cells after start_ranks again")
        for rank in busy:  # the cell's result is complete, for %%px to show what the ranks printed
            book_errors.fail_tasks(self.client, rank, Interrupted(message))
        while self._busy() and time.monotonic() < deadline + 5:
            time.sleep(0.05)
        self.restart()
        raise Interrupted(message)

    def restart(self) -> None:
        """Stop these ranks and start as many again, in place: ``ranks`` and ``%%px`` mean the new ones."""
        global _current
        active = _current is self
        self.stop()
        fresh = start_ranks(self.world_size, timeout_s=self.timeout_s, activate=active)
        self.__dict__.update(fresh.__dict__)
        fresh.cluster = None  # the ranks are self's now: stopping the husk must not stop them
        self.client.send_signal = self.interrupt
        _current = self

    def share_cores(self, threads: int) -> None:
        """The kernel runs its single-process references beside the ranks: give it ``threads`` torch threads,
        as each engine has, until :meth:`stop`. With more, its OpenMP threads wait for each other by spinning
        on cores the engines need, and a small reference runs many times slower beside busy ranks."""
        import torch

        self._kernel_threads = torch.get_num_threads()
        torch.set_num_threads(threads)

    def pull(self, name: str) -> list:
        """The value of ``name`` on every rank, as a list indexed by rank."""
        return self.view.pull(name, block=True)

    def push(self, **values) -> None:
        """Set the same variables on every rank."""
        self.view.push(values, block=True)

    def apply(self, fn, *args, **kwargs) -> list:
        """Call ``fn`` on every rank; the results as a list indexed by rank."""
        return self.view.apply_sync(fn, *args, **kwargs)

    def connections(self) -> list[tuple[int, int, int]]:
        """Measured TCP connections among the kernel, the controller and the engines.

        A list of ``(pid_a, pid_b, count)``: ``count`` established connections between the two processes
        (the controller's worker processes are counted as the controller).
        """
        import psutil

        controller = self.cluster.controller.process.pid
        owner = {os.getpid(): os.getpid(), controller: controller}
        for child in psutil.Process(controller).children(recursive=True):
            owner[child.pid] = controller
        owner.update({pid: pid for pid in self.pids})
        by_address, links = {}, []
        for pid in owner:
            for conn in psutil.Process(pid).net_connections(kind="tcp"):
                if conn.status == psutil.CONN_ESTABLISHED:
                    by_address[tuple(conn.laddr)] = owner[pid]
                    links.append((owner[pid], tuple(conn.raddr)))
        counts: dict[tuple[int, int], int] = {}
        for pid, remote in links:
            peer = by_address.get(remote)
            if peer is not None and peer != pid:
                key = (min(pid, peer), max(pid, peer))
                counts[key] = counts.get(key, 0) + 1
        # each connection was seen from both ends
        return [(a, b, n // 2) for (a, b), n in sorted(counts.items())]

    def stop(self) -> None:
        """Stop the engines and the controller; safe to call twice."""
        global _current
        if self.cluster is None:
            return
        cluster, self.cluster = self.cluster, None
        self._watching.set()
        # Kill the engines outright: one may be stuck in a collective, and an engine asked to stop with
        # SIGTERM takes the launcher's full 5 s grace period.
        _kill(self.pids)
        try:
            self.client.close()
        finally:
            try:
                if cluster is not None:
                    cluster.stop_cluster_sync()
            finally:
                if self._server is not None:
                    self._server.stop()
                self._janitor.terminate()
                self._janitor.wait()
                shutil.rmtree(self.run_dir, ignore_errors=True)
                if self._kernel_threads is not None:
                    import torch

                    torch.set_num_threads(self._kernel_threads)
                if _current is self:
                    _current = None

    def __repr__(self) -> str:
        state = "running" if self.cluster is not None else "stopped"
        return f"<Ranks world_size={self.world_size} backend={self.backend} {state}>"


def _ranks_word(ranks: list[int]) -> str:
    return f"rank {ranks[0]} was" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))} were"


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _join(rank: int, world_size: int, store_file: str, timeout_s: float, workdir: str, threads: int) -> int:
    """Runs on each engine: become rank ``rank`` of the process group."""
    import os

    import torch

    os.chdir(workdir)
    torch.set_num_threads(threads)  # N engines share the cores; more threads would only contend
    from helpers import dist as book_dist

    book_dist.init_process_group(rank=rank, world_size=world_size, store_file=store_file,
                                 timeout_s=timeout_s)
    return os.getpid()


def start_ranks(world_size: int = 4, *, timeout_s: float | None = None, activate: bool = True) -> Ranks:
    """Start ``world_size`` ranks and make them the target of ``%%px``.

    ``timeout_s`` is the collective timeout (default ``BOOK_COLLECTIVE_TIMEOUT``, 60 s).
    """
    global _current
    from helpers import exercises  # noqa: F401  (registers the %%solution magic of the exercises' solutions)

    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if book_dist.backend() == "nccl":
        import torch

        if torch.cuda.device_count() < world_size:
            raise ValueError(f"BOOK_BACKEND=nccl puts one rank on each GPU: {world_size} ranks need "
                             f"{world_size} GPUs, this machine has {torch.cuda.device_count()}")
    if _current is not None:
        _current.stop()
    timeout_s = book_dist.collective_timeout() if timeout_s is None else timeout_s

    run_dir = tempfile.mkdtemp(prefix="book-rendezvous-")
    store_file = os.path.join(run_dir, "store")
    # Engines are forked from a process that has imported torch (helpers.forkserver): the build's and the
    # tests' shared one when there is one, else one of these ranks' own, started now so that its imports
    # overlap the controller's start.
    shared = os.environ.get(forkserver.ENV)
    server = None if forkserver.reachable(shared) else forkserver.start(run_dir)
    janitor = None
    ranks = None
    engine_pids: list[int] = []
    cluster = None
    try:
        path = None
        # At most twice: a start whose controller never pings its engines (controller.wait_for_engines) is
        # retried once on a fresh controller with other ports; any other failure is reported at once.
        for attempt in (1, 2):
            cluster = controller.new_cluster(run_dir)
            cluster.start_controller_sync()
            path = path or (shared if server is None else server.wait().path)
            controller.wait_for_connection_file(cluster, timeout_s=REGISTRATION_TIMEOUT_S)
            # No nanny process per engine: it costs a few seconds of start-up on two cores, and the engines
            # are stopped by signal (stop, janitor) rather than through it. An engine gives up on a controller
            # that has not answered its registration within IPEngine.timeout, 5 s by default: two notebooks
            # starting 8 ranks each beside the unit tests once left one engine unregistered that way. It may
            # wait 60 s, still inside the 120 s this function waits for all of them.
            env = {**os.environ, "IPP_PROFILE_DIR": cluster.profile_dir, "IPP_CLUSTER_ID": cluster.cluster_id}
            engine_args = ["--IPEngine.enable_nanny=False", f"--IPEngine.timeout={REGISTRATION_TIMEOUT_S}"]
            engine_pids = [forkserver.spawn(path, engine_args, env, os.getcwd(),
                                            os.path.join(run_dir, f"engine-{i}.log"))
                           for i in range(world_size)]
            controller_pid = cluster.controller.process.pid
            janitor = subprocess.Popen(
                [sys.executable, "-m", "helpers.janitor", "--remove", run_dir, str(os.getpid()),
                 str(controller_pid), *map(str, engine_pids), *([str(server.process.pid)] if server else [])],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True,
                cwd=ROOT,
            )
            client = cluster.connect_client_sync()
            unpinged = controller.wait_for_engines(client, run_dir, world_size, timeout_s=120)
            if unpinged is None:
                break
            if attempt == 2:
                raise TimeoutError(f"{unpinged}, twice (each time on a fresh controller)")
            client.close()
            _kill(engine_pids)
            engine_pids = []
            for i in range(world_size):  # the logs are appended to: the next engines' must start empty
                os.remove(os.path.join(run_dir, f"engine-{i}.log"))
            janitor.terminate()
            janitor.wait()
            janitor = None
            cluster.stop_cluster_sync()
        if sorted(client.ids) != list(range(world_size)):
            raise RuntimeError(f"expected engine ids 0..{world_size - 1}, got {client.ids}")
        workdir = os.getcwd()
        threads = max(1, (os.cpu_count() or 1) // world_size)
        # All ranks must join at once: launch every join, then wait for all of them.
        pending = [client[rank].apply_async(_join, rank, world_size, store_file, timeout_s, workdir,
                                             threads)
                   for rank in range(world_size)]
        deadline = time.monotonic() + timeout_s + 30
        for result in pending:
            result.get(timeout=max(1.0, deadline - time.monotonic()))
        ranks = Ranks(cluster, client, world_size, run_dir, janitor, server)
        ranks.timeout_s = timeout_s
        ranks.share_cores(threads)
    finally:
        if ranks is None:
            _kill(engine_pids)
            if janitor is not None:
                janitor.terminate()
                janitor.wait()
            try:
                if cluster is not None:
                    cluster.stop_cluster_sync()
            finally:
                if server is not None:
                    server.stop()
                shutil.rmtree(run_dir, ignore_errors=True)
    _current = ranks
    if activate:
        ranks.view.activate()
        from IPython import get_ipython

        shell = get_ipython()
        if shell is not None:
            # Output grouped by rank, in rank order, once every rank is done: the same page on every build.
            shell.run_line_magic("pxconfig", "--no-stream --progress-after -1")
            book_errors.install(shell)  # a failure shows its message and its rank, not four tracebacks
            # An interrupt that %%px does not catch (of a %%px --local cell's local run, or of ranks.apply):
            # the ranks stop too, else the cell would wait for them to end their part by themselves.
            shell.set_custom_exc((KeyboardInterrupt,), _interrupt_ranks_too)
    return ranks


def _interrupt_ranks_too(shell, etype, value, tb, tb_offset=None):
    shell.showtraceback((etype, value, tb), tb_offset=tb_offset)
    if _current is not None and _current.cluster is not None and _current._busy():
        try:
            _current.interrupt()
        except Interrupted as e:
            print(f"Interrupted: {e}", file=sys.stderr)


@atexit.register
def _stop_at_exit() -> None:
    if _current is not None:
        _current.stop()
