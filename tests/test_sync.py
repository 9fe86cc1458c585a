"""`make sync` never loses an edit of the .md: a stale .ipynb saved after it is refused, not synced over it;
the ordinary edits of either side still go through."""

import contextlib
import io
import os
import shutil
from types import SimpleNamespace

import jupytext
import nbformat

from helpers import ROOT
from helpers.tools import sync as sync_tool

SOURCE = os.path.join(ROOT, "notebooks", "00_how_this_book_runs.md")


def sync(*paths) -> SimpleNamespace:
    """`make sync` on ``paths``, in this process (jupytext's start would dominate the test's time)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = sync_tool.main([str(p) for p in paths])
    return SimpleNamespace(returncode=status, stderr=err.getvalue())


def later(path, seconds=10):
    """Mark ``path`` as saved ``seconds`` after now (the order of saves, without waiting)."""
    when = os.path.getmtime(path) + seconds
    os.utime(path, (when, when))


def test_a_stale_notebook_saved_after_an_edit_of_the_md_does_not_overwrite_it(tmp_path):
    md, ipynb = tmp_path / "00_x.md", tmp_path / "00_x.ipynb"
    shutil.copy(SOURCE, md)
    assert sync(md).returncode == 0 and ipynb.exists()
    stale = ipynb.read_bytes()  # JupyterLab has it open

    md.write_text(md.read_text() + "\nAn edit of the source.\n")  # edited in an editor
    later(md)
    ipynb.write_bytes(stale)  # ... then the open notebook is autosaved
    later(ipynb, 20)
    done = sync(md)
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith(f"make sync: {md}: changed since 00_x.ipynb last saw it"), done.stderr
    assert "An edit of the source." in md.read_text()
    assert ipynb.read_bytes() == stale


def test_edits_of_either_side_go_through(tmp_path):
    md, ipynb = tmp_path / "00_x.md", tmp_path / "00_x.ipynb"
    shutil.copy(SOURCE, md)
    assert sync(md).returncode == 0

    md.write_text(md.read_text() + "\nEdited in the .md.\n")
    later(md)
    assert sync(md).returncode == 0
    assert "Edited in the .md." in nbformat.read(ipynb, as_version=4).cells[-1].source

    nb = nbformat.read(ipynb, as_version=4)  # opened after that sync, edited and saved in JupyterLab
    nb.cells.append(nbformat.v4.new_markdown_cell("Edited in the notebook."))
    nbformat.write(nb, ipynb)
    later(ipynb, 20)
    done = sync(md)
    assert done.returncode == 0, done.stderr
    assert jupytext.read(md).cells[-1].source == "Edited in the notebook."
