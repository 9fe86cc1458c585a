"""The backend setting, and joining the group under torchrun's environment with loopback-only sockets."""

import os
import subprocess
import sys
import textwrap

import pytest

from helpers import dist as book_dist


def test_backend_setting(monkeypatch):
    monkeypatch.delenv("BOOK_BACKEND", raising=False)
    assert book_dist.backend() == "gloo" and book_dist.device_type() == "cpu"
    assert str(book_dist.device()) == "cpu"
    monkeypatch.setenv("BOOK_BACKEND", "nccl")
    assert book_dist.device_type() == "cuda"
    monkeypatch.setenv("BOOK_BACKEND", "mpi")
    with pytest.raises(ValueError, match="BOOK_BACKEND='mpi': expected one of"):
        book_dist.backend()


def test_nccl_device_one_gpu_per_rank(monkeypatch):
    # the GPUs are faked: rank r on cuda:r, and a local rank beyond the GPUs refused, never folded onto one
    import torch

    monkeypatch.setenv("BOOK_BACKEND", "nccl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("BOOK_RANK", "1")
    assert book_dist.device() == torch.device("cuda", 1)
    monkeypatch.setenv("LOCAL_RANK", "0")  # torchrun's local rank wins over the engine's
    assert book_dist.device() == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(ValueError, match="local rank 2 has none, this machine has 2"):
        book_dist.device()


def test_collective_timeout_setting(monkeypatch):
    for bad in ("0", "-1", "abc", "nan", "inf", ""):
        monkeypatch.setenv("BOOK_COLLECTIVE_TIMEOUT", bad)
        with pytest.raises(ValueError) as caught:
            book_dist.collective_timeout()
        assert str(caught.value) == f"BOOK_COLLECTIVE_TIMEOUT={bad}: expected a positive, finite number of " \
                                    f"seconds"
    monkeypatch.setenv("BOOK_COLLECTIVE_TIMEOUT", "12.5")
    assert book_dist.collective_timeout() == 12.5


def test_env_rendezvous_listens_on_loopback_only(tmp_path):
    """Two processes join as torchrun's workers would; rank 0's store and gloo listen on 127.0.0.1 alone."""
    worker = tmp_path / "worker.py"
    worker.write_text(textwrap.dedent("""
        import os, psutil, torch, torch.distributed as dist
        from helpers.dist import init_process_group
        init_process_group()
        x = torch.tensor([dist.get_rank() + 1.0])
        dist.all_reduce(x)
        listening = [c.laddr.ip for c in psutil.Process().net_connections(kind="tcp")
                     if c.status == psutil.CONN_LISTEN]
        dist.barrier()
        print(dist.get_rank(), x.item(), sorted(set(listening)), flush=True)
        dist.destroy_process_group()
    """))
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, str(worker)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=dict(os.environ, RANK=str(r), WORLD_SIZE="2",
                                                  MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
             for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    lines = sorted(o[0].strip() for o in outs)
    assert lines[0] == "0 3.0 ['127.0.0.1']", lines
    assert lines[1].startswith("1 3.0")
    assert "0.0.0.0" not in lines[1] and "'::'" not in lines[1]
