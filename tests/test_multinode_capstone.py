"""Chapter 15's five-dimensional capstone, 16 ranks, as two torchrun launches of 8 meeting at a c10d
rendezvous on 127.0.0.1, the shape of two machines of 8 GPUs (README, "Running on a real cluster"), as
``test_multinode.py`` runs chapter 00. ``make unit`` runs it; ``make test`` leaves it out (two minutes) to
stay under 15 minutes on two cores."""

import os
import re
import time

from test_multinode import free_loopback_port, run_nodes
from test_ranks import book_processes, wait_until_gone


def test_the_capstone_runs_as_two_nodes_of_eight(tmp_path):
    """Chapter 15's five-dimensional run on 16 ranks as two launches of 8 meeting on loopback, as on two
    machines of 8 GPUs: every rank passes its own checks (each dimension's, the planted faults caught, its
    parameters against one process every few steps) and the launches leave nothing behind."""
    assert not book_processes(), "processes from an earlier run are still alive"
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    port = free_loopback_port()
    node_args = [["--nproc", "8", "--nnodes", "2", "--node-rank", str(n),
                  "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"test-{port}"] for n in range(2)]
    started = time.monotonic()
    procs, outs, listening = run_nodes(node_args, str(tmpdir), chapter="15", timeout_s=600)
    print(f"chapter 15 on two nodes of 8: {time.monotonic() - started:.1f} s")
    for n, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"node {n} exited {p.returncode}:\n{out[-3000:]}\n{err[-3000:]}"
        passed = re.findall(r"^ok  on each rank: \d+ comparisons", out, re.M)
        assert len(passed) == 8, out[-3000:]  # each of this node's ranks, against one process
    assert {ip for ip, _, _ in listening} == {"127.0.0.1"}, sorted(listening)
    assert wait_until_gone(10) == [], "the launches left processes behind"
    assert os.listdir(tmpdir) == [], f"left in the temporary folder: {os.listdir(tmpdir)}"
