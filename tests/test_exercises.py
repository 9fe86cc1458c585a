"""The exercise machinery (helpers/exercises.py) and every chapter's exercise cells, with no chapter run.

- ``exercises.check`` turns a stub, a wrong answer and an answer that raises into one ``not yet`` line, an
  accepted answer into ``correct``, and leaves nothing in the table of checks;
- ``exercises.calls_to`` sees a function called under another name;
- every chapter's exercise has a stub that raises NotImplementedError, a cell that checks the reader's
  answer with ``exercises.check``, and solution cells that start with ``%%solution`` (tagged ``solution``,
  collapsed in JupyterLab) and define none of the names the reader writes.
"""

import ast
import glob
import os
import re

import jupytext
import pytest

from helpers import ROOT, exercises
from helpers.checks import RESULTS, check_equal


def checker(answer):
    check_equal("exercise: twice 21", answer(21), 42)


def test_check_says_not_yet_for_a_stub_a_wrong_answer_and_an_exception_and_correct_for_a_right_one(capsys):
    def my_double(x):
        raise NotImplementedError("write my_double")

    before = list(RESULTS)
    assert not exercises.check("double", checker, my_double)
    assert capsys.readouterr().out == ("not yet: `my_double` is still the stub (it raises "
                                       "NotImplementedError): write it in the cell above\n")
    assert not exercises.check("double", checker, lambda x: x + x + 1)
    out = capsys.readouterr().out
    assert out.startswith("not yet: check 'exercise: twice 21' failed on kernel"), out
    assert out.count("\n") == 1, out
    assert not exercises.check("double", checker, lambda x: x / 0)
    assert capsys.readouterr().out == "not yet: `<lambda>` raised ZeroDivisionError: division by zero\n"
    assert exercises.check("double", checker, lambda x: 2 * x)
    assert capsys.readouterr().out == "correct: the checker accepts your answer to 'double'\n"
    assert RESULTS == before, "check left rows in the chapter's table of checks"


def test_calls_to_sees_a_function_under_another_name():
    from helpers.parallel import data_parallel
    from helpers.parallel.data_parallel import build_buckets as renamed

    with exercises.calls_to(data_parallel.build_buckets) as used:
        renamed([], 1)
    assert used == {"build_buckets": 1}
    with exercises.calls_to(data_parallel.build_buckets) as used:
        pass
    assert used == {"build_buckets": 0}


def test_torchrun_runs_the_solutions():
    from helpers.tools.px_script import px_cells

    cells = px_cells(os.path.join(ROOT, "notebooks", "02_collectives.md"))
    assert any(c.startswith("def reference_ring_all_reduce") for c in cells)
    assert not any("%%solution" in c for c in cells)


def test_solution_cells_run_only_when_asked(monkeypatch):
    monkeypatch.delenv("BOOK_SOLUTIONS", raising=False)
    assert not exercises.solutions_run()
    monkeypatch.setenv("BOOK_SOLUTIONS", "run")
    assert exercises.solutions_run()


CHAPTERS = sorted(p for p in glob.glob(os.path.join(ROOT, "notebooks", "[0-9][0-9]_*.md"))
                  if "{exercise}" in open(p).read())
DEFINED = re.compile(r"^(?:def|class) (\w+)", re.M)


@pytest.mark.parametrize("path", CHAPTERS, ids=[os.path.basename(p)[:2] for p in CHAPTERS])
def test_every_exercise_has_a_stub_a_check_cell_and_a_solution_that_runs_when_asked(path):
    text = open(path).read()
    start, end = text.index("```{solution-start}"), text.index("```{solution-end}")
    cells = [c for c in jupytext.read(path).cells if c.cell_type == "code"]
    solution = [c for c in cells if c.source.startswith("%%solution")]
    assert solution, "no %%solution cell"
    for c in solution:
        assert "solution" in c.metadata.get("tags", []) and c.metadata.get("jupyter", {}).get("source_hidden")
    # every code cell of the dropdown is a %%solution cell, and none is outside it
    inside = text[start:end]
    assert inside.count("```{code-cell}") == inside.count("\n%%solution\n") == len(solution)
    stubs = [c for c in cells if "raise NotImplementedError" in c.source and c not in solution]
    assert stubs, "no stub for the reader's answer"
    written = {name for c in stubs for name in DEFINED.findall(c.source)}
    checks = [c for c in cells if "exercises.check(" in c.source]
    assert checks and any(name in c.source for c in checks for name in written), "no cell checks the answer"
    defined = {name for c in solution for name in DEFINED.findall(c.source)}
    assert not defined & written, f"the solution overwrites the reader's {defined & written}"
    for c in stubs + checks:
        body = "\n".join(line for line in c.source.splitlines() if not line.startswith("%"))
        ast.parse(body)
