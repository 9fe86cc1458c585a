"""One setting picks the backend and the device; one function joins the process group.

``BOOK_BACKEND`` is the setting: ``gloo`` (the default) puts every rank on the CPU, ``nccl`` puts local
rank r (``LOCAL_RANK`` under torchrun, the engine's rank in a notebook) on ``cuda:r``. Ranks are never folded
onto fewer GPUs: NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected"), so a local
rank without a GPU of its own is refused by :func:`device` in one line, and ``make gpu-check`` skips a chapter
that needs more ranks than there are GPUs (chapters 10, 13 and 15 start 8), saying why. Chapters never name a
backend or a device themselves; they call :func:`device`.

:func:`init_process_group` works in both places a chapter's code runs:

- on an ipyparallel engine started by :func:`helpers.ranks.start_ranks`, which passes the rank, the world size
  and a rendezvous file (a ``FileStore``: nothing listens on a port);
- under ``torchrun``, which passes ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``. When the
  master address is a loopback address, rank 0 opens the rendezvous socket itself on that address, because a
  plain ``TCPStore`` listens on every interface.

The collective timeout (``BOOK_COLLECTIVE_TIMEOUT`` seconds, default 60) turns a rank that waits for a peer
that never comes into an error, well before a notebook cell's own timeout.
"""

from __future__ import annotations

import datetime
import ipaddress
import math
import os
import socket

BACKENDS = {"gloo": "cpu", "nccl": "cuda"}
DEFAULT_TIMEOUT_S = 60.0


def backend() -> str:
    """The process-group backend named by ``BOOK_BACKEND`` (``gloo`` unless set)."""
    name = os.environ.get("BOOK_BACKEND", "gloo").strip().lower()
    if name not in BACKENDS:
        raise ValueError(f"BOOK_BACKEND={name!r}: expected one of {sorted(BACKENDS)}")
    return name


def device_type() -> str:
    """``cpu`` for gloo, ``cuda`` for nccl."""
    return BACKENDS[backend()]


def device():
    """The device this rank computes on: the CPU, or its own GPU under nccl."""
    import torch

    if device_type() == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("BOOK_BACKEND=nccl needs CUDA, and torch.cuda.is_available() is False here")
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("BOOK_RANK", "0")))
    n_gpus = torch.cuda.device_count()
    if local_rank >= n_gpus:
        raise ValueError(f"BOOK_BACKEND=nccl puts one rank on each GPU: local rank {local_rank} has none, "
                         f"this machine has {n_gpus} (NCCL refuses two ranks of one communicator on one GPU)")
    return torch.device("cuda", local_rank)


def collective_timeout() -> float:
    """Seconds a rank waits inside one collective before it raises."""
    text = os.environ.get("BOOK_COLLECTIVE_TIMEOUT", str(DEFAULT_TIMEOUT_S))
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:  # nan fails both
        raise ValueError(f"BOOK_COLLECTIVE_TIMEOUT={text}: expected a positive, finite number of seconds")
    return value


def loopback_interface() -> str:
    """Name of the loopback interface (``lo`` on Linux, ``lo0`` on macOS)."""
    for _, name in socket.if_nameindex():
        if name.startswith("lo"):
            return name
    raise RuntimeError("no loopback interface found to bind gloo to")


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def _loopback_tcp_store(host: str, port: int, rank: int, world_size: int, timeout):
    """A TCPStore whose server (on rank 0) listens on ``host`` alone, not on every interface."""
    import torch.distributed as dist

    if rank != 0:
        return dist.TCPStore(host, port, world_size, False, timeout=timeout)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((socket.gethostbyname(host), port))
    sock.listen(world_size)
    store = dist.TCPStore(host, sock.getsockname()[1], world_size, True, timeout=timeout,
                          master_listen_fd=sock.detach())
    return store


def init_process_group(rank: int | None = None, world_size: int | None = None,
                       store_file: str | None = None, timeout_s: float | None = None) -> None:
    """Join this process to the book's process group (see the module docstring)."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    timeout = datetime.timedelta(seconds=timeout_s if timeout_s is not None else collective_timeout())
    if store_file is not None:
        if rank is None or world_size is None:
            raise ValueError("a rendezvous file needs the rank and the world size")
        os.environ["BOOK_RANK"] = str(rank)
        store = dist.FileStore(store_file, world_size)
        host_is_loopback = True
    else:
        rank = int(os.environ["RANK"]) if rank is None else rank
        world_size = int(os.environ["WORLD_SIZE"]) if world_size is None else world_size
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = int(os.environ["MASTER_PORT"])
        host_is_loopback = _is_loopback(host)
        if host_is_loopback:
            store = _loopback_tcp_store(host, port, rank, world_size, timeout)
        else:
            store = dist.TCPStore(host, port, world_size, rank == 0, timeout=timeout)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of size {world_size}")
    if host_is_loopback and backend() == "gloo":
        # gloo otherwise binds its pair sockets to the address the hostname resolves to.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
    kwargs = {}
    if backend() == "nccl":
        kwargs["device_id"] = device()
        torch.cuda.set_device(kwargs["device_id"])
    dist.init_process_group(backend(), store=store, rank=rank, world_size=world_size,
                            timeout=timeout, **kwargs)
