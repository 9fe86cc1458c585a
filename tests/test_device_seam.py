"""One device seam (issue 37, item 4): every tensor a helper of ``helpers/parallel/`` or ``helpers/training/``
creates names its device.

A tensor factory called as ``torch.<factory>(...)`` (or imported from torch by name) must say ``device=``: the
run's device (``helpers.dist.device()``), an input's ``.device``, or ``"cpu"`` where the CPU is deliberate,
with the reason beside it. ``*_like`` factories take their input's device and are not checked. The test reads
the source (AST), so it needs no GPU: under gloo ``device()`` is the CPU and a forgotten ``device=`` changes
nothing a CPU run can see.

The chapters' side: in a chapter's rank-side cells (``%%px``, not ``--local``), every tensor factory and every
model class (the GPT, the MoE GPT and layer, ``nn`` layers) is given ``device=`` or moved by ``.to(...)`` (a
cast to a dtype alone is no move) along its chain, unless it is built for a ``check_*`` call or copied into a
tensor (``copy_``), or listed with its reason; and every chapter with ranks asks for ``device()`` or
``rank_device()`` or calls a helper that does.
"""

from __future__ import annotations

import ast
import functools
import pathlib
import re

from helpers import ROOT

FACTORIES = {"empty", "zeros", "ones", "full", "arange", "range", "linspace", "logspace", "eye", "randn",
             "rand", "randint", "randperm", "normal", "tensor", "as_tensor", "empty_strided", "tril_indices",
             "triu_indices", "scalar_tensor"}
FOLDERS = ("helpers/parallel", "helpers/training")

# Files exempt from the rule while their owners change them (issue 37, item 4): none now. A file listed
# here must exist (test_in_flight_files_exist).
IN_FLIGHT: dict[str, str] = {}


def factory_calls_without_device(source: str, name: str) -> list[str]:
    """``name:line: torch.<factory>(...)`` for every tensor factory call in ``source`` without ``device=``."""
    tree = ast.parse(source, filename=name)
    imported = {alias.asname or alias.name: alias.name for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.module == "torch"
                for alias in node.names if alias.name in FACTORIES}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "torch":
            factory = func.attr
        elif isinstance(func, ast.Name) and func.id in imported:
            factory = imported[func.id]
        else:
            continue
        if factory in FACTORIES and not any(k.arg == "device" for k in node.keywords):
            found.append(f"{name}:{node.lineno}: torch.{factory}(...) without device=")
    return found


def helper_files() -> list[pathlib.Path]:
    return sorted(p for folder in FOLDERS for p in (pathlib.Path(ROOT) / folder).rglob("*.py"))


def test_every_factory_names_its_device():
    found = []
    for path in helper_files():
        name = path.relative_to(ROOT).as_posix()
        if name not in IN_FLIGHT:
            found += factory_calls_without_device(path.read_text(), name)
    assert not found, ("tensors created without a device (pass device=helpers.dist.device(), an input's "
                       ".device, or \"cpu\" with the reason beside it):\n" + "\n".join(found))


def test_in_flight_files_exist():
    # a renamed or removed file must leave the allow-list too
    missing = [name for name in IN_FLIGHT if not (pathlib.Path(ROOT) / name).exists()]
    assert not missing, f"allow-listed files that no longer exist: {missing}"


def test_a_planted_factory_is_caught():
    planted = "import torch\nfrom torch import zeros as z\n\n\ndef f(n, x):\n    a = torch.zeros(n)\n" \
              "    b = torch.zeros(n, device=x.device)\n    c = torch.zeros_like(x)\n    d = z(n)\n" \
              "    e = torch.full((n,), 1.0, dtype=torch.float64)\n    return a, b, c, d, e\n"
    assert factory_calls_without_device(planted, "planted.py") == [
        "planted.py:6: torch.zeros(...) without device=",
        "planted.py:9: torch.zeros(...) without device=",
        "planted.py:10: torch.full(...) without device=",
    ]


# The chapters' side of the seam: what the ranks build in a chapter's %%px cells goes on the run's device.
# A %%px --local cell runs in the kernel too, where the single-process references stay on the CPU; the ranks
# move what such a cell made (its batches) in a %%px cell of their own, which this test reads.
MODEL_BUILDERS = {"GPT", "MoEGPT", "MoELayer", "Linear", "Embedding", "LayerNorm", "RMSNorm"}
MOVES = {"to", "cuda"}
DTYPE = re.compile(r"(b?float|u?int|complex)\d*(_\w+)?|half|double|long|bool")  # torch.<dtype>: no move
# helpers.checks' comparisons bring both sides to the CPU before they compare; copy_ writes on the device of
# the tensor it writes into
TAKEN_WHERE_NEEDED = ("check_", "copy_")
# (chapter, call as written) -> why the CPU is right there; each must still occur
# (test_exceptions_still_occur). A key is a call's text: it covers every call so written in that chapter.
CPU_ON_PURPOSE: dict[tuple[str, str], str] = {
    ("02_collectives.md", "torch.zeros(0)"):
        "the empty result of a rank a collective leaves out; per_kind brings every result to the CPU",
    ("12_optimizers.md", "GPT(dcfg, seed=0)"):
        "the exercise reads the model's matrix shapes (EX_SHAPES) and nothing else",
    ("14_rl_algorithms.md", 'torch.tensor([s["losses"] for s in steps], dtype=torch.float64)'):
        "each step's loss as Python floats, kept for the checks on the rank and in the kernel (on the CPU)",
}


@functools.lru_cache(maxsize=None)  # three tests read each chapter
def px_cells(path: pathlib.Path) -> list[tuple[int, str]]:
    """(index, source without its magic line) of each rank-side cell: ``%%px`` (with ``%%solution``), not
    ``%%px --local``."""
    import jupytext

    cells = []
    for i, cell in enumerate(jupytext.read(path).cells):
        lines = cell.source.splitlines()
        lines = lines[1:] if lines[:1] == ["%%solution"] else lines
        if cell.cell_type == "code" and lines and lines[0].split()[0] == "%%px" and "--local" not in lines[0]:
            cells.append((i, "\n".join(lines[1:])))
    return cells


def _dtype_only(call: ast.Call) -> bool:
    """``.to(torch.bfloat16)``: a cast that leaves the tensor where it is."""
    return not call.keywords and bool(call.args) and all(
        isinstance(a, ast.Attribute) and isinstance(a.value, ast.Name) and a.value.id == "torch"
        and DTYPE.fullmatch(a.attr) for a in call.args)


def _moved_or_checked(node: ast.AST, parent: dict) -> bool:
    """Whether the value of ``node`` is moved (``.to(...)``, ``.cuda()``) further along its chain of
    attributes, indexes and calls, or is built inside the arguments of a ``check_*`` or ``copy_`` call."""
    here = node
    while isinstance(parent.get(here), (ast.Attribute, ast.Subscript, ast.Call)):
        up = parent[here]
        if (up.func if isinstance(up, ast.Call) else up.value) is not here:  # an argument, an index: the end
            break
        call = parent.get(up)
        moves = isinstance(up, ast.Attribute) and up.attr in MOVES
        if moves and isinstance(call, ast.Call) and call.func is up and not _dtype_only(call):
            return True
        here = up
    while node in parent:
        node = parent[node]
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name.startswith(TAKEN_WHERE_NEEDED):
                return True
    return False


def rank_builds_without_device(source: str) -> list[str]:
    """The calls in a rank-side cell that build a tensor or a model without saying where: a torch tensor
    factory or a model class, without ``device=``, not moved by ``.to(...)`` along its chain, and not a value
    built for a ``check_*`` call or copied into a tensor (``copy_``)."""
    tree = ast.parse(source)
    parent = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or any(k.arg == "device" for k in node.keywords):
            continue
        func = node.func
        torch_factory = (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
                         and func.value.id == "torch" and func.attr in FACTORIES)
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if (torch_factory or name in MODEL_BUILDERS) and not _moved_or_checked(node, parent):
            found.append((node.lineno, node.col_offset, ast.get_source_segment(source, node).split("\n")[0]))
    return [text for *_, text in sorted(found)]


def chapters() -> list[pathlib.Path]:
    return sorted((pathlib.Path(ROOT) / "notebooks").glob("[0-9][0-9]_*.md"))


def test_ranks_build_on_the_run_device():
    found = []
    for path in chapters():
        for index, source in px_cells(path):
            try:
                calls = rank_builds_without_device(source)
            except SyntaxError:  # not Python after its magic line: nothing to read
                continue
            found += [f"{path.name}, cell {index}: {call}" for call in calls
                      if (path.name, call) not in CPU_ON_PURPOSE]
    assert not found, ("rank-side models and tensors built without the run's device (add .to(device()), "
                       "device=device(), or list the CPU's reason in CPU_ON_PURPOSE):\n" + "\n".join(found))


def test_exceptions_still_occur():
    # an exception whose code has gone must leave the list too
    stale = []
    for chapter, call in CPU_ON_PURPOSE:
        sources = [source for _, source in px_cells(pathlib.Path(ROOT) / "notebooks" / chapter)]
        if not any(call in rank_builds_without_device(source) for source in sources):
            stale.append((chapter, call))
    assert not stale, f"CPU_ON_PURPOSE lists calls no rank-side cell makes: {stale}"


def test_a_planted_rank_build_is_caught():
    planted = ("model = GPT(cfg, seed=0)\nmoved = GPT(cfg, seed=0).double().to(device())\n"
               "mlp = GPT(cfg, seed=0).blocks[0].mlp.to(device())\nh = torch.randn(4, generator=g)\n"
               "h2 = torch.randn(4, generator=g).to(device())\nz = torch.zeros(3, device=device())\n"
               "check_close('x', torch.tensor(losses).mean(), want)\nf(torch.ones(2)).to(device())\n"
               "p.copy_(torch.randn(3, generator=g))\nbf16 = GPT(cfg, seed=0).to(torch.bfloat16)\n"
               "both = GPT(cfg, seed=0).to(device(), torch.bfloat16)\n"
               "rows = x.to(device())[torch.arange(2)]\n")
    assert rank_builds_without_device(planted) == ["GPT(cfg, seed=0)", "torch.randn(4, generator=g)",
                                                   "torch.ones(2)", "GPT(cfg, seed=0)", "torch.arange(2)"]


# Chapters whose ranks get the device from the helper that trains them, shown on the page: (helper, why).
DEVICE_FROM_HELPER = {
    "10_combining_parallelism.md": ("helpers.parallel.composition.train",
                                    "it puts the model and the batches on the run's rank_device()"),
    "15_capstone.md": ("helpers.training.capstone.train",
                       "it puts the model and every batch on the run's rank_device()"),
}


def test_every_chapter_with_ranks_asks_for_the_device():
    import importlib
    import inspect

    silent = []
    for path in chapters():
        sources = [source for _, source in px_cells(path)]
        if not sources or re.search(r"\b(device|rank_device)\(\)", "\n".join(sources)):
            continue
        helper = DEVICE_FROM_HELPER.get(path.name, ("", ""))[0]
        module, _, name = helper.rpartition(".")
        asks = helper and "rank_device()" in inspect.getsource(getattr(importlib.import_module(module), name))
        called = helper and any(f"{module.rpartition('.')[2]}.{name}(" in source for source in sources)
        if not (asks and called):
            silent.append(path.name)
    assert not silent, (f"chapters whose %%px cells never ask for device() or rank_device(), nor call a "
                        f"helper of DEVICE_FROM_HELPER that does: {silent}")
