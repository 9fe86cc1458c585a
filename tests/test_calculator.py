"""The calculator (chapter 01): parameter counts, the ZeRO rule, activations, FLOPs, traffic, time, errors.

Everything runs in this process: counts in exact integers, float formulas to rel=1e-12 (1e-6 where no
tolerance is given), and the presets within 1% of the sizes the models are known by.
"""

from dataclasses import replace

import pytest
import torch

from helpers.cost import memory_budget, model_size, pipeline_schedules, time_model
from helpers.cost.memory_budget import Layout, budget
from helpers.cost.model_size import LLAMA3_8B, LLAMA3_70B, LLAMA3_405B, Batch, ModelShape
from helpers.model import GPT, GPTConfig


def test_preset_parameter_counts_match_the_architectures():
    assert model_size.count_params(model_size.GPT2_SMALL).total == 124_439_808  # the GPT-2 small release
    assert model_size.count_params(LLAMA3_8B).total == 8_030_261_248
    assert model_size.count_params(LLAMA3_70B).total == 70_553_706_496
    assert model_size.active_params(model_size.MIXTRAL_8X7B) == 12_879_925_248
    for model in model_size.PRESETS:
        total, active = model_size.NOMINAL_PARAMS[model.name]
        assert abs(model_size.count_params(model).total / total - 1) < 0.01
        assert abs(model_size.active_params(model) / active - 1) < 0.01


@pytest.mark.parametrize("cfg", [GPTConfig(), GPTConfig(tie_embeddings=False, gated=True, n_kv_heads=4),
                                 GPTConfig.llama_style()])
def test_the_books_gpt_is_counted_exactly(cfg):
    model = GPT(cfg)
    counted = model_size.count_params(ModelShape.from_gpt(cfg)).total
    assert counted == sum(p.numel() for p in model.parameters())


def test_zero_rule_reproduces_figure_1_of_the_zero_paper():
    psi = 7_500_000_000  # 7.5B parameters, Nd = 64, K = 12
    gb = [sum(memory_budget.model_state_bytes(psi, 64, z, memory_budget.BF16)) / 1e9 for z in range(4)]
    assert [round(g, 1) for g in gb] == [120.0, 31.4, 16.6, 1.9]


def test_korthikanti_closed_forms():
    s, b, h, a, t = 2048, 4, 1024, 16, 4
    m = ModelShape("k", 1, h, a, a, 4 * h, 64, gated=False, norm="layernorm")

    def act(t=1, sequence_parallel=False, r="none"):
        model = replace(memory_budget.KORTHIKANTI, recompute=r)
        return memory_budget.layer_activation_bytes(m, s, b, model, memory_budget.BF16, t, sequence_parallel)

    sbh = s * b * h
    assert act() == sbh * 34 + 5 * a * s * s * b
    assert act(t=t) == sbh * 10 + sbh * 24 // t + 5 * a * s * s * b // t
    assert act(t=t, sequence_parallel=True) == sbh * 34 // t + 5 * a * s * s * b // t
    assert act(t=t, r="selective") == sbh * 10 + sbh * 24 // t
    assert act(t=t, sequence_parallel=True, r="selective") == sbh * 34 // t
    assert act(r="full") == 2 * sbh


def test_flops_are_six_n_t_plus_attention():
    batch = Batch(seq_len=2048, micro_batch=1, global_batch=64)
    f = model_size.step_flops(LLAMA3_8B, batch)
    tokens = 64 * 2048
    assert f["linear"] == 6 * model_size.matmul_params(LLAMA3_8B) * tokens
    assert f["attention"] == 3 * 32 * 4 * tokens * 2048 * 4096
    # full recomputation repeats the layers' forward, not the LM head's (Narayanan et al. 2021, eq. 3)
    head_forward = 2 * LLAMA3_8B.vocab_size * LLAMA3_8B.d_model * tokens
    full = model_size.step_flops(LLAMA3_8B, batch, "full")
    assert full["total"] == f["total"] + f["linear"] // 3 - head_forward + f["attention"] // 3
    assert full["model"] == f["model"]


def test_full_recomputation_flops_against_flop_counter():
    """Checkpointing every block of the book's GPT: FlopCounterMode counts what the calculator predicts
    (with early stopping off, PyTorch recomputes the whole block, as Megatron does; on, it skips the last
    matmul)."""
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    from helpers.measure import count_flops

    cfg = GPTConfig()
    model, b = GPT(cfg), 2
    idx = torch.randint(0, cfg.vocab_size, (b, cfg.seq_len), generator=torch.Generator().manual_seed(0))

    def step():
        h = model.tok_emb(idx) + model.pos_emb(torch.arange(cfg.seq_len))
        for block in model.blocks:
            h = checkpoint(block, h, use_reentrant=False)
        model.lm_head(model.ln_f(h)).logsumexp(-1).mean().backward()

    with set_checkpoint_early_stop(False):
        counted = sum(count_flops(step).values())
    predicted = model_size.step_flops(ModelShape.from_gpt(cfg), Batch(cfg.seq_len, b, b), "full")
    assert counted == predicted["total"]


def test_zero_stages_shard_what_they_should():
    batch = Batch(4096, 1, 64)
    states = {z: budget(LLAMA3_8B, batch, Layout(dp=8, zero=z)) for z in range(4)}
    n = model_size.count_params(LLAMA3_8B).total
    assert states[0].optimizer_bytes == 12 * n
    assert states[1].optimizer_bytes == 12 * -(-n // 8) and states[1].grad_bytes == 2 * n
    assert states[2].grad_bytes == 2 * -(-n // 8) and states[2].param_bytes == 2 * n
    assert states[3].param_bytes == 2 * -(-n // 8)
    # traffic: ZeRO-1/2 move as many bytes as an all-reduce; ZeRO-3 half as much again
    assert states[1].sent["dp"] == states[0].sent["dp"] == 2 * 7 / 8 * 2 * n
    assert states[3].sent["dp"] == pytest.approx(1.5 * states[0].sent["dp"] * batch.global_batch / 8)


def test_zero2_reduce_scatters_every_micro_batch():
    """Sharded gradients cannot accumulate whole: a reduce-scatter per micro-batch, an all-gather per step."""
    n = model_size.count_params(LLAMA3_8B).total
    for m in (1, 4):
        b = budget(LLAMA3_8B, Batch(4096, 1, 8 * m), Layout(dp=8, zero=2))
        assert b.micro_batches == m
        assert b.sent["dp"] == pytest.approx((m + 1) * 7 / 8 * 2 * n, rel=1e-12)
        assert b.messages["dp"] == (m + 1) * 7


def test_fp8_parameter_gathers_send_one_byte_per_parameter():
    """ZeRO-3 with FP8 gathers (torchao's float8 FSDP), by hand: per micro-batch a forward and a backward
    all-gather of 1 byte per parameter and a bf16 reduce-scatter, each 7/8 of the buffer on 8 ranks:
    7/8 * n * (1 + 1 + 2) against bf16's 7/8 * n * (2 + 2 + 2). ZeRO-1's gather keeps param_bytes."""
    n, m = model_size.count_params(LLAMA3_8B).total, 4
    batch = Batch(4096, 1, 8 * m)
    assert memory_budget.BF16.gather_bytes == 2 and memory_budget.FP8_GATHER.gather_bytes == 1
    fp8 = budget(LLAMA3_8B, batch, Layout(dp=8, zero=3), memory_budget.FP8_GATHER)
    bf16 = budget(LLAMA3_8B, batch, Layout(dp=8, zero=3), memory_budget.BF16)
    assert fp8.sent["dp"] == pytest.approx(m * 7 / 8 * n * (1 + 1 + 2), rel=1e-12)
    assert bf16.sent["dp"] == pytest.approx(m * 7 / 8 * n * (2 + 2 + 2), rel=1e-12)
    assert fp8.messages["dp"] == bf16.messages["dp"] == m * 3 * 7
    assert [x.nbytes for x in fp8.dp_transfers] == pytest.approx([7 / 8 * n, 7 / 8 * n * 3], rel=1e-12)
    assert fp8.param_bytes == bf16.param_bytes  # the shard a rank keeps stays in bf16
    zero1 = [budget(LLAMA3_8B, batch, Layout(dp=8, zero=1), p).sent["dp"]
             for p in (memory_budget.FP8_GATHER, memory_budget.BF16)]
    assert zero1[0] == zero1[1]


def test_sequence_parallel_sends_the_backward_regathers_too():
    """SP's all-gathers and reduce-scatters carry what TP's all-reduces carry, plus two re-gathers per layer
    in backward and one for the LM head's input: 25 % more (chapter 05 books them on the real run)."""
    batch = Batch(4096, 1, 8)
    tp = budget(LLAMA3_8B, batch, Layout(tp=8))
    sp = budget(LLAMA3_8B, batch, Layout(tp=8, sequence_parallel=True))
    x = 4096 * LLAMA3_8B.d_model * 2  # one activation of a micro-batch, bf16
    m, layers = 8, LLAMA3_8B.n_layers
    assert tp.sent["tp"] == pytest.approx(m * (4 * layers + 2) * 2 * 7 / 8 * x, rel=1e-12)
    assert sp.sent["tp"] - tp.sent["tp"] == pytest.approx(m * (2 * layers + 1) * 7 / 8 * x, rel=1e-12)
    assert sp.sent["tp"] == pytest.approx(1.25 * tp.sent["tp"], rel=1e-12)
    assert sp.messages["tp"] - tp.messages["tp"] == m * (2 * layers + 1) * 7
    assert sp.activation_bytes < tp.activation_bytes


def test_interleaved_stages_hold_fewer_chunks_down_the_pipeline():
    """Chapter 06 measures 11, 9, 7, 5 chunks on p=4, v=2, m=8; the first stage is Korthikanti's eq. 5."""
    in_flight = pipeline_schedules.micro_batches_in_flight
    assert [in_flight("1f1b", 4, 2, 8, r) * 2 for r in range(4)] == [11, 9, 7, 5]
    assert in_flight("1f1b", 4, 2, 8, 0) == 4 * (1 + 3 / 8)
    assert [in_flight("1f1b", 4, 1, 8, r) for r in range(4)] == [4, 3, 2, 1]
    assert in_flight("gpipe", 4, 1, 8, 3) == 8
    batch = Batch(4096, 1, 8)
    acts = [budget(LLAMA3_8B, batch, Layout(pp=4, vpp=2), stage=r).activation_bytes for r in range(4)]
    assert [round(a / acts[3] * 5, 6) for a in acts] == [11, 9, 7, 5]


def test_uneven_pipeline_stages():
    assert [len(r) for r in pipeline_schedules.stage_layers(126, 16)] == [8] * 14 + [7] * 2
    b = budget(LLAMA3_405B, Batch(8192, 1, 2048),
               Layout(dp=128, tp=8, pp=16, vpp=2, sequence_parallel=True, zero=1))
    assert b.params_on_rank > 0


def test_step_time_and_mfu_are_sane():
    b = budget(LLAMA3_70B, Batch(8192, 1, 1024), Layout(dp=8, tp=8, pp=4, zero=1, sequence_parallel=True))
    t = time_model.step_time(b, time_model.H100)
    assert 0 < t.mfu < time_model.H100.efficiency
    assert t.step_s > t.compute_s


def test_gradient_all_reduce_hides_only_behind_the_last_micro_batch_backward():
    """With m micro-batches, the all-reduce of the accumulated gradients starts in the last backward: it can
    hide behind 2/3 of compute/m, not 2/3 of the whole step's compute."""
    m = 8
    b = budget(LLAMA3_8B, Batch(8192, 1, 64 * m), Layout(dp=64))
    t = time_model.step_time(b, time_model.H100)
    last_backward = 2 / 3 * t.compute_s / m
    assert last_backward < t.comm_s["dp"] < 2 / 3 * t.compute_s  # the old model hid all of it
    assert t.exposed_comm_s == pytest.approx(t.comm_s["dp"] - last_backward, rel=1e-12)
    assert t.step_s == pytest.approx(t.compute_s + t.comm_s["dp"] - last_backward, rel=1e-12)
    assert time_model.step_time(b, time_model.H100, overlap=False).exposed_comm_s == t.comm_s["dp"]


def test_mfu_counts_model_flops_only():
    """PaLM's MFU: (6N + 12·L·H·Q·T) FLOPs per token times tokens per second over the peak; recomputation
    changes the step time, never the numerator."""
    model, batch = LLAMA3_8B, Batch(8192, 1, 64)
    n_matmul = model_size.count_params(model).total - model.vocab_size * model.d_model - \
        (2 * model.n_layers + 1) * model.d_model  # the embedding lookup and the norms do no matmul
    per_token = 6 * n_matmul + 12 * model.n_layers * model.n_heads * model.head_dim * batch.seq_len
    for recompute in ("none", "full"):
        b = budget(model, batch, Layout(dp=8, tp=8), act=memory_budget.ActivationModel(recompute=recompute))
        t = time_model.step_time(b, time_model.H100)
        tokens_per_s = batch.global_batch * batch.seq_len / t.step_s
        assert t.mfu == pytest.approx(per_token * tokens_per_s / (64 * time_model.H100.peak_flops), rel=1e-12)


@pytest.mark.parametrize("layout, batch, message", [
    (Layout(tp=3), Batch(4096, 1, 8), "tp=3 must divide n_heads=32 of Llama-3 8B"),
    (Layout(pp=33), Batch(4096, 1, 8), r"n_chunks=33 \(pp·vpp\) must not exceed n_layers=32 of Llama-3 8B"),
    (Layout(cp=3), Batch(4096, 1, 8), "cp=3 must divide seq_len=4096"),
    (Layout(dp=4), Batch(4096, 1, 6), "must be a multiple of dp\\*micro_batch"),
    (Layout(dp=2, ep=2), Batch(4096, 1, 8), "ep=2 > 1 but Llama-3 8B has no experts"),
])
def test_bad_layouts_name_the_constraint(layout, batch, message):
    with pytest.raises(ValueError, match=message):
        budget(LLAMA3_8B, batch, layout)


def _message(call) -> str:
    with pytest.raises(ValueError) as err:
        call()
    return str(err.value)


@pytest.mark.parametrize("tp, changes, sequence_parallel", [
    (3, {}, False), (4, dict(d_model=48, n_heads=12, n_kv_heads=3), False), (2, dict(d_ff=63), False),
    (2, dict(vocab_size=17), False), (2, dict(seq_len=7), True)])
def test_the_calculator_and_the_module_refuse_a_layout_in_the_same_words(tp, changes, sequence_parallel):
    """One rule, one sentence (helpers.layout_rules): the calculator adds only the model's name."""
    from helpers.parallel import tensor_parallel

    cfg = GPTConfig(vocab_size=16, seq_len=8, n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64)
    cfg = replace(cfg, **changes)
    shape = ModelShape.from_gpt(cfg, name="the small GPT")
    module = _message(lambda: tensor_parallel.check_layout(cfg, tp, sequence_parallel))
    layout = Layout(tp=tp, sequence_parallel=sequence_parallel)
    calculator = _message(lambda: budget(shape, Batch(cfg.seq_len, 1, 1), layout))
    broken, why = module.split(": ", 1)
    assert calculator == f"{broken} of the small GPT: {why}", (calculator, module)


def test_bad_layout_fields_are_refused_at_once():
    with pytest.raises(ValueError, match="needs tp > 1"):
        Layout(sequence_parallel=True)
    with pytest.raises(ValueError, match="ZeRO stage"):
        Layout(zero=4)
    with pytest.raises(ValueError, match="ep=3 must divide dp\\*cp=4"):
        Layout(dp=4, ep=3)
    with pytest.raises(ValueError, match="world size 16 != dp\\*tp\\*pp\\*cp"):
        budget(LLAMA3_8B, Batch(4096, 1, 8), Layout(dp=8), world_size=16)


@pytest.mark.parametrize("gated", [False, True])
def test_measured_activations_of_the_books_gpt(gated):
    """The calculator's profile of the book's GPT equals what autograd saves, per layer, exactly; gated, the
    MLP keeps gate, silu(gate), up and their product (four d_ff-wide tensors)."""
    from helpers.measure import saved_bytes_per_layer

    cfg = GPTConfig(gated=gated)
    act = memory_budget.ActivationModel(attention="flash", kv_expanded=True, norm_stat_bytes=8)
    shape = ModelShape.from_gpt(cfg)
    assert saved_bytes_per_layer(cfg, 2, 32) == memory_budget.layer_activation_bytes(shape, 32, 2, act,
                                                                                      memory_budget.FP32)


def test_from_gpt_maps_the_llama_style_config():
    """RMSNorm (a scale, no bias), rotary positions (no position table), SwiGLU, untied."""
    shape = ModelShape.from_gpt(GPTConfig.llama_style())
    assert (shape.norm, shape.learned_positions, shape.gated, shape.tie_embeddings) == ("rmsnorm", 0, True,
                                                                                         False)
    assert ModelShape.from_gpt(GPTConfig()).learned_positions == GPTConfig().seq_len


# What PyTorch's eager modules keep: LayerNorm its mean and 1/std (8 bytes a token); RMSNorm, unfused, its
# 1/rms (4) and the normalized input x/rms(x) too; attention repeats the KV heads before the fused kernel.
EAGER = {"layernorm": memory_budget.ActivationModel(kv_expanded=True, norm_stat_bytes=8),
         "rmsnorm": memory_budget.ActivationModel(kv_expanded=True, norm_stat_bytes=4,
                                                  norm_keeps_normalized=True)}


@pytest.mark.parametrize("materialized", [False, True])
def test_measured_activations_of_the_llama_style_block(materialized):
    """RMSNorm, RoPE and SwiGLU, per layer, to the byte: the rotary tables are shared by the layers (computed
    once per forward), and autograd keeps the rotated q and k, which the calculator counts as Q and K."""
    from helpers.measure import saved_bytes_per_layer

    cfg = GPTConfig.llama_style()
    act = replace(EAGER["rmsnorm"], attention="materialized" if materialized else "flash")
    predicted = memory_budget.layer_activation_bytes(ModelShape.from_gpt(cfg), 32, 2, act, memory_budget.FP32)
    assert saved_bytes_per_layer(cfg, 2, 32, materialized=materialized) == predicted


def test_selective_recomputation_keeps_no_attention_statistics():
    """Selective recomputation reruns the whole core from Q, K and V: no probabilities and no log-sum-exp."""
    act = memory_budget.ActivationModel(kv_expanded=False)
    none = memory_budget.layer_activation_bytes(LLAMA3_8B, 4096, 1, act, memory_budget.BF16)
    sel = memory_budget.layer_activation_bytes(LLAMA3_8B, 4096, 1, replace(act, recompute="selective"),
                                               memory_budget.BF16)
    assert none - sel == LLAMA3_8B.n_heads * 4096 * 4  # one fp32 log-sum-exp per query row and head


def test_kv_heads_are_replicated_when_tp_exceeds_them():
    """Llama-3 8B has 8 KV heads: at tp=16 each rank holds one (shared with one other rank), not half."""
    assert [model_size.kv_heads_per_rank(8, tp) for tp in (1, 2, 8, 16, 32)] == [8, 4, 1, 1, 1]
    m, hd, d = LLAMA3_8B, LLAMA3_8B.head_dim, LLAMA3_8B.d_model
    q_rank = m.n_heads * hd // 16
    assert model_size._attention_params(m, 16) == d * (q_rank + 2 * hd) + q_rank * d
    for tp in (1, 2, 4, 8):  # where tp divides the KV heads, one rank holds 1/tp of the layer
        assert model_size._attention_params(m, tp) == model_size._attention_params(m) // tp
    act = replace(EAGER["rmsnorm"], kv_expanded=False)
    at8, at16 = (memory_budget.layer_activation_bytes(m, 4096, 1, act, memory_budget.BF16, tp=tp,
                                                      sequence_parallel=True) for tp in (8, 16))
    kv = 2 * 4096 * hd * 2  # K and V of one head, bf16: the same on a rank at tp=8 and at tp=16
    assert at8 - kv == 2 * (at16 - kv)  # everything else halves
    try:
        b16 = budget(m, Batch(4096, 1, 8), Layout(tp=16, sequence_parallel=True, cp=2))
    except ValueError as refused:  # the layout rules before KV replication
        assert "n_kv_heads=8" in str(refused)
        return
    b8 = budget(m, Batch(4096, 1, 8), Layout(tp=8, sequence_parallel=True, cp=2))
    assert b16.sent["cp"] == b8.sent["cp"]  # each rank passes its one KV head around the ring
    layer16 = model_size._attention_params(m, 16) + m.d_ff * d * 3 // 16 + 2 * d
    layer8 = model_size._attention_params(m, 8) + m.d_ff * d * 3 // 8 + 2 * d
    head = m.vocab_size * d
    # the layers, and the embedding and the untied head, each split by tp
    embeddings = 2 * (head // 16 - head // 8)
    assert b16.params_on_rank - b8.params_on_rank == m.n_layers * (layer16 - layer8) + embeddings


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_measured_recomputation_of_the_llama_style_block(recompute):
    """Under checkpoint, a layer keeps what the calculator's recompute option says: the core's inputs (grouped
    K/V heads, not repeated) without the probabilities, or the layer's input alone; gradients bit for bit."""
    from torch.utils.checkpoint import checkpoint

    from helpers.measure import attention_backend, saved_tensors
    from helpers.model import causal_attention

    def recomputing(model):
        for layer, block in model.blocks.items():
            if recompute == "full":
                model.blocks[layer] = _Checkpointed(block)
            else:
                block.attn.core = lambda q, k, v: checkpoint(causal_attention, q, k, v, use_reentrant=False)
        return model

    cfg = GPTConfig.llama_style()
    idx = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    totals = []
    for n_layers in (1, 2):
        model = recomputing(GPT(replace(cfg, n_layers=n_layers)))
        with attention_backend(materialized=True):
            totals.append(sum(b for b, _, _ in saved_tensors(lambda: model(idx, idx), model).values()))
    act = replace(EAGER["rmsnorm"], attention="materialized", recompute=recompute, kv_expanded=False)
    assert totals[1] - totals[0] == memory_budget.layer_activation_bytes(ModelShape.from_gpt(cfg), 32, 2, act,
                                                                         memory_budget.FP32)
    plain, redone = GPT(cfg), recomputing(GPT(cfg))
    for m in (plain, redone):
        m(idx, idx)[1].backward()
    for p, q in zip(plain.parameters(), redone.parameters()):
        assert torch.equal(p.grad, q.grad)


class _Checkpointed(torch.nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, h, *args):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.block, h, *args, use_reentrant=False)
