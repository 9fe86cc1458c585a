"""A failure on the page: one line per distinct error with its ranks, no absolute path, no checks' frames."""

import os

from ipyparallel.error import CompositeError, RemoteError

from helpers import errors
from helpers.checks import CheckFailed

ROOT = errors.ROOT
TB = (f'File {ROOT}/helpers/parallel/collectives.py:57, in ring_all_reduce(tensor)\n'
      f'File {ROOT}/.venv/lib/python3.11/site-packages/torch/distributed/c10d.py:9, in all_reduce\n')


def test_a_composite_error_groups_ranks_and_keeps_one_frame_of_the_book():
    elist = [("RuntimeError", "Timed out\n  waiting 5000ms", TB, {"engine_id": r, "method": "execute"})
             for r in (0, 2, 3)]
    elist.insert(1, ("CheckFailed", "check 'x' failed on rank 1: max abs error 1.5", "CheckFailed: ...",
                     {"engine_id": 1, "method": "execute"}))
    lines = errors.remote_error_lines(CompositeError("one or more exceptions", elist))
    assert lines == ["on ranks 0, 2, 3: RuntimeError: Timed out waiting 5000ms",
                     "    at helpers/parallel/collectives.py:57, in ring_all_reduce",
                     "on rank 1: CheckFailed: check 'x' failed on rank 1: max abs error 1.5"]
    assert not any(ROOT in line for line in lines)


def test_a_single_remote_error_names_its_rank():
    err = RemoteError("ValueError", "cp=3 must divide n_heads=8", TB, {"engine_id": 2, "method": "execute"})
    assert errors.remote_error_lines(err)[0] == "on rank 2: ValueError: cp=3 must divide n_heads=8"


def test_a_failed_check_shows_its_message_alone(monkeypatch):
    monkeypatch.delenv("BOOK_FULL_TRACEBACKS", raising=False)
    assert CheckFailed("check 'y' failed on kernel: 2 of 3 elements differ")._render_traceback_() == \
        ["CheckFailed: check 'y' failed on kernel: 2 of 3 elements differ"]
    monkeypatch.setenv("BOOK_FULL_TRACEBACKS", "1")
    assert "Traceback" in "".join(CheckFailed("z")._render_traceback_()) or \
        "CheckFailed: z" in "".join(CheckFailed("z")._render_traceback_())


def test_frames_outside_the_repository_are_not_shown():
    assert errors.innermost_book_frame("File /usr/lib/python3.11/x.py:1, in f\n") is None
    assert errors.innermost_book_frame(TB) == "helpers/parallel/collectives.py:57, in ring_all_reduce"
    assert os.path.isabs(ROOT)


def test_ipyparallels_notice_of_a_dead_engine_names_the_rank_not_minus_one():
    """The controller's "Engine 1 died" comes without engine_info: the rank is read from the message."""
    died = RemoteError("EngineError", "Engine 1 died while running task 'abc'", "", {})
    assert errors.remote_error_lines(died) == \
        ["on rank 1: EngineError: Engine 1 died while running task 'abc'"]
    unknown = RemoteError("RuntimeError", "lost", "", {})
    assert errors.remote_error_lines(unknown) == ["on an unknown rank: RuntimeError: lost"]
