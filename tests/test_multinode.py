"""Beyond one machine: chapter 00 as two "nodes" of two ranks each, two torchrun launches meeting at a c10d
rendezvous on 127.0.0.1, as two machines of a cluster would (README, "Running on a real cluster").
``test_multinode_capstone.py`` runs chapter 15 the same way, as two nodes of 8 ranks.

Both launches run as `make torchrun` runs one: under the reaper, through helpers.tools.px_script. While
they run, the test lists every socket their processes listen on; each must be on 127.0.0.1, and the rendezvous
store must be among them, on the endpoint.
"""

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil

from test_ranks import book_processes, wait_until_gone

from helpers import ROOT

CHAPTER = "00"
NNODES, NPROC = 2, 2
TIMEOUT_S = 240
PX_SCRIPT = [sys.executable, "-m", "helpers.tools.reap", "--",  # as `make torchrun` runs it
             sys.executable, "-m", "helpers.tools.px_script"]


def free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: list[str], tmpdir: str, chapter: str = CHAPTER) -> subprocess.Popen:
    cmd = [*PX_SCRIPT, chapter, *args]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, TMPDIR=tmpdir), start_new_session=True)


class ListenerWatch(threading.Thread):
    """Every listening TCP socket of the given processes and their descendants, polled until stopped."""

    def __init__(self, pids: list[int]):
        super().__init__(daemon=True)
        self.pids, self.seen, self.done = pids, set(), threading.Event()

    def run(self):
        while not self.done.is_set():
            for root in self.pids:
                try:
                    procs = [psutil.Process(root)] + psutil.Process(root).children(recursive=True)
                except psutil.Error:
                    continue
                for proc in procs:
                    try:
                        for c in proc.net_connections(kind="inet"):
                            if c.status == psutil.CONN_LISTEN:
                                self.seen.add((c.laddr.ip, c.laddr.port, " ".join(proc.cmdline()[:4])))
                    except psutil.Error:
                        pass
            time.sleep(0.1)


def run_nodes(args_of_node: list[list[str]], tmpdir: str, chapter: str = CHAPTER,
              timeout_s: float = TIMEOUT_S):
    procs = [launch(args, tmpdir, chapter) for args in args_of_node]
    watch = ListenerWatch([p.pid for p in procs])
    watch.start()
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout_s))
    finally:
        watch.done.set()
        watch.join()
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return procs, outs, watch.seen


def rank_summaries(stdout: str) -> dict[int, str]:
    found = re.finditer(r"^rank (\d+): \d+ checks passed$", stdout, re.M)
    return {int(m.group(1)): m.group(0) for m in found}


def test_a_chapter_runs_as_two_nodes_on_loopback(tmp_path):
    assert not book_processes(), "processes from an earlier run are still alive"
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    port = free_loopback_port()
    endpoint = f"127.0.0.1:{port}"
    node_args = [["--nproc", str(NPROC), "--nnodes", str(NNODES), "--node-rank", str(n),
                  "--rdzv-endpoint", endpoint, "--rdzv-id", f"test-{port}"] for n in range(NNODES)]
    started = time.monotonic()
    procs, outs, listening = run_nodes(node_args, str(tmpdir))
    print(f"two nodes: {time.monotonic() - started:.1f} s; listeners {sorted(listening)}")
    for n, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"node {n} exited {p.returncode}:\n{out[-3000:]}\n{err[-3000:]}"

    # One world of NNODES * NPROC ranks, NPROC of them started by each launch.
    world = NNODES * NPROC
    per_node = [rank_summaries(out) for out, _ in outs]
    assert [len(s) for s in per_node] == [NPROC] * NNODES, per_node
    assert sorted(r for s in per_node for r in s) == list(range(world)), per_node
    for out, _ in outs:
        assert re.search(rf"^rank \d+ of {world}: ", out, re.M), out[-2000:]
        assert "ok  all_reduce of integer values" in out, out[-2000:]

    # The same checks, passed by the same ranks, as one node of `world` ranks (`make torchrun NPROC=4`).
    one = subprocess.run([*PX_SCRIPT, CHAPTER, "--nproc", str(world)], cwd=ROOT, capture_output=True,
                         text=True, timeout=TIMEOUT_S, env=dict(os.environ, TMPDIR=str(tmpdir)))
    assert one.returncode == 0, one.stderr[-3000:]
    merged = {r: line for s in per_node for r, line in s.items()}
    assert merged == rank_summaries(one.stdout)

    # Every listener on loopback, the rendezvous store among them on the endpoint.
    assert listening, "no listening socket was seen: the watch saw nothing of the run"
    assert {ip for ip, _, _ in listening} == {"127.0.0.1"}, sorted(listening)
    assert any(p == port for _, p, _ in listening), f"nothing listened on the endpoint {endpoint}"

    assert wait_until_gone(10) == [], "the launches left processes behind"
    assert os.listdir(tmpdir) == [], f"left in the temporary folder: {os.listdir(tmpdir)}"


def test_endpoint_flags():
    from helpers.tools import px_script

    local = px_script.multinode_torchrun_args(2, 2, 1, "127.0.0.1:29400")
    assert local[local.index("--rdzv-backend") + 1] == "c10d"
    assert local[local.index("--rdzv-endpoint") + 1] == "127.0.0.1:29400"
    assert "is_host=false" in local and local[local.index("--local-addr") + 1] == "127.0.0.1"
    # A real cluster: torchrun's agent on the endpoint's host hosts the store; workers find rank 0 by name.
    remote = px_script.multinode_torchrun_args(8, 4, 3, "10.1.2.3:29400")
    assert "--rdzv-conf" not in remote and "--local-addr" not in remote
    assert remote[:6] == ["--nnodes", "4", "--node-rank", "3", "--nproc-per-node", "8"]
    assert px_script.main(["00", "--nnodes", "2"]) == 2
