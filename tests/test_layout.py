"""The book's layout: every chapter in the table of contents, jupytext pairs in sync, settings consistent, and
the lists that must not drift (roadmap, exercises, README, the chapter -> module index) in line with them."""

import ast
import glob
import os
import re

import jupytext
import yaml

import helpers
from helpers import ROOT
from helpers import dist as book_dist

SKELETON = "book/chapter_skeleton.md"
ENDING_MARK = "% The sections below end every chapter"
WITH_EXERCISE = range(1, 15)  # chapters 01-14 end with an exercise


def load(name):
    with open(os.path.join(ROOT, name)) as f:
        return yaml.safe_load(f)


def toc_files(node) -> list[str]:
    found = []
    if isinstance(node, dict):
        if "file" in node:
            found.append(node["file"])
        if "root" in node:
            found.append(node["root"])
        for value in node.values():
            found += toc_files(value)
    elif isinstance(node, list):
        for value in node:
            found += toc_files(value)
    return found


def chapters() -> list[str]:
    return sorted(glob.glob(os.path.join(ROOT, "notebooks", "[0-9][0-9]_*.md")))


def unstamped(text: str) -> str:
    return re.sub(r"jupytext_version: .*\n", "", text)


def test_every_chapter_is_in_the_toc_and_every_entry_exists():
    listed = toc_files(load("_toc.yml"))
    for path in chapters():
        rel = os.path.relpath(path, ROOT)[:-3]
        assert rel in listed, f"{rel} is not in _toc.yml"
    for entry in listed:
        assert glob.glob(os.path.join(ROOT, entry + ".*")), f"_toc.yml lists {entry}, which does not exist"
    assert chapters(), "no chapters found"


def test_jupytext_pairs_are_in_sync():
    for path in chapters():
        text = open(path).read()
        nb = jupytext.reads(text, fmt="md:myst")
        assert nb.metadata["jupytext"]["formats"] == "ipynb,md:myst", f"{path}: not paired with an .ipynb"
        # the text is in jupytext's own form: writing it back changes nothing but the version stamp
        again = jupytext.writes(nb, fmt="md:myst")
        assert unstamped(again) == unstamped(text), \
            f"{path} is not in canonical jupytext form: run `make sync`"
        paired = path[:-3] + ".ipynb"
        if os.path.exists(paired):  # made by `make sync`/`make lab`; when present it must match
            ipynb = jupytext.read(paired)
            assert [c.source for c in ipynb.cells] == [c.source for c in nb.cells], \
                f"{paired} differs from {path}: run `make sync`"


def test_a_collective_times_out_before_a_cell_does():
    config = load("_config.yml")
    assert book_dist.DEFAULT_TIMEOUT_S < config["execute"]["timeout"]
    # failing notebooks are warnings, so the build must turn warnings into errors
    from helpers.tools import build
    assert {"-W", "--keep-going"} <= set(build.JB_FLAGS)
    assert "notebooks/*.ipynb" in config["exclude_patterns"]


def test_requirements_are_pinned():
    lines = [line.strip() for line in open(os.path.join(ROOT, "requirements.txt")) if line.strip()
             and not line.startswith("#")]
    unpinned = [line for line in lines if not re.fullmatch(r"[A-Za-z0-9_.\-\[\]]+==[A-Za-z0-9_.+\-]+", line)]
    assert not unpinned, unpinned
    assert "torch==2.13.0" in lines and "jupyter-book==1.0.4.post1" in lines


def test_every_chapters_distributed_code_exports_for_torchrun():
    """The %%px cells of each chapter form a script (no magics, no cells aimed at some ranks only)."""
    from helpers.tools import px_script

    for path in chapters():
        try:
            script = px_script.export(path)
        except ValueError as err:
            assert "has no %%px cells" in str(err), err
            continue
        compile(script, path, "exec")


# --------------------------------------------------------------------------------- lists that cannot drift
# book/roadmap.md, book/exercises.md, the README's layout table and the chapter -> module index
# (helpers.CHAPTERS) are checked against _toc.yml and against the module files on disk; every chapter against
# the ending of book/chapter_skeleton.md. Pure Python: no ranks, no imports of the modules checked.


def read(name: str) -> str:
    with open(os.path.join(ROOT, name)) as f:
        return f.read()


def toc_chapters() -> dict[str, str]:
    """Chapter number -> its entry in _toc.yml ("notebooks/05_tensor_parallel")."""
    entries = [e for e in toc_files(load("_toc.yml")) if re.fullmatch(r"notebooks/\d\d_\w+", e)]
    return {os.path.basename(e)[:2]: e for e in entries}


def table_rows(name: str) -> dict[str, list[str]]:
    """The rows of a page's tables whose first cell is a chapter number: number -> the other cells."""
    rows = {}
    for line in read(name).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and re.fullmatch(r"\d\d", cells[0]):
            assert cells[0] not in rows, f"{name}: two rows for chapter {cells[0]}"
            rows[cells[0]] = cells[1:]
    return rows


def module_files() -> dict[str, str]:
    """Every module file under helpers/ but __init__.py: dotted name -> path relative to the repository."""
    found = {}
    for path in sorted(glob.glob(os.path.join(ROOT, "helpers", "**", "*.py"), recursive=True)):
        rel = os.path.relpath(path, ROOT)
        if os.path.basename(rel) != "__init__.py":
            found[rel[:-3].replace(os.sep, ".")] = rel
    return found


def docstring(rel: str) -> str:
    return ast.get_docstring(ast.parse(read(rel))) or ""


def level2_headings(path: str) -> list[str]:
    """The ## headings of a notebook's Markdown cells, in order (code cells' # comments are not headings)."""
    nb = jupytext.reads(read(path), fmt="md:myst")
    return [line[3:].strip() for cell in nb.cells if cell.cell_type == "markdown"
            for line in cell.source.splitlines() if line.startswith("## ")]


def test_every_chapter_in_the_toc_has_its_roadmap_row():
    rows, listed = table_rows("book/roadmap.md"), toc_chapters()
    for nn, entry in listed.items():
        assert nn in rows, f"book/roadmap.md has no row for chapter {nn} ({entry}, in _toc.yml): add one"
        status = rows[nn][-1]
        assert f"../{entry}>" in status, \
            f"book/roadmap.md: chapter {nn} is in _toc.yml, but its status is {status!r}, not a link " \
            f"{{doc}}`published <../{entry}>`"
    for nn, cells in rows.items():
        linked = re.findall(r"<\.\./(notebooks/[^>]+)>", cells[-1])
        assert not linked or linked == [listed.get(nn)], \
            f"book/roadmap.md: chapter {nn}'s row links {linked}, but _toc.yml lists {listed.get(nn)}"


def test_every_chapter_in_the_toc_has_its_exercise_row():
    rows, listed = table_rows("book/exercises.md"), toc_chapters()
    for nn, entry in listed.items():
        if int(nn) not in WITH_EXERCISE:
            continue
        assert nn in rows, f"book/exercises.md has no row for chapter {nn} ({entry}, in _toc.yml): add one"
        label = re.findall(r"\{ref\}`[^`<]*<([\w-]+)>`", rows[nn][0])
        assert label, f"book/exercises.md: chapter {nn} is in _toc.yml, but its exercise row is " \
                      f"{rows[nn][0]!r}, not a {{ref}} link to the chapter's exercise"
        assert re.search(rf"^```{{exercise}}.*\n:label: {label[0]}$", read(entry + ".md"), re.M), \
            f"book/exercises.md links chapter {nn}'s exercise as {label[0]!r}, but {entry}.md has no " \
            f"{{exercise}} with `:label: {label[0]}`"
    for nn, cells in rows.items():
        assert "{ref}" not in cells[0] or nn in listed, \
            f"book/exercises.md links chapter {nn}'s exercise, but chapter {nn} is not in _toc.yml"


def test_the_chapter_module_index_matches_the_toc_and_the_files():
    listed, index, files = toc_chapters(), helpers.CHAPTERS, module_files()
    missing = [f"{nn} ({entry})" for nn, entry in listed.items() if nn not in index]
    assert not missing, f"helpers/__init__.py: CHAPTERS has no entry for chapter(s) {missing}, in _toc.yml"
    stale = sorted(set(index) - set(listed))
    assert not stale, f"helpers/__init__.py: CHAPTERS lists chapter(s) {stale}, which _toc.yml does not"
    taught = {m for modules in index.values() for m in modules}
    absent = sorted(m for m in taught | set(helpers.HARNESS) if m not in files)
    assert not absent, f"helpers/__init__.py names modules with no file under helpers/: {absent}"
    both = sorted(taught & set(helpers.HARNESS))
    assert not both, f"helpers/__init__.py: {both} both taught by a chapter (CHAPTERS) and in HARNESS"
    unlisted = sorted(m for m in files if not m.startswith("helpers.tools.") and m not in taught
                      and m not in helpers.HARNESS)
    assert not unlisted, \
        f"module files in neither CHAPTERS (under the chapter that teaches them) nor HARNESS of " \
        f"helpers/__init__.py: {[files[m] for m in unlisted]}"


def test_every_taught_module_names_its_chapter():
    files = module_files()
    wrong = [f"{files[m]} (chapter {nn} in helpers.CHAPTERS)" for nn, modules in helpers.CHAPTERS.items()
             for m in modules if m in files and f"chapter {nn}" not in docstring(files[m]).lower()]
    assert not wrong, f"these modules' docstrings do not name their chapter (\"(chapter NN)\"): {wrong}"


def test_the_readme_layout_table_names_every_module_file():
    rows = {}
    for line in read("README.md").splitlines():
        first = line.strip("|").split("|")[0].strip() if line.startswith("|") else ""
        if re.fullmatch(r"`helpers/(\w+/)?`", first):
            rows[first.strip("`")] = line
    problems = []
    folders = sorted({os.path.dirname(rel) + "/" for rel in glob.glob("helpers/**/__init__.py", root_dir=ROOT,
                                                                     recursive=True)})
    for folder in folders:
        on_disk = {os.path.basename(p) for p in glob.glob(os.path.join(ROOT, folder, "*.py"))}
        on_disk.discard("__init__.py")
        if folder not in rows:
            problems.append(f"no row for `{folder}` (holding {sorted(on_disk)})")
            continue
        named = set(re.findall(r"`(\w+\.py)`", rows[folder])) - {"__init__.py"}
        problems += [f"`{folder}` row does not name {folder}{n}" for n in sorted(on_disk - named)]
        problems += [f"`{folder}` row names {n}, which is not in {folder}" for n in sorted(named - on_disk)]
    problems += [f"a row for `{folder}`, which is not a package under helpers/" for folder in sorted(rows)
                 if folder not in folders]
    assert not problems, "README.md's layout table is out of date: " + "; ".join(problems)


def test_no_file_in_helpers_is_over_400_lines():
    long = {}
    for path in glob.glob(os.path.join(ROOT, "helpers", "**", "*.py"), recursive=True):
        with open(path) as f:
            n = sum(1 for _ in f)
        if n > 400:
            long[os.path.relpath(path, ROOT)] = n
    assert not long, f"files in helpers/ over 400 lines (split them where the idea splits): {long}"


def skeleton_ending() -> list[str]:
    """The ## sections after ENDING_MARK in the skeleton: what every chapter ends with, in order."""
    nb = jupytext.reads(read(SKELETON), fmt="md:myst")
    marked = [i for i, cell in enumerate(nb.cells) if ENDING_MARK in cell.source]
    assert len(marked) == 1, f"{SKELETON}: expected one cell with {ENDING_MARK!r}, found {len(marked)}"
    return [line[3:].strip() for cell in nb.cells[marked[0]:] if cell.cell_type == "markdown"
            for line in cell.source.splitlines() if line.startswith("## ")]


def test_the_skeleton_is_a_chapter_outside_the_book():
    config = load("_config.yml")
    assert SKELETON[:-3] not in toc_files(load("_toc.yml")), f"{SKELETON} must stay out of _toc.yml"
    assert SKELETON in config["exclude_patterns"], f"{SKELETON} must be in _config.yml's exclude_patterns"
    text = read(SKELETON)
    nb = jupytext.reads(text, fmt="md:myst")
    assert nb.metadata["jupytext"]["formats"] == "ipynb,md:myst", f"{SKELETON}: not paired with an .ipynb"
    assert unstamped(jupytext.writes(nb, fmt="md:myst")) == unstamped(text), \
        f"{SKELETON} is not in canonical jupytext form"
    from helpers.tools import px_script
    compile(px_script.export(os.path.join(ROOT, SKELETON)), SKELETON, "exec")
    assert "Exercise" in skeleton_ending() and skeleton_ending()[-1] == "Checks run in this chapter"


def test_every_chapter_ends_with_the_skeletons_sections():
    ending = skeleton_ending()
    for path in chapters():
        nn = int(os.path.basename(path)[:2])
        want = [s for s in ending if s != "Exercise" or nn in WITH_EXERCISE]
        got = level2_headings(path)
        assert got[-len(want):] == want, \
            f"{os.path.relpath(path, ROOT)} ends with the sections {got[-len(want):]}; every chapter ends " \
            f"with {want}, in this order ({SKELETON})"


# what book/conventions.md rules out, in helpers/, tests/ and the chapters (not in this file, which names it)
NEVER = {r"\bgroup_size\b": "group_size (GQA's query heads per KV head are n_rep)",
         r"\bas get_batch\b": "an alias for get_batch (helpers.data.get_batch is its name)",
         r"^\s*from \.": "a relative import (absolute imports only: from helpers.x import y)",
         r"^\s*(from [\w.]+ )?import [\w.]+ as (dp|tp|pp|cp|ep|vpp|[a-z])\b":
             "a degree's name or a single letter as an import alias (full module names)"}


def test_no_word_the_conventions_rule_out():
    paths = [p for p in glob.glob(os.path.join(ROOT, "helpers", "**", "*.py"), recursive=True)
             + glob.glob(os.path.join(ROOT, "tests", "**", "*.py"), recursive=True)
             + glob.glob(os.path.join(ROOT, "notebooks", "*.md"))
             if os.path.abspath(p) != os.path.abspath(__file__)]
    found = [f"{os.path.relpath(path, ROOT)}:{n}: {why}" for path in sorted(paths)
             for n, line in enumerate(read(path).splitlines(), 1)
             for pattern, why in NEVER.items() if re.search(pattern, line)]
    assert not found, "words book/conventions.md rules out:\n" + "\n".join(found)


def test_every_definition_of_comms_is_shown_on_a_page():
    """``helpers/parallel/comms.py`` is the layer every chapter after 02 calls for its communication: each of
    its functions and classes is listed by ``show_source`` on some chapter's page (the chapter that first uses
    it; issue 37, item 6), so no call a chapter makes through it is unseen."""
    tree = ast.parse(read("helpers/parallel/comms.py"))
    defined = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    shown = {name for path in chapters() for call in re.findall(r"show_source\(([^)]*)\)", read(path))
             for name in re.findall(r"\bcomms\.(\w+)", call)}
    assert not defined - shown, f"comms.py's definitions shown on no page: {sorted(defined - shown)} (show " \
                                f"each with show_source where a chapter first uses it)"
