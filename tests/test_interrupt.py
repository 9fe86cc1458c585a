"""The stop button on a %%px cell, in a real kernel driven by jupyter_client: the ranks stop (or are
restarted, saying so) within seconds, and the kernel answers the next cell. And a rank that dies fails its
cell at once, by name."""

import os
import signal
import time

import ipyparallel as ipp
import pytest
from jupyter_client import KernelManager

from helpers import ROOT, errors

START_S = 180  # starting a kernel and two ranks, on two loaded cores
BOUND_S = 10  # from the interrupt to the reply, when the ranks stop
RESTART_BOUND_S = 40  # ... when they are restarted (INTERRUPT_GRACE_S, then a start of two ranks)

SLEEPING_CELL = "%%px\nimport time\nfor _ in range(300):\n    time.sleep(0.1)\n"  # 30 s, in Python
STUCK_CELL = ("%%px\nimport time, torch, torch.distributed as dist\n"
              "if dist.get_rank() == 0:\n    time.sleep(30)\n"
              "dist.all_reduce(torch.ones(1))  # rank 1 waits here, in C++, for rank 0\n")


def run(kc, code: str, timeout: float) -> dict:
    """Execute ``code``; its reply's content, with the cell's stdout and stderr as ``text``."""
    msg_id = kc.execute(code)
    return reply(kc, msg_id, timeout)


def reply(kc, msg_id: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    text = []
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"no reply within {timeout} s; output so far: {''.join(text)[-2000:]}"
        try:
            msg = kc.get_iopub_msg(timeout=min(left, 1))
        except Exception:
            continue
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            text.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            text.append("\n".join(msg["content"]["traceback"]))
        elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return {**shell_reply(kc, msg_id, deadline), "text": "".join(text)}


def shell_reply(kc, msg_id: str, deadline: float) -> dict:
    """The content of ``msg_id``'s reply on the shell channel, skipping replies to other requests: a loaded
    kernel that takes over a second to start leaves extra kernel_info replies there (``wait_for_ready`` asks
    again each second), and taking the next reply as this cell's once shifted every answer by one."""
    while True:
        msg = kc.get_shell_msg(timeout=max(1, deadline - time.monotonic()))
        if msg["parent_header"].get("msg_id") == msg_id:
            return msg["content"]


def wait_until_busy(kc, msg_id: str) -> None:
    while True:
        msg = kc.get_iopub_msg(timeout=30)
        if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "execute_input":
            return


@pytest.fixture(scope="module")
def kernel():
    km = KernelManager(kernel_name="python3")
    km.start_kernel(cwd=os.path.join(ROOT, "notebooks"), env=dict(os.environ, BOOK_COLLECTIVE_TIMEOUT="120"))
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)
        kc.kernel_info()  # a reply nobody reads, as wait_for_ready leaves on a loaded machine (shell_reply)
        started = run(kc, "from helpers.ranks import start_ranks\nranks = start_ranks(2)", START_S)
        assert started["status"] == "ok", started["text"]
        yield km, kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)


def interrupt(km, kc, cell: str, bound: float) -> tuple[dict, float]:
    msg_id = kc.execute(cell)
    wait_until_busy(kc, msg_id)
    time.sleep(1.5)  # the ranks are inside the cell
    started = time.monotonic()
    km.interrupt_kernel()
    answer = reply(kc, msg_id, bound)
    return answer, time.monotonic() - started


def test_the_stop_button_stops_the_ranks_and_the_kernel_answers(kernel):
    km, kc = kernel
    answer, took = interrupt(km, kc, SLEEPING_CELL, BOUND_S)
    assert answer["status"] == "error" and answer["ename"] == "Interrupted", answer
    assert "the ranks stopped the cell" in answer["text"], answer["text"]
    assert took < BOUND_S
    assert run(kc, "print('next')", 10)["text"] == "next\n"
    # the same ranks, still one group, still holding what they had
    assert run(kc, "%%px\nimport torch, torch.distributed as dist\nx = torch.ones(1)\ndist.all_reduce(x)",
               20)["status"] == "ok"
    assert "[2.0, 2.0]" in run(kc, "print([t.item() for t in ranks.pull('x')])", 10)["text"]


def test_the_stop_button_stops_a_local_and_remote_cell_on_both_sides(kernel):
    """%%px --local runs the cell in the kernel, then waits for the ranks: an interrupt of the kernel's part
    stops the ranks' part too."""
    km, kc = kernel
    answer, took = interrupt(km, kc, SLEEPING_CELL.replace("%%px", "%%px --local"), BOUND_S)
    assert "Interrupted: the ranks stopped the cell" in answer["text"], answer["text"]
    assert took < BOUND_S
    assert run(kc, "%%px\nimport torch, torch.distributed as dist\ny = torch.ones(1)\ndist.all_reduce(y)",
               10)["status"] == "ok"


def test_ranks_stuck_in_a_collective_are_restarted_saying_so(kernel):
    km, kc = kernel
    pids = run(kc, "print(*ranks.pids)", 10)["text"].split()
    answer, took = interrupt(km, kc, STUCK_CELL, RESTART_BOUND_S)
    assert answer["status"] == "error" and answer["ename"] == "Interrupted", answer
    assert "rank 1 was still busy" in answer["text"] and "restarted" in answer["text"], answer["text"]
    assert took < RESTART_BOUND_S
    assert run(kc, "print(*ranks.pids)", 10)["text"].split() != pids, "the same engines"
    assert run(kc, "%%px\nimport torch, torch.distributed as dist\nx = torch.ones(1)\ndist.all_reduce(x)",
               20)["status"] == "ok"
    assert "[2.0, 2.0]" in run(kc, "print([t.item() for t in ranks.pull('x')])", 10)["text"]


@ipp.interactive
def _rank_one_waits_forever_rank_zero_in_a_collective():
    import time

    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(600)
    dist.all_reduce(torch.ones(1))


def test_a_killed_rank_fails_its_cell_at_once_by_name():
    from helpers.ranks import start_ranks

    ranks = start_ranks(2, timeout_s=120, activate=False)
    try:
        result = ranks.view.apply_async(_rank_one_waits_forever_rank_zero_in_a_collective)
        time.sleep(1)
        killed = time.monotonic()
        os.kill(ranks.pids[1], signal.SIGKILL)
        with pytest.raises(ipp.error.CompositeError) as caught:
            result.get(timeout=60)
        took = time.monotonic() - killed
        lines = errors.remote_error_lines(caught.value)
        assert any(line.startswith("on rank 1: EngineError: rank 1 died") for line in lines), lines
        assert not any("rank -1" in line for line in lines), lines
        assert took < 10, f"the cell failed {took:.0f} s after the kill"
    finally:
        ranks.stop()
