"""The reference model and data: deterministic, validated, and trainable."""

import pytest
import torch

from helpers import data
from helpers.model import GPT, GPTConfig, cross_entropy


def test_same_seed_same_weights_whatever_the_global_rng():
    cfg = GPTConfig()
    torch.manual_seed(123)
    a = GPT(cfg, seed=7)
    torch.manual_seed(456)
    b = GPT(cfg, seed=7)
    c = GPT(cfg, seed=8)
    for (name, pa), (_, pb), (_, pc) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert torch.equal(pa, pb), name
        if pa.dim() == 2:
            assert not torch.equal(pa, pc), name


def test_shapes_gqa_and_tied_embeddings():
    cfg = GPTConfig(n_heads=4, n_kv_heads=2, vocab_size=16)
    model = GPT(cfg)
    assert model.blocks[0].attn.k_proj.weight.shape == (2 * cfg.head_dim, cfg.d_model)
    assert model.lm_head.weight is model.tok_emb.weight
    idx = torch.randint(0, 16, (3, cfg.seq_len))
    assert model(idx).shape == (3, cfg.seq_len, 16)
    untied = GPT(GPTConfig(tie_embeddings=False, gated=True))
    assert untied.lm_head.weight is not untied.tok_emb.weight
    assert untied.blocks[0].mlp.gate_proj is not None


def test_gqa_equals_mha_with_repeated_kv_heads():
    """GQA is MHA whose KV heads are copies: expanding the weights must give the same output."""
    gqa_cfg = GPTConfig(n_heads=4, n_kv_heads=2, n_layers=1)
    mha_cfg = GPTConfig(n_heads=4, n_kv_heads=4, n_layers=1)
    gqa, mha = GPT(gqa_cfg, seed=1).double(), GPT(mha_cfg, seed=1).double()
    state = gqa.state_dict()
    hd = gqa_cfg.head_dim
    for proj in ("k_proj", "v_proj"):
        w = state[f"blocks.0.attn.{proj}.weight"].view(2, hd, -1)
        state[f"blocks.0.attn.{proj}.weight"] = w.repeat_interleave(2, dim=0).reshape(4 * hd, -1)
    mha.load_state_dict(state)
    idx = torch.randint(0, gqa_cfg.vocab_size, (2, 16))
    assert torch.allclose(gqa(idx), mha(idx), rtol=0, atol=1e-12)


def test_causal_prefix_property_and_positions():
    model = GPT(GPTConfig()).double()
    idx = torch.randint(0, 13, (2, 20))
    full = model(idx)
    assert torch.allclose(model(idx[:, :10]), full[:, :10], atol=1e-12)
    with pytest.raises(ValueError, match="position 39 is past seq_len=32"):
        model(idx, positions=torch.arange(20, 40))


@pytest.mark.parametrize("kwargs, message", [
    (dict(d_model=64, n_heads=5), "n_heads=5 must divide d_model=64"),
    (dict(n_heads=4, n_kv_heads=3), "n_kv_heads=3 must divide n_heads=4"),
    (dict(n_layers=0), "n_layers must be positive"),
])
def test_bad_shapes_name_the_constraint(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**kwargs)


def test_data_is_deterministic_and_in_vocabulary():
    tokens = data.make_tokens(200, seed=3)
    assert torch.equal(tokens, data.make_tokens(200, seed=3))
    assert int(tokens.max()) < len(data.ALPHABET)
    text = data.decode(tokens)
    a, rest = text.splitlines()[0].split("+")
    b, c = rest.split("=")
    assert int(a) + int(b) == int(c)
    x, y = data.get_batch(tokens, step=5, batch_size=4, seq_len=16, seed=1)
    x2, y2 = data.get_batch(tokens, step=5, batch_size=4, seq_len=16, seed=1)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert not torch.equal(x, data.get_batch(tokens, step=6, batch_size=4, seq_len=16, seed=1)[0])
    assert torch.equal(torch.cat([data.rank_rows(x, r, 2) for r in range(2)]), x)
    with pytest.raises(ValueError, match="does not split evenly over 3 ranks"):
        data.rank_rows(x, 0, 3)


def test_a_few_steps_reduce_the_loss_fast():
    import time

    cfg = GPTConfig()
    model = GPT(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = data.make_tokens()
    losses = []
    started = time.perf_counter()
    for step in range(30):
        x, y = data.get_batch(tokens, step, batch_size=8, seq_len=cfg.seq_len)
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    per_step = (time.perf_counter() - started) / 30
    assert losses[-1] < 0.7 * losses[0], losses
    print(f"{per_step * 1e3:.1f} ms per step, loss {losses[0]:.2f} -> {losses[-1]:.2f}")
    assert cross_entropy(torch.zeros(1, 1, 4), torch.zeros(1, 1, dtype=torch.long)).item() == pytest.approx(
        torch.log(torch.tensor(4.0)).item())


def test_llama_style_is_one_flag_set_with_rmsnorm_rope_swiglu_and_untied_embeddings():
    cfg = GPTConfig.llama_style(n_kv_heads=2)
    model = GPT(cfg)
    assert isinstance(model.blocks[0].ln1, torch.nn.RMSNorm) and isinstance(model.ln_f, torch.nn.RMSNorm)
    assert model.pos_emb is None and model.blocks[0].mlp.gated
    assert model.lm_head.weight is not model.tok_emb.weight
    with pytest.raises(ValueError, match="norm='batchnorm' is not one of"):
        GPTConfig(norm="batchnorm")
    with pytest.raises(ValueError, match="head_dim=3 is odd"):
        GPTConfig(d_model=12, n_heads=4, n_kv_heads=4, rope_theta=10000.0)


def test_rotary_positions_make_scores_depend_on_the_distance_only():
    """RoPE's defining property (Su et al. 2021): q·k after rotation depends on p_q - p_k alone, exactly in
    fp64 up to rounding; and rotation keeps every vector's norm."""
    from helpers.model import apply_rotary, rotary_tables

    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 1, 1, 16, dtype=torch.float64, generator=gen) for _ in range(2))

    def score(p_q, p_k):
        tables = [rotary_tables(torch.tensor([p]), 16, 10000.0, torch.float64) for p in (p_q, p_k)]
        return (apply_rotary(q, tables[0]) * apply_rotary(k, tables[1])).sum()

    assert torch.allclose(score(3, 1), score(10, 8), rtol=1e-12)
    assert torch.allclose(score(5, 5), (q * k).sum(), rtol=1e-12)
    assert not torch.allclose(score(3, 1), score(3, 2), rtol=1e-3)
    rotated = apply_rotary(q, rotary_tables(torch.tensor([7]), 16, 10000.0, torch.float64))
    assert torch.allclose(rotated.norm(), q.norm(), rtol=1e-12)


def test_rotary_positions_are_relative_so_only_the_gaps_between_positions_matter():
    """Shifting every position by 8 changes nothing (within fp64 rounding); opening a gap in the middle does:
    a context-parallel rank that gave its tokens the wrong offsets would compute another model."""
    model = GPT(GPTConfig.llama_style()).double()
    idx = torch.randint(0, 64, (2, 8))
    assert torch.equal(model(idx), model(idx, positions=torch.arange(8)))
    assert torch.allclose(model(idx), model(idx, positions=torch.arange(8, 16)), rtol=0, atol=1e-12)
    gap = torch.cat([torch.arange(4), torch.arange(12, 16)])
    assert not torch.allclose(model(idx)[:, 4:], model(idx, positions=gap)[:, 4:], atol=1e-6)
