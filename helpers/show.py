"""Show the code a chapter teaches, from the module that runs it, and tables of computed values.

A chapter's implementation lives in one small module under ``helpers/`` (one file per idea, as in picotron);
the chapter walks through it with ``show_source(fn)``, which prints the function's or class's own source as a
highlighted code block. What the page shows is therefore exactly what the ranks run.
"""

from __future__ import annotations

import inspect
import re
import textwrap


def show_source(*objects) -> None:
    """Display the source of each function or class, one code block each, with the file it lives in."""
    from IPython.display import Markdown, display

    for obj in objects:
        source = textwrap.dedent(inspect.getsource(obj)).rstrip()
        module = inspect.getmodule(obj)
        where = module.__name__.replace(".", "/") + ".py" if module else "?"
        display(Markdown(f"`{where}`\n\n```python\n{source}\n```"))


def cell(value) -> str:
    """A value as one Markdown table cell: a bare ``|`` would end the cell and push the rest of the row out
    (Markdown then drops the extra cells), so it is escaped; a line break would end the row, so it becomes a
    space."""
    return re.sub(r"(?<!\\)\|", r"\\|", " ".join(str(value).splitlines()))


def markdown_table(header: list, rows: list[list]) -> str:
    """A Markdown table, every cell through :func:`cell`; a row of another width than the header's raises."""
    wrong = [i for i, row in enumerate(rows) if len(row) != len(header)]
    if wrong:
        raise ValueError(f"table rows {wrong} do not have the header's {len(header)} cells")
    lines = ["| " + " | ".join(map(cell, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(cell, row)) + " |" for row in rows]
    return "\n".join(lines)


def show_table(header: list[str], rows: list[list]) -> None:
    """Display a Markdown table of computed values (every cell is formatted by the caller)."""
    from IPython.display import Markdown, display

    display(Markdown(markdown_table(header, rows)))


_DELIMITER = re.compile(r"^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$")
_FENCE = re.compile(r"^\s*(```|~~~)")


def _cells(line: str) -> list[str]:
    """A table row's cells as markdown-it splits them: at every ``|`` not escaped by a backslash."""
    from markdown_it.rules_block.table import escapedSplit

    cells = escapedSplit(line.strip())
    if cells and cells[0] == "":
        cells.pop(0)
    if cells and cells[-1] == "":
        cells.pop()
    return cells


def ragged_rows(markdown: str) -> list[str]:
    """Each row of a Markdown table in ``markdown`` whose cells are not as many as its header's."""
    lines, found, fenced, i = markdown.splitlines(), [], None, 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if fence:
            fenced = None if fenced == fence.group(1) else fenced or fence.group(1)
        elif not fenced and "|" in lines[i] and i + 1 < len(lines) and "-" in lines[i + 1] \
                and "|" in lines[i + 1] and _DELIMITER.match(lines[i + 1]):
            width = len(_cells(lines[i + 1]))
            rows = [lines[i]]
            i += 2
            while i < len(lines) and lines[i].strip() and "|" in lines[i]:
                rows.append(lines[i])
                i += 1
            found += [f"{len(_cells(row))} cells where its header has {width}: {row.strip()[:80]!r}"
                      for row in rows if len(_cells(row)) != width]
            continue
        i += 1
    return found

