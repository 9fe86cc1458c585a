"""The comparison helpers must catch a wrong value, a wrong shard placement, a NaN, a wrong shape or dtype."""

import math

import pytest
import torch

from helpers import checks
from helpers.checks import CheckFailed, check_close, check_equal, check_shard, confirm_failure, report


@pytest.fixture(autouse=True)
def fresh_results():
    checks.clear()
    yield
    checks.clear()


def test_close_passes_within_tolerance_and_records_the_error():
    want = torch.linspace(-1, 1, 11)
    check_close("x", want * (1 + 1e-7), want, rtol=1e-6, quiet=True)
    [result] = checks.RESULTS
    assert result.passed and 0 < result.max_abs <= 1e-6 and result.name == "x"


def test_close_rejects_a_wrong_value_and_says_where():
    want = torch.zeros(3, 4)
    got = want.clone()
    got[1, 2] = 0.5
    with pytest.raises(CheckFailed) as err:
        check_close("grad[w]", got, want + 1.0, rtol=1e-6)
    message = str(err.value)
    assert "grad[w]" in message and "kernel" in message
    assert "max abs error 1.000e+00" in message and "index (0, 0)" in message
    assert "rtol=1e-06" in message
    assert not checks.RESULTS[-1].passed


def test_error_is_relative_to_the_tensor_scale():
    want = torch.tensor([1000.0, 1e-9])
    got = torch.tensor([1000.0, 2e-9])  # a tiny absolute error on a tiny entry
    check_close("scaled", got, want, rtol=1e-6, quiet=True)
    assert checks.RESULTS[-1].max_rel == pytest.approx(1e-12)


def test_a_wrong_scale_fails():
    want = torch.randn(100, generator=torch.Generator().manual_seed(0))
    with pytest.raises(CheckFailed, match="max rel error 7.500e-01"):
        check_close("mean not sum", want / 4, want, rtol=1e-6)


def test_nan_is_caught_even_with_a_loose_tolerance():
    got = torch.tensor([1.0, math.nan, 3.0])
    with pytest.raises(CheckFailed, match=r"1 NaN .* first difference at index \(1,\)"):
        check_close("loss", got, torch.tensor([1.0, 2.0, 3.0]), rtol=10.0)


def test_matching_nans_and_infs_pass():
    x = torch.tensor([1.0, math.inf, math.nan])
    check_equal("with inf and nan", x.clone(), x, quiet=True)


def test_shape_and_dtype_mismatches_fail():
    with pytest.raises(CheckFailed, match=r"shape \(3,\), but the reference has \(4,\)"):
        check_close("v", torch.zeros(3), torch.zeros(4), rtol=1e-6)
    with pytest.raises(CheckFailed, match="dtype torch.float32, but the reference has torch.float64"):
        check_equal("w", torch.zeros(3), torch.zeros(3, dtype=torch.float64))


def test_exact_mode_rejects_one_ulp():
    want = torch.tensor([1.0, 2.0, 3.0])
    got = want.clone()
    got[2] = torch.nextafter(got[2], torch.tensor(4.0))
    with pytest.raises(CheckFailed, match="1 of 3 elements differ"):
        check_equal("bits", got, want)
    check_close("within fp32 rounding", got, want, rtol=1e-6, quiet=True)


def test_dicts_are_compared_key_by_key():
    want = {"a": torch.ones(2), "b": torch.zeros(2)}
    check_close("params", {"a": torch.ones(2), "b": torch.zeros(2)}, want, rtol=0.0, quiet=True)
    assert [r.name for r in checks.RESULTS] == ["params[a]", "params[b]"]
    with pytest.raises(CheckFailed, match=r"missing \['b'\], unexpected \['c'\]"):
        check_close("params", {"a": torch.ones(2), "c": torch.zeros(2)}, want, rtol=0.0)
    with pytest.raises(CheckFailed, match=r"params\[b\]"):
        check_close("params", {"a": torch.ones(2), "b": torch.ones(2)}, want, rtol=1e-6)


def test_text_is_compared_exactly():
    check_equal("lines", ["a", "b"], ["a", "b"], quiet=True)
    with pytest.raises(CheckFailed, match="got \\['b', 'a'\\]"):
        check_equal("lines", ["b", "a"], ["a", "b"])
    with pytest.raises(ValueError):
        check_close("lines", "a", "a", rtol=0.1)


def test_shard_in_its_place_passes():
    full = torch.arange(24.0).reshape(6, 4)
    check_shard("rows 2-3", full[2:4], full, dim=0, offset=2, exact=True, quiet=True)
    check_shard("cols 1-2", full[:, 1:3] * (1 + 1e-8), full, dim=1, offset=1, rtol=1e-6, quiet=True)


def test_shard_at_the_wrong_offset_names_the_offset_it_fits():
    full = torch.arange(24.0).reshape(6, 4)
    with pytest.raises(CheckFailed, match=r"matches the reference at offset\(s\) \[4\] along dim 0"):
        check_shard("rank 1's rows", full[4:6], full, dim=0, offset=2, exact=True)


def test_shard_that_does_not_fit_fails():
    full = torch.zeros(6, 4)
    with pytest.raises(CheckFailed, match="does not fit at offset 5"):
        check_shard("too long", torch.zeros(2, 4), full, dim=0, offset=5, exact=True)
    with pytest.raises(ValueError):
        check_shard("no tolerance", torch.zeros(2, 4), full, dim=0, offset=0)


def test_report_lists_every_check_and_raises_on_a_failure():
    with pytest.raises(CheckFailed, match="ran no checks"):
        report()
    check_close("good", torch.ones(2), torch.ones(2), rtol=1e-6, quiet=True)
    report()
    with pytest.raises(CheckFailed):
        check_equal("bad", torch.zeros(1), torch.ones(1))
    with pytest.raises(CheckFailed, match="1 of 2 checks failed: bad on kernel"):
        report()


def test_summary_table_merges_ranks():
    rows = [checks.CheckResult("g", f"rank {r}", 1e-7 * r, 1e-7, "rtol=1e-06, atol=0e+00", True)
            for r in range(4)]
    table = checks.summary_table(rows)
    assert "| g | ranks 0–3 | 4 | 3.00e-07 |" in table
    merged = checks.summary_table([checks.CheckResult(f"grads, rank {r}[w{i}]", "kernel", 1e-8, 1e-7, "rtol",
                                                      True) for r in range(2) for i in range(3)])
    assert "| grads | kernel (results of ranks 0–1) | 6 | 1.00e-08 | 1.00e-07 | rtol | yes |" in merged
    shards = checks.summary_table([checks.CheckResult(f"rows, rank {r} (dim 0, offset {4 * r}, length 4)",
                                                      "kernel", 0.0, 0.0, "exact", True) for r in range(3)])
    assert "| rows | kernel (results of ranks 0–2) | 3 |" in shards


def test_confirm_failure_requires_the_failure_where_it_was_planted():
    with pytest.raises(CheckFailed):
        check_equal("planted", torch.zeros(1), torch.ones(1))
    confirm_failure("planted", ["kernel"])
    assert all(r.passed for r in checks.RESULTS)
    with pytest.raises(CheckFailed, match="it failed on no rank"):
        confirm_failure("never failed", ["rank 2"])


def test_check_every_rank_names_the_rank_that_is_wrong():
    class FakeRanks:  # what check_every_rank needs of helpers.ranks.Ranks
        world_size = 3

        def pull(self, name):
            return [{"w": torch.ones(2)}, {"w": torch.ones(2)}, {"w": torch.tensor([1.0, 2.0])}]

    with pytest.raises(CheckFailed, match=r"'grads, rank 2\[w\]' failed"):
        checks.check_every_rank(FakeRanks(), "grads", "g", {"w": torch.ones(2)}, rtol=1e-6)


class _TwoShards:  # what check_reassembled needs of helpers.ranks.Ranks: rank r holds row r of "w", "b" whole


    def __init__(self, b1):
        self.b1 = b1

    def pull(self, name):
        return [{"w": torch.tensor([[1.0, 2.0]]), "b": torch.ones(2)},
                {"w": torch.tensor([[3.0, 4.0]]), "b": self.b1}]


def _rows(per_rank):
    return {"w": torch.cat([p["w"] for p in per_rank]), "b": per_rank[0]["b"]}


def test_check_reassembled_puts_the_shards_together_and_compares():
    want = {"w": torch.tensor([[1.0, 2.0], [3.0, 4.0]]), "b": torch.ones(2)}
    checks.check_reassembled(_TwoShards(torch.ones(2)), "grads", "g", want, unshard=_rows, replicated=["b"],
                             rtol=1e-6)
    with pytest.raises(CheckFailed, match=r"'grads\[w\]' failed"):
        checks.check_reassembled(_TwoShards(torch.ones(2)), "grads", "g", want,
                                 unshard=lambda p: _rows(p[::-1]), replicated=["b"], rtol=1e-6)


def test_check_reassembled_rejects_replicated_tensors_that_differ_between_ranks():
    want = {"w": torch.tensor([[1.0, 2.0], [3.0, 4.0]]), "b": torch.ones(2)}
    with pytest.raises(CheckFailed, match=r"replicated tensors equal to rank 0's, rank 1\[b\]\" failed"):
        checks.check_reassembled(_TwoShards(torch.tensor([1.0, 1.5])), "grads", "g", want, unshard=_rows,
                                 replicated=["b"], rtol=1e-6)


def test_summarize_prints_the_worst_error(capsys):
    check_close("sum a", torch.ones(2) * (1 + 1e-7), torch.ones(2), rtol=1e-6, quiet=True)
    check_close("sum b", torch.ones(2), torch.ones(2), rtol=1e-6, quiet=True)
    checks.summarize("sum")
    assert "ok  sum: 2 comparisons" in capsys.readouterr().out
    with pytest.raises(CheckFailed, match="no check named"):
        checks.summarize("nothing")


def test_a_check_named_with_a_bar_keeps_its_row():
    """Chapter 13's `||ΔW||` split its row; the table escapes it and every row has the header's width."""
    from helpers.show import ragged_rows

    rows = [checks.CheckResult("||ΔW|| / ||W||", "kernel", 0.0, 0.0, "exact", True),
            checks.CheckResult("a|b", "rank 0", 0.0, 0.0, "rtol=1e-06 | atol=0", True)]
    for table in (checks.summary_table(rows), checks.family_table(rows)):
        assert ragged_rows(table) == [], table
    assert r"\|\|ΔW\|\| / \|\|W\|\|" in checks.summary_table(rows)


def test_the_report_folds_its_rows_and_shows_the_count(monkeypatch):
    shown = []
    monkeypatch.setattr("IPython.display.display", lambda obj: shown.append(obj.data))
    for i in range(3):
        check_equal(f"c{i}", i, i)
    report()
    text = shown[-1]
    assert text.startswith("**3 checks** ran in this chapter, all passed")
    assert ":::{dropdown} The table of checks: 3 checks in 3 rows\n" in text
    assert text.index(":::{dropdown}") < text.index("| c0 |")
