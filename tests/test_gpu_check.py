"""``make gpu-check`` (issue 37, item 5): its plumbing, on the CPU.

Where there is no GPU the check still runs under gloo and prints the same table; here it runs two tiny
notebooks of two ranks (one that passes, one whose rank fails a check), so the test is fast, and the table
must say which passed and which failed. The chapters' rank counts and the NCCL skip rule are checked against
the notebooks' own ``start_ranks`` calls and a machine of 4 GPUs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import myst_notebook
from helpers import ROOT
from helpers.tools import gpu_check

SETUP = """
from helpers.ranks import start_ranks
world_size = 2
ranks = start_ranks(world_size)
"""

CHECK = """
%%px
import torch
import torch.distributed as dist
from helpers.dist import device
x = torch.ones(3, device=device()) * (dist.get_rank() + 1)
dist.all_reduce(x)
assert x.tolist() == [{total}] * 3, x
"""


@pytest.fixture
def notebooks(tmp_path):
    good, bad = tmp_path / "gpu_check_probe_good.md", tmp_path / "gpu_check_probe_bad.md"
    good.write_text(myst_notebook(SETUP, CHECK.format(total=3.0)))  # 1 + 2
    bad.write_text(myst_notebook(SETUP, CHECK.format(total=4.0)))
    yield str(good), str(bad)
    for path in (good, bad):  # what run_chapter and gpu_check wrote for them
        name = os.path.basename(path)[:-3]
        for left in (os.path.join(ROOT, "_build", "chapters", name + ".ipynb"),
                     os.path.join(ROOT, "_build", "gpu_check", name + ".log")):
            if os.path.exists(left):
                os.remove(left)


def run(*args, backend="gloo"):
    env = dict(os.environ, BOOK_BACKEND=backend)
    return subprocess.run([sys.executable, "-m", "helpers.tools.gpu_check", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_the_table_on_gloo(notebooks):
    good, bad = notebooks
    done = run(f"{good},{bad}")
    assert done.returncode == 1, done.stdout + done.stderr  # one failed
    table = done.stdout.split("\n\n")[-1]
    assert re.search(r"^chapter\s+ranks\s+result\s+seconds$", table, re.M), table
    assert re.search(r"^gpu_check_probe_good\s+2 on the CPU\s+passed\s+\d+\.\d$", table, re.M), table
    bad_row = re.search(r"^gpu_check_probe_bad\s+2 on the CPU\s+failed: (.*)\s+\d+\.\d$", table, re.M)
    assert bad_row and "AssertionError" in bad_row.group(1), table
    assert "1 passed, 1 failed, 0 skipped; failed: gpu_check_probe_bad" in done.stdout


def test_bad_chapter_and_no_gpu_refused_in_one_line():
    done = run("abc")
    assert done.returncode == 2 and done.stderr.strip().startswith("CH=abc: not a chapter number"), done
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    done = run("00", backend="nccl")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done
    assert "BOOK_BACKEND=nccl: no GPU here" in done.stderr


def test_rank_counts_and_the_nccl_skip():
    needed = {name: gpu_check.ranks_needed(path) for name, path in gpu_check.parse_chapters([])}
    for name, path in gpu_check.parse_chapters([]):  # read independently: the literal in start_ranks(...)
        with open(path) as f:
            text = f.read()
        literal = re.findall(r"start_ranks\((\d+)\)", text)
        if literal:
            assert needed[name] == max(map(int, literal)), name
    assert needed["00"] == 4 and needed["01"] == 0 and needed["10"] == 8
    assert gpu_check.skip_reason(8, "nccl", 4).startswith("needs 8 ranks, one per GPU")
    assert gpu_check.skip_reason(4, "nccl", 4) == "" and gpu_check.skip_reason(8, "gloo", 0) == ""


def test_nccl_skips_what_the_gpus_cannot_hold(monkeypatch, capsys):
    # four GPUs faked: chapters 10 and 13 start 8 ranks, so neither runs (nothing starts), each row saying why
    import torch

    monkeypatch.setenv("BOOK_BACKEND", "nccl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(gpu_check, "run_one", lambda *args: pytest.fail("a chapter was run"))
    assert gpu_check.main(["10,13"]) == 0
    out = capsys.readouterr().out
    assert "gpu-check: BOOK_BACKEND=nccl, 2 chapters on 4 GPUs" in out
    for chapter in ("10", "13"):
        row = (rf"^{chapter}\s+8, one per GPU\s+skipped: needs 8 ranks, one per GPU "
               rf"\(NCCL refuses two ranks of one communicator on one GPU\); this machine has 4\s*$")
        assert re.search(row, out, re.M), out
    assert "0 passed, 0 failed, 2 skipped" in out
