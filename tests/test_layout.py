"""The book's layout: every chapter in the table of contents, jupytext pairs in sync, settings consistent."""

import glob
import os
import re

import jupytext
import yaml

from helpers import dist as book_dist

from helpers import ROOT


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
        strip = lambda s: re.sub(r"jupytext_version: .*\n", "", s)
        assert strip(again) == strip(text), f"{path} is not in canonical jupytext form: run `make sync`"
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
    lines = [l.strip() for l in open(os.path.join(ROOT, "requirements.txt")) if l.strip()
             and not l.startswith("#")]
    unpinned = [l for l in lines if not re.fullmatch(r"[A-Za-z0-9_.\-\[\]]+==[A-Za-z0-9_.+\-]+", l)]
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
