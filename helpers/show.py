"""Show the code a chapter teaches, from the module that runs it, and tables of computed values.

A chapter's implementation lives in one small module under ``helpers/`` (one file per idea, as in picotron);
the chapter walks through it with ``show_source(fn)``, which prints the function's or class's own source as a
highlighted code block. What the page shows is therefore exactly what the ranks run.
"""

from __future__ import annotations

import inspect
import textwrap


def show_source(*objects) -> None:
    """Display the source of each function or class, one code block each, with the file it lives in."""
    from IPython.display import Markdown, display

    for obj in objects:
        source = textwrap.dedent(inspect.getsource(obj)).rstrip()
        module = inspect.getmodule(obj)
        where = module.__name__.replace(".", "/") + ".py" if module else "?"
        display(Markdown(f"`{where}`\n\n```python\n{source}\n```"))


def show_table(header: list[str], rows: list[list]) -> None:
    """Display a Markdown table of computed values (every cell is formatted by the caller)."""
    from IPython.display import Markdown, display

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    display(Markdown("\n".join(lines)))
