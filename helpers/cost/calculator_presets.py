"""What the calculator's command line and its page can be asked about: models, GPUs, precisions (chapter 01).

Each model preset is a :class:`helpers.cost.model_size.ModelShape` with the published size it is known by and
the source of both; each GPU a :class:`helpers.cost.time_model.Cluster` with its memory. The shapes of Llama
3, Mixtral, DeepSeek-V3 and GPT-2 small are chapter 01's own; the others are added here, from their papers and
configs. ``tests/test_calculator_cli.py`` checks every preset's exact count against its published figure.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from helpers.cost import memory_budget, model_size, time_model
from helpers.cost.model_size import ModelShape


@dataclass(frozen=True)
class Preset:
    """A model by the name the command line takes, with the size its authors publish (total and active
    parameters) and where they publish it (a key of ``book/references.bib``)."""

    shape: ModelShape
    published_total: float
    published_active: float
    cite: str
    note: str = ""


def _gpt(name: str, n_layers: int, d_model: int, n_heads: int, positions: int, source: str) -> ModelShape:
    """GPT-2's architecture (GPT-3 keeps it, Brown et al. 2020, section 2.1): LayerNorm, biases, GELU MLP of
    width 4·d_model, learned positions, the embedding tied to the head, GPT-2's 50257-token vocabulary."""
    return ModelShape(name, n_layers=n_layers, d_model=d_model, n_heads=n_heads, n_kv_heads=n_heads,
                      d_ff=4 * d_model, vocab_size=50257, gated=False, tie_embeddings=True, norm="layernorm",
                      linear_bias=True, learned_positions=positions, source=source)


# Brown et al. 2020, table 2.1: layers, d_model, heads (d_head 128) and the 2048-token context
GPT3_6B7 = _gpt("GPT-3 6.7B", 32, 4096, 32, 2048, "Brown et al. 2020, table 2.1")
GPT3_175B = _gpt("GPT-3 175B", 96, 12288, 96, 2048, "Brown et al. 2020, table 2.1")
# Qwen2.5 (Qwen Team 2024): the shapes of the released configs (hidden_size, intermediate_size, 152064
# rows of the untied embedding); the QKV projections' biases (under 0.01% of the parameters) left out
QWEN25_7B = ModelShape("Qwen2.5 7B", n_layers=28, d_model=3584, n_heads=28, n_kv_heads=4, d_ff=18944,
                       vocab_size=152064, source="Qwen Team 2024, table 1 and the released config")
QWEN25_72B = ModelShape("Qwen2.5 72B", n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, d_ff=29568,
                        vocab_size=152064, source="Qwen Team 2024, table 1 and the released config")

PRESETS = {
    "gpt2": Preset(model_size.GPT2_SMALL, 124e6, 124e6, "radford2019language",
                   "the released checkpoint's size; the paper's table 2 says 117M"),
    "gpt3-6.7b": Preset(GPT3_6B7, 6.7e9, 6.7e9, "brown2020gpt3"),
    "gpt3-175b": Preset(GPT3_175B, 175.0e9, 175.0e9, "brown2020gpt3"),
    "llama3-8b": Preset(model_size.LLAMA3_8B, 8e9, 8e9, "llama3"),
    "llama3-70b": Preset(model_size.LLAMA3_70B, 70e9, 70e9, "llama3"),
    "llama3-405b": Preset(model_size.LLAMA3_405B, 405e9, 405e9, "llama3"),
    "mixtral-8x7b": Preset(model_size.MIXTRAL_8X7B, 47e9, 13e9, "jiang2024mixtral"),
    "deepseek-v3-like": Preset(model_size.DEEPSEEK_V3_LIKE, 671e9, 37e9, "liu2024deepseekv3",
                               "latent attention counted as multi-head attention and the shared expert left "
                               "out: its active parameters fall about 5% short of the published 37B"),
    "qwen2.5-7b": Preset(QWEN25_7B, 7.61e9, 7.61e9, "qwen2024qwen25"),
    "qwen2.5-72b": Preset(QWEN25_72B, 72.7e9, 72.7e9, "qwen2024qwen25"),
}


@dataclass(frozen=True)
class GPU:
    """One GPU model in a cluster of 8-GPU nodes: the time model's cluster and the memory of one GPU."""

    cluster: time_model.Cluster
    memory: float   # bytes
    fitted: bool    # whether the matmul ceiling was fitted on published runs of this GPU (chapter 01)
    cite: str


# H200: the H100's compute and NVLink with 141 GB at 4.8 TB/s (NVIDIA's H200 datasheet). B200: 2.25 PFLOP/s
# dense BF16, 180 GB at 8 TB/s, NVLink 5 at 1.8 TB/s both ways (NVIDIA's DGX B200 datasheet: 1,440 GB and
# 64 TB/s for 8 GPUs), its bus bandwidth taken as 80% of one direction as for the H100 (360 of 450 GB/s),
# and the same 400 Gb/s network port per GPU. Neither has a published run to fit its matmul ceiling on: they
# borrow the H100's (``fitted`` False, and the command line says so).
_H100 = time_model.H100
GPUS = {
    "h100": GPU(_H100, 80e9, True, "nvidia_h100_datasheet"),
    "a100": GPU(time_model.A100_SELENE, 80e9, True, "narayanan2021efficient"),
    "h200": GPU(replace(_H100, name="8x H200 SXM per node, NVLink 4 and 8x400 Gb/s InfiniBand",
                        hbm_bw=4.8e12), 141e9, False, "nvidia_h200_datasheet"),
    "b200": GPU(replace(_H100, name="8x B200 per node, NVLink 5 and 8x400 Gb/s InfiniBand",
                        peak_flops=2.25e15, intra_bw=720e9, hbm_bw=8e12), 180e9, False,
                "nvidia_dgx_b200_datasheet"),
}

PRECISIONS = {"fp32": memory_budget.FP32, "bf16": memory_budget.BF16,
              "bf16-fp32-grads": memory_budget.BF16_FP32_GRADS, "fp8": memory_budget.FP8,
              "fp8-gather": memory_budget.FP8_GATHER}

# The chapter that measures each number the calculator prints (the page links each number to it)
CHAPTERS = {"parameters": "04", "gradients": "04", "optimizer states": "04", "activations": "05",
            "overheads": "01", "dp": "03", "dp (experts)": "08", "tp": "05", "pp": "06", "cp": "07",
            "ep": "08", "compute": "01", "bubble": "06", "mfu": "01"}
