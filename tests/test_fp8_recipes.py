"""The FP8 and FP4 recipes (chapter 09): every value within half an ulp at its block's scale, the scales the
formats require, torch._scaled_mm on CPU, and the errors bad input gets."""

import pytest
import torch

from helpers.training import fp8_recipes, number_formats
from helpers.training.fp8_recipes import expand_blocks, half_ulp_excess

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.fixture(scope="module")
def x():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 512, generator=generator)
    x[:, [7, 300]] *= 100.0  # outlier channels
    return x


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("quantize", [
    fp8_recipes.quantize_tensorwise, fp8_recipes.quantize_rowwise,
    lambda x, dtype: fp8_recipes.quantize_blockwise(x, (1, 128), dtype),
    lambda x, dtype: fp8_recipes.quantize_blockwise(x, (128, 128), dtype),
], ids=["tensorwise", "rowwise", "1x128", "128x128"])
def test_fp32_scaled_recipes_round_to_nearest(x, quantize, dtype):
    q, scale = quantize(x, dtype)
    assert q.dtype == dtype and scale.dtype == torch.float32
    y = x * expand_blocks(scale, x.shape)
    assert half_ulp_excess(y, q.float(), fp8_recipes.FP8_FORMATS[dtype]).max() == 0
    x_hat = fp8_recipes.dequantize(q, scale)
    bound = fp8_recipes.FP8_FORMATS[dtype].ulp(y) / 2 / expand_blocks(scale, x.shape)  # in units of x
    # in fp32, x * scale and q / scale round once each: 2^-24 of |x| each, at most 2^-18 of a half ulp
    assert ((x_hat - x).abs() <= bound * (1 + 2 ** -16)).all()


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_fp32_scales_are_torchaos_and_clamp_nothing(x, dtype):
    fmax = torch.finfo(dtype).max
    for block in [(256, 512), (1, 512), (1, 128), (128, 128)]:
        q, scale = fp8_recipes.quantize_blocks(x, block, dtype)
        amax = torch.tensor([[x[i:i + block[0], j:j + block[1]].abs().max().item()
                              for j in range(0, 512, block[1])] for i in range(0, 256, block[0])])
        assert torch.equal(scale, (fmax / amax.double()).float())  # torchao's amax_to_scale
        y = x * expand_blocks(scale, x.shape)
        assert (y.abs() <= fmax * (1 + 2 ** -22)).all(), f"{block}: a value clamped"


def test_mx_scales_of_tiny_blocks_keep_their_own_exponent():
    tiny = torch.randn(32, 128, generator=torch.Generator().manual_seed(1)) * 1e-13
    q, scale = fp8_recipes.quantize_mxfp8(tiny)
    amax = torch.stack([tiny[:, j:j + 32].abs().amax(1) for j in range(0, 128, 32)], 1)
    assert torch.equal(scale.double(), torch.exp2((torch.frexp(amax).exponent - 1 - 8).double()))  # OCP's
    assert not ((fp8_recipes.dequantize_mx(q, scale) == 0) & (tiny != 0)).any()
    q, scale = fp8_recipes.quantize_mxfp8(torch.zeros(2, 32))
    assert scale.float().tolist() == [[2.0 ** -127]] * 2 and (q.float() == 0).all()


def test_a_tensor_holding_inf_has_no_scale():
    with pytest.raises(ValueError, match="inf or NaN"):
        fp8_recipes.quantize_tensorwise(torch.tensor([1.0, float("inf")]))


def test_tensorwise_takes_the_agreed_amax(x):
    q, scale = fp8_recipes.quantize_tensorwise(x, amax=torch.tensor(1000.0))
    assert scale.item() == pytest.approx(448.0 / 1000.0)
    assert q.float().abs().max() <= 448.0 * x.abs().max() / 1000.0 + 32


@pytest.mark.parametrize("rounding", ["floor", "up"])
def test_mxfp8_scales_are_powers_of_two_and_values_round_to_nearest(x, rounding):
    q, scale = fp8_recipes.quantize_mxfp8(x, rounding=rounding)
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (256, 512 // 32)
    assert (torch.frexp(scale.float()).mantissa == 0.5).all()
    y = x / expand_blocks(scale.float(), x.shape)
    assert half_ulp_excess(y, q.float(), number_formats.E4M3).max() == 0
    saturated = (y.abs() > 448 + 16).sum()
    assert (saturated > 0) if rounding == "floor" else (saturated == 0)  # OCP's floor can land past 448


def test_mx_shared_exponent_is_ocps():
    amax = torch.tensor([1.0, 300.0, 448.0, 500.0])
    assert fp8_recipes.mx_shared_exponent(amax, number_formats.E4M3).tolist() == [-8.0, 0.0, 0.0, 0.0]
    assert fp8_recipes.mx_shared_exponent(amax, number_formats.E4M3, "up").tolist() == [-8.0, 0.0, 0.0, 1.0]


def test_nvfp4_scales_are_transformer_engines_and_values_on_the_e2m1_grid(x):
    q, block_scale, tensor_scale = fp8_recipes.quantize_nvfp4(x)
    assert block_scale.dtype == E4M3 and block_scale.shape == (256, 512 // 16)
    assert tensor_scale.dtype == torch.float32 and tensor_scale.dim() == 0
    # TE's reference: encode = 448 * 6 / amax; block decode scale = e4m3(nearest)(block_amax / 6 * encode)
    encode = torch.tensor(448.0 * 6.0) / x.abs().max()
    block_amax = torch.stack([x[:, j:j + 16].abs().amax(1) for j in range(0, 512, 16)], 1)
    assert torch.equal(block_scale.float(), (block_amax / 6.0 * encode).to(E4M3).float())
    assert tensor_scale.item() == (1 / encode).item()
    y = x / (expand_blocks(block_scale.float(), x.shape) * tensor_scale)
    assert y.abs().max() < 6.0 / (1 - 2 ** -4)  # a nearest e4m3 scale is at most half an e4m3 ulp low
    assert half_ulp_excess(y.clamp(-6, 6), q, number_formats.E2M1).max() == 0
    assert set(q.abs().unique().tolist()) <= {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0}


def test_scaled_mm_matches_dequantize_then_matmul(x):
    generator = torch.Generator().manual_seed(1)
    w = torch.randn(128, 512, generator=generator)
    for quantize in (fp8_recipes.quantize_tensorwise, fp8_recipes.quantize_rowwise):
        (q_a, s_a), (q_w, s_w) = quantize(x), quantize(w)
        out = torch._scaled_mm(q_a, q_w.t(), scale_a=s_a.reciprocal(), scale_b=s_w.reciprocal().t(),
                               out_dtype=torch.float32)
        want = fp8_recipes.dequantize(q_a, s_a) @ fp8_recipes.dequantize(q_w, s_w).t()
        assert (out - want).abs().max() <= 1e-5 * want.abs().max()  # fp32 sums in another order


def test_simulate_on_the_fp4_grid_finer_blocks_lose_less(x):
    errors = [(fp8_recipes.simulate(x, number_formats.E2M1, block) - x).norm().item()
              for block in [(256, 512), (1, 128), (1, 16)]]
    assert errors[0] > errors[1] > errors[2]


def test_a_block_that_does_not_divide_names_both_numbers(x):
    with pytest.raises(ValueError, match="block size 128 does not divide dimension 1 of size 200"):
        fp8_recipes.quantize_blockwise(x[:, :200], (1, 128))
    with pytest.raises(ValueError, match="block size 32 does not divide dimension 1 of size 40"):
        fp8_recipes.quantize_mxfp8(x[:, :40])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fnuz])
def test_an_unsupported_dtype_names_the_supported_ones(x, dtype):
    with pytest.raises(ValueError, match="torch.float8_e4m3fn, torch.float8_e5m2"):
        fp8_recipes.quantize_tensorwise(x, dtype)


def test_a_too_small_agreed_amax_saturates_instead_of_overflowing():
    x = torch.tensor([[0.5, 2.0, 500.0, -3000.0]])
    q, scale = fp8_recipes.quantize_tensorwise(x, E5M2, amax=1.0)
    assert (x * scale).to(E5M2).float().isinf().any()  # what the cast alone would give
    assert q.float().tolist() == [[28672.0, 57344.0, 57344.0, -57344.0]]


# ------------------------------------------------------------------------ FP8 training (fp8_training.py)


def test_float8_linear_through_scaled_mm_equals_the_dequantized_matmuls():
    from helpers.training.fp8_training import Float8Linear

    generator = torch.Generator().manual_seed(2)
    layer = torch.nn.Linear(64, 32, bias=False)
    x0, g0 = torch.randn(3, 16, 64, generator=generator), torch.randn(3, 16, 32, generator=generator)
    got = {}
    for scaled_mm in (False, True):
        x = x0.clone().requires_grad_()
        layer.weight.grad = None
        out = Float8Linear(layer, scaled_mm)(x)
        out.backward(g0)
        got[scaled_mm] = (out.detach(), x.grad, layer.weight.grad.clone())
    for a, b in zip(got[True], got[False]):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()  # fp32 sums in another order


def test_float8_matmul_uses_e4m3_forward_and_e5m2_gradients():
    from helpers.training.fp8_training import Float8Matmul

    generator = torch.Generator().manual_seed(3)
    x = torch.randn(16, 64, generator=generator).requires_grad_()
    w = torch.randn(32, 64, generator=generator).requires_grad_()
    g = torch.randn(16, 32, generator=generator)
    Float8Matmul.apply(x, w).backward(g)
    e4 = [fp8_recipes.dequantize(*fp8_recipes.quantize_tensorwise(t.detach(), E4M3)) for t in (x, w)]
    g5 = fp8_recipes.dequantize(*fp8_recipes.quantize_tensorwise(g, E5M2))
    assert torch.allclose(x.grad, g5 @ e4[1], rtol=1e-6, atol=0)
    assert torch.allclose(w.grad, g5.t() @ e4[0], rtol=1e-6, atol=0)


def test_convert_to_float8_swaps_the_blocks_linears_and_keeps_their_parameters():
    from conftest import small_config

    from helpers.model import GPT
    from helpers.training.fp8_training import Float8Linear, convert_to_float8

    model = GPT(small_config(), seed=0)
    before = dict(model.named_parameters())
    swapped = convert_to_float8(model)
    assert len(swapped) == 6 * model.cfg.n_layers and all(n.startswith("blocks.") for n in swapped)
    assert not isinstance(model.lm_head, Float8Linear)
    after = dict(model.named_parameters())
    assert after.keys() == before.keys() and all(after[n] is before[n] for n in before)
