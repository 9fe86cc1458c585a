"""Number formats from their bits (chapter 09): the formula against torch.finfo and torch's own casts.

Everything is exact: the constants, the 256 codes of each 8-bit format and the rounding of every midpoint.
"""

import pytest
import torch

from helpers.training import number_formats
from helpers.training.number_formats import E2M1, E4M3, E5M2, E8M0, Format, round_to_format


@pytest.mark.parametrize("fmt", list(number_formats.TORCH_DTYPES), ids=lambda f: f.name)
def test_constants_equal_torch_finfo(fmt):
    finfo = torch.finfo(number_formats.TORCH_DTYPES[fmt])
    assert fmt.max == finfo.max
    assert fmt.smallest_normal == finfo.smallest_normal
    assert fmt.eps == finfo.eps
    assert fmt.bits == finfo.bits
    assert finfo.min == (-fmt.max if fmt.signed else fmt.smallest_normal)


def test_the_constants_the_papers_give():
    assert (E4M3.max, E5M2.max, E2M1.max) == (448.0, 57344.0, 6.0)
    smallest = (E4M3.smallest_subnormal, E5M2.smallest_subnormal, E2M1.smallest_subnormal)
    assert smallest == (2.0 ** -9, 2.0 ** -16, 0.5)
    assert (E4M3.emax, E5M2.emax, E2M1.emax) == (8, 15, 2)  # OCP MX's emax of the element formats
    assert (E8M0.max, E8M0.smallest_normal) == (2.0 ** 127, 2.0 ** -127)


@pytest.mark.parametrize("fmt", [E4M3, E5M2, E8M0], ids=lambda f: f.name)
def test_every_code_decodes_as_torch_views_it(fmt):
    torch_values = torch.arange(256, dtype=torch.uint8).view(number_formats.TORCH_DTYPES[fmt]).double()
    mine = fmt.values()
    assert torch.equal(torch_values.isnan(), mine.isnan())
    assert torch.equal(torch_values.nan_to_num(nan=0.0), mine.nan_to_num(nan=0.0))


def test_fp4_has_sixteen_finite_codes():
    values = E2M1.values()
    assert values.isfinite().all()
    assert values[:8].tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_rounding_matches_torch_cast_ties_to_even(fmt):
    dtype = number_formats.TORCH_DTYPES[fmt]
    values = fmt.values()
    values = values[values.isfinite()].unique().sort().values
    midpoints = ((values[1:] + values[:-1]) / 2).float()
    assert torch.equal(round_to_format(midpoints, fmt), midpoints.to(dtype).float())
    codes = midpoints.to(dtype).view(torch.uint8)
    assert (codes % 2 == 0).all()  # a tie goes to the even code
    generator = torch.Generator().manual_seed(0)
    binades = torch.randint(-14, 14, (100_000,), generator=generator)
    y = torch.randn(100_000, generator=generator) * torch.exp2(binades.float())
    y = y.clamp(-fmt.max, fmt.max)
    assert torch.equal(round_to_format(y, fmt), y.to(dtype).float())


def test_ulp_is_the_spacing_of_the_binade():
    assert E4M3.ulp(torch.tensor([1.0, 1.9, 256.0, 448.0, 2.0 ** -7])).tolist() == [0.125, 0.125, 32.0, 32.0,
                                                                                  2.0 ** -9]


def test_an_unknown_convention_is_refused():
    with pytest.raises(ValueError, match="ieee, fn, fnu, none"):
        Format("bad", 4, 3, 7, "saturating")


@pytest.mark.parametrize("fmt", [E4M3, E5M2, number_formats.BF16, number_formats.FP16], ids=lambda f: f.name)
def test_infinities_saturate_to_the_largest_value(fmt):
    got = round_to_format(torch.tensor([float("inf"), -float("inf")]), fmt)
    assert got.tolist() == [fmt.max, -fmt.max]


def test_e8m0_has_no_zero_and_no_sign():
    got = round_to_format(torch.tensor([2.0 ** -130, 0.0, 2.0 ** -127, 2.0 ** 200]), E8M0)
    assert got.tolist() == [2.0 ** -127, 2.0 ** -127, 2.0 ** -127, 2.0 ** 127]
    with pytest.raises(ValueError, match="unsigned"):
        round_to_format(torch.tensor([-1.0]), E8M0)


def test_nan_stays_nan_where_the_format_has_one_and_is_refused_in_fp4():
    assert round_to_format(torch.tensor([float("nan")]), E4M3).isnan().all()
    with pytest.raises(ValueError, match="no NaN"):
        round_to_format(torch.tensor([float("nan")]), E2M1)
