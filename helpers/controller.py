"""The ipyparallel controller of a set of ranks (:mod:`helpers.ranks`), and the wait for its engines.

The controller listens on 127.0.0.1 only, on a pool of ports of its own (:func:`ports`). Its profile
(connection files, logs, the engine-state file) is in the ranks' folder, not ~/.ipython, so it goes with
that folder.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import socket
import time

CONTROLLER_PORTS = 32  # more than the controller binds (20 at ipyparallel's default scheduler depth)
UNPINGED_BEATS = 20  # missed heartbeats in a row (of 0.8 s each) after which a controller is given up
# The controller registers an engine at its first heartbeat: at ipyparallel's 3 s period that is most of a
# start (6.0 s of waiting for two engines here, 1.2 s at 0.3 s). 100 misses keep the default's 30 s of silence
# before it gives an engine up.
HEARTBEAT = ["--HeartMonitor.period=300", "--HeartMonitor.max_heartmonitor_misses=100"]


def new_cluster(run_dir: str):
    """A cluster (not started) whose controller keeps its profile in ``run_dir`` and binds :func:`ports`."""
    import ipyparallel as ipp

    return ipp.Cluster(n=0, controller_ip="127.0.0.1", log_level=logging.ERROR,
                       profile_dir=os.path.join(run_dir, "ipython"), controller_args=HEARTBEAT + ports())


def log_tail(run_dir: str, world_size: int) -> str:
    """The end of the log of the first engine that did not complete its registration (of engine 0 if all
    did)."""
    tails = []
    for i in range(world_size):
        try:
            with open(os.path.join(run_dir, f"engine-{i}.log")) as f:
                text = f.read()
        except OSError as e:
            text = f"(unreadable: {e})"
        tails.append((i, text[-600:].strip() or "(empty)", "Completed registration" in text))
    i, tail, _ = next((t for t in tails if not t[2]), tails[0])
    return f"engine {i}'s log ends: {tail}"


def wait_for_connection_file(cluster, timeout_s: float) -> None:
    """Return once the controller has written the engines' connection file whole. Starting the controller
    does not wait for it, and an engine that finds the file empty, half written, or missing after 10 s
    exits: under load, 5 of 8 engines of a test once died reading it empty."""
    path = os.path.join(cluster.profile_dir, "security", f"ipcontroller-{cluster.cluster_id}-engine.json")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with open(path) as f:
                json.load(f)
            return
        except (OSError, ValueError):
            if cluster.controller.state != "running":
                raise RuntimeError("the controller stopped before it wrote the engines' connection "
                                   "file") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"the controller did not write the engines' connection file within "
                                   f"{timeout_s:.0f} s") from None
            time.sleep(0.05)


def ports(n: int = CONTROLLER_PORTS) -> list[str]:
    """The controller's argument giving it ``n`` free ports below the range the system assigns by itself.

    ipyparallel picks each port by binding port 0 and closing it; its child processes (the heart monitor, the
    schedulers) bind the port a moment later, and gloo's sockets and every outgoing connection draw from the
    same range in between. In one CI run beside the unit tests the heart monitor's port went that way: every
    engine registered and none was ever pinged. Below that range nothing takes a port unasked. Two sets of
    ranks starting at once may still draw the same block (about 1 in 400); :func:`wait_for_engines` sees that
    and the start is retried. No room below the range (an unusual system setting): ipyparallel's own ports.
    """
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            assigned_from = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        assigned_from = 49152  # IANA's dynamic range, where macOS and Windows assign from
    low = 20000
    blocks = (assigned_from - low) // n
    if blocks < 2:
        return []
    start = low + n * random.SystemRandom().randrange(blocks)
    free = []
    for port in range(start, start + n):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # a service of this machine has it
        free.append(port)
    return [f"--IPController.ports={','.join(map(str, free))}"]


def wait_for_engines(client, run_dir: str, world_size: int, timeout_s: float) -> str | None:
    """Wait until ``world_size`` engines are registered: None, or why a retry on a fresh controller may work.

    The controller registers an engine at its first heartbeat. An engine that completed its registration
    but hears no ping for ``UNPINGED_BEATS`` beats in a row (its log says so) is talking to a controller whose
    heart monitor could not bind its port: that controller will never register it.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.wait_for_engines(world_size, timeout=1, interactive=False)  # no progress bar on the page
            return None
        except TimeoutError:
            pass
        for i in range(world_size):
            try:
                with open(os.path.join(run_dir, f"engine-{i}.log")) as f:
                    log = f.read()
                misses = [int(m) for m in re.findall(r"No heartbeat in the last \d+ ms \((\d+) time", log)]
            except OSError:
                misses = []
            if misses and misses[-1] >= UNPINGED_BEATS:
                return (f"engine {i} registered but the controller never pinged it ({misses[-1]} heartbeats "
                        f"missed in a row; its heart monitor's port was taken)")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(client.ids)} of {world_size} engines registered within "
                               f"{timeout_s:.0f} s; {log_tail(run_dir, world_size)}")
