"""One device seam (issue 37, item 4): every tensor a helper of ``helpers/parallel/`` or ``helpers/training/``
creates names its device.

A tensor factory called as ``torch.<factory>(...)`` (or imported from torch by name) must say ``device=``: the
run's device (``helpers.dist.device()``), an input's ``.device``, or ``"cpu"`` where the CPU is deliberate,
with the reason beside it. ``*_like`` factories take their input's device and are not checked. The test reads
the source (AST), so it needs no GPU: under gloo ``device()`` is the CPU and a forgotten ``device=`` changes
nothing a CPU run can see.
"""

from __future__ import annotations

import ast
import pathlib

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
