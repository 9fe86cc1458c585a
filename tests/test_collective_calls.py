"""Every ``torch.distributed`` collective the book calls after chapter 02 goes through
:mod:`helpers.parallel.comms`, which books each call in the ledger once (issue 37, item 6).

An AST walk of every module under ``helpers/`` and of every notebook's code cells (a notebook's imports hold
for all of its cells; cell magics are dropped) finds each reference to a collective of ``torch.distributed`` —
through a module alias (``import torch.distributed as dist``, ``from torch import distributed``) or a name
imported from it — and names the function or class it sits in. A reference outside the layer itself must be
listed below with the reason it calls torch directly; a listed exception that is no longer in the code fails
too, so the list cannot outlive its reasons. Pure Python: nothing is imported or run.
"""

from __future__ import annotations

import ast
import collections
import glob
import os
import re

import jupytext

from helpers import ROOT

# torch.distributed's collectives, point-to-point calls and synchronisations (process-group set-up and
# queries, such as get_rank or new_group, are not communication of data)
COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
    "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single", "broadcast",
    "reduce", "gather", "scatter", "send", "recv", "isend", "irecv", "batch_isend_irecv", "P2POp", "barrier",
    "monitored_barrier", "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
    "send_object_list", "recv_object_list", "all_reduce_coalesced", "all_gather_coalesced",
}

# files that call torch's collectives throughout, and why
WHOLE_FILES = {
    "helpers/parallel/comms.py": "the layer itself: each call booked (or counted) in the ledger once",
    "helpers/parallel/ledger.py": "Ledger.exchange posts chapter 02's counted messages with isend/irecv: "
                                  "the from-scratch collectives are built on it",
    "notebooks/00_how_this_book_runs.md": "before chapter 02: shows torch's own collectives at work",
    "notebooks/02_collectives.md": "teaches torch's collectives and checks the book's own against them",
}

# (file, the function or class a call sits in, the collective): why it calls torch directly
EXCEPTIONS = {
    # timings: a booking is not what is timed, and the slowest rank's time is bookkeeping, not traffic
    ("helpers/cost/collective_costs.py", "time_collective", "barrier"): "lines the ranks up to time",
    ("helpers/cost/collective_costs.py", "time_collective", "all_reduce"): "the slowest rank's time",
    ("helpers/timing.py", "timed", "barrier"): "lines the ranks up before each timed run",
    ("helpers/timing.py", "slowest", "all_reduce"): "the slowest rank's time",
    ("helpers/tools/bench_rows.py", "ring", "all_reduce"):
        "PyTorch's side of make bench's ring row: the book's ring is timed against torch's all-reduce",
    ("notebooks/03_ddp.md", "time_steps", "barrier"): "lines the ranks up before a wall-clock timing",
    ("notebooks/03_ddp.md", "time_steps", "all_reduce"): "the slowest rank's time, after the timed steps",
    # control, not data the ledger describes
    ("helpers/training/capstone.py", "train", "barrier"): "every rank starts the measured step together",
    ("helpers/training/checkpoint.py", "_check_names", "all_gather_object"):
        "every rank's tensor names and problems, so that all ranks refuse a bad checkpoint alike",
    ("helpers/training/capstone_checks.py", "shared_reference", "broadcast_object_list"):
        "rank 0's single-process reference run, sent as a Python object to check against",
    ("helpers/training/capstone_checks.py", "_agree", "all_gather_object"):
        "every rank's findings of a dimension's check to every rank, so that all fail it alike",
    ("helpers/training/capstone_checks.py", "_gather", "all_gather"):
        "a check's gather of what a dimension's group holds, after the run: not the run's traffic",
    ("helpers/training/capstone_checks.py", "_tp_findings", "broadcast"):
        "a check's copy of tp rank 0's tensor, after the run: not the run's traffic",
    ("helpers/training/checkpoint_pieces.py", "share", "all_gather_object"):
        "every rank's boxes to every rank, so that each box several ranks keep is written a part by each",
    ("notebooks/15_capstone.md", "<module>", "broadcast_object_list"):
        "rank 0's checkpoint folder to every rank",
    ("notebooks/15_capstone.md", "<module>", "barrier"): "every rank done reading before the folder goes",
    ("notebooks/09_mixed_precision.md", "scaler_checker", "all_gather_object"):
        "the exercise checker gathers every rank's verdicts to print them once",
    # what the reader writes: the exercise asks for torch's collective by name (it is to be written without
    # the book's modules), and the solution and the checker's wrong variants call it
    ("notebooks/05_tensor_parallel.md", "Copy", "all_reduce"): "chapter 05's exercise solution: f",
    ("notebooks/05_tensor_parallel.md", "Reduce", "all_reduce"): "chapter 05's exercise solution: g",
    ("notebooks/05_tensor_parallel.md", "ReduceBothWays", "all_reduce"): "chapter 05's checker: a wrong g",
    ("notebooks/03_ddp.md", "ReferenceDDP", "all_reduce"): "chapter 03's solution: bucketed all-reduces",
    ("notebooks/03_ddp.md", "Unscaled", "all_reduce"): "chapter 03's checker: a wrong variant (sums)",
    ("notebooks/03_ddp.md", "DoubleCounted", "all_reduce"): "chapter 03's checker: a wrong variant",
    ("notebooks/07_context_parallel.md", "reference_all_to_all", "all_to_all_single"):
        "chapter 07's solution",
    ("notebooks/07_context_parallel.md", "AllGather", "all_gather"): "chapter 07's checker: a wrong variant",
    ("notebooks/07_context_parallel.md", "AllGather", "all_reduce"): "chapter 07's checker: a wrong variant",
    ("notebooks/08_moe.md", "ReferenceAllToAll", "all_to_all_single"): "chapter 08's solution: dispatch",
    ("notebooks/08_moe.md", "reference_ep_moe", "all_to_all_single"): "chapter 08's solution: the counts",
    ("notebooks/08_moe.md", "GatherDispatch", "all_gather_single"): "chapter 08's checker: a wrong variant "
                                                                    "(dispatch by all-gather)",
    ("notebooks/08_moe.md", "ep_checker", "all_reduce"): "chapter 08's checker: the router's gradient summed "
                                                         "over the ranks, to compare with one process",
    ("helpers/exercises.py", "check", "all_gather_object"): "an exercise's verdict from every rank, gathered "
                                                            "for the reader (Python objects, not tensors)",
    # torch's own behaviour is what is shown
    ("notebooks/09_mixed_precision.md", "<module>", "all_gather_single"):
        "probes whether the backend itself moves an fp8 tensor (comms sends its uint8 view)",
}

MAGIC = re.compile(r"\s*(%{1,2}[A-Za-z]|!)")


def _aliases(tree: ast.AST, modules: set[str], names: dict[str, str]) -> None:
    """Add the names ``tree`` binds to torch.distributed (``modules``) and to its collectives (``names``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update(a.asname or a.name for a in node.names if a.name == "torch.distributed")
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            modules.update(a.asname or a.name for a in node.names if a.name == "distributed")
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            names.update({a.asname or a.name: a.name for a in node.names if a.name in COLLECTIVES})


def _uses(tree: ast.AST, modules: set[str], names: dict[str, str]) -> list[tuple[str, str]]:
    """(the enclosing function or class, the collective) of each reference to one in ``tree``."""
    found = []

    def visit(node, scope):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scope = node.name if scope == "<module>" else scope  # the outermost name: a class, not its method
        if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES:
            owner = ast.unparse(node.value)
            if owner in modules or owner == "torch.distributed":
                found.append((scope, node.attr))
        elif isinstance(node, ast.Name) and node.id in names and isinstance(node.ctx, ast.Load):
            found.append((scope, names[node.id]))
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":  # imported is used
            found.extend((scope, a.name) for a in node.names if a.name in COLLECTIVES)
        for child in ast.iter_child_nodes(node):
            visit(child, scope)
    visit(tree, "<module>")
    return found


def direct_calls() -> dict[tuple[str, str, str], int]:
    """(file, scope, collective) -> how many references, over helpers/ and the notebooks' code cells."""
    out = collections.Counter()
    for path in sorted(glob.glob(os.path.join(ROOT, "helpers", "**", "*.py"), recursive=True)):
        rel = os.path.relpath(path, ROOT)
        with open(path) as f:
            tree = ast.parse(f.read())
        modules, names = set(), {}
        _aliases(tree, modules, names)
        out.update((rel, scope, c) for scope, c in _uses(tree, modules, names))
    for path in sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.md"))):
        rel = os.path.relpath(path, ROOT)
        cells = [cell.source for cell in jupytext.read(path).cells if cell.cell_type == "code"]
        trees = [ast.parse("\n".join("" if MAGIC.match(line) else line for line in source.splitlines()))
                 for source in cells]
        modules, names = set(), {}
        for tree in trees:
            _aliases(tree, modules, names)
        for tree in trees:
            out.update((rel, scope, c) for scope, c in _uses(tree, modules, names))
    return out


def test_every_collective_outside_comms_is_a_listed_exception():
    found = direct_calls()
    unlisted = sorted(f"{path}: {collective} in {scope}" for path, scope, collective in found
                      if path not in WHOLE_FILES and (path, scope, collective) not in EXCEPTIONS)
    assert not unlisted, \
        "these call torch.distributed's collectives directly; call helpers.parallel.comms instead (booked " \
        "in the ledger), or list the exception with its reason in tests/test_collective_calls.py: " + \
        "; ".join(unlisted)


def test_every_listed_exception_is_still_in_the_code():
    found = direct_calls()
    stale = sorted(f"{path}: {collective} in {scope}" for path, scope, collective in EXCEPTIONS
                   if (path, scope, collective) not in found)
    stale += sorted(path for path in WHOLE_FILES if not any(f == path for f, _, _ in found))
    assert not stale, f"tests/test_collective_calls.py lists exceptions no longer in the code: {stale}"
