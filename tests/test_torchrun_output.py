"""`make torchrun`'s output: shown as it comes, the book's own error line last, a run stopped at a documented
limit saying who never joined, and nothing left in the temporary folder without the reaper.

The ranks of the tiny notebook sleep TINY_SLEEP seconds after they print that they started, so that the first
line comes well before the end: a run whose output is captured and shown at the end fails the check."""

import os
import re
import socket
import subprocess
import sys
import threading
import time

from conftest import myst_notebook
from helpers import ROOT
from helpers.tools.px_script import DEFAULT_TIMEOUT_S

TINY = myst_notebook("""
%%px
import os
import time

import torch.distributed as dist

print(f"rank {dist.get_rank()} started", flush=True)
time.sleep(float(os.environ.get("TINY_SLEEP", "0")))
if os.environ.get("TINY_NEEDS_4") and dist.get_world_size() != 4:
    raise ValueError(f"this chapter runs on 4 ranks, got world_size={dist.get_world_size()}")
""")


def px_script(tmp_path, *args, **env):
    """Run px_script on the tiny notebook, not under the reaper, with a TMPDIR of its own; (status, lines
    with the second each arrived at, seconds taken, the TMPDIR)."""
    notebook = tmp_path / "tiny.md"
    notebook.write_text(TINY)
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "helpers.tools.px_script", str(notebook), *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, TMPDIR=str(tmpdir), **env))
    started, lines = time.monotonic(), []

    def read(pipe):
        for line in pipe:
            lines.append((time.monotonic() - started, line.rstrip("\n")))

    readers = [threading.Thread(target=read, args=(p,)) for p in (proc.stdout, proc.stderr)]
    for r in readers:
        r.start()
    status = proc.wait(timeout=120)
    took = time.monotonic() - started
    for r in readers:
        r.join()
    return status, lines, took, tmpdir


def test_output_streams_a_rank_count_error_ends_it_and_nothing_is_left_in_tmp(tmp_path):
    status, lines, took, tmpdir = px_script(tmp_path, "--nproc", "2", TINY_NEEDS_4="1", TINY_SLEEP="5")
    assert status != 0
    # torchrun's first line (its banner) came as it was written, before the ranks had imported torch and
    # failed, not at the end
    assert lines and lines[0][0] < took - 3, f"the first line came at {lines[0][0]:.1f} s of {took:.1f} s"
    # the book's line after torchrun's report of its workers (dozens of lines)
    want = "px_script: on ranks 0, 1: ValueError: this chapter runs on 4 ranks, got world_size=2"
    assert lines[-1][1] == want, "\n".join(line for _, line in lines[-20:])
    # torchrun's torchelastic_* logs (and any torchinductor_* cache) went with the run
    assert os.listdir(tmpdir) == [], os.listdir(tmpdir)


def test_a_node_that_never_joins_is_named(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    status, lines, took, _ = px_script(tmp_path, "--nproc", "1", "--nnodes", "2", "--node-rank", "0",
                                       "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "lonely",
                                       "--timeout", "8")
    text = "\n".join(line for _, line in lines)
    # stopped by its --timeout of 8 s, not the default 300 (under load torchrun's start alone takes 30 s)
    assert status == 124 and took < DEFAULT_TIMEOUT_S / 2, text
    assert re.fullmatch(rf"px_script: stopped after 8 s \(BOOK_TORCHRUN_TIMEOUT\): the rendezvous at "
                        rf"127\.0\.0\.1:{port} \(--rdzv-id lonely\) never completed: 1 of 2 nodes joined "
                        rf"\(127\.0\.0\.1 pid \d+\); start every node's launch, --node-rank 0 to 1, with the "
                        rf"same endpoint and --rdzv-id", lines[-1][1]), text
