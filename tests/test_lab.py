"""The book in JupyterLab: a chapter's .ipynb pair, made as `make sync` makes it, runs to the same checks as
its .md; and the HTML offers a page's .ipynb and .md for download.

Chapter 01 is the one executed (no ranks, the fastest chapter), once: the pair's cells are the .md's cells
(source, tags and metadata), and the .md itself runs in the book build, so running the pair shows the checks
pass as it is opened in JupyterLab. Then, in the same kernel, its exercise is done as a reader does it: the
stub, run as shipped, gets the checker's one-line "not yet" (no traceback) and the solution does not run; a
wrong answer gets "not yet" with the checker's reason; asking for the solution runs it and its checks without
touching the reader's answer; an answer that is right gets "correct". Everything happens in a temporary copy
of notebooks/, so the repository gets no stray .ipynb.
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile

import jupytext
import nbformat
import yaml
from nbclient import NotebookClient

from helpers import ROOT

CHAPTER = "01_memory_and_time"
JUPYTEXT = os.path.join(os.path.dirname(sys.executable), "jupytext")


def execute(nb, cwd: str, then: list[str] = ()):
    """Run every cell, as JupyterLab's "run all" does, then each source in ``then`` as a new cell in the
    same kernel (what a reader types afterwards); return the notebook and those cells' text outputs."""
    with open(os.path.join(ROOT, "_config.yml")) as f:
        timeout = yaml.safe_load(f)["execute"]["timeout"]
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=True,
                            resources={"metadata": {"path": cwd}})
    said = []
    with client.setup_kernel():
        for index, cell in enumerate(nb.cells):
            client.execute_cell(cell, index)
        for source in then:
            cell = nbformat.v4.new_code_cell(source)
            nb.cells.append(cell)
            client.execute_cell(cell, len(nb.cells) - 1)
            said.append(text(cell))
    return nb, said


def text(cell) -> str:
    """What a code cell showed: its streams, its plain-text results and its errors."""
    return "".join(o.get("text", "") + o.get("data", {}).get("text/plain", "") + o.get("evalue", "")
                   for o in cell.get("outputs", []))


def cell_with(nb, start: str):
    return next(c for c in nb.cells if c.cell_type == "code" and c.source.startswith(start))


def errors(nb) -> list[str]:
    return [f"{o.ename}: {o.evalue}" for c in nb.cells if c.cell_type == "code"
            for o in c.get("outputs", []) if o.output_type == "error"]


def cells(nb) -> list[tuple]:
    """What runs and how: each cell's type, source and metadata (tags included)."""
    return [(c.cell_type, c.source, dict(c.metadata)) for c in nb.cells]


SEPARATOR = re.compile(r"\|[-:| ]+\|")


def table_rows(markdown: str) -> list[str]:
    """The data rows of every Markdown table in ``markdown`` (not its headers or separator lines)."""
    lines = markdown.splitlines()
    return [line for i, line in enumerate(lines) if line.startswith("|") and not SEPARATOR.fullmatch(line)
            and not (i + 1 < len(lines) and SEPARATOR.fullmatch(lines[i + 1]))]


def checks_shown(nb) -> list[str]:
    """Each `ok ...` line the checks printed, then each row of the chapter's table of checks, in order."""
    lines, rows = [], []
    for cell in nb.cells:
        for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
            if out.output_type == "stream":
                lines += [line for line in out.get("text", "").splitlines() if line.startswith("ok  ")]
            markdown = "".join(out.get("data", {}).get("text/markdown", ""))
            if "| check | where |" in markdown:  # checks.report's table
                rows += table_rows(markdown)
    return lines + rows


# What a reader does after "run all", each a new cell: a wrong answer and its check, then the solution asked
# for, then the check again (the solution left the stub alone), then a right answer and its check.
READER = [
    "def my_budget():\n"
    "    return dict.fromkeys(['parameters', 'gradients', 'optimizer states', 'dp bytes sent'], 0)",
    'exercises.check("memory budget", budget_checker, my_budget)',
    "%env BOOK_SOLUTIONS=run",
    None,  # the solution cell, run again
    'exercises.check("memory budget", budget_checker, my_budget)',
    "def my_budget():\n    return reference_budget()",
    'exercises.check("memory budget", budget_checker, my_budget)',
]


def test_the_ipynb_pair_holds_the_md_cells_passes_its_checks_and_its_exercise_runs_as_a_reader_does(
        monkeypatch):
    monkeypatch.delenv("BOOK_SOLUTIONS", raising=False)  # as in JupyterLab: the solution runs when asked
    notebooks = os.path.join(ROOT, "notebooks")
    before = sorted(os.listdir(notebooks))
    with tempfile.TemporaryDirectory(prefix="book-lab-") as tmp:
        copy = os.path.join(tmp, "notebooks")
        os.mkdir(copy)
        md = shutil.copy(os.path.join(notebooks, CHAPTER + ".md"), copy)
        # `make sync` on the copy: the chapter's own pairing metadata says to write an .ipynb beside it
        done = subprocess.run([JUPYTEXT, "--sync", md], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        ipynb = md[:-3] + ".ipynb"
        assert os.path.exists(ipynb), f"jupytext --sync wrote no pair: {os.listdir(copy)}"

        pair = nbformat.read(ipynb, as_version=4)
        source = jupytext.read(md)
        assert cells(pair) == cells(source), "the .ipynb pair's cells differ from the .md's"
        solution = cell_with(pair, "%%solution").source
        from_ipynb, said = execute(pair, copy, [solution if c is None else c for c in READER])

    assert errors(from_ipynb) == [], errors(from_ipynb)
    shown = checks_shown(from_ipynb)
    rows = [line for line in shown if line.startswith("| ")]
    assert rows and all(row.rstrip().endswith("| yes |") for row in rows), f"the pair's checks: {rows}"
    assert len(shown) > len(rows) > 0, "the pair printed no `ok` line"

    # run as shipped: the stub gets one "not yet" line, the solution cell does not run
    stub = text(cell_with(from_ipynb, "from helpers import exercises"))
    assert stub.strip() == ("not yet: `my_budget` is still the stub (it raises NotImplementedError): "
                            "write it in the cell above"), stub
    assert "did not run" in text(cell_with(from_ipynb, "%%solution"))
    assert all("Traceback" not in text(c) for c in from_ipynb.cells)
    wrong, asked, solution, again, right = said[1], said[2], said[3], said[4], said[6]
    assert wrong.startswith("not yet: check 'exercise 1: parameters (bytes, an integer)' failed"), wrong
    assert "BOOK_SOLUTIONS=run" in asked
    assert "ok  the checker rejects 'fp32 parameters'" in solution, solution
    assert again.startswith("not yet: check 'exercise 1: parameters"), "the solution overwrote the answer"
    assert right.startswith("correct: the checker accepts your answer to 'memory budget'"), right
    assert sorted(os.listdir(notebooks)) == before, "the test left files in notebooks/"


# The page's download menu: the theme's .md (source) button is there by default; the .ipynb button needs the
# executed notebook copied into _sources, which sphinx-book-theme does only when a launch service is set.
PAGE = """\
---
jupytext:
  formats: ipynb,md:myst
  text_representation: {extension: .md, format_name: myst}
kernelspec: {display_name: Python 3, language: python, name: python3}
---

# A page

```{code-cell} ipython3
print(6 * 7)
```
"""


def test_the_html_offers_the_ipynb_and_the_md_for_download():
    with tempfile.TemporaryDirectory(prefix="book-download-") as tmp:
        book = os.path.join(tmp, "book")
        os.makedirs(os.path.join(book, "notebooks"))
        shutil.copytree(os.path.join(ROOT, "book"), os.path.join(book, "book"))
        shutil.copy(os.path.join(ROOT, "_config.yml"), book)
        with open(os.path.join(book, "_toc.yml"), "w") as f:
            f.write("format: jb-book\nroot: notebooks/page\n")
        with open(os.path.join(book, "notebooks", "page.md"), "w") as f:
            f.write(PAGE)
        done = subprocess.run([sys.executable, "-m", "helpers.tools.build", book], cwd=ROOT,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-4000:]
        html_dir = os.path.join(book, "_build", "html")
        html = open(os.path.join(html_dir, "notebooks", "page.html")).read()
        # sphinx-book-theme's buttons: <a href="..." class="btn btn-sm btn-download-notebook-button ...">
        button = r'<a href="([^"]+)"[^>]*class="[^"]*btn-download-(notebook|source)-button'
        buttons = dict(re.findall(button, html))
        by_suffix = {os.path.splitext(href)[1]: href for href in buttons}
        assert {".md", ".ipynb"} <= set(by_suffix), f"download buttons on the page: {buttons}"
        for href in by_suffix.values():
            target = os.path.normpath(os.path.join(html_dir, "notebooks", href))
            assert os.path.exists(target), f"{href} points nowhere"
        executed = nbformat.read(os.path.join(html_dir, "notebooks", by_suffix[".ipynb"]), as_version=4)
        assert "42" in "".join(o.get("text", "") for o in executed.cells[-1].outputs), \
            "the .ipynb offered is not the executed notebook"
