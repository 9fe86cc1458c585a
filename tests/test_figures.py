"""helpers/figures.py: its recorders see what ran and where (no ranks needed: a toy layer books messages)."""

import types

import matplotlib
import torch

from helpers import figures
from helpers.parallel.ledger import LEDGER, Message

matplotlib.use("Agg")


def _book(name):
    LEDGER.messages.append(Message(name, name, 0, "send", -1, 0))
    LEDGER.messages.append(Message(name, name, 0, "recv", -1, 0))


class _BookedBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        _book("all_reduce")
        return grad


class ColumnParallelLinear(torch.nn.Linear):  # named as the book's layers, so megatron_name places it
    def forward(self, x):
        return super().forward(_BookedBackward.apply(x))


class RowParallelLinear(torch.nn.Linear):
    def forward(self, x):
        _book("all_reduce")
        return super().forward(x)


def test_record_block_collectives_places_each_booking_in_the_layer_that_made_it():
    LEDGER.clear()
    model = torch.nn.Sequential(torch.nn.LayerNorm(4), ColumnParallelLinear(4, 4), RowParallelLinear(4, 4))
    x = torch.randn(2, 4, requires_grad=True)
    events = figures.record_block_collectives(model, lambda: model(x).sum().backward())
    got = [(phase, name, coll) for phase, name, _, coll in events]
    assert got == [("forward", "0", []), ("forward", "1", []), ("forward", "2", ["all_reduce"]),
                   ("backward", "2", []), ("backward", "1", ["all_reduce"]), ("backward", "0", [])]
    names = [figures.megatron_name(kind, c, phase, False) for phase, _, kind, cs in events for c in cs]
    assert names == ["g", "f"]
    assert all(not h for m in model.modules() for h in (m._forward_hooks, m._forward_pre_hooks))  # removed


def test_megatron_name_under_sequence_parallelism():
    assert figures.megatron_name("ColumnParallelLinear", "all_gather", "forward", True) == "f"
    assert figures.megatron_name("ColumnParallelLinear", "all_gather", "backward", True) == "re-gather"
    assert figures.megatron_name("RowParallelLinear", "reduce_scatter", "forward", True) == "g"


def test_holdings_reads_back_the_tags():
    tags = figures.head_position_tags(2, 4, torch.tensor([5, 6, 7]))
    assert tags.shape == (2, 4, 3, 2)
    held = figures.holdings(tags, 4, 8)
    want = torch.zeros(4, 8, dtype=torch.int64)
    want[:, 5:8] = 1
    assert torch.equal(held, want)
    assert torch.equal(figures.holdings(tags[:, 1:2], 4, 8).sum(1), torch.tensor([0, 3, 0, 0]))


def test_record_ring_blocks_wraps_and_restores():
    calls = []
    module = types.SimpleNamespace(ring_step=lambda *a: calls.append(a))
    original = module.ring_step
    kv = torch.stack([torch.ones(2), torch.zeros(2)])
    with figures.record_ring_blocks(module) as seen:
        module.ring_step(None, kv, None, None, None, 0, 3, True)
        module.ring_step(None, 2 * kv, None, None, None, 0, 2, True)
    assert seen == [(0, 2.0, 3), (1, 4.0, 2)] and len(calls) == 2
    assert module.ring_step is original


def test_the_drawings_draw():
    from helpers.parallel.mesh import Mesh

    figs = [figures.draw_ring_blocks([[0, 1], [1, 0]]),
            figures.draw_mesh_groups(Mesh((2, 2, 2), ("pp", "cp", "tp"), world_size=8), 5)]
    maps = [figures.holdings(figures.head_position_tags(1, 2, torch.tensor([r])), 2, 2) for r in range(2)]
    figs.append(figures.draw_ulysses(maps, maps, [((1, 2, 1, 2), (1, 1, 2, 2))] * 2))
    import matplotlib.pyplot as plt

    for fig in figs:
        assert fig.axes
        plt.close(fig)
