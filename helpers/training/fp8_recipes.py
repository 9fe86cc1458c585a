"""FP8 (and FP4) matmul recipes: how each scales its blocks before the cast (chapter 09).

A recipe picks the blocks that share one scale, from the whole tensor down to 16 values. The convention for
the fp32 scales is torchao's: ``scale = fp8_max / amax`` over the block, ``q = cast(clamp(x * scale))`` and
``x ≈ q.float() / scale`` (:func:`dequantize`). The scale *multiplies* before the cast, so the block's
largest value lands on the format's largest; ``torch._scaled_mm`` takes the inverse, ``1 / scale``.

- :func:`quantize_tensorwise`: one scale for the tensor (``amax`` may be given: an amax agreed across ranks);
- :func:`quantize_rowwise`: one scale per row (the rows of an activation, the output rows of a weight);
- :func:`quantize_blockwise`: DeepSeek-V3's tiles, 1x128 for activations and 128x128 for weights
  (DeepSeek-AI 2024);
- :func:`quantize_mxfp8`: OCP MX v1.0, blocks of 32 along a row with a power-of-two e8m0 scale ``X``,
  shared exponent ``floor(log2(amax)) - emax_elem``, ``x ≈ q * X`` (:func:`dequantize_mx`);
- :func:`quantize_nvfp4`: blocks of 16 e2m1 values with an e4m3 block scale and an fp32 tensor scale,
  ``x ≈ q * block_scale * tensor_scale`` (:func:`dequantize_nvfp4`); torch 2.13 cannot cast to fp4 on
  CPU, so the values are rounded to the e2m1 grid in fp32 (``number_formats.round_to_format``).

Every recipe clamps to the format's range before the cast, because a cast past the largest value does not
saturate in every format (chapter 09 measures it).
"""

from __future__ import annotations

import torch

from helpers.training import number_formats

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_FORMATS = {torch.float8_e4m3fn: number_formats.E4M3, torch.float8_e5m2: number_formats.E5M2}
# an all-zero block gets a finite scale: torchao's float8 code clamps its amax the same way (EPS = 1e-12 in
# torchao/float8/float8_utils.py); MX scales take no floor (OCP MX v1.0: the block's own exponent)
AMAX_FLOOR = 1e-12
DEEPSEEK_ACTIVATION_TILE = (1, 128)
DEEPSEEK_WEIGHT_BLOCK = (128, 128)
MX_BLOCK = 32
NVFP4_BLOCK = 16


def fp8_format(dtype: torch.dtype) -> number_formats.Format:
    """The format of a supported fp8 dtype; any other dtype is refused, naming those supported."""
    if dtype not in FP8_FORMATS:
        names = ", ".join(str(d) for d in FP8_DTYPES)
        raise ValueError(f"dtype {dtype} is not supported: the fp8 recipes take {names}")
    return FP8_FORMATS[dtype]


def amax_to_scale(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``fp8_max / amax`` in fp32, computed in fp64 as torchao's ``amax_to_scale`` does; an inf or NaN amax
    (a tensor holding inf or NaN) has no finite scale and is refused."""
    if not bool(torch.isfinite(amax).all()):
        raise ValueError(f"an amax of {amax.max().item()} has no finite scale: the tensor holds inf or NaN")
    return (fp8_format(dtype).max / amax.double().clamp(min=AMAX_FLOOR)).float()


def _cast(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    fmax = fp8_format(dtype).max
    return y.clamp(-fmax, fmax).to(dtype)  # clamp first: past the largest value, e5m2 gives inf


def quantize_tensorwise(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, amax=None):
    """``(q, scale)``: one fp32 scale for the whole tensor, ``scale = fp8_max / amax``.

    ``q = cast(clamp(x * scale, -fp8_max, fp8_max))`` and ``x ≈ q.float() / scale``. ``amax`` given (a
    tensor or a number, e.g. the maximum of every rank's ``x.abs().max()``) is used instead of the tensor's
    own, so that every rank quantizes with the same scale.
    """
    amax = x.abs().max() if amax is None else torch.as_tensor(amax, device=x.device)
    scale = amax_to_scale(amax.float(), dtype)
    return _cast(x.float() * scale, dtype), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 ``q / scale``, with each block's scale spread over its block (the convention of this module)."""
    return q.float() / expand_blocks(scale, q.shape)


def expand_blocks(scale: torch.Tensor, shape) -> torch.Tensor:
    """One scale per block, spread to one per element: dimension ``d`` repeats ``shape[d] // scale.shape[d]``
    times (a 0-d or size-1 scale broadcasts as it is)."""
    for d in range(scale.dim()):
        if scale.shape[d] not in (1, shape[d]):
            scale = scale.repeat_interleave(shape[d] // scale.shape[d], dim=d)
    return scale


def _blocks(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """A 2-d ``x`` as ``(rows / br, br, cols / bc, bc)``; a block that does not divide is refused."""
    if x.dim() != 2:
        raise ValueError(f"the block recipes take a 2-d tensor, got shape {tuple(x.shape)}")
    for d, (size, b) in enumerate(zip(x.shape, block)):
        if b <= 0 or size % b:
            raise ValueError(f"block size {b} does not divide dimension {d} of size {size} "
                             f"(tensor of shape {tuple(x.shape)}, block {tuple(block)})")
    (rows, cols), (br, bc) = x.shape, block
    return x.reshape(rows // br, br, cols // bc, bc)


def block_amax(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The largest ``|x|`` of each block: shape ``(rows / br, cols / bc)``."""
    return _blocks(x.float(), block).abs().amax(dim=(1, 3))


def quantize_blocks(x: torch.Tensor, block: tuple[int, int], dtype: torch.dtype = torch.float8_e4m3fn):
    """``(q, scale)`` with one fp32 scale ``fp8_max / amax`` per ``block`` of a 2-d tensor."""
    scale = amax_to_scale(block_amax(x, block), dtype)
    return _cast(x.float() * expand_blocks(scale, x.shape), dtype), scale


def quantize_rowwise(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn):
    """One scale per row: scale of shape ``(rows, 1)``, what ``torch._scaled_mm`` takes for a row-wise A."""
    return quantize_blocks(x, (1, x.shape[-1]), dtype)


def quantize_blockwise(x: torch.Tensor, block: tuple[int, int] = DEEPSEEK_ACTIVATION_TILE,
                       dtype: torch.dtype = torch.float8_e4m3fn):
    """DeepSeek-V3's fine-grained scaling: tiles of 1x128 (activations) or blocks of 128x128 (weights)."""
    return quantize_blocks(x, block, dtype)


def mx_shared_exponent(amax: torch.Tensor, element: number_formats.Format, rounding: str = "floor"):
    """A block's shared exponent, within e8m0's range [-127, 127].

    ``"floor"``: OCP MX v1.0's ``floor(log2(amax)) - emax_elem``; ``"up"``: the smallest power of two
    that keeps ``amax / X`` within the element format's largest value, ``ceil(log2(amax / max_elem))``.
    No floor on the amax: a block of tiny values keeps its own exponent (an amax of 2^-50 gives 2^-58), and
    an all-zero block (log2 0 = -inf) takes e8m0's smallest scale, 2^-127, which encodes zeros as well as any.
    """
    if rounding not in ("floor", "up"):
        raise ValueError(f"rounding={rounding!r} is not one of 'floor', 'up'")
    e8m0 = number_formats.E8M0
    amax = amax.double()
    if rounding == "floor":
        exponent = torch.floor(torch.log2(amax)) - element.emax
    else:
        exponent = torch.ceil(torch.log2(amax / element.max))
    return exponent.clamp(-e8m0.bias, e8m0.emax)


def quantize_mxfp8(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, block: int = MX_BLOCK,
                   rounding: str = "floor"):
    """``(q, scale)``: blocks of ``block`` values along each row share a power-of-two scale ``X`` (e8m0).

    ``q = cast(clamp(x / X))`` and ``x ≈ q * X``. With OCP's floor, ``amax / X`` lies in
    ``[2^emax, 2^(emax+1))``, so values of the block above the format's largest (448 for e4m3) saturate;
    ``rounding="up"`` (:func:`mx_shared_exponent`) avoids that at the price of one binade of range.
    """
    element = fp8_format(dtype)
    exponent = mx_shared_exponent(block_amax(x, (1, block)), element, rounding)
    scale = torch.exp2(exponent).float().to(torch.float8_e8m0fnu)  # a power of two: exact in e8m0
    return _cast(x.float() / expand_blocks(scale.float(), x.shape), dtype), scale


def dequantize_mx(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 ``q * X`` for MX's multiplying scale ``X`` (e8m0)."""
    return q.float() * expand_blocks(scale.float(), q.shape)


def quantize_nvfp4(x: torch.Tensor, block: int = NVFP4_BLOCK):
    """``(q, block_scale, tensor_scale)``: 16-value blocks on the e2m1 grid (fp32, simulated), one e4m3
    scale per block and one fp32 scale for the tensor, as Transformer Engine's reference NVFP4 quantizer.

    The tensor's encode scale ``6 * 448 / amax`` puts every block's decode scale ``block_amax / 6 * encode``
    within e4m3's range; that decode scale is cast to the *nearest* e4m3 value, so where the cast went down a
    block's largest values land a little past 6 and are clamped to 6 before the rounding to e2m1 (at most
    ``6 / (1 - 2^-4)``: e4m3's relative half ulp). ``tensor_scale`` is the decode scale ``1 / encode``.
    An all-zero tensor or block gives zeros (its encode scale is capped at fp32's largest, as TE caps it).
    """
    e2m1, e4m3 = number_formats.E2M1, number_formats.E4M3
    fp32_max = torch.finfo(torch.float32).max
    encode = torch.tensor(e2m1.max * e4m3.max, dtype=torch.float32, device=x.device) / x.abs().max().float()
    encode = encode.clamp(max=fp32_max)
    decode = (block_amax(x, (1, block)) / e2m1.max * encode).clamp(max=e4m3.max)
    block_scale = decode.to(torch.float8_e4m3fn)  # round to nearest
    block_encode = (encode / block_scale.float()).clamp(max=fp32_max)
    y = (x.float() * expand_blocks(block_encode, x.shape)).clamp(-e2m1.max, e2m1.max)
    return number_formats.round_to_format(y, e2m1), block_scale, 1.0 / encode


def dequantize_nvfp4(q: torch.Tensor, block_scale: torch.Tensor, tensor_scale: torch.Tensor) -> torch.Tensor:
    """fp32 ``q * block_scale * tensor_scale``."""
    return q * expand_blocks(block_scale.float(), q.shape) * tensor_scale


def simulate(x: torch.Tensor, fmt: number_formats.Format, block: tuple[int, int]) -> torch.Tensor:
    """Quantize and dequantize on the grid of any format (fp4 included), one fp32 scale per ``block``."""
    scale = expand_blocks(fmt.max / block_amax(x, block).clamp(min=AMAX_FLOOR), x.shape)
    return number_formats.round_to_format(x.float() * scale, fmt) / scale


def half_ulp_excess(y: torch.Tensor, q: torch.Tensor, fmt: number_formats.Format) -> torch.Tensor:
    """How far each quantized value ``q`` lies beyond half an ulp of ``fmt`` from the scaled value ``y``.

    All zeros when every cast rounded to a nearest value: ``|y - q| <= ulp(y) / 2`` with the ulp of ``y``'s
    binade (:meth:`Format.ulp`); a ``y`` past the format's largest value must give exactly ``±max``.
    """
    y, q = y.double(), q.double()
    inside = ((y - q).abs() - fmt.ulp(y) / 2).clamp(min=0)
    saturated = (q - y.sign() * fmt.max).abs()
    return torch.where(y.abs() <= fmt.max, inside, saturated)
