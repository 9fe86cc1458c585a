"""Bad values given to make's targets: one line naming the setting, its value and what is allowed, exit status
2, no traceback (README, "Bad input"); and Ctrl-C on `make chapter` says "interrupted" and nothing else."""

import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from helpers import ROOT
from helpers.tools import px_script, run_chapter

CHAPTERS = ", ".join(f"{n:02d}" for n in range(16))


@pytest.mark.parametrize("argv, line", [
    (["abc"], f"CH=abc: not a chapter number; the chapters are {CHAPTERS}"),
    (["99"], f"CH=99: no such chapter; the chapters are {CHAPTERS}"),
    (["00", "--nproc", "0"], "NPROC=0 (--nproc): expected a whole number of at least 1"),
    (["00", "--nproc", "abc"], "NPROC=abc (--nproc): expected a whole number of at least 1"),
    (["00", "--nnodes", "0"], "--nnodes=0: expected a whole number of at least 1"),
    (["00", "--nnodes", "-1"], "--nnodes=-1: expected a whole number of at least 1"),
    (["00", "--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "127.0.0.1:1"],
     "--node-rank=2: expected a whole number from 0 to 1"),
    (["00", "--timeout", "inf"], "--timeout=inf: expected a positive, finite number of seconds"),
])
def test_torchrun_refuses_a_bad_value_in_one_line(argv, line, capsys):
    assert px_script.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err == f"px_script: {line}\n" and captured.out == ""


@pytest.mark.parametrize("value", ["abc", "nan", "inf", "-5"])
def test_a_bad_collective_timeout_is_refused_before_anything_starts(value, monkeypatch, capsys):
    monkeypatch.setenv("BOOK_COLLECTIVE_TIMEOUT", value)
    line = f"BOOK_COLLECTIVE_TIMEOUT={value}: expected a positive, finite number of seconds"
    assert run_chapter.main(["00"]) == 2
    assert capsys.readouterr().err == line + "\n"
    assert px_script.main(["00"]) == 2
    assert capsys.readouterr().err == f"px_script: {line}\n"


@pytest.mark.parametrize("value, line", [
    ("abc", f"CH=abc: not a chapter number; the chapters are {CHAPTERS}"),
    ("99", f"CH=99: no such chapter; the chapters are {CHAPTERS}"),
])
def test_a_chapter_that_is_not_there_is_refused_by_every_target(value, line, capsys):
    assert run_chapter.main([value]) == 2
    assert capsys.readouterr().err == line + "\n"
    for target in ("chapter", "bench"):  # through make, as a reader types it
        # as a reader types it, not as a sub-make of `make test` (whose jobserver note would come first)
        alone = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
        done = subprocess.run(["make", "--no-print-directory", "-s", target, f"CH={value}"], cwd=ROOT,
                              capture_output=True, text=True, timeout=60, env=alone)
        assert done.returncode == 2, done.stderr
        assert done.stderr.splitlines()[0] == line, done.stderr
        assert "Traceback" not in done.stderr + done.stdout


def test_ctrl_c_on_a_chapter_says_interrupted_and_nothing_else():
    """As `make chapter CH=00` runs it; SIGINT to its process group, as a terminal's Ctrl-C sends, once the
    ranks are starting."""
    proc = subprocess.Popen([sys.executable, "-m", "helpers.tools.reap", "--", sys.executable, "-m",
                             "helpers.tools.run_chapter", "00"], cwd=ROOT, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout))
    reader.start()
    try:
        deadline = time.monotonic() + 90
        while not any("ipyparallel.controller" in " ".join(p.cmdline())
                      for p in psutil.Process(proc.pid).children(recursive=True)):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
            time.sleep(0.1)
        time.sleep(2)
        before = len(lines)
        sent = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        status = proc.wait(timeout=30)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        reader.join()
    assert status == 130
    assert lines[before:] == ["interrupted\n"], "".join(lines[before:])
    assert took < 10


@pytest.mark.parametrize("value", ["abc", "7"])
def test_the_bench_called_directly_refuses_a_chapter_without_rows(value, capsys):
    from helpers.tools import bench

    with pytest.raises(SystemExit) as stop:
        bench.main(["--chapter", value])
    assert stop.value.code == 2
    rows = "02, 03, 04, 05, 06, 12"
    assert capsys.readouterr().err == f"--chapter {value}: the bench has rows for chapters {rows}\n"
