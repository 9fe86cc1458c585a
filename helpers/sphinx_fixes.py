"""A Sphinx extension for the book's HTML: each script once per page.

Under Jupyter Book, sphinx-thebe's ``env-before-read-docs`` handler runs twice and adds its inline
configuration twice; two ``const THEBE_JS_URL`` declarations are a JavaScript SyntaxError on every page (the
browser test in ``tests/test_browser.py`` fails on it). Dropping repeated script entries, identical in source and
attributes (an inline script with no file name is one whether the name is None or ""), keeps the first of each
and changes nothing else.
"""

from __future__ import annotations


def _script_key(script) -> tuple:
    attributes = getattr(script, "attributes", {}) or {}
    return str(getattr(script, "filename", script) or ""), tuple(sorted((k, str(v)) for k, v in attributes.items()))


def _each_script_once(app, pagename, templatename, context, doctree) -> None:
    seen, unique = set(), []
    for script in context.get("script_files", []):
        key = _script_key(script)
        if key not in seen:
            seen.add(key)
            unique.append(script)
    context["script_files"] = unique


def setup(app):
    app.connect("html-page-context", _each_script_once, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
