"""``make bench`` (helpers/tools/bench.py): the "no measurable difference" rule of :mod:`helpers.timing` on
made-up timings, and the table, CSV and figure of a tiny run on two ranks (one pair per row). No time is
asserted."""

import csv

import pytest

from helpers import timing
from helpers.tools import bench


def test_ratio_is_the_median_of_the_pairs_and_its_spread_their_iqr():
    got = timing.compare([2.0, 4.0, 6.0, 8.0, 10.0], [1.0, 2.0, 3.0, 4.0, 5.0])
    assert got["ratio"] == 2.0 and got["ratio_q25"] == got["ratio_q75"] == 2.0
    assert got["ours_ms"] == 6000.0 and got["theirs_ms"] == 3000.0
    assert got["ours_iqr_ms"] == 4000.0 and got["runs"] == 5
    assert got["verdict"] == "ours 2.00x the time"
    assert timing.compare([1.0] * 3, [2.0] * 3)["verdict"] == "ours 2.00x as fast"


@pytest.mark.parametrize("ours, verdict", [
    ([1.00, 1.10, 0.90, 1.05, 0.95], timing.NO_DIFFERENCE),  # ratio 1.0, quartiles 0.95-1.05
    ([1.05, 1.06, 1.04, 1.05, 1.05], "ours 1.05x the time"),  # ratio 1.05, quartiles 1.05-1.05
    ([1.2, 0.9, 1.3, 1.0, 1.25], timing.NO_DIFFERENCE),  # ratio 1.2, quartiles 1.0-1.25: 1 is inside
    ([1.2, 0.8, 1.3, 1.1, 1.25], "ours 1.20x the time"),  # ratio 1.2, quartiles 1.1-1.25
    ([1.01, 1.05, 1.22, 1.33, 1.40], "ours 1.22x the time"),  # quartiles 1.05-1.33, wider than 0.22: above 1
    ([0.7, 0.8, 0.9, 0.95, 0.99], "ours 1.11x as fast"),  # quartiles 0.8-0.95, wider than 0.1: below 1
])
def test_no_measurable_difference_when_the_spread_contains_1(ours, verdict):
    got = timing.compare(ours, [1.0] * len(ours))
    assert got["verdict"] == verdict


def test_unpaired_runs_are_refused():
    with pytest.raises(ValueError, match="paired runs"):
        timing.compare([1.0, 2.0], [1.0])


def test_bus_bandwidth_is_what_a_rank_of_the_ring_sends_per_second():
    assert bench.bus_bandwidth(10**9, 1.0, 4) == pytest.approx(1.5)


def test_a_tiny_bench_writes_its_table_csv_and_figure(ranks, tmp_path, capsys):
    table = bench.main(["--chapter", "02", "--sizes", "1024,4096", "--repeats", "1", "--out", str(tmp_path)],
                       ranks=ranks)
    table += bench.main(["--chapter", "12", "--repeats", "1", "--out", str(tmp_path / "muon")], ranks=ranks)
    printed = capsys.readouterr().out
    assert [r["row"] for r in table] == ["ring all-reduce 1 KiB", "ring all-reduce 4 KiB", "Muon step",
                                         "distributed Muon step"]
    for r in table:
        assert r["runs"] == 1 and r["ours_ms"] > 0 and r["theirs_ms"] > 0 and r["verdict"], r
    assert all(r["ours_busbw_gbs"] > 0 for r in table[:2])
    assert "[2/2] 02 ring all-reduce 4 KiB" in printed  # progress, one line per row
    assert "[2/2] 12 distributed Muon step" in printed
    with open(tmp_path / "bench.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["row"] for r in rows] == ["ring all-reduce 1 KiB", "ring all-reduce 4 KiB"]
    assert list(rows[0]) == bench.FIELDS and rows[1]["bytes"] == "4096"
    assert (tmp_path / "bench.png").stat().st_size > 0


def test_every_chapter_has_rows_and_an_unknown_one_is_refused():
    assert {row[0] for row in bench.plan(None, [1024])} == set(bench.GROUPS)
    assert [row[1] for row in bench.plan("04", [1024])] == ["ZeRO-1 step", "ZeRO-3 step"]
    with pytest.raises(SystemExit, match="rows for chapters"):
        bench.plan("99", [1024])
