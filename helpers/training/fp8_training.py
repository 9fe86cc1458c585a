"""FP8 training of the book's GPT (chapter 09): its linear layers in FP8, and ZeRO-3 gathering them in FP8.

- :class:`Float8Matmul` is one linear layer's three matmuls in FP8, with the formats of the FP8 paper
  (Micikevicius et al. 2022): the forward ``y = x W^T`` with ``x`` and ``W`` in e4m3, the backward
  ``grad_x = grad_y W`` and ``grad_W = grad_y^T x`` with the output's gradient in e5m2 (its range matters
  more than its precision) and ``x``, ``W`` in e4m3 as saved by the forward. Every cast uses the tensorwise
  recipe of :mod:`helpers.training.fp8_recipes` with the scale taken from the tensor itself (*current* or
  *dynamic* scaling, torchao's default ``Float8LinearConfig``). The products are computed in fp32 from the
  dequantized operands, which is what ``torch._scaled_mm`` computes up to the order of its sums
  (``scaled_mm=True`` runs it instead; chapter 09 checks the two agree): on this CPU build it is a reference
  kernel, hundreds of times slower than an fp32 matmul, and the CPU has no FP8 arithmetic, so FP8 here shows
  what the formats do to training, never how fast it is.
- :func:`convert_to_float8` swaps every ``nn.Linear`` of the transformer blocks for a :class:`Float8Linear`
  that keeps the same weight ``Parameter`` (torchao's ``convert_to_float8_training`` swaps modules the same
  way); the embedding and the LM head stay in the model's precision, as DeepSeek-V3 and torchao keep them.
- :class:`Float8GatherZero3` is chapter 04's ZeRO-3 whose all-gathers move the blocks' parameters in e4m3
  (``wire="fp8"``, torchao's float8 all-gather for FSDP2: the ranks agree on each parameter's amax with one
  all-reduce MAX per unit, then every rank quantizes its shard with that scale) or in bf16 (``wire="bf16"``,
  FSDP2's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``); the shards and the optimizer stay fp32.
"""

from __future__ import annotations

import torch
from torch import nn

from helpers.parallel import comms, zero
from helpers.training.fp8_recipes import amax_to_scale, dequantize, quantize_tensorwise

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def scaled_matmul(q_a: torch.Tensor, scale_a: torch.Tensor, q_b: torch.Tensor, scale_b: torch.Tensor,
                  scaled_mm: bool = False) -> torch.Tensor:
    """fp32 ``(q_a / scale_a) @ (q_b / scale_b)`` for tensorwise-scaled FP8 operands; with ``scaled_mm``,
    through ``torch._scaled_mm`` (which multiplies by the inverse scales after the product)."""
    if scaled_mm:
        return torch._scaled_mm(q_a.contiguous(), q_b.t().contiguous().t(), scale_a=scale_a.reciprocal(),
                                scale_b=scale_b.reciprocal(), out_dtype=torch.float32)
    return dequantize(q_a, scale_a) @ dequantize(q_b, scale_b)


class Float8Matmul(torch.autograd.Function):
    """``x W^T`` with e4m3 ``x`` and ``W`` forward and an e5m2 output gradient backward (the FP8 paper's
    formats, torchao's tensorwise recipe, current scaling). The result has ``x``'s dtype."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, scaled_mm: bool = False) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):  # the fp32 products must stay fp32
            q_x, scale_x = quantize_tensorwise(x.reshape(-1, x.shape[-1]), E4M3)
            q_w, scale_w = quantize_tensorwise(weight, E4M3)
            out = scaled_matmul(q_x, scale_x, q_w.t(), scale_w, scaled_mm)
        ctx.save_for_backward(q_x, scale_x, q_w, scale_w)  # one byte a value, as torchao saves them
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype, ctx.scaled_mm = x.shape, x.dtype, weight.dtype, scaled_mm
        return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q_x, scale_x, q_w, scale_w = ctx.saved_tensors
        with torch.autocast(grad_out.device.type, enabled=False):
            q_g, scale_g = quantize_tensorwise(grad_out.reshape(-1, grad_out.shape[-1]), E5M2)
            grad_x = scaled_matmul(q_g, scale_g, q_w, scale_w, ctx.scaled_mm)
            grad_w = scaled_matmul(q_g.t(), scale_g, q_x, scale_x, ctx.scaled_mm)
        return grad_x.to(ctx.x_dtype).reshape(ctx.x_shape), grad_w.to(ctx.w_dtype), None


class Float8Linear(nn.Module):
    """A bias-free ``nn.Linear`` whose matmuls run in FP8 (:class:`Float8Matmul`); it keeps the linear's own
    weight ``Parameter``, so an optimizer built before or after the swap updates the same tensor."""

    def __init__(self, linear: nn.Linear, scaled_mm: bool = False):
        super().__init__()
        if linear.bias is not None:
            raise ValueError("Float8Linear takes a linear without bias (the book's GPT has none)")
        self.weight, self.scaled_mm = linear.weight, scaled_mm
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Float8Matmul.apply(x, self.weight, self.scaled_mm)


def convert_to_float8(model: nn.Module, scaled_mm: bool = False) -> list[str]:
    """Swap every ``nn.Linear`` inside ``model.blocks`` for a :class:`Float8Linear`, in place; the names of
    the swapped layers. The embedding and the LM head (tied to it or not) stay as they are."""
    swapped = []
    for block_name, block in model.blocks.named_children():
        for parent_name, parent in block.named_modules():
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, Float8Linear(child, scaled_mm))
                    swapped.append(".".join(n for n in ("blocks", block_name, parent_name, name) if n))
    if not swapped:
        raise ValueError("convert_to_float8 found no nn.Linear in model.blocks")
    return swapped


class Float8GatherZero3(zero.Zero3):
    """Chapter 04's ZeRO-3 with the blocks' parameters all-gathered in e4m3 (``wire="fp8"``) or in bf16
    (``wire="bf16"``); the root unit (embeddings, final norm) is gathered in bf16 either way, and the model,
    its shards and AdamW's state stay fp32. The gathered weights are dequantized into fp32, so forward and
    backward compute in fp32 on what the wire carried. Prefetching is not offered."""

    def __init__(self, model: nn.Module, units: list[nn.Module], group=None, *, wire: str = "fp8", **adamw):
        if wire not in ("fp8", "bf16"):
            raise ValueError(f"wire={wire!r} is not one of 'fp8', 'bf16'")
        if adamw.get("prefetch"):
            raise ValueError("Float8GatherZero3 gathers synchronously: prefetch=True is not offered")
        wrong = sorted({str(p.dtype) for p in model.parameters() if p.dtype != torch.float32})
        if wrong:
            raise ValueError(f"Float8GatherZero3 shards an fp32 model (its wire casts); it has {wrong}")
        self.wire = wire
        super().__init__(model, units, group, **adamw)

    def _start_gather(self, i: int, async_op: bool):
        """Unit ``i``'s parameters gathered on the wire's dtype and dequantized into one fp32 buffer, laid
        out as chapter 04's all-gather lays it (every rank's flat shard, rank after rank)."""
        if self.wire == "bf16" or i == 0:
            wire = comms.all_gather(self.flats[i].to(torch.bfloat16), 0, self.group)
            return None, wire.to(self.flats[i].dtype)
        unit = self.units[i]
        pieces = zero.split_views(self.flats[i], [self.shards[p].shape for p in unit])
        # one all-reduce for the unit's amaxes (torchao's precompute_float8_dynamic_scale_for_fsdp: one for
        # all the weights)
        amaxes = comms.all_reduce(torch.stack([piece.abs().max() for piece in pieces]), self.group, op="max")
        q = torch.cat([quantize_tensorwise(piece, E4M3, amax=amax)[0].reshape(-1)
                       for piece, amax in zip(pieces, amaxes)])
        gathered = comms.all_gather(q, 0, self.group, wire_dtype=E4M3)  # the uint8 view on gloo's wire
        scales = torch.cat([amax_to_scale(amax, E4M3).expand(piece.numel())
                            for piece, amax in zip(pieces, amaxes)])
        return None, (gathered.float().view(self.world_size, -1) / scales).reshape(-1)


def gathered_weights(model: nn.Module, wire: str) -> dict[str, torch.Tensor]:
    """What one process's forward sees under :class:`Float8GatherZero3` with ``wire``: each fp32 parameter
    of the blocks quantized tensorwise to e4m3 and back (``"fp8"``) or rounded to bf16, everything else in
    bf16 and back. Written from the recipe, for checking the distributed run against it."""
    blocks = {p for p in model.blocks.parameters()}
    out = {}
    for name, p in model.named_parameters():
        if wire == "fp8" and p in blocks:
            out[name] = dequantize(*quantize_tensorwise(p.detach(), E4M3))
        else:
            out[name] = p.detach().to(torch.bfloat16).float()
    return out


__all__ = ["scaled_matmul", "Float8Matmul", "Float8Linear", "convert_to_float8", "Float8GatherZero3",
           "gathered_weights"]
