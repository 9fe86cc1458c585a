"""``make sync``: each chapter's ``.md`` and its ``.ipynb`` pair brought in line by jupytext, without losing
an edit of the ``.md``: ``python -m helpers.tools.sync notebooks/NN_*.md``.

The ``.md`` is the source (committed; the ``.ipynb`` is made from it). jupytext's ``--sync`` lets the newer
file win, so a stale ``.ipynb`` saved after an edit of the ``.md`` (JupyterLab's autosave of a notebook
opened before the edit) overwrites that edit. Each sync therefore records, in the ``.ipynb``'s metadata
(``book_sync``), the hash of the ``.md`` it was synced with; a notebook saved from it keeps the record.
When the ``.ipynb`` is the newer file but the ``.md`` has changed since that record, and their cells differ,
the pair is refused, the ``.md`` left as it is, and the exit status is 1.
"""

from __future__ import annotations

import hashlib
import os
import sys

import jupytext
import nbformat
from jupytext.cli import jupytext as jupytext_cli

KEY = "book_sync"


def _md_hash(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _cells(nb) -> list[tuple[str, str]]:
    return [(cell.cell_type, cell.source.strip()) for cell in nb.cells]


def unseen_edit(md: str) -> str | None:
    """Why syncing ``md`` would lose an edit of it, or None."""
    ipynb = md[:-3] + ".ipynb"
    if not os.path.exists(ipynb) or os.path.getmtime(ipynb) <= os.path.getmtime(md):
        return None  # the .md wins, or makes the pair
    nb = nbformat.read(ipynb, as_version=4)
    if nb.metadata.get(KEY, {}).get("md_sha256") == _md_hash(md) or _cells(nb) == _cells(jupytext.read(md)):
        return None  # the .ipynb saw this .md, or there is nothing to lose
    name = os.path.basename(ipynb)
    return (f"{md}: changed since {name} last saw it, and {name} was saved later, so syncing would overwrite "
            f"the .md's edit; left both as they are. The .md is the source: keep it with `rm {ipynb}` and "
            f"`make sync` again, or keep the notebook's version with `jupytext --to md:myst {ipynb}`")


def sync(md: str) -> str | None:
    """Sync one pair and record the .md it was synced with; the reason it was refused, or None."""
    reason = unseen_edit(md)
    if reason is not None:
        return reason
    status = jupytext_cli(["--quiet", "--sync", md])
    if status:
        return f"{md}: jupytext --sync failed with status {status}"
    ipynb = md[:-3] + ".ipynb"
    nb = nbformat.read(ipynb, as_version=4)
    nb.metadata[KEY] = {"md_sha256": _md_hash(md)}
    nbformat.write(nb, ipynb)
    os.utime(md)  # the .md stays the newer file, as jupytext leaves it: the next sync does not rewrite it
    return None


def main(argv: list[str]) -> int:
    refused = [reason for md in argv if (reason := sync(md)) is not None]
    for reason in refused:
        print(f"make sync: {reason}", file=sys.stderr)
    return 1 if refused else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
