"""The time model of one training step: what each parallelism sends, and alpha-beta time (chapter 01).

The third of the three parts of chapter 01's calculator, after :mod:`helpers.cost.model_size` and
:mod:`helpers.cost.memory_budget` (whose :func:`~helpers.cost.memory_budget.budget` calls :func:`traffic`).
Each kind of parallelism has its traffic formula here, public, and the chapter whose ledger measures that
traffic shows it and checks it: data parallelism and ZeRO in chapters 03 and 04, tensor parallelism in 05, the
pipeline in 06, context parallelism in 07, expert parallelism in 08.

- bytes of ring collectives: a ring all-reduce sends 2(n-1)/n of the buffer from each rank, an all-gather or a
  reduce-scatter (n-1)/n (Patarasuk and Yuan 2009);
- time: the alpha-beta model, latency alpha per message plus bytes over bandwidth (Hockney 1994).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from helpers.cost.budget_types import Budget, Layout
from helpers.cost.collective_costs import cost_terms
from helpers.cost.model_size import kv_heads_per_rank, whole_number
from helpers.cost.pipeline_schedules import stage_layers


@dataclass(frozen=True)
class Cluster:
    """Hardware for the time model. Bandwidths are per GPU, in bytes per second, as nccl-tests' bus
    bandwidth. ``efficiency`` is the fraction of the peak the largest GEMMs reach; with ``hbm_bw`` (the
    memory bandwidth) each GEMM's own rate follows from its shape (:mod:`helpers.cost.matmul_rate`), without
    it every matmul runs at ``efficiency``."""

    name: str
    gpus_per_node: int
    peak_flops: float          # dense FLOP/s of one GPU at the compute precision
    intra_bw: float            # within a node (NVLink)
    inter_bw: float            # between nodes (InfiniBand / RoCE)
    intra_alpha: float = 5e-6  # latency of one message within a node, seconds
    inter_alpha: float = 10e-6
    efficiency: float = 0.5    # the matmul ceiling (all matmuls, when hbm_bw is None)
    hbm_bw: float | None = None  # bytes/s of the GPU's memory: GEMMs priced by their shape when given
    attention_efficiency: float = 0.5  # flash attention's rate on the work it does, fraction of peak

    def __post_init__(self):
        for f in ("gpus_per_node", "peak_flops", "intra_bw", "inter_bw"):
            if not getattr(self, f) > 0:
                raise ValueError(f"Cluster {self.name!r}: {f} must be positive, got {getattr(self, f)}")
        for f in ("efficiency", "attention_efficiency"):
            if not 0 < getattr(self, f) <= 1:
                raise ValueError(f"Cluster {self.name!r}: {f} is a fraction of the peak, in (0, 1], got "
                                 f"{getattr(self, f)}")
        if self.hbm_bw is not None and not self.hbm_bw > 0:
            raise ValueError(f"Cluster {self.name!r}: hbm_bw must be positive or None, got {self.hbm_bw}")
        for f in ("intra_alpha", "inter_alpha"):
            if not getattr(self, f) >= 0:
                raise ValueError(f"Cluster {self.name!r}: {f} is a latency in seconds, at least 0, got "
                                 f"{getattr(self, f)}")
        whole_number(f"Cluster {self.name!r}: gpus_per_node", self.gpus_per_node, least=1)


# The ceilings: fitted on the fitting runs of helpers.cost.published_runs (chapter 01 refits them at build,
# fails when they drift); flash attention at the 50 % of peak FlashAttention-2 reports as its lower end on
# A100 (Dao 2023: 50-73 %). Memory bandwidths from the vendors' datasheets (H100 SXM 3.35 TB/s, A100 80GB
# 2.0 TB/s).
H100_CEILING, A100_CEILING = 0.654, 0.673
H100 = Cluster("8x H100 SXM per node, NVLink 4 and 8x400 Gb/s InfiniBand", gpus_per_node=8,
               peak_flops=989e12, intra_bw=360e9, inter_bw=45e9, efficiency=H100_CEILING, hbm_bw=3.35e12)
# NVIDIA's Selene (Narayanan et al. 2021, section 5): DGX A100 nodes, NVLink 3 (600 GB/s both ways, 300 one
# way; 240 taken as the bus bandwidth reached) and 8x200 Gb/s HDR InfiniBand per node (25 GB/s per GPU)
A100_SELENE = Cluster("8x A100 80GB per node, NVLink 3 and 8x200 Gb/s InfiniBand (Selene)", gpus_per_node=8,
                      peak_flops=312e12, intra_bw=240e9, inter_bw=25e9, efficiency=A100_CEILING,
                      hbm_bw=2.0e12)


@dataclass(frozen=True)
class Assumptions:
    """The time model's assumptions, each named, cited where production does it, and switchable: a test or a
    page turns one off to see how much it moves a prediction.

    - ``gemm_shape``: each GEMM at its shape's rate (:mod:`helpers.cost.matmul_rate`); off: every matmul at
      the cluster's ``efficiency``.
    - ``causal_skip``: a causal flash-attention kernel skips the masked half of the product (FlashAttention-2,
      Dao 2023), though MFU counts all of it; off: it computes the whole square.
    - ``elementwise``: the memory-bound operations (norms, residuals, activations) at the memory bandwidth;
      off: free (only with ``gemm_shape``).
    - ``tp_overlap``: with sequence parallelism, the all-gathers and reduce-scatters are split and pipelined
      with the GEMMs that use them (Megatron-LM's ``--tp-comm-overlap``, torchtitan's async TP); one chunk in
      ``tp`` of the traffic, and whatever exceeds the GEMMs, stays exposed. Off (or without SP): all exposed.
    - ``dp_overlap``: gradient reductions behind the backward of the micro-batch they follow (DDP's buckets).
    - ``zero3_prefetch``: ZeRO-3/FSDP gathers prefetched behind the micro-batch before (FSDP's prefetch).
    - ``cp_overlap``: context parallelism's K/V transfers behind the attention blocks (ring attention).
    - ``ep_node_limited``: a model with node-limited routing (``ModelShape.route_nodes``) sends each token
      across at most that many nodes, once each, and fans out over NVLink (DeepSeek-AI 2024).
    """

    gemm_shape: bool = True
    causal_skip: bool = True
    elementwise: bool = True
    tp_overlap: bool = True
    dp_overlap: bool = True
    zero3_prefetch: bool = True
    cp_overlap: bool = True
    ep_node_limited: bool = True


DEFAULT = Assumptions()


@dataclass(frozen=True)
class DPTransfer:
    """Data-parallel collectives issued together, ``times`` per step, and the compute they may hide behind.

    ``behind`` is "backward" (the backward of one micro-batch: the gradients it reduces are final only once
    the micro-batch that produced them has passed), "forward" (ZeRO-3's prefetched gather before a
    micro-batch's forward) or "" (nothing: the parameters' all-gather after the optimizer step). A reduction
    once per step thus hides behind the last micro-batch's backward alone, 2/3 of compute/m, on the first
    pipeline stage, whose last backward ends the step.
    """

    kind: str          # "dp" or "dp (experts)": the group, for its link
    nbytes: float      # per occurrence
    messages: int      # sequential message steps per occurrence
    times: int         # occurrences per step
    behind: str


# --------------------------------------------------------------------------------------------- traffic

def ring_all_reduce_bytes(n_bytes: int, n: int) -> float:
    """Bytes one rank sends in a ring all-reduce of ``n_bytes`` over ``n`` ranks: 2(n-1)/n of the buffer."""
    return cost_terms("ring_all_reduce", n)[1] * n_bytes


def ring_all_gather_bytes(n_bytes: int, n: int) -> float:
    """All-gather (or reduce-scatter) of an ``n_bytes`` result: (n-1)/n of it, per rank."""
    return cost_terms("ring_all_gather", n)[1] * n_bytes


def data_parallel_traffic(n_params: int, dp: int, zero: int, m: int, precision, label: str = "dp"):
    """The data-parallel collectives of one step for ``n_params`` parameters reduced over ``dp`` ranks.

    Unsharded gradients accumulate over the ``m`` micro-batches and are reduced once (an all-reduce; ZeRO-1 a
    reduce-scatter, then an all-gather of the updated parameters); sharded ones (ZeRO-2, ZeRO-3) keep only
    this rank's shard, so every micro-batch's gradient is reduce-scattered before the next overwrites the
    unsharded buffer; ZeRO-3 also gathers the parameters for every micro-batch's forward and again for its
    backward. ZeRO-3's gathers carry ``precision.gather_bytes`` per parameter (one byte when FP8 gathers cast
    the shards first, as torchao's float8 FSDP does); ZeRO-1/2's gather of the updated parameters refreshes
    the copy every rank keeps, so it carries ``param_bytes``; gradients are reduced in ``grad_bytes``. Each
    entry is a :class:`DPTransfer`: bytes and message steps per occurrence, occurrences per step.
    """
    g, p = n_params * precision.grad_bytes, n_params * precision.param_bytes
    rs, ag, n = ring_all_gather_bytes(g, dp), ring_all_gather_bytes(p, dp), dp - 1
    if zero == 3:
        ag = ring_all_gather_bytes(n_params * precision.gather_bytes, dp)
    if zero == 0:
        plan = [(ring_all_reduce_bytes(g, dp), 2 * n, 1, "backward")]
    elif zero == 1:
        plan = [(rs, n, 1, "backward"), (ag, n, 1, "")]
    elif zero == 2:
        plan = [(rs, n, m, "backward"), (ag, n, 1, "")]
    else:
        plan = [(ag, n, m, "forward"), (ag + rs, 2 * n, m, "backward")]
    return [DPTransfer(label, nbytes, k, times, behind) for nbytes, k, times, behind in plan]


def tensor_parallel_traffic(x_bytes: int, tp: int, sequence_parallel: bool, layers: int, m: int,
                            recompute: str = "none", embedding: bool = True) -> tuple[float, int]:
    """Bytes one rank sends per step and its message steps, for ``layers`` layers whose activation tensor
    (one micro-batch, this rank's tokens) is ``x_bytes``.

    Two all-reduces per layer forward and two backward (Megatron's f and g); with sequence parallelism each
    becomes an all-gather and a reduce-scatter (the same bytes), and backward gathers the inputs of the two
    column-parallel layers again, half an all-reduce each: the activation accounting of Korthikanti et al.
    2022 keeps only this rank's slice of them, as Megatron does. A fully recomputed forward repeats the
    forward's two. The vocabulary-parallel embedding (forward) counts where ``embedding`` is on this rank's
    stage; the LM head's input (backward, re-gathered with SP) always does: with pipeline stages the model
    charges the busiest stage's layers and the costlier end, the head.
    """
    all_reduce = ring_all_reduce_bytes(x_bytes, tp)  # = an all-gather + a reduce-scatter of x
    regather = ring_all_gather_bytes(x_bytes, tp) if sequence_parallel else 0
    n_layer = 4 + (2 if recompute == "full" else 0)  # all-reduces, or all-gather/reduce-scatter pairs
    head = all_reduce + regather
    sent = m * (layers * (n_layer * all_reduce + 2 * regather) + head + (all_reduce if embedding else 0))
    pairs = layers * n_layer + (2 if embedding else 1)
    return sent, m * (2 * pairs + ((2 * layers + 1) if sequence_parallel else 0)) * (tp - 1)


def pipeline_traffic(boundary_bytes: int, vpp: int, m: int) -> tuple[float, int]:
    """An interior stage sends every micro-batch's activations forward and their gradients back, per chunk."""
    return 2 * vpp * m * boundary_bytes, 2 * vpp * m


def context_parallel_traffic(kv_bytes: int, cp: int, layers: int, m: int) -> tuple[float, int]:
    """Ring attention sends K and V forward and K, V and their gradients backward, ``cp - 1`` steps each way,
    in every layer: three ``kv_bytes`` blocks per step (``kv_bytes`` holds both K and V)."""
    return m * layers * 3 * (cp - 1) * kv_bytes, m * layers * 3 * (cp - 1)


def expert_parallel_traffic(routed_bytes: int, ep: int, moe_layers: int, m: int) -> tuple[float, int]:
    """The all-to-alls of every MoE layer (dispatch and combine forward, their two gradients backward), each
    sending the ``(ep-1)/ep`` of the ``routed_bytes`` (tokens x top-k rows) that leave this rank, under
    uniform routing."""
    return m * moe_layers * 4 * (ep - 1) * routed_bytes / ep, m * moe_layers * 4 * (ep - 1)


def traffic(model, batch, L, P, act, dense: int, expert: int, m: int):
    """Bytes each parallelism sends from one rank per optimizer step, its sequential message steps, and when
    the data-parallel part of it runs (:class:`DPTransfer`): the formulas above, for the busiest pipeline
    stage."""
    sent, steps, transfers = {}, {}, []
    # dense parameters are reduced over the dp·cp ranks, each expert's over the dp·cp/ep ranks that hold it
    for label, count, dp in (("dp", dense, L.dp * L.cp), ("dp (experts)", expert, L.dp * L.cp // L.ep)):
        if dp == 1 or count == 0:
            continue
        plan = data_parallel_traffic(count, dp, L.zero, m, P, label)
        transfers += plan
        sent[label] = sum(x.nbytes * x.times for x in plan)
        steps[label] = sum(x.messages * x.times for x in plan)
    s_rank = batch.seq_len // L.cp
    x = batch.micro_batch * s_rank * model.d_model * P.act_bytes  # one activation tensor of a micro-batch
    stage = max(stage_layers(model.n_layers, L.pp), key=len)  # the busiest stage
    if L.tp > 1:
        sent["tp"], steps["tp"] = tensor_parallel_traffic(x, L.tp, L.sequence_parallel, len(stage), m,
                                                          act.recompute, embedding=L.pp == 1)
    if L.pp > 1:
        sent["pp"], steps["pp"] = pipeline_traffic(x // (L.tp if L.sequence_parallel else 1), L.vpp, m)
    if L.cp > 1:
        kv_heads = kv_heads_per_rank(model.n_kv_heads, L.tp)  # a replicated KV head travels on every rank
        kv = 2 * batch.micro_batch * s_rank * kv_heads * model.head_dim * P.act_bytes
        sent["cp"], steps["cp"] = context_parallel_traffic(kv, L.cp, len(stage), m)
    if L.ep > 1 and model.n_experts:
        tokens = batch.micro_batch * s_rank // (L.tp if L.sequence_parallel else 1)
        routed = tokens * model.top_k * model.d_model * P.act_bytes
        # the stage with the most MoE layers, which need not be the longest (dense layers come first)
        moe = max(model.moe_layers_in(s) for s in stage_layers(model.n_layers, L.pp))
        sent["ep"], steps["ep"] = expert_parallel_traffic(routed, L.ep, moe, m)
    return sent, steps, transfers


# --------------------------------------------------------------------------------------------- time

@dataclass
class StepTime:
    compute_s: float
    comm_s: dict
    exposed_comm_s: float
    bubble_s: float
    step_s: float
    mfu: float
    matmul_efficiency: float = 0.0  # the fraction of peak the step's FLOPs ran at
    exposed_s: dict = field(default_factory=dict)  # the exposed part of each group's traffic


def _link(kind: str, L: Layout, cluster: Cluster) -> tuple[float, float]:
    """(bandwidth, alpha) of the link a parallelism's ranks talk over: within a node if they fit in one (tp
    innermost, then cp, dp, pp)."""
    span = _span(kind, L)
    if span <= cluster.gpus_per_node:
        return cluster.intra_bw, cluster.intra_alpha
    return cluster.inter_bw, cluster.inter_alpha


def _span(kind: str, L: Layout) -> int:
    return {"tp": L.tp, "cp": L.tp * L.cp, "ep": L.tp * L.cp * L.ep, "dp": L.tp * L.cp * L.dp,
            "dp (experts)": L.tp * L.cp * L.dp,
            "pp": 2 * L.tp * L.cp * L.dp}[kind]  # pp: two neighbouring stages


def _ep_seconds(b: Budget, cluster: Cluster, node_limited: bool) -> float:
    """The all-to-alls: the share that stays in a node over NVLink, the rest over the network; with
    node-limited routing, a token crosses to at most ``route_nodes`` other nodes, once each."""
    L, model = b.layout, b.model
    nodes = max(1, _span("ep", L) // cluster.gpus_per_node)
    off_node = 1 - 1 / nodes
    if node_limited and model.route_nodes and nodes > 1:
        off_node *= min(1.0, model.route_nodes / model.top_k)
    n_bytes, alpha = b.sent["ep"], (cluster.inter_alpha if nodes > 1 else cluster.intra_alpha)
    return (n_bytes * (1 - off_node) / cluster.intra_bw + n_bytes * off_node / cluster.inter_bw
            + b.messages["ep"] * alpha)


def step_time(b: Budget, cluster: Cluster, overlap: bool = True, assumptions: Assumptions | None = None
              ) -> StepTime:
    """The alpha-beta time of one step: compute at the rate of its GEMMs' shapes, each group's traffic at
    its link less what hides behind compute (each overlap named in :class:`Assumptions`), plus the
    pipeline bubble, (pp-1)/(vpp*m) of the compute (Narayanan et al. 2021). A data-parallel transfer hides
    only behind the compute in flight with it (:class:`DPTransfer`); ``overlap=False`` is
    ``assumptions.dp_overlap`` off."""
    from helpers.cost.matmul_rate import compute_profile

    A = assumptions or DEFAULT
    L, m = b.layout, b.micro_batches
    shaped = A.gemm_shape and cluster.hbm_bw is not None
    if shaped:
        profile = compute_profile(b.model, b.batch, L, b.activations_model, cluster, A.elementwise,
                                  A.causal_skip)
        efficiency = profile["flops"] / (profile["seconds"] * cluster.peak_flops)
    else:
        efficiency = cluster.efficiency
    rate = cluster.peak_flops * efficiency
    compute = b.flops["total"] / L.world_size / rate
    forward = b.flops["model"] / 3 / L.world_size / rate / m  # a micro-batch's forward, no recomputation
    comm = {}
    for kind, n_bytes in b.sent.items():
        if kind == "ep":
            comm[kind] = _ep_seconds(b, cluster, A.ep_node_limited)
            continue
        bw, alpha = _link(kind, L, cluster)
        comm[kind] = n_bytes / bw + b.messages[kind] * alpha
    exposed = {k: v for k, v in comm.items() if not k.startswith("dp")}
    if "tp" in comm and A.tp_overlap and L.sequence_parallel:
        # the layers' GEMMs on this rank's share of the step, the same share of the step as compute
        share = profile["linear_s"] / profile["seconds"] if shaped else 0.9
        exposed["tp"] = max(0.0, comm["tp"] - share * compute) + comm["tp"] / L.tp
    if "cp" in comm and A.cp_overlap:
        share = profile["attention_s"] / profile["seconds"] if shaped else 0.1
        exposed["cp"] = max(0.0, comm["cp"] - share * compute * (L.cp - 1) / L.cp) + comm["cp"] / L.cp
    window = {"forward": forward, "backward": compute / m - forward, "": 0.0}
    if overlap and A.dp_overlap:  # transfers that share a window (the dense and the expert groups') together
        shared = {}
        for x in b.dp_transfers:
            bw, alpha = _link(x.kind, L, cluster)
            seconds = x.nbytes / bw + x.messages * alpha
            shared[x.behind, x.times] = shared.get((x.behind, x.times), 0.0) + seconds
        prefetch = A.zero3_prefetch or L.zero < 3
        dp_exposed = sum(times * max(0.0, seconds - (window[behind] if prefetch else 0.0))
                         for (behind, times), seconds in shared.items())
    else:
        dp_exposed = sum(v for k, v in comm.items() if k.startswith("dp"))
    if dp_exposed or any(k.startswith("dp") for k in comm):
        exposed["dp"] = dp_exposed
    bubble = compute * (L.pp - 1) / (L.vpp * m) if L.pp > 1 else 0.0
    total_exposed = sum(exposed.values())
    step = compute + bubble + total_exposed
    mfu = b.flops["model"] / (step * L.world_size * cluster.peak_flops)
    return StepTime(compute, comm, total_exposed, bubble, step, mfu, efficiency, exposed)
