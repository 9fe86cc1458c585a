"""The built book in a real browser, offline, at a laptop's and a phone's width
(helpers/tools/browser_check.py).

Runs after the build (`make test`: the unit tests beside the build, then this). The first test checks every
page of `_build/html` and keeps the screenshots in `_build/screenshots`; the others plant one defect each in
its own copy of a chapter page (all copies in one copy of the site) and check that the browser check catches
it, so a pass means something.
"""

import os
import re
import shutil

import pytest

from helpers import ROOT
from helpers.tools import browser_check

SITE = os.path.join(ROOT, "_build", "html")
PAGE = "notebooks/02_collectives.html"

unavailable = browser_check.why_unavailable()
if unavailable:
    print(f"\n{'!' * 100}\nBROWSER TEST SKIPPED: {unavailable}\n{'!' * 100}")
pytestmark = pytest.mark.skipif(bool(unavailable), reason=f"BROWSER TEST SKIPPED: {unavailable}")


@pytest.fixture(scope="module")
def site():
    if not os.path.exists(os.path.join(SITE, PAGE)):
        pytest.fail(f"no built book at {os.path.relpath(SITE, ROOT)}: run `make build` first")
    return SITE


def test_every_page_works_offline_at_both_widths(site):
    shots = os.path.join(ROOT, "_build", "screenshots")
    shutil.rmtree(shots, ignore_errors=True)
    reports = browser_check.check_site(site, screenshots=shots)
    pages = {r.page for r in reports}
    assert PAGE in pages and len(pages) >= 10, sorted(pages)
    bad = [f"{r.page} at {browser_check.WIDTHS[r.width]} px: {line}" for r in reports for line in r.failures]
    assert not bad, "\n".join(bad)
    assert len(os.listdir(shots)) == 2 * len(pages)


HIDDEN_MENU_BUTTON = r'\1<button class="sidebar-toggle primary-toggle" style="display:none"></button>'
UNWRAPPED_CODE = "<style>div.cell_output pre, div.highlight pre { white-space: pre !important; }</style>"
# One defect per copy of PAGE, each copy beside it (so its relative links still resolve): how to plant it.
DEFECTS = {
    "mathjax from a cdn": lambda html: html.replace(
        'src="../_static/mathjax/tex-chtml.js"', 'src="https://cdn.jsdelivr.net/npm/mathjax@3/es5/tex-chtml.js"'),
    "a deleted figure": lambda html: re.sub(r'(<img[^>]+src="\.\./_images/)[^"]+"', r'\1deleted.png"', html,
                                            count=1),
    "a figure without alt text": lambda html: re.sub(r'(<img[^>]+)alt="[^"]*"',
                                                     r'\1alt="0123456789abcdef0123.png"', html, count=1),
    "a broken link": lambda html: html.replace('href="../book/roadmap.html"',
                                               'href="../book/roadmap.html#no-such-anchor"', 1)
                                      .replace('href="03_ddp.html"', 'href="03_no_such_chapter.html"', 1),
    # the bug the theme had: a hidden second menu button earlier in the page takes the click handler
    "a dead menu button": lambda html: re.sub(r"(<body[^>]*>)", HIDDEN_MENU_BUTTON, html, count=1),
    "an output wider than the column": lambda html: html.replace("</head>", UNWRAPPED_CODE + "</head>", 1),
}

BOTH_WIDTHS = {"a dead menu button", "an output wider than the column"}


@pytest.fixture(scope="module")
def planted(site, tmp_path_factory):
    """What the browser check reports on each planted page: one copy of the site, two browser runs."""
    root = str(tmp_path_factory.mktemp("planted") / "html")
    shutil.copytree(site, root)
    with open(os.path.join(root, PAGE), encoding="utf-8") as f:
        page = f.read()
    pages = {}
    for defect, plant in DEFECTS.items():
        broken = plant(page)
        assert broken != page, f"planting {defect} changed nothing"
        rel = PAGE.replace(".html", "_" + re.sub(r"\W+", "_", defect) + ".html")
        with open(os.path.join(root, rel), "w", encoding="utf-8") as f:
            f.write(broken)
        pages[rel] = defect
    found = {defect: [] for defect in DEFECTS}
    # The menu does one thing at each width and a column's width differs: those two at both; the rest, which
    # no width changes, at the phone's only.
    both = [rel for rel, defect in pages.items() if defect in BOTH_WIDTHS]
    phone = [rel for rel in pages if rel not in both]
    reports = browser_check.check_site(root, only=both)
    reports += browser_check.check_site(root, only=phone, widths={"phone": browser_check.WIDTHS["phone"]})
    for r in reports:
        found[pages[r.page]] += [f"{r.width}: {line}" for line in r.failures]
    return {defect: "\n".join(lines) for defect, lines in found.items()}


def test_mathjax_from_a_cdn_is_caught(planted):
    found = planted["mathjax from a cdn"]
    assert "request leaves the machine: https://cdn.jsdelivr.net" in found, found
    assert "formula not typeset" in found or "no MathJax" in found, found


def test_a_deleted_figure_is_caught(planted):
    found = planted["a deleted figure"]
    assert "image does not load: ../_images/deleted.png" in found, found


def test_a_figure_without_alt_text_is_caught(planted):
    found = planted["a figure without alt text"]
    assert "figure without alt text: ../_images/" in found, found


def test_a_broken_link_is_caught(planted):
    found = planted["a broken link"]
    assert "link to a missing anchor: roadmap.html#no-such-anchor" in found, found
    assert "link to a missing file: 03_no_such_chapter.html" in found, found


def test_a_dead_menu_button_is_caught(planted):
    found = planted["a dead menu button"]
    assert "the menu button does not open the chapter list" in found, found
    assert "the menu button does not hide the chapter list" in found, found


def test_an_output_wider_than_the_column_is_caught(planted):
    found = planted["an output wider than the column"]
    assert "wider than the text column: pre" in found, found
