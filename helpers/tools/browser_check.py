"""Open every page of the built book in a real browser, offline, as a reader would; report what is broken.

``python -m helpers.tools.browser_check _build/html [--screenshots DIR [--full-page]] [--page REL ...]``
drives headless Chromium (Debian's ``chromium``, through Playwright) over every page at 1280 px (a laptop)
and 390 px (a phone). Every request that would leave the machine is blocked and reported, as for a reader
who ran ``make build`` with no network. A page fails on:

- a console error or an uncaught JavaScript exception;
- a request for anything but a local file (a CDN, a font server, analytics);
- a local file that does not load (an image, a script, a style sheet) or an image with no pixels;
- a figure without alt text, or whose alt text is only its file name (myst-nb names output images by hash);
- a formula left as raw TeX (an element of class ``math`` that MathJax did not typeset);
- an internal link to a page that does not exist, or to an anchor that page does not have;
- a menu button (☰) that does not open the chapter list on a phone or hide it on a laptop;
- an output, a code cell or a table wider than the text column (it would scroll sideways or be clipped); on a
  phone a table may scroll inside its own box, which must fit the column;
- a figure (an image in the text) without a caption: an ``img`` outside a ``figure`` with a ``figcaption``;
- an output longer than 60 lines (a block of text or code, or a table of more than 60 rows), unless it is
  folded away in a closed toggle (``hide-output``, a dropdown);
- a table with a row of the wrong width: in the page (a row whose cells, counting ``colspan``, are not the
  header's), or in the Markdown it was made from (a cell with a bare ``|`` splits its row; Markdown then drops
  the extra cells or pads the row with empty ones, so the HTML alone cannot tell). The Markdown is the page's
  executed notebook (``jupyter_execute/`` beside the site: its Markdown cells and Markdown outputs) or its
  source in ``_sources/``.

It keeps a screenshot of every page at both widths (JPEG) in ``--screenshots``: of the first screen, or
with ``--full-page`` of the whole page, which took most of the check's time in ``make test`` (about 5 s for a
long chapter against 0.5 s for its first screen, measured here). It exits 1 and lists every failure, page by
page, or exits 0. Without Chromium or Playwright it says so and exits 2.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import urllib.parse
from dataclasses import dataclass, field

WIDTHS = {"laptop": 1280, "phone": 390}
MAX_OUTPUT_LINES = 60
SKIP_DIRS = {"_static", "_sources", "_images", "_sphinx_design_static", "_panels_static"}
# The theme's own pages hold no chapter content; search.html is opened like every other page.
SKIP_PAGES = {"genindex.html"}


@dataclass
class PageReport:
    page: str
    width: str
    failures: list[str] = field(default_factory=list)


def find_browser() -> str | None:
    """The Chromium to drive: ``BOOK_CHROMIUM`` if set, else the first one on PATH."""
    explicit = os.environ.get("BOOK_CHROMIUM")
    if explicit:
        return explicit if os.path.exists(explicit) else None
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def why_unavailable() -> str | None:
    """None if the browser test can run here, else the reason it cannot."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the Python package playwright is not installed (it is pinned in requirements.txt)"
    if find_browser() is None:
        return "no Chromium found (apt-get install chromium, or set BOOK_CHROMIUM to its path)"
    return None


_REFRESH = re.compile(r"""<meta\s+http-equiv=["']refresh["']\s+content=["'][^"']*url=([^"']+)["']""", re.I)


def redirect_target(path: str) -> str | None:
    """Where a redirect page (``index.html`` of Jupyter Book) sends the reader, as a path; None if not one."""
    with open(path, encoding="utf-8", errors="replace") as f:
        found = _REFRESH.search(f.read(4096))
    return os.path.join(os.path.dirname(path), found.group(1).split("#")[0]) if found else None


def pages_of(root: str) -> list[str]:
    """Every HTML page of the built site, relative to ``root``, except redirects (checked apart)."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        for name in sorted(files):
            rel = os.path.relpath(os.path.join(folder, name), root)
            redirect = redirect_target(os.path.join(root, rel))
            if name.endswith(".html") and rel not in SKIP_PAGES and not redirect:
                found.append(rel)
    return found


def broken_redirects(root: str) -> list[PageReport]:
    """A report for each redirect page whose target does not exist."""
    reports = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
        for name in files:
            path = os.path.join(folder, name)
            target = name.endswith(".html") and redirect_target(path)
            if target and not os.path.isfile(target):
                reports.append(PageReport(os.path.relpath(path, root), "laptop",
                                          [f"redirects to a missing page: {os.path.relpath(target, root)}"]))
    return reports


_ID = re.compile(r"""\bid\s*=\s*["']([^"']+)["']""")


class Anchors:
    """The ids each local page defines, read once per file."""

    def __init__(self) -> None:
        self._ids: dict[str, set[str]] = {}

    def of(self, path: str) -> set[str]:
        if path not in self._ids:
            with open(path, encoding="utf-8", errors="replace") as f:
                self._ids[path] = set(_ID.findall(f.read()))
        return self._ids[path]


def broken_links(hrefs: list[str], anchors: Anchors) -> list[str]:
    """The local links among ``hrefs`` (absolute ``file:`` URLs) whose file or anchor does not exist."""
    broken = []
    for href in sorted(set(hrefs)):
        url = urllib.parse.urlsplit(href)
        if url.scheme != "file":
            continue
        path = urllib.parse.unquote(url.path)
        if not os.path.exists(path):
            broken.append(f"link to a missing file: {os.path.basename(path)}")
        elif url.fragment and os.path.isfile(path):
            fragment = urllib.parse.unquote(url.fragment)
            if fragment not in anchors.of(path):
                broken.append(f"link to a missing anchor: {os.path.basename(path)}#{fragment}")
    return broken


def page_markdown(root: str, rel: str) -> list[str]:
    """The Markdown a page was made from: its executed notebook's Markdown cells and Markdown outputs, or
    the source Sphinx copied to ``_sources/``; an empty list if there is neither."""
    import json

    stem = rel[:-len(".html")]
    executed = os.path.join(os.path.dirname(os.path.abspath(root)), "jupyter_execute", stem + ".ipynb")
    if os.path.isfile(executed):
        with open(executed, encoding="utf-8") as f:
            notebook = json.load(f)
        texts = []
        for cell in notebook.get("cells", []):
            source = cell.get("source", "")
            if cell.get("cell_type") == "markdown":
                texts.append(source if isinstance(source, str) else "".join(source))
            for output in cell.get("outputs", []):
                shown = output.get("data", {}).get("text/markdown")
                if shown:
                    texts.append(shown if isinstance(shown, str) else "".join(shown))
        return texts
    for suffix in (".md", ".md.txt", ".txt"):
        source = os.path.join(root, "_sources", stem + suffix)
        if os.path.isfile(source):
            with open(source, encoding="utf-8", errors="replace") as f:
                return [f.read()]
    return []


def ragged_source_tables(root: str, rel: str) -> list[str]:
    from helpers.show import ragged_rows

    return [row for text in page_markdown(root, rel) for row in ragged_rows(text)]


# Runs in the page once it has loaded and MathJax (if the page has formulas) has finished.
_INSPECT = """async ([phone, limit]) => {
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) { await MathJax.startup.promise; }
  const article = document.querySelector('.bd-article') || document.body;
  const edge = article.getBoundingClientRect().right;
  const maths = [...article.querySelectorAll('.math')];
  const raw = maths.filter(m => !m.querySelector('mjx-container'));
  const images = [...document.querySelectorAll('img')].filter(i => !(i.complete && i.naturalWidth > 0));
  const unnamed = [...article.querySelectorAll('img')].filter(i => {
    const alt = (i.getAttribute('alt') || '').trim(), file = (i.getAttribute('src') || '').split('/').pop();
    return !alt || alt.split('/').pop() === file || /^[0-9a-f]{16,}(\\.\\w+)?$/i.test(alt.split('/').pop());
  }).map(i => i.getAttribute('src'));
  const wide = [];
  for (const el of article.querySelectorAll('pre, table')) {
    if (el.closest('.math') || !(el.offsetWidth || el.offsetHeight)) continue;
    // On a phone a table may scroll inside its own box, as long as the box fits the column.
    const box = el.tagName === 'TABLE' && phone && el.closest('.pst-scrollable-table-container');
    if (box && box.getBoundingClientRect().right - edge <= 1) continue;
    const over = el.scrollWidth - el.clientWidth, out = el.getBoundingClientRect().right - edge;
    if (over > 1 || out > 1) {
      const text = (el.innerText || '').trim().split('\\n')[0].slice(0, 60);
      wide.push(`${el.tagName.toLowerCase()} ${Math.max(over, out).toFixed(0)} px too wide: "${text}"`);
    }
  }
  const uncaptioned = [...article.querySelectorAll('img')].filter(i => {
    const figure = i.closest('figure'), caption = figure && figure.querySelector('figcaption');
    return !(caption && caption.textContent.trim());
  }).map(i => i.getAttribute('src'));
  const shut = el => !!el.closest('details:not([open])');
  const long = [];  // each output block (a text output, a code listing, a table) on its own
  for (const el of article.querySelectorAll('.cell_output pre, .cell_output table')) {
    if (shut(el) || el.parentElement.closest('pre, table')) continue;
    const lines = el.tagName === 'PRE' ? el.textContent.replace(/\\n+$/, '').split('\\n').length
                                       : el.rows.length;
    const first = (el.innerText || '').trim().split('\\n')[0].slice(0, 60);
    if (lines > limit) long.push(`${el.tagName.toLowerCase()} of ${lines} lines: "${first}"`);
  }
  const ragged = [];
  for (const t of article.querySelectorAll('table')) {
    const rows = [...t.rows];
    if (rows.some(r => [...r.cells].some(c => c.rowSpan > 1))) continue;
    const widths = rows.map(r => [...r.cells].reduce((n, c) => n + (c.colSpan || 1), 0));
    const bad = widths.findIndex(w => w !== widths[0]);
    if (bad > 0) ragged.push(`row ${bad + 1} has ${widths[bad]} cells, the first ${widths[0]}: ` +
                              `"${rows[bad].innerText.trim().slice(0, 60)}"`);
  }
  return {raw: raw.map(m => m.textContent.slice(0, 50)), hasMath: maths.length, uncaptioned, long, ragged,
          mathjax: !!window.MathJax, images: images.map(i => i.getAttribute('src')), unnamed,
          links: [...document.querySelectorAll('a[href], link[href]')].map(a => a.href), wide};
}"""

_SIDEBAR_SHOWN = """() => {
  const bar = document.querySelector('.bd-sidebar-primary');
  if (!bar) return null;
  const r = bar.getBoundingClientRect(), style = getComputedStyle(bar);
  return style.visibility !== 'hidden' && style.display !== 'none' && r.width > 0 && r.right > 1;
}"""


def check_menu(page, width: str) -> str | None:
    """Click the visible ☰: on a phone the chapter list must appear, on a laptop it must go."""
    toggle = page.locator(".primary-toggle:visible")
    if toggle.count() == 0:
        return "no visible menu button (☰)"
    before = page.evaluate(_SIDEBAR_SHOWN)
    if before is None:
        return "no chapter list (.bd-sidebar-primary) on the page"
    toggle.first.click()
    page.wait_for_timeout(400)
    after = page.evaluate(_SIDEBAR_SHOWN)
    expected = (False, True) if width == "phone" else (True, False)
    if (before, after) != expected:
        return (f"the menu button does not {'open' if width == 'phone' else 'hide'} the chapter list "
                f"(shown before the click: {before}, after: {after})")
    return None


def _offline(leaving: list[str]):
    """A route handler: local files load, every other request is blocked and written down."""

    def handle(route):
        if route.request.url.startswith(("file:", "data:", "blob:")):
            route.continue_()
        else:
            leaving.append(route.request.url)
            route.abort()

    return handle


def check_site(root: str, *, screenshots: str | None = None, only: list[str] | None = None,
               widths: dict[str, int] = WIDTHS, full_page: bool = False) -> list[PageReport]:
    """Every page (or those in ``only``) at every width; a report per page and width."""
    from playwright.sync_api import sync_playwright

    root = os.path.abspath(root)
    pages = only or pages_of(root)
    anchors = Anchors()
    reports = [] if only else broken_redirects(root)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=find_browser(), args=["--no-sandbox"])
        try:
            for width, px in widths.items():
                context = browser.new_context(viewport={"width": px, "height": 900})
                leaving: list[str] = []
                context.route("**/*", _offline(leaving))
                for rel in pages:
                    reports.append(_check_page(context, root, rel, width, leaving, anchors, screenshots,
                                               full_page))
                context.close()
        finally:
            browser.close()
    return reports


def _check_page(context, root, rel, width, leaving, anchors, screenshots, full_page) -> PageReport:
    report = PageReport(rel, width)
    page = context.new_page()
    errors, missing = [], []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(f"uncaught {e}"))
    page.on("requestfailed",
            lambda r: missing.append(r.url) if r.url.startswith("file:") else None)
    del leaving[:]
    page.goto("file://" + urllib.parse.quote(os.path.join(root, rel)), wait_until="load")
    found = page.evaluate(_INSPECT, [width == "phone", MAX_OUTPUT_LINES])
    fail = report.failures.append
    for text in errors:
        if "net::ERR_FAILED" not in text:  # a blocked request, reported below by its URL
            fail(f"console error: {text[:200]}")
    for url in sorted(set(leaving)):
        fail(f"request leaves the machine: {url[:160]}")
    for url in sorted(set(missing)):
        fail(f"local file does not load: {os.path.relpath(urllib.parse.unquote(url[7:]), root)}")
    for src in found["images"]:
        fail(f"image does not load: {src}")
    for src in found["unnamed"]:
        fail(f"figure without alt text: {src}")
    for src in found["uncaptioned"]:
        fail(f"figure without a caption: {src}")
    for text in found["long"]:
        fail(f"output longer than {MAX_OUTPUT_LINES} lines: {text}")
    for text in found["ragged"]:
        fail(f"table with a row of the wrong width: {text}")
    for text in ragged_source_tables(root, rel):
        fail(f"table with a row of the wrong width in its Markdown: {text}")
    if found["hasMath"] and not found["mathjax"]:
        fail(f"{found['hasMath']} formulas and no MathJax on the page")
    for tex in found["raw"][:5]:
        fail(f"formula not typeset: {tex!r}")
    if len(found["raw"]) > 5:
        fail(f"... and {len(found['raw']) - 5} more formulas not typeset")
    for text in broken_links(found["links"], anchors):
        fail(text)
    for text in found["wide"][:5]:
        fail(f"wider than the text column: {text}")
    if len(found["wide"]) > 5:
        fail(f"... and {len(found['wide']) - 5} more outputs or tables wider than the text column")
    if screenshots:
        shot = os.path.join(screenshots, f"{rel[:-5].replace(os.sep, '__')}-{width}.jpg")
        os.makedirs(screenshots, exist_ok=True)
        page.screenshot(path=shot, full_page=full_page, type="jpeg", quality=60)
    if rel != "search.html":
        problem = check_menu(page, width)
        if problem:
            fail(problem)
    page.close()
    return report


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", help="the built site, e.g. _build/html")
    parser.add_argument("--screenshots", help="folder for a screenshot of each page at each width")
    parser.add_argument("--full-page", action="store_true", help="whole pages, not first screens")
    parser.add_argument("--page", action="append", help="check only this page (relative to root)")
    args = parser.parse_args(argv)
    reason = why_unavailable()
    if reason:
        print(f"browser check NOT RUN: {reason}", file=sys.stderr)
        return 2
    reports = check_site(args.root, screenshots=args.screenshots, only=args.page, full_page=args.full_page)
    failed = [r for r in reports if r.failures]
    for r in failed:
        print(f"{r.page} at {WIDTHS[r.width]} px:")
        for line in r.failures:
            print(f"  - {line}")
    print(f"browser check: {len(reports) - len(failed)} passed, {len(failed)} failed "
          f"({len({r.page for r in reports})} pages at {len(WIDTHS)} widths)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
