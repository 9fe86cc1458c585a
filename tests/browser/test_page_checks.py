"""The browser check's page rules, on small hand-made pages (no book build needed): a figure without a
caption, an output over 60 lines and a table with a row of the wrong width each fail; the same page done
right passes them (helpers/tools/browser_check.py)."""

import json

import pytest

from helpers.tools import browser_check

unavailable = browser_check.why_unavailable()
pytestmark = pytest.mark.skipif(bool(unavailable), reason=f"BROWSER TEST SKIPPED: {unavailable}")

# A 1x1 PNG, so that the image loads and only its caption is in question.
DOT = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGA"
       "hKmMIQAAAABJRU5ErkJggg==")
RIGHT = {
    "figure": f'<figure><img src="{DOT}" alt="a red dot"><figcaption><p>One dot.</p></figcaption></figure>',
    "output": '<div class="cell_output"><pre>' + "\n".join(f"line {i}" for i in range(60)) + "</pre>"
              "<table>" + "<tr><td>row</td></tr>" * 60 + "</table></div>"
              '<div class="cell_output"><details class="hide"><summary>show</summary><pre>'
              + "\n".join(f"folded {i}" for i in range(100)) + "</pre></details></div>",
    "table": "<table><tr><th>a</th><th>b</th></tr><tr><td colspan=2>both</td></tr>"
             "<tr><td>1</td><td>2</td></tr></table>",
}
WRONG = {
    "figure": f'<figure><img src="{DOT}" alt="a red dot"></figure><p><img src="{DOT}" alt="another dot"></p>',
    "output": '<div class="cell_output"><pre>' + "\n".join(f"line {i}" for i in range(61)) + "</pre></div>",
    "table": "<table><tr><th>a</th><th>b</th></tr><tr><td>1</td></tr><tr><td>1</td><td>2</td></tr></table>",
}
GOOD_MD = "| what | value |\n|---|---|\n| \\|\\|ΔW\\|\\| | 1 |\n"
BAD_MD = "| what | value |\n|---|---|\n| ||ΔW|| | 1 |\n"


def page(body: str) -> str:
    return '<!doctype html><html><head><meta charset="utf-8"></head><body>' \
           f'<article class="bd-article">{body}</article></body></html>'


@pytest.fixture(scope="module")
def found(tmp_path_factory):
    """Every new rule's failures on every hand-made page: one browser run at the phone's width."""
    root = tmp_path_factory.mktemp("site") / "html"
    (root / "_sources").mkdir(parents=True)
    (root.parent / "jupyter_execute").mkdir()
    pages = {}
    for kind in RIGHT:
        for verdict, body in (("right", RIGHT[kind]), ("wrong", WRONG[kind])):
            (root / f"{kind}_{verdict}.html").write_text(page(body), encoding="utf-8")
            pages[f"{kind}_{verdict}.html"] = None
    # the table's Markdown: a page's source in _sources/, a notebook's Markdown output in jupyter_execute/
    for verdict, text in (("right", GOOD_MD), ("wrong", BAD_MD)):
        (root / f"source_{verdict}.html").write_text(page("<p>a table</p>"), encoding="utf-8")
        (root / "_sources" / f"source_{verdict}.md").write_text(text, encoding="utf-8")
        (root / f"notebook_{verdict}.html").write_text(page("<p>a table</p>"), encoding="utf-8")
        cells = [{"cell_type": "code", "source": "show()", "metadata": {}, "execution_count": 1,
                  "outputs": [{"output_type": "display_data", "metadata": {},
                               "data": {"text/markdown": text}}]}]
        notebook = {"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
        (root.parent / "jupyter_execute" / f"notebook_{verdict}.ipynb").write_text(json.dumps(notebook))
        pages[f"source_{verdict}.html"] = pages[f"notebook_{verdict}.html"] = None
    reports = browser_check.check_site(str(root), only=sorted(pages), widths={"phone": 390})
    new_rules = ("caption", "lines", "wrong width")
    return {r.page[:-5]: [f for f in r.failures if any(rule in f for rule in new_rules)] for r in reports}


def test_the_right_pages_pass_the_new_rules(found):
    assert all(not found[name] for name in found if name.endswith("_right")), found


def test_a_figure_without_a_caption_fails(found):
    assert len(found["figure_wrong"]) == 2, found["figure_wrong"]
    assert all(f.startswith("figure without a caption: data:image/png") for f in found["figure_wrong"])


def test_an_output_over_60_lines_fails(found):
    want = 'output longer than 60 lines: pre of 61 lines: "line 0"'
    assert found["output_wrong"] == [want], found["output_wrong"]


def test_a_ragged_table_fails(found):
    want = 'table with a row of the wrong width: row 2 has 1 cells, the first 2: "1"'
    assert found["table_wrong"] == [want], found["table_wrong"]
    for name in ("source_wrong", "notebook_wrong"):
        assert found[name] == ["table with a row of the wrong width in its Markdown: 6 cells where its "
                               "header has 2: '| ||ΔW|| | 1 |'"], found[name]
