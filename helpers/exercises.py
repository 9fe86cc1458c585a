"""Exercise checkers that are themselves checked.

A chapter's exercise has three parts on the page: the task (a ``{exercise}`` directive), a *checker* (a
function that runs an answer against the single-process reference through :mod:`helpers.checks` and raises
``CheckFailed`` with a message that says what is wrong), and a solution inside ``{solution-start}`` /
``{solution-end}`` with ``:class: dropdown``, which the build executes. The chapter then calls :func:`verify`:

    verify("ring all-reduce", checker, solution=ring_all_reduce,
           wrong={"reduces in the wrong order": wrong_order, "skips a chunk": missing_chunk})

which runs the checker on the solution (it must pass) and on each known-wrong answer (each must be rejected).
A checker that accepts a wrong answer fails the build, so a reader can trust a checker that says "correct".
"""

from __future__ import annotations

import contextlib
import io
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
