"""ZeRO-3's parameter all-gather in FP8 (chapter 09): one byte per parameter on the wire instead of two.

torchao's float8 training for FSDP2 all-gathers the weights already cast to FP8, so that the all-gather, the
largest traffic of ZeRO-3, moves half the bytes of a bf16 one. Every rank must quantize its shard with the
*same* scale, or the gathered rows would be on different scales: the ranks first agree on the tensor's amax
with an all-reduce (MAX) of their shards' amaxes, then each quantizes its rows with the tensorwise recipe of
:mod:`helpers.training.fp8_recipes` and the FP8 bytes are gathered. gloo refuses FP8 tensors
("Invalid scalar type", measured in chapter 09), so :func:`helpers.parallel.comms.all_gather` sends the
``uint8`` view of the bytes and reinterprets them after (``wire_dtype`` set to the FP8 dtype). NCCL needs no
view: PyTorch's NCCL backend maps ``float8_e4m3fn`` and ``float8_e5m2`` to NCCL's own FP8 types from NCCL 2.24
on, and to ``ncclUint8`` before (``torch/csrc/distributed/c10d/NCCLUtils.hpp`` of torch 2.13.0). Since the
agreed amax is the full tensor's, the gathered weights dequantize to exactly what one process gets by
quantizing the full tensor.
"""

from __future__ import annotations

import torch

from helpers.parallel import comms, zero
from helpers.training.fp8_recipes import dequantize, quantize_tensorwise


def agreed_amax(shard: torch.Tensor, group=None) -> torch.Tensor:
    """The largest ``|x|`` over every rank's shard (an all-reduce MAX of one fp32 number)."""
    amax = shard.detach().abs().max().float().reshape(1)
    return comms.all_reduce(amax, group, op="max")[0]


def fp8_all_gather_rows(shard: torch.Tensor, n_rows: int, group=None,
                        dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's dim-0 ``shard`` (chapter 04's rows) gathered in FP8: ``(q, scale)`` of the full tensor,
    its padding rows dropped; :func:`helpers.training.fp8_recipes.dequantize` gives the weights."""
    q, scale = quantize_tensorwise(shard.detach(), dtype, amax=agreed_amax(shard, group))
    gathered = comms.all_gather(q, 0, group, wire_dtype=dtype)  # the uint8 view on the wire
    return gathered[:n_rows], scale


def fp8_gathered_weights(shard: torch.Tensor, n_rows: int, group=None,
                         dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """The dequantized full weights, in fp32, from the FP8 all-gather of every rank's shard."""
    return dequantize(*fp8_all_gather_rows(shard, n_rows, group, dtype))


def single_process_weights(full: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """What one process gets: the full tensor quantized with its own amax, then dequantized."""
    return dequantize(*quantize_tensorwise(full.detach(), dtype))


def shards_of(model: torch.nn.Module, group=None) -> dict[str, torch.Tensor]:
    """This rank's dim-0 shard of every parameter, as chapter 04's ZeRO-3 keeps them."""
    import torch.distributed as dist

    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    return {name: zero.shard_of(p.detach(), rank, world_size) for name, p in model.named_parameters()}


__all__ = ["agreed_amax", "fp8_all_gather_rows", "fp8_gathered_weights", "single_process_weights",
           "shards_of"]
