"""The built book in a real browser, offline, at a laptop's and a phone's width (helpers/tools/browser_check.py).

Runs after the build (`make test` = unit, build, browser). The first test checks every page of `_build/html`
and keeps the screenshots in `_build/screenshots`; the others plant one defect each in a copy of a chapter
page and check that the browser check catches it, so a pass means something.
"""

import os
import re
import shutil

import pytest

from helpers.tools import browser_check

from helpers import ROOT
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


def failures(root: str, page: str = PAGE) -> list[str]:
    return [f"{r.width}: {line}" for r in browser_check.check_site(root, only=[page]) for line in r.failures]


@pytest.fixture
def copy(site, tmp_path):
    """A copy of the site to break, and a function that edits one page of it."""
    root = str(tmp_path / "html")
    shutil.copytree(site, root)

    def edit(change, page=PAGE):
        path = os.path.join(root, page)
        with open(path, encoding="utf-8") as f:
            before = f.read()
        after = change(before)
        assert after != before, "the planted defect changed nothing"
        with open(path, "w", encoding="utf-8") as f:
            f.write(after)

    return root, edit


def test_every_page_works_offline_at_both_widths(site):
    shots = os.path.join(ROOT, "_build", "screenshots")
    shutil.rmtree(shots, ignore_errors=True)
    reports = browser_check.check_site(site, screenshots=shots)
    pages = {r.page for r in reports}
    assert PAGE in pages and len(pages) >= 10, sorted(pages)
    bad = [f"{r.page} at {browser_check.WIDTHS[r.width]} px: {line}" for r in reports for line in r.failures]
    assert not bad, "\n".join(bad)
    assert len(os.listdir(shots)) == 2 * len(pages)


def test_mathjax_from_a_cdn_is_caught(copy):
    root, edit = copy
    edit(lambda html: html.replace('src="../_static/mathjax/tex-chtml.js"',
                                   'src="https://cdn.jsdelivr.net/npm/mathjax@3/es5/tex-chtml.js"'))
    found = "\n".join(failures(root))
    assert "request leaves the machine: https://cdn.jsdelivr.net" in found, found
    assert "formula not typeset" in found or "no MathJax" in found, found


def test_a_deleted_figure_is_caught(copy):
    root, _ = copy
    with open(os.path.join(root, PAGE), encoding="utf-8") as f:
        figure = re.search(r'<img[^>]+src="\.\./(_images/[^"]+)"', f.read()).group(1)
    os.remove(os.path.join(root, figure))
    found = "\n".join(failures(root))
    assert f"image does not load: ../{figure}" in found, found


def test_a_figure_without_alt_text_is_caught(copy):
    root, edit = copy
    edit(lambda html: re.sub(r'(<img[^>]+)alt="[^"]*"', lambda m: m.group(1) + 'alt="0123456789abcdef0123.png"',
                             html, count=1))
    found = "\n".join(failures(root))
    assert "figure without alt text: ../_images/" in found, found


def test_a_broken_link_is_caught(copy):
    root, edit = copy
    edit(lambda html: html.replace('href="../book/roadmap.html"', 'href="../book/roadmap.html#no-such-anchor"', 1)
         .replace('href="03_ddp.html"', 'href="03_no_such_chapter.html"', 1))
    found = "\n".join(failures(root))
    assert "link to a missing anchor: roadmap.html#no-such-anchor" in found, found
    assert "link to a missing file: 03_no_such_chapter.html" in found, found


def test_a_dead_menu_button_is_caught(copy):
    """The bug the theme had: a hidden second ☰ earlier in the page takes the click handler."""
    root, edit = copy
    edit(lambda html: re.sub(r"(<body[^>]*>)", r'\1<button class="sidebar-toggle primary-toggle" '
                             r'style="display:none"></button>', html, count=1))
    found = "\n".join(failures(root))
    assert "the menu button does not open the chapter list" in found, found
    assert "the menu button does not hide the chapter list" in found, found


def test_an_output_wider_than_the_column_is_caught(copy):
    root, edit = copy
    edit(lambda html: html.replace("</head>", "<style>div.cell_output pre, div.highlight pre "
                                   "{ white-space: pre !important; }</style></head>", 1))
    found = "\n".join(failures(root))
    assert "wider than the text column: pre" in found, found
