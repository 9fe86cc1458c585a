"""AdamW and Muon from scratch (helpers.training.optimizers, chapter 12) against PyTorch's, single process."""

import pytest
import torch

from helpers.data import get_batch, make_tokens
from helpers.model import GPT, GPTConfig
from helpers.reference import named_params
from helpers.training.optimizers import (AdamW, Muon, MuonWithAdamW, adjusted_lr, muon_params, muon_update,
                                         newton_schulz)

CFG = GPTConfig()  # the book's small GPT: tied embeddings, LayerNorm with biases, learned positions
STEPS = 4


def _train(make_optimizer, dtype, cfg=CFG):
    tokens = make_tokens()
    model = GPT(cfg, seed=0).to(dtype)
    optimizer = make_optimizer(model)
    for step in range(STEPS):
        x, y = get_batch(tokens, step, 8, cfg.seq_len)
        model(x, y)[1].backward()
        optimizer.step()
        optimizer.zero_grad()
    return named_params(model)


def _assert_bitwise(ours, theirs, what):
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), (
            f"{what}: {name} differs, max abs {(ours[name] - theirs[name]).abs().max().item():.3e}")


@pytest.mark.parametrize("foreach", [None, False])
def test_adamw_matches_torch_bit_for_bit_fp64(foreach):
    args = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ours = _train(lambda m: AdamW(m.parameters(), **args), torch.float64)
    theirs = _train(lambda m: torch.optim.AdamW(m.parameters(), foreach=foreach, **args), torch.float64)
    _assert_bitwise(ours, theirs, f"AdamW against torch.optim.AdamW(foreach={foreach}), fp64, {STEPS} steps")


@pytest.mark.parametrize("mode", ["original", "match_rms_adamw"])
def test_muon_matches_torch_bit_for_bit(mode):
    def make(muon_class, adamw_class):
        def build(model):
            matrices, rest = muon_params(model)
            return MuonWithAdamW(muon_class(matrices, lr=0.02, weight_decay=0.1, adjust_lr_fn=mode),
                                 adamw_class(rest, lr=1e-2))
        return build
    cfg = GPTConfig.llama_style()  # untied head, RMSNorm, SwiGLU: a second split of the parameters
    ours = _train(make(Muon, AdamW), torch.float32, cfg)
    theirs = _train(make(torch.optim.Muon, torch.optim.AdamW), torch.float32, cfg)
    _assert_bitwise(ours, theirs, f"Muon against torch.optim.Muon (adjust_lr_fn={mode}), fp32, {STEPS} steps")


@pytest.mark.parametrize("shape", [(256, 64), (64, 256), (128, 96)])
def test_newton_schulz_singular_values_in_band(shape):
    G = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    s = torch.linalg.svdvals(newton_schulz(G).double())  # 5 steps in bf16, as Muon runs them
    assert s.min() > 0.6 and s.max() < 1.25, (
        f"Newton-Schulz on a Gaussian {shape} matrix: singular values in [{s.min():.3f}, {s.max():.3f}], "
        f"outside the band [0.6, 1.25]")


def test_newton_schulz_transposes_tall_matrices():
    tall = torch.randn(128, 32, generator=torch.Generator().manual_seed(1))
    out = newton_schulz(tall, dtype=torch.float32)
    assert out.shape == tall.shape
    assert torch.equal(out, newton_schulz(tall.T, dtype=torch.float32).T), (
        "Newton-Schulz of a tall matrix must be the transpose of Newton-Schulz of its (wide) transpose")
    # a tall matrix iterates on its 32x32 Gram matrix: the orthogonal factor has orthonormal columns
    gram = out.double().T @ out.double()
    assert gram.shape == (32, 32)


def test_muon_update_uses_nesterov_and_updates_the_buffer_in_place():
    g = torch.randn(16, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    buf = torch.randn(16, 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    want_buf = 0.95 * buf + 0.05 * g
    update = muon_update(g, buf, 0.95, dtype=torch.float64)
    torch.testing.assert_close(buf, want_buf, rtol=1e-13, atol=1e-15)  # lerp rounds differently
    torch.testing.assert_close(update, newton_schulz(g + 0.95 * (want_buf - g), dtype=torch.float64),
                               rtol=1e-12, atol=1e-14)


def test_not_2d_refused_with_the_shape():
    with pytest.raises(ValueError, match=r"shape \(64,\)"):
        newton_schulz(torch.zeros(64))
    with pytest.raises(ValueError, match=r"shape \(2, 3, 4\)"):
        Muon([torch.nn.Parameter(torch.zeros(2, 3, 4))])
    with pytest.raises(ValueError, match=r"not one of"):
        Muon([torch.nn.Parameter(torch.zeros(2, 3))], adjust_lr_fn="sqrt")


def test_muon_params_split():
    for cfg in (CFG, GPTConfig.llama_style()):
        model = GPT(cfg, seed=0)
        matrices, rest = muon_params(model)
        names = {id(p): n for n, p in model.named_parameters()}
        assert all(p.ndim == 2 for p in matrices)
        assert not {names[id(p)].split(".")[0] for p in matrices} & {"tok_emb", "pos_emb", "lm_head"}
        assert len(matrices) + len(rest) == len(names)
        assert len(matrices) == cfg.n_layers * (4 + (3 if cfg.gated else 2))


def test_adjusted_lr():
    assert adjusted_lr(1.0, (256, 64), "original") == 2.0
    assert adjusted_lr(1.0, (64, 256), "original") == 1.0
    assert adjusted_lr(1.0, (64, 256), "match_rms_adamw") == pytest.approx(0.2 * 16)
    with pytest.raises(ValueError, match="not one of"):
        adjusted_lr(1.0, (2, 2), "spectral")
