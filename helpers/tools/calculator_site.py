"""A Sphinx extension: ships chapter 01's calculator and a pinned Pyodide into the built site, for the page
"Try the calculator" (``book/calculator.md``, driven by ``book/_static/calculator.js``).

At the end of a build it writes ``_static/calculator/``:

- ``pyodide.js`` and ``pyodide.asm.js``, Pyodide's loader and runtime, from the npm package ``pyodide`` at
  :data:`PYODIDE_VERSION`, fetched once at build time by ``npm pack`` into ``.venv/`` (checked against the
  registry's sha512 pinned here; no download when the page runs);
- ``runtime.js``: the WebAssembly module, the standard library and the lock file, base64 in a script. A page
  opened from ``file://`` may load scripts but not ``fetch`` files (Chromium refuses the scheme), so
  ``calculator.js`` answers Pyodide's three fetches from this script: the same page works from a disk, from
  ``python -m http.server`` and from GitHub Pages;
- ``sources.js``: the calculator's Python files, read from ``helpers/`` at build time (the modules that
  ``import helpers.cost.calculator`` loads, found by importing it with torch made unimportable), and each
  chapter's page, for the links; never a second copy in the repository, never a second implementation in
  JavaScript.
"""

from __future__ import annotations

import base64
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile

from helpers import ROOT

PYODIDE_VERSION = "0.27.7"
PYODIDE_SHA512 = ("RUSVJlhQdfWfgO9hVHCiXoG+nVZQRS5D9FzgpLJ/VcgGBLSAKoPL8kTiOikxbHQm1kRISeWUBdulEgO26qpSRA==")
RUNTIME = ("pyodide.asm.wasm", "python_stdlib.zip", "pyodide-lock.json")
SCRIPTS = ("pyodide.js", "pyodide.asm.js")
CACHE = os.path.join(ROOT, ".venv", f"pyodide-{PYODIDE_VERSION}")

# Lists the helpers modules the calculator imports (some only when they are first needed: it runs a budget
# and a search), in a Python where torch cannot be imported: the page's Python has no torch either, so a
# module that needs it fails here first, at build time.
_LIST_MODULES = """
import json, sys
sys.modules['torch'] = None
import helpers.cost.calculator
helpers.cost.calculator.run(['--model', 'mixtral-8x7b', '--gpus', '16', '--tp', '2', '--ep', '8'])
helpers.cost.calculator.run(['--model', 'gpt2', '--gpus', '1', '--global-batch', '8', '--search'])
print(json.dumps(sorted(m.__file__ for n, m in sys.modules.items() if n.split('.')[0] == 'helpers')))
"""


def pyodide_dir() -> str:
    """The unpacked npm package, fetched with ``npm pack`` the first time and checked against its sha512."""
    package = os.path.join(CACHE, "package")
    if all(os.path.exists(os.path.join(package, f)) for f in RUNTIME + SCRIPTS):
        return package
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError(f"the calculator page needs Pyodide {PYODIDE_VERSION} from npm, and npm is not "
                           f"installed (apt-get install npm)")
    os.makedirs(CACHE, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as work:
        subprocess.run([npm, "pack", f"pyodide@{PYODIDE_VERSION}", "--pack-destination", work, "--silent"],
                       check=True, cwd=work, stdout=subprocess.DEVNULL)
        tgz = os.path.join(work, f"pyodide-{PYODIDE_VERSION}.tgz")
        with open(tgz, "rb") as f:
            digest = base64.b64encode(hashlib.sha512(f.read()).digest()).decode()
        if digest != PYODIDE_SHA512:
            raise RuntimeError(f"pyodide-{PYODIDE_VERSION}.tgz: sha512 {digest} is not the pinned "
                               f"{PYODIDE_SHA512}")
        with tarfile.open(tgz) as tar:
            members = [m for m in tar.getmembers() if m.name in {f"package/{f}" for f in RUNTIME + SCRIPTS}]
            tar.extractall(CACHE, members=members, filter="data")
    return package


def calculator_sources() -> dict[str, str]:
    """Repository path -> text of every helpers module ``import helpers.cost.calculator`` loads."""
    out = subprocess.run([sys.executable, "-c", _LIST_MODULES], check=True, capture_output=True, text=True,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    sources = {}
    for path in json.loads(out.stdout):
        rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
        with open(path) as f:
            sources[rel] = f.read()
    return sources


def chapter_pages() -> dict[str, str]:
    """Chapter number -> its page, relative to the site's root (notebooks/NN_name.html)."""
    return {os.path.basename(p)[:2]: f"notebooks/{os.path.basename(p)[:-3]}.html"
            for p in sorted(glob.glob(os.path.join(ROOT, "notebooks", "[0-9][0-9]_*.md")))}


def choices() -> dict[str, list[str]]:
    """Flag -> the values the command line accepts, for the page's menus (read from its parser)."""
    from helpers.cost.calculator import parser

    return {a.option_strings[0]: [str(c) for c in a.choices] for a in parser()._actions if a.choices}


def write_assets(outdir: str) -> str:
    """Write ``_static/calculator/`` into the built site ``outdir``; returns its path."""
    package, target = pyodide_dir(), os.path.join(outdir, "_static", "calculator")
    os.makedirs(target, exist_ok=True)
    for name in SCRIPTS:
        shutil.copyfile(os.path.join(package, name), os.path.join(target, name))
    runtime = {}
    for name in RUNTIME:
        with open(os.path.join(package, name), "rb") as f:
            runtime[name] = base64.b64encode(f.read()).decode()
    with open(os.path.join(target, "runtime.js"), "w") as f:
        f.write(f"window.calculatorRuntime = {json.dumps(runtime)};\n")
    data = {"version": PYODIDE_VERSION, "sources": calculator_sources(), "chapters": chapter_pages(),
            "choices": choices()}
    with open(os.path.join(target, "sources.js"), "w") as f:
        f.write(f"window.calculatorSources = {json.dumps(data)};\n")
    return target


def _build_finished(app, exception) -> None:
    if exception is None and app.builder.format == "html":
        write_assets(app.outdir)


def setup(app):
    app.connect("build-finished", _build_finished)
    return {"parallel_read_safe": True, "parallel_write_safe": True}


if __name__ == "__main__":  # python -m helpers.tools.calculator_site SITE: the assets into a built site
    print(write_assets(sys.argv[1]))
