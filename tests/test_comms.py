"""The booked-collective layer (helpers.parallel.comms), on two ranks.

Each collective's result is checked exactly (integer-valued inputs, so every sum is exact), and so is its
ledger entry: one booking per call, of the tensor on the wire (its dtype and size), over the group's
ranks. A bf16 wire is checked against a cast by hand; an fp8 all-gather moves one byte per element and gives
back exactly what was cast, whether the cast is on the wire or the tensor is fp8 already; an fp8 reduction is
refused with the reason. Point-to-point messages are counted once per tensor on each side, and a receive
nobody sends times out with the peer named.
"""

import ipyparallel as ipp
import pytest
import torch


@ipp.interactive  # sent by value: the engines cannot import this test module
def _collectives():
    import torch
    import torch.distributed as dist

    from helpers.parallel import comms
    from helpers.parallel.ledger import LEDGER

    rank = dist.get_rank()
    LEDGER.clear()
    out = {}
    x = torch.arange(6.0).reshape(2, 3) + 10 * rank
    out["all_reduce"] = comms.all_reduce(x.clone())
    out["max"] = comms.all_reduce(x.clone(), op="max")
    out["async"] = comms.all_reduce(x.clone(), async_op=True).wait()
    out["gather1"] = comms.all_gather(x, dim=1)
    out["scatter1"] = comms.reduce_scatter(torch.arange(8.0).reshape(2, 4) * (rank + 1), dim=1)
    out["padded"] = comms.reduce_scatter(torch.arange(3.0) * (rank + 1), pad=True)
    out["a2a"] = comms.all_to_all(torch.arange(3.0) + 10 * rank, send_splits=[1, 2] if rank == 0 else [2, 1],
                                  recv_splits=[1, 2] if rank == 0 else [2, 1], label="uneven")
    grads = torch.full((4,), 1.0 + 2.0 ** -12) * (rank + 1)  # 1 + 2^-12 rounds to 1 in bf16
    out["bf16"] = comms.all_reduce(grads.clone(), wire_dtype=torch.bfloat16)
    values = torch.tensor([0.5, -3.0, 448.0, 0.013671875]) * (rank + 1)
    out["fp8"] = comms.all_gather(values, wire_dtype=torch.float8_e4m3fn)
    out["fp8_want"] = values.to(torch.float8_e4m3fn).float()
    try:
        comms.all_reduce(values.clone(), wire_dtype=torch.float8_e4m3fn)
    except ValueError as err:
        out["fp8_reduce"] = str(err)
    out["booked"] = [(m.collective, m.numel, m.dtype, m.group_ranks) for m in LEDGER.booked()]
    out["fp8_native"] = comms.all_gather(values.to(torch.float8_e4m3fn)).float()  # bytes, reinterpreted
    LEDGER.clear()
    peer = 1 - rank
    sent = comms.send(torch.full((5,), float(rank)), peer, tag=7, label="pp", phase="activations")
    out["p2p"] = comms.recv(torch.empty(5), peer, tag=7, label="pp", phase="activations")
    sent.wait()
    ring = comms.send_recv(torch.full((2,), float(rank)), peer, peer, label="ring", async_op=True)
    out["ring"] = ring.wait()
    out["counted"] = [(m.collective, m.phase, m.direction, m.peer, m.nbytes, m.group_ranks)
                      for m in LEDGER.messages if m.counted]
    LEDGER.clear()
    return out


def test_each_collective_gives_the_exact_result_and_one_booking(ranks):
    results = ranks.apply(_collectives)
    x = [torch.arange(6.0).reshape(2, 3) + 10 * r for r in range(2)]
    for rank, got in enumerate(results):
        assert torch.equal(got["all_reduce"], x[0] + x[1])
        assert torch.equal(got["max"], x[1])
        assert torch.equal(got["async"], x[0] + x[1])
        assert torch.equal(got["gather1"], torch.cat(x, dim=1))
        total = torch.arange(8.0).reshape(2, 4) * 3
        assert torch.equal(got["scatter1"], total[:, 2 * rank:2 * rank + 2])
        padded = torch.tensor([0.0, 3.0, 6.0, 0.0])
        assert torch.equal(got["padded"], padded[2 * rank:2 * rank + 2])
        want_a2a = torch.tensor([0.0, 10.0, 11.0]) if rank == 0 else torch.tensor([1.0, 2.0, 12.0])
        assert torch.equal(got["a2a"], want_a2a)
        # on the wire in bf16: each rank's 1 + 2^-12 became 1, so the sum is 1 + 2, not 3 + 3 * 2^-12
        assert torch.equal(got["bf16"], torch.full((4,), 3.0))
        fp8_want = torch.cat([results[r]["fp8_want"] for r in range(2)])
        assert torch.equal(got["fp8"], fp8_want)
        assert torch.equal(got["fp8_native"], fp8_want)
        assert "is not reduced on the wire" in got["fp8_reduce"]
        names = [b[0] for b in got["booked"]]
        assert names == ["all_reduce", "all_reduce", "all_reduce", "all_gather", "reduce_scatter",
                         "reduce_scatter", "uneven", "all_reduce", "all_gather"]
        assert got["booked"][7][2] == "torch.bfloat16"  # the booking is of the wire's tensor
        assert got["booked"][8][1:3] == (8, "torch.uint8")  # fp8 gathered as bytes: 2 ranks x 4
        assert got["booked"][5][1] == 4  # the padded buffer, 3 rows padded to 4
        assert all(b[3] == (0, 1) for b in got["booked"])
        assert torch.equal(got["p2p"], torch.full((5,), float(1 - rank)))
        assert torch.equal(got["ring"], torch.full((2,), float(1 - rank)))
        assert got["counted"] == [("pp", "activations", "send", 1 - rank, 20, (0, 1)),
                                  ("pp", "activations", "recv", 1 - rank, 20, (0, 1)),
                                  ("ring", "p2p", "send", 1 - rank, 8, (0, 1)),
                                  ("ring", "p2p", "recv", 1 - rank, 8, (0, 1))]


@ipp.interactive
def _unanswered():
    import torch
    import torch.distributed as dist

    from helpers.parallel import comms

    try:
        comms.recv(torch.empty(1), 1 - dist.get_rank(), tag=99, timeout_s=1.0)
    except RuntimeError as err:
        return str(err)
    return "no error"


def test_a_receive_nobody_answers_times_out_naming_the_peer(ranks):
    for rank, message in enumerate(ranks.apply(_unanswered)):
        assert f"the receive from rank {1 - rank} (nothing arrived) did not complete" in message, message


def test_the_reduction_ops_are_named():
    from helpers.parallel import comms

    with pytest.raises(ValueError, match="op='mean' is not one of 'sum', 'max', 'min'"):
        comms.all_reduce(torch.zeros(1), op="mean")
