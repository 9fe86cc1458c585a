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
