"""Exercise checkers that are themselves checked.

A chapter's exercise has three parts on the page: the task (a ``{exercise}`` directive), a *checker* (a
function that runs an answer against the single-process reference through :mod:`helpers.checks` and raises
``CheckFailed`` with a message that says what is wrong), and a solution inside ``{solution-start}`` /
``{solution-end}`` with ``:class: dropdown``, which the build executes. The chapter then calls :func:`verify`:

    verify("ring all-reduce", checker, solution=ring_all_reduce,
           wrong={"reduces in the wrong order": wrong_order, "skips a chunk": missing_chunk})

which runs the checker on the solution (it must pass) and on each known-wrong answer (each must be rejected).
A checker that accepts a wrong answer fails the build, so a reader can trust a checker that says "correct".

Where the reader works, the exercise has four cells (``book/exercises.md`` shows them):

- a *starter* cell: the function to write, as a stub that raises ``NotImplementedError``;
- a *check my answer* cell, ``exercises.check("name", checker, my_answer)``, which prints ``correct: ...`` or
  one line ``not yet: ...`` (a stub, a wrong value, an exception of the answer's own), never a traceback, and
  leaves nothing in the chapter's table of checks;
- the checker itself, shown on the page;
- the reference solution, in the ``{solution-start}`` dropdown, in cells that start with ``%%solution``: the
  cell magic below runs them only when ``BOOK_SOLUTIONS=run`` is set (the build and ``make chapter`` set it;
  ``%env BOOK_SOLUTIONS=run`` in JupyterLab asks for it), and the reference is bound to its own name
  (``reference_...``), so running every cell never overwrites the reader's answer.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import threading
from typing import Callable

from helpers.checks import RESULTS, CheckFailed, CheckResult, _where


def _speaks() -> bool:
    """Whether this process prints: the kernel, or rank 0 when every rank runs the exercise (``%%px``)."""
    try:
        import torch.distributed as dist
    except ImportError:
        return True
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def verify(exercise: str, checker: Callable, *, solution, wrong: dict[str, object],
           reasons: dict[str, str] | None = None) -> None:
    """The checker accepts ``solution`` and rejects every answer in ``wrong`` (label -> answer).

    ``reasons`` (label -> words): the rejection of that answer must say these words, so that a checker which
    rejects it for another mistake's reason (a probe that fires first) fails the build.

    On ranks, only rank 0 prints (the page would otherwise show every line once per rank); every rank still
    runs the checker, and a rank whose checker fails raises.
    """
    if not wrong:
        raise ValueError(f"exercise {exercise!r}: give at least one wrong answer the checker must reject")
    quiet = contextlib.nullcontext() if _speaks() else contextlib.redirect_stdout(io.StringIO())
    with quiet:
        checker(solution)
        for label, answer in wrong.items():
            before = len(RESULTS)
            try:
                checker(answer)
            except CheckFailed as err:
                if reasons and label in reasons and reasons[label] not in str(err):
                    raise CheckFailed(f"exercise {exercise!r}: the checker rejected '{label}' with another "
                                      f"mistake's message (expected {reasons[label]!r}): {err}") from None
                # the planted failure is expected: keep one passing row instead of the failed ones
                del RESULTS[before:]
                RESULTS.append(CheckResult(f"exercise {exercise}: rejects '{label}'", _where(), 0.0, 0.0,
                                           "must reject", True))
                print(f"ok  the checker rejects '{label}': {str(err).splitlines()[0][:160]}")
                continue
            raise CheckFailed(f"exercise {exercise!r}: the checker accepted a wrong answer ('{label}')")


@contextlib.contextmanager
def calls_to(*functions):
    """Count the calls made inside the block to each of ``functions`` (Python functions, by name), whatever
    name the caller reached them by (an alias, ``from ... import``): a profile hook matches their code.

    A checker uses it to notice that the chapter's own function did the work the reader was asked to write.
    """
    codes = {f.__code__: f.__name__ for f in functions}
    counts = dict.fromkeys(codes.values(), 0)

    def hook(frame, event, arg):
        if event == "call" and frame.f_code in codes:
            counts[codes[frame.f_code]] += 1

    previous = sys.getprofile()
    sys.setprofile(hook)
    threading.setprofile(hook)
    try:
        yield counts
    finally:
        sys.setprofile(previous)
        threading.setprofile(None)


def solutions_run() -> bool:
    """Whether ``%%solution`` cells run: in the build and ``make chapter`` (``BOOK_SOLUTIONS=run``), and where
    the reader asked for them (``%env BOOK_SOLUTIONS=run``); read at each cell, so asking works at once."""
    return os.environ.get("BOOK_SOLUTIONS", "") == "run"


def _verdict(exercise: str, checker: Callable, answer) -> str | None:
    """None when the checker accepts ``answer``, else the one line that says why not."""
    name = getattr(answer, "__name__", "your answer")
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            checker(answer)
    except NotImplementedError:
        return f"`{name}` is still the stub (it raises NotImplementedError): write it in the cell above"
    except CheckFailed as err:
        text = str(err).splitlines()[0] if str(err) else "the checker rejected it"
        if "NotImplementedError" in text:  # a checker that turned the stub's exception into a CheckFailed
            return f"`{name}` is still the stub (it raises NotImplementedError): write it in the cell above"
        return text[:300]
    except Exception as err:  # the answer's own bug: a short line, not a traceback
        return f"`{name}` raised {type(err).__name__}: {str(err).splitlines()[0][:240] if str(err) else ''}"
    return None


def check(exercise: str, checker: Callable, answer) -> bool:
    """Run ``checker`` on the reader's ``answer`` and print ``correct: ...`` or ``not yet: ...`` in one line.

    Never raises for a wrong answer (a stub run as shipped gets "not yet", so the page and "run all" go on),
    and the checker's rows are taken out of the chapter's table of checks, which holds only what the chapter
    itself claims. On ranks every rank runs the checker; the verdict is rank 0's unless another rank objects,
    and only rank 0 prints it.
    """
    before = len(RESULTS)
    problem = _verdict(exercise, checker, answer)
    del RESULTS[before:]
    try:
        import torch.distributed as dist

        ranks = dist.is_available() and dist.is_initialized()
    except ImportError:
        ranks = False
    if ranks:
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
        problem = next((f"{p} (rank {r})" if r else p for r, p in enumerate(problems) if p), None)
    if _speaks():
        print(f"correct: the checker accepts your answer to '{exercise}'" if problem is None
              else f"not yet: {problem}")
    return problem is None


def _solution_magic(line: str, cell: str) -> None:
    """``%%solution``: run the cell (magics such as ``%%px`` included) only when solutions are asked for."""
    if not solutions_run():
        print("The reference solution did not run, so it cannot touch your answer; `%env BOOK_SOLUTIONS=run` "
              "and this cell again run it (it defines reference_... names and checks them).")
        return
    from IPython import get_ipython

    shell = get_ipython()
    code = shell.transform_cell(cell)
    # cached like any cell's code, so inspect.getsource works on what the solution defines
    filename = shell.compile.cache(code, shell.execution_count, raw_code=cell)
    exec(compile(code, filename, "exec"), shell.user_ns)


def _register() -> None:
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is not None and hasattr(shell, "register_magic_function"):
        shell.register_magic_function(_solution_magic, magic_kind="cell", magic_name="solution")


_register()
