"""What collectives move and how long they take (chapter 02): exact bytes per rank, and the α–β model.

The bytes. :func:`expected_bytes` gives what each rank sends and receives in each collective's algorithm,
exactly, on a buffer split as :func:`chunk_sizes` splits it (uneven chunks included); :func:`all_to_all_bytes`
the same for an all-to-all with uneven split sizes. The ledger (:mod:`helpers.parallel.ledger`) counts the
book's own messages against these, and books torch's collectives with them.

The time. A message of ``n`` bytes costs ``α + n·β`` (Hockney 1994): ``α`` the latency of one message,
``β`` the time per byte. A collective of ``steps`` rounds, on whose critical path ``fraction·n`` bytes move,
costs ``steps·α + fraction·n·β`` (Thakur, Rabenseifner and Gropp 2005); :data:`COSTS` holds the two numbers
for each algorithm. :func:`time_collective` measures a collective on every rank, :func:`fit` finds ``α``
and ``β`` from measured ``(collective, bytes, world_size, seconds)`` samples by least squares, and
:meth:`AlphaBeta.time` predicts. :func:`bus_bandwidth` applies the nccl-tests factors (nccl-tests
``doc/PERFORMANCE.md``), so a measured time reads as the bandwidth of the bottleneck link, comparable across
world sizes. Nothing here knows which algorithm gloo or NCCL really runs: booked bytes and fitted
parameters are those of the model's algorithm.

    from helpers.cost.collective_costs import expected_bytes, fit, time_collective
    expected_bytes("ring_all_reduce", numel, world_size, rank)  # (bytes sent, bytes received)
    model = fit(samples)                               # samples: (collective, bytes, world_size, seconds)
    model.time("all_reduce", 16e9, 8)                  # predicted seconds
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

# ---------------------------------------------------------------------------------------------------------
# What each algorithm moves: exact bytes per rank
# ---------------------------------------------------------------------------------------------------------


def chunk_sizes(numel: int, world_size: int) -> list[int]:
    """How a flat buffer of ``numel`` elements splits into ``world_size`` chunks.

    The first ``numel % world_size`` chunks are one element longer, as ``torch.tensor_split`` splits; chunk
    ``r`` is the one rank ``r`` owns after a reduce-scatter. Chunks may be empty when ``numel < world_size``.
    """
    base, extra = divmod(numel, world_size)
    return [base + (i < extra) for i in range(world_size)]


ALIASES = {
    "all_reduce": "ring_all_reduce", "reduce_scatter": "ring_reduce_scatter",
    "all_gather": "ring_all_gather", "all_to_all": "pairwise_all_to_all",
    "broadcast": "tree_broadcast", "reduce": "tree_reduce",
}
"""torch.distributed's names, mapped to the algorithm the formulas assume for them."""


def tree_children(vrank: int, world_size: int) -> int:
    """How many children ``vrank`` (rank relative to the root) has in a binomial tree of ``world_size``."""
    low = vrank & -vrank if vrank else 1 << max(0, (world_size - 1).bit_length())
    return sum(1 for k in range(low.bit_length()) if (1 << k) < low and vrank + (1 << k) < world_size)


def expected_bytes(collective: str, numel: int, world_size: int, rank: int, *, element_size: int = 4,
                   root: int = 0) -> tuple[int, int]:
    """Bytes ``rank`` sends and receives in ``collective`` on a buffer of ``numel`` elements.

    ``numel`` is the full buffer: the input of a reduce-scatter, the output of an all-gather, what each rank
    holds for an all-to-all. Chunks follow :func:`chunk_sizes`, so uneven sizes are exact too. With ``n``
    bytes and even chunks, a ring moves ``(N-1)/N·n`` per rank in a reduce-scatter or all-gather and
    ``2(N-1)/N·n`` in an all-reduce (Patarasuk and Yuan 2009).
    """
    n, c = numel, chunk_sizes(numel, world_size)
    r, size = rank, world_size
    name = ALIASES.get(collective, collective)
    if name == "ring_reduce_scatter":  # rank r sends every chunk but its own, receives all but r-1's
        elements = (n - c[r], n - c[(r - 1) % size])
    elif name == "ring_all_gather":  # sends every chunk but r+1's, receives every chunk but its own
        elements = (n - c[(r + 1) % size], n - c[r])
    elif name == "ring_all_reduce":
        rs = expected_bytes("ring_reduce_scatter", numel, size, r, element_size=1)
        ag = expected_bytes("ring_all_gather", numel, size, r, element_size=1)
        elements = (rs[0] + ag[0], rs[1] + ag[1])
    elif name == "recursive_doubling_all_reduce":  # log2 N rounds, the whole buffer each way
        rounds = (size - 1).bit_length()
        elements = (rounds * n, rounds * n)
    elif name == "pairwise_all_to_all":  # chunk j to rank j; chunk r of every other rank arrives
        elements = (n - c[r], (size - 1) * c[r])
    elif name in ("tree_broadcast", "tree_reduce"):
        vrank = (r - root) % size
        down = (tree_children(vrank, size) * n, n if vrank else 0)  # broadcast: to children, from parent
        elements = down if name == "tree_broadcast" else down[::-1]
    elif name == "send_recv":
        elements = (n, n)
    else:
        raise ValueError(f"no byte formula for collective {collective!r}")
    return elements[0] * element_size, elements[1] * element_size


def all_to_all_bytes(input_split_sizes, output_split_sizes, rank: int, *, row_bytes: int) -> tuple[int, int]:
    """Bytes ``rank`` sends and receives in an all-to-all with uneven splits (``all_to_all_single``).

    ``input_split_sizes[j]`` rows go to rank ``j``, ``output_split_sizes[j]`` rows arrive from rank ``j``; the
    rank's own split never leaves it. With even splits of a buffer of ``n`` rows this is
    :func:`expected_bytes`'s ``pairwise_all_to_all``.
    """
    if rank >= len(input_split_sizes) or len(input_split_sizes) != len(output_split_sizes):
        raise ValueError(f"an all-to-all needs one input and one output split per rank, got "
                         f"{len(input_split_sizes)} and {len(output_split_sizes)} for rank {rank}")
    sent = sum(input_split_sizes) - input_split_sizes[rank]
    received = sum(output_split_sizes) - output_split_sizes[rank]
    return int(sent) * row_bytes, int(received) * row_bytes


# ---------------------------------------------------------------------------------------------------------
# The α–β model
# ---------------------------------------------------------------------------------------------------------


def _log2_ceil(world_size: int) -> int:
    return (world_size - 1).bit_length()


COSTS = {
    # algorithm: (latency steps, bytes on the critical path as a fraction of the buffer), as functions of N
    "ring_all_reduce": (lambda N: 2 * (N - 1), lambda N: 2 * (N - 1) / N),
    "ring_reduce_scatter": (lambda N: N - 1, lambda N: (N - 1) / N),
    "ring_all_gather": (lambda N: N - 1, lambda N: (N - 1) / N),
    "pairwise_all_to_all": (lambda N: N - 1, lambda N: (N - 1) / N),
    "tree_broadcast": (_log2_ceil, _log2_ceil),
    "tree_reduce": (_log2_ceil, _log2_ceil),
    "recursive_doubling_all_reduce": (_log2_ceil, _log2_ceil),
    "send_recv": (lambda N: 1, lambda N: 1),
}
"""Each algorithm in the α–β model: ``time = steps(N)·α + fraction(N)·n·β`` (Thakur et al. 2005)."""

BUS_FACTORS = {
    "all_reduce": lambda N: 2 * (N - 1) / N,
    "reduce_scatter": lambda N: (N - 1) / N,
    "all_gather": lambda N: (N - 1) / N,
    "all_to_all": lambda N: (N - 1) / N,
    "broadcast": lambda N: 1.0,
    "reduce": lambda N: 1.0,
    "send_recv": lambda N: 1.0,
}
"""nccl-tests' factors from algorithm bandwidth (``bytes / time``) to bus bandwidth (doc/PERFORMANCE.md)."""


def cost_terms(collective: str, world_size: int) -> tuple[float, float]:
    """``(steps, fraction)`` of ``collective``: it costs ``steps·α + fraction·n·β`` on ``n`` bytes."""
    name = ALIASES.get(collective, collective)
    if name not in COSTS:
        raise ValueError(f"no cost model for collective {collective!r}; known: {sorted(COSTS)}")
    steps, fraction = COSTS[name]
    return float(steps(world_size)), float(fraction(world_size))


@dataclass(frozen=True)
class AlphaBeta:
    """A fitted α–β model: ``alpha`` seconds per message, ``beta`` seconds per byte."""

    alpha: float
    beta: float

    def time(self, collective: str, nbytes: float, world_size: int) -> float:
        """Predicted seconds for ``collective`` on a buffer of ``nbytes`` over ``world_size`` ranks."""
        steps, fraction = cost_terms(collective, world_size)
        return steps * self.alpha + fraction * nbytes * self.beta

    @property
    def bandwidth(self) -> float:
        """``1/β``: the bytes per second of one link, the asymptote of bus bandwidth."""
        return 1.0 / self.beta


def fit(samples) -> AlphaBeta:
    """Least-squares ``α`` and ``β`` from ``(collective, nbytes, world_size, seconds)`` samples.

    Each sample says ``seconds ≈ steps·α + fraction·nbytes·β``. The residuals are relative (each row is
    divided by its measured time), so a 10 µs point weighs as much as a 10 ms one: the fit is judged on a
    log-log plot, where small sizes determine ``α`` and large ones ``β``.
    """
    import torch

    rows = []
    for collective, nbytes, world_size, seconds in samples:
        steps, fraction = cost_terms(collective, world_size)
        rows.append([steps / seconds, fraction * nbytes / seconds])  # this row, divided by its time...
    if len(rows) < 2:
        raise ValueError("fitting α and β needs at least two samples")
    # A fit of measured times, in the notebook's kernel: on the CPU whatever device the ranks ran on.
    a = torch.tensor(rows, dtype=torch.float64, device="cpu")
    b = torch.ones(len(rows), 1, dtype=torch.float64, device="cpu")  # ...must come out as 1
    alpha, beta = torch.linalg.lstsq(a, b).solution.flatten().tolist()
    return AlphaBeta(alpha, beta)


def algorithm_bandwidth(nbytes: float, seconds: float) -> float:
    """nccl-tests' ``algbw = S / t``, bytes per second."""
    return nbytes / seconds


def bus_bandwidth(collective: str, nbytes: float, seconds: float, world_size: int) -> float:
    """nccl-tests' ``busbw = algbw × factor(N)``: comparable with a link's bandwidth, whatever N is."""
    if collective not in BUS_FACTORS:
        raise ValueError(f"no bus-bandwidth factor for {collective!r}; known: {sorted(BUS_FACTORS)}")
    return algorithm_bandwidth(nbytes, seconds) * BUS_FACTORS[collective](world_size)


def time_collective(run, *, repeats: int = 5, warmup: int = 1, group=None) -> float:
    """Seconds one call of ``run()`` takes on the slowest rank: the median over ``repeats`` calls.

    Every rank must call it together. Each call starts after a barrier; its time is the slowest rank's,
    because a collective is done when its last rank is.
    """
    import torch
    import torch.distributed as dist

    from helpers import dist as book_dist

    def call():
        run()
        if dist.get_backend(group) == "nccl":
            torch.cuda.synchronize()  # NCCL returns before the GPU is done

    for _ in range(warmup):
        call()
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    slowest = torch.tensor(times, dtype=torch.float64, device=book_dist.device())  # all-reduced there
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return statistics.median(slowest.tolist())



__all__ = ["chunk_sizes", "expected_bytes", "all_to_all_bytes", "tree_children", "ALIASES", "COSTS",
           "BUS_FACTORS", "cost_terms", "AlphaBeta", "fit", "algorithm_bandwidth", "bus_bandwidth",
           "time_collective"]
