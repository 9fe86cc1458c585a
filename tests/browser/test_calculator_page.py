"""The page "Try the calculator" as a reader uses it (issue 39): opened from the disk with the network
blocked, filled in with Llama 3 70B on 64 H100 and a stated layout, it must show the numbers that
`python -m helpers.cost.calculator --json` prints for the command line the page itself displays, with no
console error and no request leaving the machine. The time from opening it to its first result is printed, not
asserted (the book times nothing in a test: a loaded machine would fail it); the wait for it is bounded.

Needs the built book (`make build`, which writes _static/calculator/ through
helpers/tools/calculator_site.py).
"""

import json
import os
import subprocess
import sys
import urllib.parse

import pytest

from helpers import ROOT
from helpers.tools import browser_check

SITE = os.path.join(ROOT, "_build", "html")
PAGE = os.path.join(SITE, "book", "calculator.html")
# the stated layout: tensor parallelism with SP inside a node, 4 pipeline stages, ZeRO-1 over dp=2, selective
# recomputation, 256 sequences of 4096 tokens
FORM = {"--gpus": "64", "--gpus-per-node": "8", "--seq": "4096", "--global-batch": "256",
        "--micro-batch": "1", "--tp": "8", "--pp": "4", "--vpp": "1", "--cp": "1", "--ep": "1", "--dp": ""}
MENUS = {"--model": "llama3-70b", "--gpu": "h100", "--zero": "1", "--recompute": "selective",
         "--precision": "bf16"}

unavailable = browser_check.why_unavailable()
pytestmark = pytest.mark.skipif(bool(unavailable), reason=f"BROWSER TEST SKIPPED: {unavailable}")


def cli(words: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "helpers.cost.calculator", *words], capture_output=True,
                          text=True, cwd=ROOT)


@pytest.fixture(scope="module")
def page():
    from playwright.sync_api import sync_playwright

    if not os.path.exists(PAGE):
        pytest.fail(f"no built calculator page at {os.path.relpath(PAGE, ROOT)}: run `make build` first")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=browser_check.find_browser(), args=["--no-sandbox"])
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        leaving: list[str] = []
        context.route("**/*", browser_check._offline(leaving))
        p = context.new_page()
        errors, missing = [], []
        p.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        p.on("pageerror", lambda e: errors.append(f"uncaught {e}"))
        p.on("requestfailed", lambda r: missing.append(r.url))
        p.goto("file://" + urllib.parse.quote(PAGE), wait_until="load")
        p.wait_for_selector("#calc-result[data-state=done]", timeout=60_000)
        yield p, errors, missing, leaving
        browser.close()


def compute(p, button: str, target: str) -> None:
    p.evaluate(f"document.getElementById('{target}').dataset.state = 'stale'")
    p.click(button)
    p.wait_for_selector(f"#{target}[data-state=done], #{target}[data-state=error]", timeout=120_000)


def shown(p, key: str) -> tuple[str, float]:
    row = p.locator(f"#calc-result .calc-row[data-key='{key}']")
    return row.locator(".calc-value").inner_text(), float(row.get_attribute("data-exact"))


def test_first_result_offline(page):
    p, errors, missing, leaving = page
    ms = int(p.evaluate("document.body.dataset.calculatorFirstResultMs"))
    print(f"\ncalculator page: load to first result {ms} ms")
    assert ms > 0
    assert not errors and not missing and not leaving, (errors, missing, leaving)


def test_the_page_shows_what_the_command_line_prints(page):
    p, errors, missing, leaving = page
    for flag, value in FORM.items():
        p.fill(f"#calc-form input[data-flag='{flag}']", value)
    for flag, value in MENUS.items():
        p.select_option(f"#calc-form select[data-flag='{flag}']", value)
    p.check("#calc-form input[data-flag='--sp']")
    compute(p, "#calc-compute", "calc-result")
    command = p.inner_text("#calc-command").split()
    assert command[:3] == ["python", "-m", "helpers.cost.calculator"]
    words = command[3:]
    for flag, value in {**FORM, **MENUS}.items():
        assert (flag not in words) if value == "" else words[words.index(flag) + 1] == value, flag
    assert "--sp" in words
    expected = json.loads(cli(words + ["--json"]).stdout)
    assert expected["layout"]["dp"] == 2 and expected["layout"]["sequence_parallel"]
    for key, item in expected["memory"].items():
        assert shown(p, key) == (f"{item['bytes'] / 1e9:.2f} GB", item["bytes"]), key
    assert shown(p, "total") == (f"{expected['memory_total'] / 1e9:.2f} GB", expected["memory_total"])
    for key, item in expected["traffic"].items():
        assert shown(p, key) == (f"{item['bytes'] / 1e9:.2f} GB", item["bytes"]), key
    for key, seconds in expected["step"].items():
        assert shown(p, key) == (f"{seconds:.2f} s", seconds), key
    assert shown(p, "step") == (f"{expected['step_seconds']:.2f} s", expected["step_seconds"])
    assert shown(p, "mfu") == (f"{100 * expected['mfu']:.1f} %", expected["mfu"])
    # every number's chapter link leads to a page of the site
    for href in p.eval_on_selector_all("#calc-result a.calc-chapter", "els => els.map(e => e.href)"):
        path = urllib.parse.unquote(urllib.parse.urlparse(href).path)
        assert os.path.exists(path), href
    assert not errors and not missing and not leaving, (errors, missing, leaving)


def test_a_broken_rule_reads_as_on_the_command_line(page):
    p, errors, missing, leaving = page
    p.fill("#calc-form input[data-flag='--tp']", "3")
    compute(p, "#calc-compute", "calc-result")
    words = p.inner_text("#calc-command").split()[3:]
    run = cli(words)
    assert run.returncode == 2
    assert "error: " + p.inner_text("#calc-result .calc-error") == run.stderr.strip()
    p.fill("#calc-form input[data-flag='--tp']", "8")
    assert not errors and not missing and not leaving, (errors, missing, leaving)


def test_the_search_shows_the_command_lines_best_layouts(page):
    p, errors, missing, leaving = page
    compute(p, "#calc-search-button", "calc-search")
    words = p.inner_text("#calc-command").split()[3:]
    expected = json.loads(cli(words + ["--json"]).stdout)["search"]
    rows = p.locator("#calc-search li")
    assert rows.count() == len(expected) == 5
    for i, row in enumerate(expected):
        assert row["describe"] in rows.nth(i).inner_text() and row["why"] in rows.nth(i).inner_text()
        assert float(rows.nth(i).get_attribute("data-exact")) == row["step_seconds"]
    assert not errors and not missing and not leaving, (errors, missing, leaving)
