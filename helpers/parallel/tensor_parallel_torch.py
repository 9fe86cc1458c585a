"""PyTorch's tensor parallelism on the book's GPT (chapter 05): the counterpart chapter 05 checks its own
layers against, and ``make bench`` times them against.

``torch.distributed.tensor.parallel`` annotates the unmodified model: each module gets a *style* that turns
its weights into ``DTensor`` shards over a device mesh and puts the collectives at its inputs and outputs. The
plan below is Megatron's split, as chapter 05 builds it: Q, K, V and the MLP's up projection
column-parallel, the output projections row-parallel, the tied embedding split by vocabulary; under sequence
parallelism the norms run on sequence shards (``SequenceParallel``) and the sequence is gathered before
attention and the MLP.
"""

from __future__ import annotations

from helpers import dist as book_dist
from helpers.model import GPT, GPTConfig


def torch_tensor_parallel(config: GPTConfig, mesh, sequence_parallel: bool) -> GPT:
    """The book's GPT (seed 0), split by PyTorch's tensor-parallel styles over the 1-D ``mesh``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel, parallelize_module)

    model = GPT(config, seed=0).to(book_dist.device())  # the weights not split stay where the split ones go
    seq = Shard(1) if sequence_parallel else Replicate()  # the residual stream between the parallel layers
    plan = {"tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
            "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)}
    if sequence_parallel:
        plan["ln_f"] = SequenceParallel()
        plan["pos_emb"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0))
    parallelize_module(model, mesh, plan)
    model.lm_head.weight = model.tok_emb.weight  # tie again: both became DTensors split by rows
    for block in model.blocks:
        block_plan = {"attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(),
                      "attn.v_proj": ColwiseParallel(), "attn.o_proj": RowwiseParallel(output_layouts=seq),
                      "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel(output_layouts=seq)}
        if sequence_parallel:
            gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
            # attention is called as attn(x, rope): the rotary tables (None here) pass through as they are
            gather_x = PrepareModuleInput(input_layouts=(Shard(1), None),
                                          desired_input_layouts=(Replicate(), None))
            block_plan.update({"ln1": SequenceParallel(), "ln2": SequenceParallel(), "attn": gather_x,
                               "mlp": gather})
        parallelize_module(block, mesh, block_plan)  # Attention reads its (local) head counts from Q, K and V
    return model
