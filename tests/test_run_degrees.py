"""A run's degrees are declared once (issue 37, item 1): ``helpers.cost.budget_types.Degrees``, of which the
calculator's ``Layout`` and chapter 10's ``ParallelDims`` are both made. Read from the sources with ``ast``: a
class anywhere under ``helpers/`` that declares a field named as one of the degrees is a second definition."""

from __future__ import annotations

import ast
import dataclasses
import glob
import os

from helpers import ROOT
from helpers.cost.budget_types import Degrees, Layout
from helpers.parallel.parallel_dims import ParallelDims

HOME = ("helpers/cost/budget_types.py", "Degrees")

# Classes that still declare degrees of their own, and why; remove an entry when its class stops
KNOWN_SECOND_DEFINITIONS = {
    # a published run states some degrees and leaves others unknown (None) for the calculator to search
    ("helpers/cost/published_runs.py", "Run"): "issue 37, item 1",
    # chapter 07's sequence layout: how a sequence is cut over the cp ranks, not a run's description
    ("helpers/parallel/blockwise_attention.py", "CPLayout"): "chapter 07, a layout of the sequence",
}


def declared_degrees() -> dict[tuple[str, str], list[str]]:
    """(file, class) -> the degree fields that class declares in its own body."""
    names = {f.name for f in dataclasses.fields(Degrees)}
    found = {}
    for path in sorted(glob.glob(os.path.join(ROOT, "helpers", "**", "*.py"), recursive=True)):
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                mine = [s.target.id for s in node.body if isinstance(s, ast.AnnAssign)
                        and isinstance(s.target, ast.Name) and s.target.id in names]
                if mine:
                    found[(os.path.relpath(path, ROOT), node.name)] = mine
    return found


def test_the_degrees_are_declared_once():
    found = declared_degrees()
    assert HOME in found, f"{HOME} declares no degrees"
    second = {where: fields for where, fields in found.items()
              if where != HOME and where not in KNOWN_SECOND_DEFINITIONS}
    assert not second, f"a run's degrees are declared again (make the class a Degrees): {second}"
    gone = set(KNOWN_SECOND_DEFINITIONS) - set(found)
    assert not gone, f"KNOWN_SECOND_DEFINITIONS lists classes that declare no degree now: {gone}"


def test_the_calculator_layout_and_parallel_dims_are_the_same_degrees():
    assert issubclass(Layout, Degrees) and issubclass(ParallelDims, Degrees)
    run = ParallelDims(pp=2, dp_replicate=2, dp_shard=2, tp=2, sequence_parallel=True, zero=1,
                       schedule="interleaved", vpp=2, m=4)
    layout = run.layout()
    assert layout.degree_values() == {**run.degree_values(), "schedule": "1f1b"}
    assert (layout.dp, layout.world_size) == (run.dp, run.world_size) == (4, 16)
    assert ParallelDims(pp=2, schedule="gpipe", m=2).layout().schedule == "gpipe"
