"""How fast one rank's matmuls run: each GEMM of a layer priced by its shape (chapter 01).

A matmul of an ``(M, K)`` by a ``(K, N)`` matrix does ``2·M·K·N`` FLOPs and, at the least, reads both
inputs and writes the output once. The roofline model (Williams, Waterman and Patterson 2009) says a kernel
takes the longer of its FLOPs at the peak rate and its bytes at the memory bandwidth; this module adds the two
instead (no kernel overlaps its first loads and its last stores with compute), with the FLOPs at a ceiling
fraction of the peak that the largest GEMMs reach. So a large square GEMM runs close to the ceiling, while the
thin per-rank matrices of a high tensor-parallel degree (a small ``N = d_ff / tp``), or a small ``M`` (few
tokens per micro-batch or per expert), spend a larger share of their time moving bytes: their rate falls.
Attention that materializes its ``s × s`` scores (Megatron-LM 2021's fused softmax) writes and reads them,
which the same formula prices; flash attention never stores them (Dao et al. 2022) and skips the masked half
of a causal product, at the efficiency its authors report
(:attr:`helpers.cost.time_model.Cluster.attention_efficiency`).

:func:`layer_gemms` lists the GEMMs of one layer on one rank for one micro-batch (forward: backward runs two
of each shape), :func:`compute_profile` prices a whole step's, and :func:`matmul_efficiency` turns it into the
fraction of the peak its FLOPs run at.
"""

from __future__ import annotations

from helpers.cost.model_size import kv_heads_per_rank


def gemm_seconds(m: int, k: int, n: int, peak: float, ceiling: float, hbm_bw: float, bytes_per: int = 2,
                 count: int = 1) -> float:
    """Seconds of ``count`` GEMMs of shape (m, k) x (k, n): FLOPs at ``ceiling·peak`` plus the three matrices'
    bytes over the memory bandwidth."""
    flops = 2 * m * k * n
    moved = bytes_per * (m * k + k * n + m * n)
    return count * (flops / (ceiling * peak) + moved / hbm_bw)


def layer_gemms(model, tokens: int, seq_len: int, tp: int, ep: int = 1, moe: bool = False) -> list[tuple]:
    """The forward GEMMs of one layer on one rank: (name, m, k, n, count). ``tokens`` is the rows a GEMM sees
    (micro-batch × this rank's sequence positions, gathered over tensor parallelism)."""
    d, hd = model.d_model, model.head_dim
    q = model.n_heads * hd // tp
    kv = kv_heads_per_rank(model.n_kv_heads, tp) * hd
    f = model.d_ff // tp
    n_in = 2 if model.gated else 1  # SwiGLU's gate and up projections, fused as Megatron does
    out = [("qkv", tokens, d, q + 2 * kv, 1), ("attention output", tokens, q, d, 1)]
    if moe:
        local = model.n_experts // ep
        rows = max(1, tokens * model.top_k * ep // model.n_experts)  # tokens one expert sees, uniform routing
        out += [("router", tokens, d, model.n_experts, 1), ("expert in", rows, d, n_in * f, local),
                ("expert out", rows, f, d, local)]
    else:
        out += [("mlp in", tokens, d, n_in * f, 1), ("mlp out", tokens, f, d, 1)]
    return out


def attention_seconds(model, tokens: int, seq_len: int, tp: int, cluster, flash: bool, causal: bool = True,
                      act_bytes: int = 2, blocks: int = 1) -> tuple[float, float]:
    """(counted FLOPs, seconds) of one layer's attention core, forward, on one rank: ``tokens`` queries
    attending to ``seq_len`` keys. MFU counts the full product (PaLM's 12·L·H·Q·T), whatever the kernel
    skips."""
    heads = model.n_heads // tp
    flops = 4 * tokens * seq_len * heads * model.head_dim
    if flash:  # no s×s tensor in memory; a causal kernel skips the masked half
        work = flops * (0.5 if causal else 1.0)
        # context parallelism runs it as ``blocks`` kernels (this rank's queries against each rank's keys):
        # each reads its Q, K and V blocks and writes its O, and every block after the first rescales the
        # partial output with the running log-sum-exp (fp32), as ring attention does (Liu et al. 2023)
        width = heads * model.head_dim
        io = blocks * act_bytes * width * (2 * tokens + 2 * seq_len // blocks)
        io += (blocks - 1) * 2 * 4 * tokens * width
        return flops, work / (cluster.attention_efficiency * cluster.peak_flops) + io / cluster.hbm_bw
    # materialized: QK^T writes the scores, the fused softmax reads and writes them, PV reads them
    per_head = (gemm_seconds(seq_len, model.head_dim, seq_len, cluster.peak_flops, cluster.efficiency,
                             cluster.hbm_bw, act_bytes)
                + gemm_seconds(seq_len, seq_len, model.head_dim, cluster.peak_flops, cluster.efficiency,
                               cluster.hbm_bw, act_bytes)
                + 2 * act_bytes * seq_len * seq_len / cluster.hbm_bw)
    return flops, per_head * heads * tokens / seq_len


def elementwise_bytes(model, tokens: int, tp: int, sequence_parallel: bool, act_bytes: int = 2) -> float:
    """Bytes one layer's memory-bound operations move in its forward, on one rank: the two norms (read and
    write the activation), the two residual additions (read two, write one) and the MLP's activation (GELU
    reads and writes the hidden tensor; SwiGLU's silu-and-multiply reads two and writes one). Outside the
    tensor-parallel region each rank repeats them on every token unless sequence parallelism splits them
    (Korthikanti et al. 2022, section 4.2.2)."""
    outside = 10 * tokens * model.d_model // (tp if sequence_parallel else 1)
    inside = (3 if model.gated else 2) * tokens * (model.d_ff * (model.top_k or 1)) // tp
    return act_bytes * (outside + inside)


def compute_profile(model, batch, layout, act, cluster, elementwise: bool = True, causal_skip: bool = True
                    ) -> dict:
    """FLOPs and seconds of one rank's step on the busiest-stage average: ``flops``, ``seconds`` (all of it),
    ``linear_s`` (the layers' GEMMs, which tensor-parallel traffic can hide behind) and ``attention_s`` (the
    attention cores, which context-parallel traffic can hide behind), each for the whole model on one
    tensor-parallel rank: divide by ``pp·dp·cp`` shares as the step does."""
    L, P = layout, cluster
    tokens = batch.micro_batch * batch.seq_len // L.cp
    flops = linear_s = attention_s = 0.0
    repeat = 4 if act.recompute == "full" else 3  # forward, backward (2x), and a recomputed forward
    n_moe = model.n_moe_layers
    for moe, n_layers in ((False, model.n_layers - n_moe), (True, n_moe)):
        if not n_layers:
            continue
        for _, m, k, n, count in layer_gemms(model, tokens, batch.seq_len, L.tp, L.ep, moe):
            flops += repeat * n_layers * count * 2 * m * k * n
            linear_s += repeat * n_layers * gemm_seconds(m, k, n, P.peak_flops, P.efficiency, P.hbm_bw,
                                                         count=count)
        a_flops, a_s = attention_seconds(model, tokens, batch.seq_len, L.tp, P, act.attention == "flash",
                                         causal=causal_skip, blocks=L.cp)
        a_repeat = 4 if act.recompute in ("full", "selective") else 3
        flops += a_repeat * n_layers * a_flops
        attention_s += a_repeat * n_layers * a_s
    v = model.vocab_size // L.tp  # the LM head, forward and backward, never recomputed
    flops += 3 * 2 * tokens * model.d_model * v
    head_s = 3 * gemm_seconds(tokens, model.d_model, v, P.peak_flops, P.efficiency, P.hbm_bw)
    # memory-bound operations: backward moves about twice the forward's bytes
    other_s = (repeat * model.n_layers * elementwise_bytes(model, tokens, L.tp, L.sequence_parallel)
               / P.hbm_bw if elementwise else 0.0)
    return {"flops": flops, "seconds": linear_s + attention_s + head_s + other_s, "linear_s": linear_s,
            "attention_s": attention_s, "elementwise_s": other_s}


def matmul_efficiency(model, batch, layout, act, cluster, shape_model: bool = True) -> float:
    """The fraction of the peak the step's FLOPs run at, on one rank of the busiest stage: the FLOP-weighted
    rate of every GEMM and attention core (forward, backward twice the forward, and what recomputation
    repeats). Without ``shape_model`` (or without a memory bandwidth for the cluster) every matmul runs at
    ``cluster.efficiency``, the one-constant model chapter 01 started from."""
    if not shape_model or cluster.hbm_bw is None:
        return cluster.efficiency
    p = compute_profile(model, batch, layout, act, cluster)
    return p["flops"] / (p["seconds"] * cluster.peak_flops)
