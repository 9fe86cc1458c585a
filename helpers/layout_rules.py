"""The constraints a parallel layout must meet, each stated once, with one wording of each error (chapter 01).

Chapter 01's calculator checks a layout for a model it only knows by its shape; chapters 05-08 check the same
layout before they split a real model. Both call these functions, so a rule cannot drift between the two and a
reader meets the same sentence wherever it is broken: ``<degree>=<n> must divide <field>=<m>: <why>``, the
field named as the model's configuration names it. ``of`` adds the model's name where one is known.
"""

from __future__ import annotations


def require_positive(**degrees: int) -> None:
    """Every degree of parallelism is at least 1."""
    for name, value in degrees.items():
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")


def require_divides(degree: str, value: int, field: str, n: int, why: str, of: str = "") -> None:
    """``value`` ranks split ``n`` things evenly, or the error names both and says why it must."""
    if n % value:
        where = f" of {of}" if of else ""
        raise ValueError(f"{degree}={value} must divide {field}={n}{where}: {why}")


def tensor_parallel(tp: int, n_heads: int, n_kv_heads: int, d_ff: int, vocab_size: int,
                    seq_len: int | None = None, of: str = "") -> None:
    """Megatron's split (chapter 05): whole heads, whole KV heads, hidden units and vocabulary rows per rank;
    with sequence parallelism (``seq_len`` given: the tokens one tensor-parallel group holds) whole tokens
    too. With more ranks than KV heads, each KV head is copied onto ``tp / n_kv_heads`` ranks, as vLLM's
    ``QKVParallelLinear`` does (``num_kv_head_replicas``), so ``tp`` must then be a multiple of
    ``n_kv_heads``.
    Megatron-LM does not copy them: up to core v0.15 it refuses (``divide(num_query_groups, world_size)``);
    from core v0.16 each rank keeps ``1/tp`` of the fused QKV weight and all-gathers the QKV activations."""
    require_positive(tp=tp)
    require_divides("tp", tp, "n_heads", n_heads, "each rank computes whole attention heads", of)
    if n_kv_heads % tp and tp % n_kv_heads:
        where = f" of {of}" if of else ""
        raise ValueError(f"tp={tp} must divide n_kv_heads={n_kv_heads} or be a multiple of it{where}: each "
                         f"rank keeps the KV heads of its query heads, or a copy of the one they share")
    require_divides("tp", tp, "d_ff", d_ff, "each rank computes d_ff/tp hidden units", of)
    require_divides("tp", tp, "vocab_size", vocab_size, "pad the vocabulary to a multiple of tp", of)
    if seq_len is not None:
        require_divides("tp", tp, "seq_len", seq_len,
                        "sequence parallelism gives each rank seq_len/tp tokens", of)


def pipeline_parallel(n_chunks: int, n_layers: int, of: str = "", *, pp: int | None = None,
                      vpp: int | None = None) -> None:
    """Chapter 06: every model chunk (``pp`` stages times ``vpp`` virtual stages) holds at least one layer.
    Given ``pp`` and ``vpp`` (their product ``n_chunks``), the error names both."""
    if (pp is None) != (vpp is None):
        raise ValueError(f"give both pp and vpp or neither, got pp={pp}, vpp={vpp}")
    if pp is not None:
        require_positive(pp=pp, vpp=vpp)
        if pp * vpp != n_chunks:
            raise ValueError(f"n_chunks={n_chunks} must be pp·vpp = {pp}·{vpp} = {pp * vpp}")
    if n_chunks < 1:
        raise ValueError(f"the pipeline needs at least one chunk, got n_chunks={n_chunks}")
    if n_chunks > n_layers:
        where = f" of {of}" if of else ""
        named = ""
        if pp is not None:
            named = f" (pp={pp} stages of vpp={vpp} chunks each; " + (
                f"with pp={pp}, vpp may be at most {n_layers // pp})" if pp <= n_layers
                else "pp alone exceeds the layers)")
        raise ValueError(f"n_chunks={n_chunks} (pp·vpp) must not exceed n_layers={n_layers}{where}: "
                         f"every chunk needs a layer{named}")


def context_parallel(cp: int, seq_len: int, zigzag: bool = False) -> None:
    """Chapter 07: each rank holds ``seq_len/cp`` positions; zig-zag cuts the sequence into ``2·cp``
    chunks."""
    require_positive(cp=cp)
    if zigzag:
        require_divides("2*cp", 2 * cp, "seq_len", seq_len,
                        "the zig-zag layout cuts the sequence into 2·cp chunks")
    else:
        require_divides("cp", cp, "seq_len", seq_len, "each rank holds seq_len/cp positions")


def ulysses(cp: int, n_heads: int, n_kv_heads: int) -> None:
    """Chapter 07: Ulysses's all-to-all gives each rank ``1/cp`` of the query heads and of the KV heads."""
    require_positive(cp=cp)
    require_divides("cp", cp, "n_heads", n_heads, "Ulysses gives each rank whole heads")
    require_divides("cp", cp, "n_kv_heads", n_kv_heads, "Ulysses gives each rank whole heads")


def expert_parallel(ep: int, n_experts: int, of: str = "") -> None:
    """Chapter 08: each rank holds ``n_experts/ep`` whole experts."""
    require_positive(ep=ep)
    require_divides("ep", ep, "n_experts", n_experts, "each rank holds n_experts/ep experts", of)


def mesh(world_size: int, dp: int, tp: int, pp: int, cp: int) -> None:
    """The ranks are a grid: their number is the product of the degrees (expert parallelism lies inside
    dp·cp)."""
    if world_size != dp * tp * pp * cp:
        raise ValueError(f"world size {world_size} != dp*tp*pp*cp = {dp}*{tp}*{pp}*{cp} "
                         f"= {dp * tp * pp * cp}")


def zero_stage(zero: int) -> None:
    """Chapter 04: ZeRO's stages are 0 (none), 1 (optimizer states), 2 (and gradients), 3 (and parameters)."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be a ZeRO stage 0, 1, 2 or 3, got {zero}")


def sequence_parallel(sequence_parallel: bool, tp: int) -> None:
    """Chapter 05: sequence parallelism splits the tokens over the tensor-parallel ranks."""
    if sequence_parallel and tp == 1:
        raise ValueError("sequence parallelism shards along the tensor-parallel group: it needs tp > 1")


def virtual_stages(vpp: int, pp: int) -> None:
    """Chapter 06: a rank's several chunks (interleaving) are stages of a pipeline."""
    if vpp > 1 and pp == 1:
        raise ValueError("virtual pipeline stages (vpp > 1) need pipeline parallelism (pp > 1)")


def experts_folded(ep: int, dp: int, cp: int) -> None:
    """Chapter 08: the expert-parallel ranks are folded onto the data- (and context-) parallel ones."""
    require_divides("ep", ep, "dp*cp", dp * cp, "experts are sharded inside the data-parallel group")
