"""Number formats from their bits (chapter 09): fp32, bf16, fp16, fp8 e4m3fn and e5m2, e8m0 and fp4 e2m1.

A binary floating-point format is a sign bit, ``E`` exponent bits and ``M`` mantissa bits. A code with
exponent field ``e`` and mantissa field ``m`` is worth

    (-1)^s * 2^(e - bias) * (1 + m / 2^M)     when e > 0 (a normal number),
    (-1)^s * 2^(1 - bias) * (m / 2^M)         when e = 0 (a subnormal number, where the format has them).

Every constant below comes from that one formula and from which codes a format keeps for inf and NaN, the
one thing the formats disagree on (Micikevicius et al. 2022, the OCP 8-bit floating point spec; OCP MX v1.0
for e8m0 and e2m1):

- ``"ieee"`` (fp32, bf16, fp16, e5m2): the all-ones exponent holds inf and NaN, never a number;
- ``"fn"`` (e4m3fn, "finite, NaN"): no inf; only the all-ones code is NaN, so the top exponent holds numbers
  and e4m3 reaches 448 instead of 240;
- ``"fnu"`` (e8m0, "finite, NaN, unsigned"): exponent bits only, no sign, no zero, no subnormals; the
  all-ones code is NaN. MX formats use it as a power-of-two block scale;
- ``"none"`` (e2m1, fp4): every code is a finite number, no inf, no NaN; the largest is 6.

:meth:`Format.values` decodes every code, so a page can compare the formula with torch's own casts byte for
byte, and :func:`round_to_format` rounds to the nearest value of any format (ties to even), which is how the
book simulates fp4, a format torch cannot compute with on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SPECIALS = ("ieee", "fn", "fnu", "none")


@dataclass(frozen=True)
class Format:
    """A floating-point format: its bits and its convention for inf and NaN (one of :data:`SPECIALS`)."""

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    special: str
    signed: bool = True
    subnormals: bool = True

    def __post_init__(self):
        if self.special not in SPECIALS:
            raise ValueError(f"special={self.special!r} is not one of {', '.join(SPECIALS)}")

    @property
    def bits(self) -> int:
        return int(self.signed) + self.exponent_bits + self.mantissa_bits

    def _top_code(self) -> tuple[int, int]:
        """The exponent and mantissa fields of the largest finite code."""
        e_all, m_all = 2 ** self.exponent_bits - 1, 2 ** self.mantissa_bits - 1
        if self.special == "ieee":
            return e_all - 1, m_all  # the all-ones exponent is inf/NaN
        if self.special in ("fn", "fnu"):  # only the all-ones code is NaN
            return (e_all, m_all - 1) if self.mantissa_bits > 0 else (e_all - 1, 0)
        return e_all, m_all

    def decode(self, e: int, m: int) -> float:
        """The value of the positive code with exponent field ``e`` and mantissa field ``m``."""
        if e == 0 and self.subnormals:
            return 2.0 ** (1 - self.bias) * (m / 2 ** self.mantissa_bits)
        return 2.0 ** (e - self.bias) * (1 + m / 2 ** self.mantissa_bits)

    @property
    def max(self) -> float:
        """The largest finite value."""
        return self.decode(*self._top_code())

    @property
    def emax(self) -> int:
        """The exponent of the largest binade (OCP MX calls it emax of the element format)."""
        return self._top_code()[0] - self.bias

    @property
    def smallest_normal(self) -> float:
        return self.decode(1 if self.subnormals else 0, 0)

    @property
    def smallest_subnormal(self) -> float:
        """The smallest positive value: a subnormal, or the smallest normal in a format without them."""
        return self.decode(0, 1) if self.subnormals and self.mantissa_bits > 0 else self.smallest_normal

    @property
    def eps(self) -> float:
        """Machine epsilon: the gap between 1 and the next value, 2^-M."""
        return 2.0 ** -self.mantissa_bits

    def values(self) -> torch.Tensor:
        """Every code's value, in code order (the sign bit first, then the exponent, then the mantissa).

        NaN codes decode as NaN and the ieee formats' inf codes as inf; float64, which holds them all exactly.
        """
        out = []
        for code in range(2 ** self.bits):
            sign = -1.0 if self.signed and code >> (self.bits - 1) else 1.0
            e = (code >> self.mantissa_bits) & (2 ** self.exponent_bits - 1)
            m = code & (2 ** self.mantissa_bits - 1)
            e_all = e == 2 ** self.exponent_bits - 1
            if self.special == "ieee" and e_all:
                out.append(sign * float("inf") if m == 0 else float("nan"))
            elif self.special in ("fn", "fnu") and e_all and m == 2 ** self.mantissa_bits - 1:
                out.append(float("nan"))
            else:
                out.append(sign * self.decode(e, m))
        # a table of the format's values from Python numbers, read in the kernel: on the CPU
        return torch.tensor(out, dtype=torch.float64, device="cpu")

    def ulp(self, y: torch.Tensor) -> torch.Tensor:
        """The unit in the last place of the format in the binade of each ``|y|`` (y within range).

        In the binade [2^k, 2^(k+1)) the values are 2^(k - M) apart; below the smallest normal, the
        subnormals are the smallest subnormal apart.
        """
        k = torch.floor(torch.log2(y.abs().double().clamp(min=self.smallest_normal)))
        return torch.exp2(k - self.mantissa_bits)


FP32 = Format("fp32", 8, 23, 127, "ieee")
BF16 = Format("bf16", 8, 7, 127, "ieee")
FP16 = Format("fp16", 5, 10, 15, "ieee")
E4M3 = Format("fp8 e4m3fn", 4, 3, 7, "fn")
E5M2 = Format("fp8 e5m2", 5, 2, 15, "ieee")
E8M0 = Format("e8m0 (MX scale)", 8, 0, 127, "fnu", signed=False, subnormals=False)
E2M1 = Format("fp4 e2m1", 2, 1, 1, "none")
FORMATS = (FP32, BF16, FP16, E4M3, E5M2, E8M0, E2M1)

# the torch dtype of each format, where torch has one that finfo describes (fp4 e2m1 has a packed dtype,
# float4_e2m1fn_x2, two values a byte, that neither finfo nor a CPU cast supports in torch 2.13)
TORCH_DTYPES = {FP32: torch.float32, BF16: torch.bfloat16, FP16: torch.float16,
                E4M3: torch.float8_e4m3fn, E5M2: torch.float8_e5m2}
if hasattr(torch, "float8_e8m0fnu"):
    TORCH_DTYPES[E8M0] = torch.float8_e8m0fnu


def round_to_format(y: torch.Tensor, fmt: Format) -> torch.Tensor:
    """``y`` rounded to the nearest value of ``fmt``, ties to even, saturating at ``±fmt.max`` (fp32).

    The values of a binade are ``ulp`` apart, so rounding is ``round(y / ulp) * ulp`` in that binade;
    ``torch.round`` rounds halves to even, as IEEE's default rounding does. Exact for any ``y`` of a format
    with fewer mantissa bits than fp64's. Edge inputs: ``±inf`` saturates to ``±fmt.max`` (``y`` is clamped
    before its ulp is taken, since the ulp of inf is inf and inf / inf is NaN); a format without zero (e8m0)
    takes its smallest value for anything below it; NaN stays NaN in a format that has a NaN, and is refused,
    like a negative number in an unsigned format, where the format has no code for it.
    """
    y64 = y.double()
    if not fmt.signed and bool((y64 < 0).any()):
        raise ValueError(f"{fmt.name} is unsigned: it has no code for the negative values given")
    if fmt.special == "none" and bool(y64.isnan().any()):
        raise ValueError(f"{fmt.name} has no NaN code: the input holds NaN")
    y64 = y64.clamp(-fmt.max, fmt.max)  # saturate first: the ulp of an inf is inf
    ulp = fmt.ulp(y64)
    rounded = torch.round(y64 / ulp) * ulp
    if fmt.special == "fnu":  # no zero and no subnormals: the smallest value is the smallest normal
        rounded = rounded.clamp(min=fmt.smallest_normal)
    return rounded.clamp(-fmt.max, fmt.max).float()
