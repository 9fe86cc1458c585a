"""Tensor and sequence parallelism (chapter 05): layouts, shards, and one small run on two ranks.

The layout and shard tests run in this process, with a stand-in group that gives the layers their rank and
size (building them needs no collective): sharding and unsharding give back every tensor bit for bit, and
``parallelize`` refuses, before it changes anything, a layout that cannot work and a block it cannot split.
The distributed test starts two ranks, runs a tensor-parallel (and a sequence-parallel) forward and backward
of a small GPT on each, and compares what they return with the single process here, within fp32 rounding:
each rank's vocabulary slice of the logits within 1e-6 absolute, the loss within 1e-6 relative, and every
unsharded gradient within rtol 1e-6 of its tensor's largest entry; two pipeline stages, each parallelized,
give the whole model's logits (atol 1e-6), and so does each rank in a group of its own (rank and size come
from the group). Without the all-reduce of the norms' gradients, sequence parallelism leaves one rank's
gradient of the final norm more than 1e-3 (relative) from the reference in some entry, and the two ranks'
shares sum to it (rtol 1e-5, atol 1e-7).

The Llama-style GPT (RMSNorm, rotary positions, SwiGLU, untied) runs the same checks; so does one with a
single KV head on two ranks, which then copies it onto both (KV-head replication): without the all-reduce of
the copies' gradients, each rank's K and V gradients are its query heads' share only, the copies differ (which
``unshard_state`` refuses), and the two shares sum to the reference's (rtol 1e-5, atol 1e-7).
"""

from dataclasses import replace

import ipyparallel as ipp
import pytest
import torch
import torch.distributed as dist

from conftest import assert_close_to_scale, seeded_batch, small_config
from helpers.model import GPT, MLP, Attention, GPTConfig
from helpers.parallel import moe, tensor_parallel
from helpers.reference import named_grads, named_params

CFG = small_config()
LLAMA = GPTConfig.llama_style(**{k: getattr(CFG, k) for k in ("vocab_size", "seq_len", "n_layers", "d_model",
                                                              "n_heads", "n_kv_heads", "d_ff")})
ONE_KV_HEAD = replace(LLAMA, n_kv_heads=1)  # on two ranks: one KV head, copied onto both
ROWS = 4  # the global batch; every rank runs all of it
RTOL = 1e-6


class StandInGroup:
    """A process group's rank and size, as ``dist.get_rank(group)`` and ``dist.get_world_size(group)`` give
    them under the ``stand_in`` fixture."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setattr(dist, "get_rank", lambda group=None: group.rank)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: group.size)


@pytest.mark.parametrize("cfg, tp_size, names", [
    (CFG, 3, "n_heads=4"),
    (replace(CFG, d_model=48, n_heads=12, n_kv_heads=3), 4, "n_kv_heads=3"),
    (replace(CFG, d_ff=63), 2, "d_ff=63"),
    (replace(CFG, vocab_size=17), 2, "vocab_size=17"),
    (replace(CFG, seq_len=7), 2, "seq_len=7"),
])
def test_a_bad_layout_names_the_broken_constraint(stand_in, cfg, tp_size, names):
    sequence_parallel = "seq_len" in names
    with pytest.raises(ValueError, match=f"tp={tp_size} must divide {names}"):
        tensor_parallel.check_layout(cfg, tp_size, sequence_parallel)
    model = GPT(cfg, seed=0)
    before = named_params(model)
    with pytest.raises(ValueError, match=f"tp={tp_size} must divide {names}"):
        tensor_parallel.parallelize(model, StandInGroup(0, tp_size), sequence_parallel=sequence_parallel)
    assert sorted(named_params(model)) == sorted(before)  # unchanged


def test_a_block_it_cannot_split_is_refused_before_anything_changes(stand_in):
    model = GPT(CFG, seed=0)
    model.blocks[1].mlp = torch.nn.Identity()  # neither the book's MLP nor a MoE layer
    before = named_params(model)
    with pytest.raises(ValueError, match=r"blocks\.1\.mlp is a Identity, not helpers\.model\.MLP"):
        tensor_parallel.parallelize(model, StandInGroup(0, 2))
    assert sorted(named_params(model)) == sorted(before)
    twice = tensor_parallel.parallelize(GPT(CFG, seed=0), StandInGroup(0, 2))
    with pytest.raises(ValueError, match=r"blocks\.0\.attn is tensor-parallel already"):
        tensor_parallel.parallelize(twice, StandInGroup(0, 2))


def test_a_moe_layer_stays_whole_and_under_sp_its_gradients_are_summed(stand_in):
    model = GPT(CFG, seed=0)
    model.blocks[1].mlp = moe.MoELayer(moe.MoEConfig(**{**vars(CFG), "n_experts": 2, "top_k": 1}))
    with torch.no_grad():  # the layer alone leaves its experts uninitialised: NaN bits would fail torch.equal
        for p in model.blocks[1].mlp.parameters():
            p.normal_(generator=torch.Generator().manual_seed(0))
    whole = {n: t for n, t in named_params(model).items() if n.startswith("blocks.1.mlp.")}
    tensor_parallel.parallelize(model, StandInGroup(0, 2), sequence_parallel=True)
    assert type(model.blocks[1].mlp) is moe.MoELayer
    for name, p in model.blocks[1].mlp.named_parameters():
        assert torch.equal(p, whole["blocks.1.mlp." + name]) and p.sequence_parallel, name


def test_a_good_layout_passes():
    tensor_parallel.check_layout(CFG, 2, sequence_parallel=True)
    tensor_parallel.check_layout(CFG, 1)
    tensor_parallel.check_layout(ONE_KV_HEAD, 2)  # tp a multiple of n_kv_heads: the KV heads are copied
    tensor_parallel.check_layout(replace(CFG, n_heads=8, n_kv_heads=2), 4)


@pytest.mark.parametrize("cfg", [CFG, replace(CFG, tie_embeddings=False), replace(CFG, gated=True), LLAMA,
                                 ONE_KV_HEAD])
@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_sharding_then_unsharding_gives_back_every_tensor_bit_for_bit(cfg, tp_size):
    reference = GPT(cfg, seed=0)
    full = dict(reference.named_parameters())
    shards = [tensor_parallel.shard_state(full, cfg, r, tp_size) for r in range(tp_size)]
    again = tensor_parallel.unshard_state(shards, cfg)
    assert sorted(again) == sorted(full)
    for name, tensor in full.items():
        assert torch.equal(again[name], tensor), name


def test_unsharding_refuses_copies_of_a_kv_head_that_differ():
    full = dict(GPT(ONE_KV_HEAD, seed=0).named_parameters())
    shards = [tensor_parallel.shard_state(full, ONE_KV_HEAD, r, 2) for r in range(2)]
    kv_rows = ONE_KV_HEAD.n_heads * ONE_KV_HEAD.head_dim // 2  # the K rows start after this rank's Q rows
    shards[1]["blocks.1.attn.qkv_proj.weight"][kv_rows] += 1.0
    with pytest.raises(ValueError, match=r"blocks\.1\.attn\.k_proj\.weight: ranks 0 and 1 hold copies"):
        tensor_parallel.unshard_state(shards, ONE_KV_HEAD)


@pytest.mark.parametrize("cfg", [CFG, replace(CFG, tie_embeddings=False), replace(CFG, gated=True), LLAMA,
                                 ONE_KV_HEAD])
def test_each_rank_holds_its_slice_under_the_plans_names(stand_in, cfg):
    reference = GPT(cfg, seed=0)
    for rank in range(2):
        model = tensor_parallel.from_reference(reference, StandInGroup(rank, 2))
        params = dict(model.named_parameters())
        assert sorted(params) == sorted(tensor_parallel.shard_plan(cfg, 2))
        full = dict(reference.named_parameters())
        for name, shard in tensor_parallel.shard_state(full, cfg, rank, 2).items():
            assert torch.equal(params[name], shard), name
        q_rows = cfg.n_heads * cfg.head_dim // 2
        qkv = params["blocks.0.attn.qkv_proj.weight"]
        assert torch.equal(qkv[:q_rows],
                           reference.blocks[0].attn.q_proj.weight[rank * q_rows:(rank + 1) * q_rows])
        kv_heads = max(cfg.n_kv_heads // 2, 1)  # on this rank
        first = rank * cfg.n_kv_heads // 2  # this rank's first KV head: r // (tp // n_kv_heads) if copied
        k_rows = slice(first * cfg.head_dim, (first + kv_heads) * cfg.head_dim)
        assert torch.equal(qkv[q_rows:q_rows + kv_heads * cfg.head_dim],
                           reference.blocks[0].attn.k_proj.weight[k_rows])
        cols = cfg.d_ff // 2
        assert torch.equal(params["blocks.1.mlp.down_proj.weight"],
                           reference.blocks[1].mlp.down_proj.weight[:, rank * cols:(rank + 1) * cols])
        if cfg.tie_embeddings:
            assert model.lm_head.weight is model.tok_emb.weight
        assert model.tok_emb.vocab_start == rank * cfg.vocab_size // 2


def test_a_copied_kv_head_is_the_one_the_ranks_query_heads_use(stand_in):
    """Four ranks, two KV heads: rank r holds KV head r // 2 (not r % 2), and ranks 2j and 2j+1 the same."""
    reference = GPT(LLAMA, seed=0)
    hd, q_rows = LLAMA.head_dim, LLAMA.n_heads * LLAMA.head_dim // 4
    for rank in range(4):
        qkv = tensor_parallel.from_reference(reference, StandInGroup(rank, 4)).blocks[0].attn.qkv_proj.weight
        head = slice(rank // 2 * hd, (rank // 2 + 1) * hd)
        attn = reference.blocks[0].attn
        want = torch.cat([attn.k_proj.weight[head], attn.v_proj.weight[head]])
        assert torch.equal(qkv[q_rows:], want), f"rank {rank} does not hold KV head {rank // 2}"


def test_a_pipeline_stage_is_parallelized_and_an_attention_core_kept(stand_in):
    def core(q, k, v):
        raise AssertionError("not called here")

    first, last = GPT(CFG, seed=0), GPT(CFG, seed=0)
    first.ln_f = first.lm_head = None
    del first.blocks["1"]
    last.tok_emb = last.pos_emb = None
    del last.blocks["0"]
    last.blocks[1].attn.core = core
    tensor_parallel.parallelize(first, StandInGroup(1, 2), sequence_parallel=True)
    tensor_parallel.parallelize(last, StandInGroup(1, 2), sequence_parallel=True)
    assert last.blocks[1].attn.core is core
    plan = tensor_parallel.shard_plan(CFG, 2)
    for stage in (first, last):
        names = [n for n, _ in stage.named_parameters()]
        assert set(names) - {"lm_head.weight"} <= set(plan), names  # a tied head on a later stage is its own
    assert isinstance(last.lm_head, tensor_parallel.ColumnParallelLinear)
    assert last.lm_head.weight.shape == (CFG.vocab_size // 2, CFG.d_model)


@ipp.interactive  # sent by value: the engines cannot import this test module
def _tensor_parallel_step(cfg, x, y, sequence_parallel, sync_norms, sync_kv=True):
    from helpers.model import GPT
    from helpers.parallel import tensor_parallel
    from helpers.reference import named_grads

    model = tensor_parallel.parallelize(GPT(cfg, seed=0), sequence_parallel=sequence_parallel)
    logits, loss = model(x, y)
    loss.backward()
    if sync_norms:
        tensor_parallel.allreduce_sequence_parallel_grads(model)
    if sync_kv:
        tensor_parallel.allreduce_replicated_kv_grads(model)
    return logits.detach(), loss.item(), named_grads(model)


@ipp.interactive
def _two_stages(cfg, x, sequence_parallel):
    import copy

    from helpers.model import GPT
    from helpers.parallel import tensor_parallel

    reference = GPT(cfg, seed=0)
    first, last = copy.deepcopy(reference), copy.deepcopy(reference)
    first.ln_f = first.lm_head = None
    del first.blocks["1"]
    last.tok_emb = last.pos_emb = None
    del last.blocks["0"]
    first, last = (tensor_parallel.parallelize(s, sequence_parallel=sequence_parallel) for s in (first, last))
    return last(first(x)).detach()


@pytest.mark.parametrize("cfg", [CFG, replace(CFG, gated=True, tie_embeddings=False), LLAMA, ONE_KV_HEAD],
                         ids=["tied", "gated-untied", "llama-style", "llama-style-one-kv-head"])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_two_ranks_match_the_single_process(ranks, cfg, sequence_parallel):
    x, y = seeded_batch(cfg, ROWS)
    reference = GPT(cfg, seed=0)
    logits, loss = reference(x, y)
    loss.backward()
    results = ranks.apply(_tensor_parallel_step, cfg, x, y, sequence_parallel, True)
    per_rank = cfg.vocab_size // 2
    for rank, (got_logits, got_loss, _) in enumerate(results):
        want = logits[..., rank * per_rank:(rank + 1) * per_rank]
        torch.testing.assert_close(got_logits, want.detach(), rtol=0, atol=1e-6)
        assert got_loss == pytest.approx(loss.item(), rel=1e-6)
    grads = tensor_parallel.unshard_state([g for _, _, g in results], cfg)
    want = named_grads(reference)
    what = f"{cfg}, sequence_parallel={sequence_parallel}"
    assert_close_to_scale(grads, want, RTOL, f"{what}, unsharded gradients:")


def test_sequence_parallel_without_the_norm_all_reduce_is_wrong(ranks):
    x, y = seeded_batch(CFG, ROWS)
    reference = GPT(CFG, seed=0)
    reference(x, y)[1].backward()
    results = ranks.apply(_tensor_parallel_step, CFG, x, y, True, False)
    partial = [g["ln_f.weight"] for _, _, g in results]
    want = reference.ln_f.weight.grad
    assert not torch.allclose(partial[0], want, rtol=1e-3, atol=0)
    torch.testing.assert_close(partial[0] + partial[1], want, rtol=1e-5, atol=1e-7)  # the ranks' shares


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_a_copied_kv_head_without_the_all_reduce_of_its_gradients_is_wrong(ranks, sequence_parallel):
    x, y = seeded_batch(ONE_KV_HEAD, ROWS)
    reference = GPT(ONE_KV_HEAD, seed=0)
    reference(x, y)[1].backward()
    results = ranks.apply(_tensor_parallel_step, ONE_KV_HEAD, x, y, sequence_parallel, True, False)
    with pytest.raises(ValueError, match="hold copies of the same KV head that differ"):
        tensor_parallel.unshard_state([g for _, _, g in results], ONE_KV_HEAD)
    q_rows, kv_rows = ONE_KV_HEAD.n_heads * ONE_KV_HEAD.head_dim // 2, ONE_KV_HEAD.head_dim
    for block in range(ONE_KV_HEAD.n_layers):
        name = f"blocks.{block}.attn.qkv_proj.weight"
        kv = [g[name][q_rows:] for _, _, g in results]  # each rank's K and V rows: its query heads' share
        attn = reference.blocks[block].attn
        want = torch.cat([attn.k_proj.weight.grad, attn.v_proj.weight.grad])
        assert kv_rows * 2 == len(want)
        assert not torch.allclose(kv[0], want, rtol=1e-3, atol=0)
        torch.testing.assert_close(kv[0] + kv[1], want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_two_parallelized_pipeline_stages_give_the_whole_models_logits(ranks, sequence_parallel):
    x, _ = seeded_batch(CFG, ROWS)
    logits = GPT(CFG, seed=0)(x).detach()
    per_rank = CFG.vocab_size // 2
    for rank, got in enumerate(ranks.apply(_two_stages, CFG, x, sequence_parallel)):
        torch.testing.assert_close(got, logits[..., rank * per_rank:(rank + 1) * per_rank], rtol=0, atol=1e-6)


@ipp.interactive
def _each_rank_alone(cfg, x, y):
    import torch.distributed as dist

    from helpers.model import GPT
    from helpers.parallel import tensor_parallel

    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]  # every rank makes every group
    model = tensor_parallel.parallelize(GPT(cfg, seed=0), groups[dist.get_rank()], sequence_parallel=True)
    logits, loss = model(x, y)
    return logits.detach(), loss.item()


def test_rank_and_size_come_from_the_group(ranks):
    """Each rank in a group of its own holds the whole model: rank 1 of the world is rank 0 of its group."""
    x, y = seeded_batch(CFG, ROWS)
    logits, loss = GPT(CFG, seed=0)(x, y)
    for got_logits, got_loss in ranks.apply(_each_rank_alone, CFG, x, y):
        torch.testing.assert_close(got_logits, logits.detach(), rtol=0, atol=1e-6)
        assert got_loss == pytest.approx(loss.item(), rel=1e-6)


def test_parallelize_keeps_the_reference_modules_and_swaps_only_their_projections(stand_in):
    model = GPT(LLAMA, seed=0)
    attn, mlp = model.blocks[0].attn, model.blocks[0].mlp
    attn.core, attn.mark = tensor_parallel.parallelize, "set by the constructor or after"  # any attribute
    tensor_parallel.parallelize(model, StandInGroup(1, 2))
    assert model.blocks[0].attn is attn and type(attn) is Attention and type(mlp) is MLP
    assert attn.core is tensor_parallel.parallelize and attn.mark.startswith("set by")
    assert (attn.head_dim, attn.rope_theta) == (LLAMA.head_dim, LLAMA.rope_theta)
    assert [n for n, _ in attn.named_children()] == ["qkv_proj", "o_proj"]
    assert [n for n, _ in mlp.named_children()] == ["gate_up_proj", "down_proj"]
    assert sorted(n for n, _ in model.named_parameters()) == sorted(tensor_parallel.shard_plan(LLAMA, 2))
