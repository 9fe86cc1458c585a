"""A Sphinx extension for the book's HTML: each script once per page, every chapter's notebook to download.

Under Jupyter Book, sphinx-thebe's ``env-before-read-docs`` handler runs twice and adds its inline
configuration twice; two ``const THEBE_JS_URL`` declarations are a JavaScript SyntaxError on every page (the
browser test in ``tests/browser/`` fails on it). Dropping repeated script entries, identical in source and
attributes (an inline script with no file name is one whether the name is None or ""), keeps the first of
each and changes nothing else.

sphinx-book-theme offers a page's executed ``.ipynb`` for download (beside its ``.md``) only when a launch
service (Binder, Colab, Thebe, ...) is configured; the book configures none, since it runs with no network.
:func:`_offer_the_notebook` copies the executed notebook into ``_sources`` and tells the theme, as it would
have. Under ``make build`` the notebooks come from a cache (:mod:`helpers.tools.build`), and myst-nb then
writes the notebook it read, without the cached outputs, to ``jupyter_execute``; so the build names the
executed copies in ``BOOK_EXECUTED`` (a JSON file: source path -> executed notebook), and those are offered.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path


def _script_key(script) -> tuple:
    attributes = getattr(script, "attributes", {}) or {}
    return (str(getattr(script, "filename", script) or ""),
            tuple(sorted((k, str(v)) for k, v in attributes.items())))


def _each_script_once(app, pagename, templatename, context, doctree) -> None:
    seen, unique = set(), []
    for script in context.get("script_files", []):
        key = _script_key(script)
        if key not in seen:
            seen.add(key)
            unique.append(script)
    context["script_files"] = unique


def _offer_the_notebook(app, pagename, templatename, context, doctree) -> None:
    """Put a notebook page's executed .ipynb in _sources, so that the download menu offers it."""
    if context.get("ipynb_source") or "kernelspec" not in app.env.metadata.get(pagename, {}):
        return
    executed = Path(app.outdir).parent / "jupyter_execute" / f"{pagename}.ipynb"
    if os.environ.get("BOOK_EXECUTED"):  # the build's own executed copies, where it made one
        with open(os.environ["BOOK_EXECUTED"]) as f:
            executed = Path(json.load(f).get(os.path.abspath(app.env.doc2path(pagename)), executed))
    if not executed.exists():
        return
    target = Path(app.outdir) / "_sources" / f"{pagename}.ipynb"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(executed, target)
    context["ipynb_source"] = f"{pagename}.ipynb"


def setup(app):
    app.connect("html-page-context", _each_script_once, priority=900)
    # before the theme's header buttons (priority 501) read ipynb_source
    app.connect("html-page-context", _offer_the_notebook, priority=500)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
