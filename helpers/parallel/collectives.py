"""Collectives from point-to-point messages (chapter 02): every byte moves through ``LEDGER.exchange``.

Chapter 02 builds each collective of ``torch.distributed`` from sends and receives, with the algorithms MPI
and NCCL use (Thakur, Rabenseifner and Gropp 2005; Patarasuk and Yuan 2009):

- ``ring_reduce_scatter``, ``ring_all_gather`` and ``ring_all_reduce`` (the two in sequence): N-1 steps each,
  every rank sends to its right neighbour and receives from its left, one chunk per step;
- ``tree_broadcast`` and ``tree_reduce``: a binomial tree, ⌈log2 N⌉ rounds;
- ``pairwise_all_to_all``: N-1 steps, at step s rank r sends to r+s and receives from r-s;
- ``recursive_doubling_all_reduce``: log2 N rounds of swapping the whole buffer with rank r xor 2^k, the
  latency-bound contrast to the ring.

Buffers are flat: a tensor is reduced or gathered as ``tensor.reshape(-1)``, split into chunks as
``torch.tensor_split`` splits (:func:`helpers.cost.collective_costs.chunk_sizes`), so sizes that do not
divide by the world size work. Ranks are numbered within ``group`` (the whole world by default).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from helpers.parallel.ledger import LEDGER


def ring_reduce_scatter_(chunks: list[torch.Tensor], group=None) -> None:
    """Ring reduce-scatter in place: afterwards ``chunks[rank]`` holds the sum of every rank's chunk ``rank``.

    At step s, rank r sends chunk r-s-1 to its right neighbour, receives chunk r-s-2 from its left one and
    adds its own contribution to it. A chunk starts on the rank after its owner and travels N-1 hops
    around the ring, gathering one addend per hop, so it ends, complete, on its owner. One receive buffer,
    the size of the largest chunk, serves every step.
    """
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    inbox = chunks[0].new_empty(max(chunk.numel() for chunk in chunks))  # allocated once, not once per step
    with LEDGER.collective("ring_reduce_scatter"):
        for step in range(world_size - 1):
            send_index = (rank - step - 1) % world_size
            recv_index = (rank - step - 2) % world_size
            received = inbox[:chunks[recv_index].numel()].view(chunks[recv_index].shape)
            LEDGER.exchange(chunks[send_index], right, received, left, group=group,
                            send_chunk=send_index, recv_chunk=recv_index)
            chunks[recv_index] += received  # the partial sum from upstream, plus this rank's addend


def ring_all_gather_(chunks: list[torch.Tensor], group=None) -> None:
    """Ring all-gather in place: ``chunks[rank]`` is this rank's; afterwards every chunk is filled.

    At step s, rank r passes chunk r-s to its right neighbour and receives chunk r-s-1 from its left one:
    each chunk travels N-1 hops from its owner, copied, not added.
    """
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    with LEDGER.collective("ring_all_gather"):
        for step in range(world_size - 1):
            send_index = (rank - step) % world_size
            recv_index = (rank - step - 1) % world_size
            LEDGER.exchange(chunks[send_index], right, chunks[recv_index], left, group=group,
                            send_chunk=send_index, recv_chunk=recv_index)


def ring_reduce_scatter(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """The sum over ranks of ``tensor``'s chunk ``rank`` (``tensor`` itself is left as it was)."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    chunks = list(tensor.detach().reshape(-1).clone().tensor_split(world_size))
    ring_reduce_scatter_(chunks, group)
    return chunks[rank]


def ring_all_gather(shard: torch.Tensor, numel: int, group=None) -> torch.Tensor:
    """Every rank's shard, concatenated: a flat tensor of ``numel`` elements; this rank's shard is chunk
    ``rank`` of it."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    buffer = shard.new_empty(numel)
    chunks = list(buffer.tensor_split(world_size))
    if chunks[rank].numel() != shard.numel():
        raise ValueError(f"rank {rank}: a shard of {shard.numel()} elements, but chunk {rank} of "
                         f"{numel} elements over {world_size} ranks has {chunks[rank].numel()}")
    chunks[rank].copy_(shard.reshape(-1))
    ring_all_gather_(chunks, group)
    return buffer


def ring_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """The sum over ranks of ``tensor``: a ring reduce-scatter, then a ring all-gather of the sums.

    Each rank sends 2(N-1)/N of the buffer, whatever N is: the bandwidth-optimal all-reduce
    (Patarasuk and Yuan 2009). The chunks are views of one buffer, so the all-gather finds each rank's
    reduced chunk where the reduce-scatter left it.
    """
    world_size = dist.get_world_size(group)
    buffer = tensor.detach().reshape(-1).clone()
    chunks = list(buffer.tensor_split(world_size))
    with LEDGER.collective("ring_all_reduce"):
        ring_reduce_scatter_(chunks, group)
        ring_all_gather_(chunks, group)
    return buffer.reshape(tensor.shape)


def tree_broadcast(tensor: torch.Tensor, src: int = 0, group=None) -> None:
    """Copy ``tensor`` of rank ``src`` into ``tensor`` on every rank, in place, along a binomial tree.

    Ranks are renumbered so that ``src`` is 0 (``vrank``). A rank first receives from its parent, ``vrank``
    minus its lowest set bit, then sends to its children ``vrank + 2^k`` for the smaller powers of two: the
    number of ranks holding the data doubles each round, ⌈log2 N⌉ rounds in all (MPICH's short-message
    broadcast, Thakur et al. 2005).
    """
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    vrank = (rank - src) % world_size
    mask = 1
    with LEDGER.collective("tree_broadcast"):
        while mask < world_size:
            if vrank & mask:
                LEDGER.exchange(recv=tensor, src=(vrank - mask + src) % world_size, group=group)
                break
            mask <<= 1
        mask >>= 1
        while mask > 0:
            if vrank + mask < world_size:
                LEDGER.exchange(tensor, (vrank + mask + src) % world_size, group=group)
            mask >>= 1


def tree_reduce(tensor: torch.Tensor, dst: int = 0, group=None) -> torch.Tensor | None:
    """The sum over ranks of ``tensor``, on rank ``dst`` (``None`` elsewhere), along a binomial tree.

    The broadcast's tree run backwards: in round k a rank whose bit k is set sends its partial sum to
    ``vrank - 2^k`` and stops; the others receive from ``vrank + 2^k`` and add.
    """
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    vrank = (rank - dst) % world_size
    partial = tensor.detach().clone()
    mask = 1
    with LEDGER.collective("tree_reduce"):
        while mask < world_size:
            if vrank & mask:
                LEDGER.exchange(partial, (vrank - mask + dst) % world_size, group=group)
                return None
            if vrank + mask < world_size:
                received = torch.empty_like(partial)
                LEDGER.exchange(recv=received, src=(vrank + mask + dst) % world_size, group=group)
                partial += received
            mask <<= 1
    return partial


def pairwise_all_to_all(outputs: list[torch.Tensor], inputs: list[torch.Tensor], group=None) -> None:
    """``inputs[j]`` goes to rank j, and ``outputs[j]`` receives what rank j sent here; any sizes.

    At step s rank r sends to r+s and receives from r-s: every pair talks exactly once, and no rank ever
    waits for two messages at once (the pairwise exchange of Thakur et al. 2005).
    """
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    outputs[rank].copy_(inputs[rank])
    with LEDGER.collective("pairwise_all_to_all"):
        for step in range(1, world_size):
            dst, src = (rank + step) % world_size, (rank - step) % world_size
            LEDGER.exchange(inputs[dst], dst, outputs[src], src, group=group, send_chunk=dst, recv_chunk=rank)


def recursive_doubling_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """The sum over ranks of ``tensor`` in log2 N rounds: swap the whole buffer with rank ``r xor 2^k``.

    Fewer messages than the ring (log2 N against 2(N-1)), each of the whole buffer instead of 1/N of it:
    better for short messages, worse for long ones (Thakur et al. 2005). N must be a power of two here;
    MPICH first folds the extra ranks into a power of two.
    """
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    if world_size & (world_size - 1):
        raise ValueError(f"recursive doubling needs a power-of-two world size, got {world_size}")
    total = tensor.detach().clone()
    mask = 1
    with LEDGER.collective("recursive_doubling_all_reduce"):
        while mask < world_size:
            partner = rank ^ mask
            received = torch.empty_like(total)
            LEDGER.exchange(total, partner, received, partner, group=group)
            total = total + received  # a + b == b + a in IEEE arithmetic: both partners hold the same bits
            mask <<= 1
    return total
