"""Every constructor of chapter 01's calculator refuses a bad field in one line naming the field, the value
and what is allowed (issue 40, item 3)."""

import numpy as np
import pytest

from helpers.cost import memory_budget, model_size, time_model
from helpers.cost.memory_budget import ActivationModel, Layout, Precision
from helpers.cost.model_size import Batch, ModelShape

SHAPE = dict(name="m", n_layers=4, d_model=64, n_heads=4, n_kv_heads=4, d_ff=256, vocab_size=256)
CLUSTER = dict(name="c", gpus_per_node=8, peak_flops=1e15, intra_bw=1e11, inter_bw=1e10)


@pytest.mark.parametrize("call, message", [
    (lambda: Batch(4096, 1, -8), r"Batch: global_batch must be a whole number of at least 1, got -8"),
    (lambda: Batch(4096, 0, 8), r"Batch: micro_batch must be a whole number of at least 1, got 0"),
    (lambda: Batch(-1, 1, 8), r"Batch: seq_len must be a whole number of at least 1, got -1"),
    (lambda: Batch(4096, 1, 0), r"Batch: global_batch must be a whole number of at least 1, got 0"),
    (lambda: Batch(4096, 1.5, 8), r"Batch: micro_batch must be a whole number of at least 1, got 1.5"),
    (lambda: Layout(dp=2.5), r"Layout: dp must be a whole number of at least 1, got 2.5"),
    (lambda: Layout(tp=0), r"Layout: tp must be a whole number of at least 1, got 0"),
    (lambda: Layout(vpp=-2, pp=2), r"Layout: vpp must be a whole number of at least 1, got -2"),
    (lambda: ModelShape(**{**SHAPE, "n_layers": -4}),
     r"m: n_layers must be a whole number of at least 1, got -4"),
    (lambda: ModelShape(**SHAPE, n_experts=8, top_k=2, n_dense_layers=5),
     r"m: n_dense_layers=5 must be at most n_layers=4"),
    (lambda: ModelShape(**SHAPE, n_dense_layers=1), r"m: n_dense_layers=1 needs n_experts > 0"),
    (lambda: ModelShape(**SHAPE, n_experts=-1), r"m: n_experts must be a whole number of at least 0, got -1"),
    (lambda: ModelShape(**SHAPE, n_experts=8, top_k=2, route_nodes=-1),
     r"m: route_nodes must be a whole number of at least 0, got -1"),
    (lambda: time_model.Cluster(**{**CLUSTER, "peak_flops": 0}),
     r"Cluster 'c': peak_flops must be positive, got 0"),
    (lambda: time_model.Cluster(**CLUSTER, efficiency=1.5),
     r"Cluster 'c': efficiency is a fraction of the peak, in \(0, 1\], got 1.5"),
    (lambda: time_model.Cluster(**CLUSTER, efficiency=0.0),
     r"Cluster 'c': efficiency is a fraction of the peak, in \(0, 1\], got 0.0"),
    (lambda: time_model.Cluster(**CLUSTER, hbm_bw=-1.0),
     r"Cluster 'c': hbm_bw must be positive or None, got -1.0"),
    (lambda: time_model.Cluster(**CLUSTER, inter_alpha=-1e-6),
     r"Cluster 'c': inter_alpha is a latency in seconds, at least 0, got -1e-06"),
    (lambda: time_model.Cluster(**{**CLUSTER, "gpus_per_node": 2.5}),
     r"Cluster 'c': gpus_per_node must be a whole number of at least 1, got 2.5"),
    (lambda: Precision("p", 2, -2, 4, 8, 2),
     r"Precision 'p': grad_bytes must be a whole number of at least 1"),
    (lambda: ActivationModel(norm_stat_bytes=-4),
     r"ActivationModel: norm_stat_bytes must be a whole number of at least 0, got -4"),
])
def test_a_bad_field_is_named_with_its_value_and_what_is_allowed(call, message):
    with pytest.raises(ValueError, match=message) as err:
        call()
    assert "\n" not in str(err.value)


def test_integer_types_beyond_python_int_are_whole_numbers():
    assert Batch(np.int64(4096), 1, 8).seq_len == 4096
    assert Layout(dp=np.int32(2)).dp == 2
    b = memory_budget.budget(model_size.LLAMA3_8B, Batch(4096, 1, 8), Layout(dp=np.int64(8)))
    assert b.layout.dp == 8
