"""Compare a distributed result with the single-process reference, and fail loudly.

Every claim in the book that a distributed computation equals the single-process one goes through
:func:`check_close` (a stated tolerance) or :func:`check_equal` (bit for bit). Each call

- names what it compares, prints the measured error next to the tolerance, and records the result;
- raises :class:`CheckFailed` on a mismatch, a shape or dtype difference, or a NaN/inf that the reference
  does not have; the message names the check, the rank it ran on, the error, where it is largest, and the
  tolerance.

The error measure is ``max |got - want|`` (max abs error) and that divided by ``max |want|`` (max rel error:
it is relative to the tensor's scale, so near-zero entries do not blow it up). ``check_close`` passes when
``max abs error <= atol + rtol * max |want|``.

:func:`check_shard` compares one rank's shard with its place in the full reference tensor and, on a mismatch,
says where in the reference the shard *does* fit (the usual cause: a wrong rank offset).
:func:`report` shows every check a chapter ran, on the kernel and on every rank, as one table.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

from helpers.show import cell


class CheckFailed(AssertionError):
    """A distributed result does not match its single-process reference."""

    def _render_traceback_(self) -> list[str]:
        """What IPython shows: the message (what failed and by how much), without the checks' frames."""
        from helpers.errors import full_tracebacks

        if full_tracebacks():
            import traceback

            return traceback.format_exception(self)
        return [f"CheckFailed: {self}"]


@dataclass
class CheckResult:
    name: str
    where: str  # "kernel" or "rank r"
    max_abs: float
    max_rel: float
    tolerance: str
    passed: bool


RESULTS: list[CheckResult] = []


def _where() -> str:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return f"rank {dist.get_rank()}"
    except ImportError:
        pass
    return "kernel"


def _as_tensor(x):
    import torch

    if isinstance(x, torch.Tensor):
        return x.detach()
    return torch.as_tensor(x)


def _is_text(x) -> bool:
    return isinstance(x, str) or (isinstance(x, (list, tuple)) and any(isinstance(v, str) for v in x))


def _index(flat_index: int, shape) -> tuple:
    idx = []
    for size in reversed(shape):
        idx.append(flat_index % size if size else 0)
        flat_index //= size if size else 1
    return tuple(reversed(idx))


def _fail(name: str, where: str, tolerance: str, detail: str, max_abs=math.inf, max_rel=math.inf):
    RESULTS.append(CheckResult(name, where, max_abs, max_rel, tolerance, False))
    raise CheckFailed(f"check {name!r} failed on {where}: {detail} (tolerance: {tolerance})")


def _compare(name: str, got, want, rtol: float | None, atol: float, exact: bool) -> CheckResult:
    import torch

    where = _where()
    tolerance = "exact" if exact else f"rtol={rtol:.0e}, atol={atol:.0e}"
    if _is_text(got) or _is_text(want):
        if not exact:
            raise ValueError(f"check {name!r}: text is compared with check_equal, not within a tolerance")
        if got != want:
            _fail(name, where, tolerance, f"got {got!r}, want {want!r}")
        result = CheckResult(name, where, 0.0, 0.0, tolerance, True)
        RESULTS.append(result)
        return result
    got, want = _as_tensor(got), _as_tensor(want)
    if got.shape != want.shape:
        _fail(name, where, tolerance, f"shape {tuple(got.shape)}, but the reference has {tuple(want.shape)}")
    if exact and got.dtype != want.dtype:
        _fail(name, where, tolerance, f"dtype {got.dtype}, but the reference has {want.dtype}")
    g = got.to("cpu", torch.float64)
    w = want.to("cpu", torch.float64)
    bad_got, bad_want = ~torch.isfinite(g), ~torch.isfinite(w)
    moved = bad_got != bad_want  # a NaN or inf where the reference has a finite value, or the other way round
    if bool(moved.any()) or bool((bad_got & bad_want & (g.nan_to_num() != w.nan_to_num())).any()):
        first = int(torch.nonzero(moved.flatten())[0]) if bool(moved.any()) else 0
        n_nan = int(torch.isnan(g).sum())
        _fail(name, where, tolerance,
              f"{n_nan} NaN and {int(torch.isinf(g).sum())} inf values where the reference has "
              f"{int(torch.isnan(w).sum())} NaN and {int(torch.isinf(w).sum())} inf; first difference at "
              f"index {_index(first, g.shape)}: got {g.flatten()[first].item()}, "
              f"want {w.flatten()[first].item()}")
    finite = ~bad_want
    diff = torch.where(finite, (g - w).abs(), torch.zeros_like(g))
    max_abs = float(diff.max()) if diff.numel() else 0.0
    scale = float(w[finite].abs().max()) if bool(finite.any()) else 0.0
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    if exact:
        passed = (bool(torch.equal(got.cpu(), want.cpu()))
                  or (max_abs == 0.0 and bool((bad_got == bad_want).all())))
    else:
        passed = max_abs <= atol + rtol * scale
    if not passed:
        at = int(diff.flatten().argmax()) if diff.numel() else 0
        detail = (f"max abs error {max_abs:.3e} at index {_index(at, g.shape)} "
                  f"(got {g.flatten()[at].item():.8g}, want {w.flatten()[at].item():.8g}); "
                  f"max rel error {max_rel:.3e}")
        if exact:
            detail += f"; {int((diff != 0).sum())} of {diff.numel()} elements differ"
        _fail(name, where, tolerance, detail, max_abs, max_rel)
    result = CheckResult(name, where, max_abs, max_rel, tolerance, True)
    RESULTS.append(result)
    return result


def _each(name: str, got, want, rtol, atol, exact, quiet):
    if isinstance(want, dict):
        if not isinstance(got, dict):
            _fail(name, _where(), "exact" if exact else f"rtol={rtol:.0e}",
                  f"got a {type(got).__name__}, the reference is a dict")
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        if missing or extra:
            _fail(name, _where(), "exact" if exact else f"rtol={rtol:.0e}",
                  f"keys differ from the reference: missing {missing}, unexpected {extra}")
        return [r for key in want
                for r in _each(f"{name}[{key}]", got[key], want[key], rtol, atol, exact, quiet)]
    result = _compare(name, got, want, rtol, atol, exact)
    if not quiet:
        print(f"ok  {result.name}: max abs error {result.max_abs:.2e}, max rel error {result.max_rel:.2e} "
              f"({result.tolerance})")
    return [result]


def check_close(name: str, got, want, *, rtol: float, atol: float = 0.0, quiet: bool = False) -> None:
    """``got`` equals ``want`` within ``atol + rtol * max|want|``; dicts are compared key by key.

    State ``rtol`` at the call: about 1e-6 for fp32 results that differ only by summation order.
    """
    if rtol is None or rtol < 0 or atol < 0:
        raise ValueError("check_close needs a non-negative rtol (and atol); use check_equal for exact claims")
    _each(name, got, want, rtol, atol, False, quiet)


def check_equal(name: str, got, want, *, quiet: bool = False) -> None:
    """``got`` equals ``want`` bit for bit (same shape, same dtype, same values); dicts key by key."""
    _each(name, got, want, None, 0.0, True, quiet)


def check_shard(name: str, shard, full, *, dim: int, offset: int, rtol: float | None = None,
                exact: bool = False, quiet: bool = False) -> None:
    """``shard`` equals ``full.narrow(dim, offset, len)``: one rank's piece of a tensor, in its place.

    On a mismatch, the message says at which offsets along ``dim`` the shard would have matched.
    """
    import torch

    if (rtol is None) == (not exact):
        raise ValueError("check_shard needs either rtol=... or exact=True")
    shard, full = _as_tensor(shard), _as_tensor(full)
    length = shard.shape[dim] if shard.dim() > dim else 0
    label = f"{name} (dim {dim}, offset {offset}, length {length})"
    if shard.dim() != full.dim() or offset < 0 or offset + length > full.shape[dim]:
        _fail(label, _where(), "exact" if exact else f"rtol={rtol:.0e}",
              f"a shard of shape {tuple(shard.shape)} does not fit at offset {offset} along dim {dim} "
              f"of a tensor of shape {tuple(full.shape)}")
    try:
        if exact:
            check_equal(label, shard, full.narrow(dim, offset, length), quiet=quiet)
        else:
            check_close(label, shard, full.narrow(dim, offset, length), rtol=rtol, quiet=quiet)
    except CheckFailed as err:
        fits = []
        for other in range(0, full.shape[dim] - length + 1):
            piece = full.narrow(dim, other, length).to(torch.float64)
            s = shard.to(torch.float64)
            tol = 0.0 if exact else rtol * float(piece.abs().max() if piece.numel() else 0)
            if other != offset and s.shape == piece.shape and float((s - piece).abs().max()) <= tol:
                fits.append(other)
        if fits:
            raise CheckFailed(f"{err}; the shard matches the reference at offset(s) {fits} along dim {dim}: "
                              f"is the rank's offset wrong?") from None
        raise


def worst(prefix: str) -> tuple[float, float, int]:
    """The largest max-abs and max-rel errors among this process's recorded checks named ``prefix...``, and
    how many there were: a one-line summary of many quiet checks."""
    rows = [r for r in RESULTS if r.name.startswith(prefix)]
    if not rows:
        raise CheckFailed(f"no check named {prefix!r}... was recorded")
    return max(r.max_abs for r in rows), max(r.max_rel for r in rows), len(rows)


def summarize(prefix: str) -> None:
    """Print one line for the many quiet checks whose names start with ``prefix``: how many, and the worst."""
    worst_abs, worst_rel, n = worst(prefix)
    print(f"ok  {prefix}: {n} comparisons, worst max abs error {worst_abs:.1e}, "
          f"max rel error {worst_rel:.1e}")


def check_reassembled(ranks, label: str, name: str, want: dict, *, unshard, replicated, rtol: float) -> None:
    """Pull the dict of tensors ``name`` from every rank, put the shards together with ``unshard`` (a function
    of the list of the ranks' dicts), and compare with ``want``; the tensors named in ``replicated`` must also
    be equal on every rank, bit for bit. Prints one summary line."""
    per_rank = ranks.pull(name)
    check_close(label, unshard(per_rank), want, rtol=rtol, quiet=True)
    replicated = list(replicated)
    for r in range(1, len(per_rank)):
        check_equal(f"{label}: replicated tensors equal to rank 0's, rank {r}",
                    {n: per_rank[r][n] for n in replicated}, {n: per_rank[0][n] for n in replicated},
                    quiet=True)
    worst_abs, worst_rel, _ = worst(label)
    print(f"ok  {label}: {len(want)} tensors, worst max abs error {worst_abs:.1e}, max rel error "
          f"{worst_rel:.1e} (rtol={rtol:.0e}); the {len(replicated)} replicated tensors agree bit for bit on "
          f"every rank")


def check_every_rank(ranks, label: str, name: str, want, *, rtol: float, atol: float = 0.0) -> None:
    """Pull ``name`` from every rank, check each rank's value against ``want``, and print one summary line."""
    for r, got in enumerate(ranks.pull(name)):
        check_close(f"{label}, rank {r}", got, want, rtol=rtol, atol=atol, quiet=True)
    worst_abs, worst_rel, n = worst(label)
    print(f"ok  {label}: {n} comparisons over {ranks.world_size} ranks, worst max abs error {worst_abs:.1e}, "
          f"worst max rel error {worst_rel:.1e} (rtol={rtol:.0e}, atol={atol:.0e})")


def clear() -> None:
    """Forget the recorded results (at the start of a chapter, and on each rank when ranks start)."""
    RESULTS.clear()


def _drop_failures_here(name: str) -> int:
    from helpers import checks

    before = len(checks.RESULTS)
    checks.RESULTS[:] = [r for r in checks.RESULTS if r.passed or not r.name.startswith(name)]
    return before - len(checks.RESULTS)


def confirm_failure(name: str, where: list[str], ranks=None) -> None:
    """A check broken on purpose failed exactly where it should: turn its failures into one passing row.

    ``name`` is the start of the failed check's name; ``where`` lists the places it must have failed
    (``"kernel"``, ``"rank 2"``). Raises if it failed elsewhere or nowhere, so a demonstration of a failing
    check is itself checked.
    """
    failed_at = sorted(r.where for r in collect(ranks) if not r.passed and r.name.startswith(name))
    label = f"deliberate failure: {name}"
    tolerance = "must fail on " + ", ".join(sorted(where))
    if failed_at != sorted(where):
        _fail(label, _where(), tolerance, f"it failed on {failed_at or 'no rank'}")
    _drop_failures_here(name)
    if ranks is not None and ranks.cluster is not None:
        ranks.apply(_drop_failures_here, name)
    RESULTS.append(CheckResult(label, _where(), 0.0, 0.0, tolerance, True))
    print(f"ok  {label}: failed on {', '.join(failed_at)}, as it must")


def _results_here() -> list[dict]:
    from helpers import checks

    return [asdict(r) for r in checks.RESULTS]


def collect(ranks=None) -> list[CheckResult]:
    """Every recorded check: the kernel's, then each rank's."""
    rows = list(RESULTS)
    if ranks is not None and ranks.cluster is not None:
        for per_rank in ranks.apply(_results_here):
            rows.extend(CheckResult(**r) for r in per_rank)
    return rows


def summary_table(rows: list[CheckResult]) -> str:
    """A Markdown table, one row per check with its worst error.

    Rows that differ only in a dict key (``grads[w1]``, ``grads[w2]``), a shard's placement or a ``, rank r``
    suffix are merged into one, which says how many tensors and which ranks it covers.
    """
    merged: dict[tuple[str, str], dict] = {}
    for r in rows:
        base = re.sub(r" \(dim \d+, offset \d+, length \d+\)$", "", re.sub(r"\[[^\]]*\]$", "", r.name))
        about = re.match(r"^(.*), rank (\d+)$", base)
        base = about.group(1) if about else base
        entry = merged.setdefault((base, r.tolerance), {"where": [], "max_abs": 0.0, "max_rel": 0.0,
                                                        "passed": True, "n": 0, "of_ranks": set()})
        entry["where"].append(r.where)
        entry["n"] += 1
        if about:
            entry["of_ranks"].add(int(about.group(2)))
        entry["max_abs"] = max(entry["max_abs"], r.max_abs)
        entry["max_rel"] = max(entry["max_rel"], r.max_rel)
        entry["passed"] &= r.passed
    lines = ["| check | where | comparisons | max abs error | max rel error | tolerance | pass |",
             "|---|---|---|---|---|---|---|"]
    for (name, tol), e in merged.items():
        where = _where_label(e["where"])
        if e["of_ranks"]:
            where += f" (results of {_where_label([f'rank {r}' for r in e['of_ranks']])})"
        # A check's name may hold a | (‖ΔW‖ written ||ΔW||): escaped, or the row loses its cells.
        lines.append(f"| {cell(name)} | {cell(where)} | {e['n']} | {e['max_abs']:.2e} | {e['max_rel']:.2e} | "
                     f"{cell(tol)} | {'yes' if e['passed'] else '**NO**'} |")
    return "\n".join(lines)


def family_table(rows: list[CheckResult]) -> str:
    """A Markdown table, one row per tolerance (exact, rtol=1e-06, ...): how many checks, the worst errors."""
    families: dict[str, list[CheckResult]] = {}
    for r in rows:
        families.setdefault(r.tolerance, []).append(r)
    lines = ["| tolerance | checks | max abs error | max rel error | all pass |", "|---|---|---|---|---|"]
    for tol, family in sorted(families.items(), key=lambda item: -len(item[1])):
        lines.append(f"| {cell(tol)} | {len(family)} | {max(r.max_abs for r in family):.2e} | "
                     f"{max(r.max_rel for r in family):.2e} | "
                     f"{'yes' if all(r.passed for r in family) else '**NO**'} |")
    return "\n".join(lines)


def _where_label(where: list[str]) -> str:
    ranks = sorted({int(w.split()[1]) for w in where if w.startswith("rank ")})
    parts = [w for w in dict.fromkeys(where) if not w.startswith("rank ")]
    if ranks:
        contiguous = ranks == list(range(ranks[0], ranks[-1] + 1))
        parts.append(f"ranks {ranks[0]}–{ranks[-1]}" if contiguous and len(ranks) > 1
                     else "rank " + ", ".join(map(str, ranks)))
    return ", ".join(parts)


def report(ranks=None) -> None:
    """Show the table of every check the chapter ran; raise if any failed or if there were none."""
    rows = collect(ranks)
    if not rows:
        raise CheckFailed("this chapter ran no checks")
    failed = [r for r in rows if not r.passed]
    table = summary_table(rows)
    families = family_table(rows)
    try:
        from IPython.display import Markdown, display

        # The whole table runs to hundreds of rows: the page shows the count and the families, the rows
        # fold away in a dropdown (closed until the reader opens it) whose title says how many there are.
        count = table.count("\n") - 1
        verdict = "all passed" if not failed else f"**{len(failed)} failed**"
        display(Markdown(f"**{len(rows)} checks** ran in this chapter, {verdict}; by tolerance:\n\n"
                         f"{families}\n\n"
                         f":::{{dropdown}} The table of checks: {len(rows)} checks in {count} rows\n\n"
                         f"{table}\n:::\n"))
    except ImportError:
        print(families, table, sep="\n\n")
    if failed:
        raise CheckFailed(f"{len(failed)} of {len(rows)} checks failed: " +
                          ", ".join(f"{r.name} on {r.where}" for r in failed))
