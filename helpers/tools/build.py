"""Build a book with jupyter-book, its log ending with what failed: ``python -m helpers.tools.build [DIR]``.

The notebooks of the table of contents are executed first, ``BOOK_BUILD_JOBS`` at a time (default 2), each by
a worker process of its own, exactly as myst-nb executes them (its reader, ``single_nb_execution``, the
notebook's folder as working directory, the configuration's timeout); the longest-looking first: those that
start the most ranks, then the longest. A notebook waits on its ranks for much of its time, so one alone keeps
about one core of two busy: two at a time measured 288 s for the 13 chapters that took 463 s one after the
other, here. A notebook whose checks read the clock says so in its metadata (``book: {runs_alone: true}``) and
runs first, with no other notebook beside it. The executed notebooks go into a jupyter-cache of this build's
own, and jupyter-book then builds from a copy of ``_config.yml`` that reads them from it (``execute_notebooks:
cache``) instead of executing them again; ``_config.yml`` itself keeps ``force``, so a plain ``jupyter-book
build`` executes everything, one notebook after the other. A notebook that failed in a worker is not cached:
jupyter-book executes it again, alone, and reports it in its own words. If it passes alone, the build fails
all the same and says so: a check that depends on the machine's load is a defect.

jupyter-book prints a failing cell's traceback in the middle of a long log and ends it with "Look above for
the cause". This wrapper streams the log unchanged, and when the build fails it repeats, as the last lines,
each notebook that failed and the errors raised in it (a ``CheckFailed`` with its numbers, a rank's exception,
a timeout), and every Sphinx warning (``-W`` turns them into errors).

The engines of every notebook are forked from one server started for the whole build, or the caller's
(:mod:`helpers.forkserver`), so torch is imported once per build rather than once per rank. The build ends
with where each notebook's time went: its kernel's start, starting ranks, cells on the ranks (``%%px``),
cells that draw, and the rest (single-process runs, calculators, checks), from an IPython start-up file that
times every cell in the build's own IPython folder (``IPYTHONDIR``, temporary, removed at the end).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import yaml

from helpers import forkserver

JB_FLAGS = ("-W", "-n", "--keep-going")  # warnings (a failed notebook among them) are errors; report them all
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
NOISE = re.compile(r"Traceback \(most recent call last\)|^nbclient\.exceptions\.CellExecutionError|"
                   r"^myst_nb\.core\.execute|^RuntimeError:\s*$|^SphinxError|^Exception occurred")
EXECUTING = re.compile(r"^(\S+\.(?:md|ipynb)): Executing notebook using")
FAILED = re.compile(r"^(\S+\.(?:md|ipynb)): WARNING: Executing notebook failed")
SAVED = re.compile(r"^(\S+\.(?:md|ipynb)): WARNING: Notebook exception traceback saved")
RANK_HEADER = re.compile(r"^\[(\d+):(?:execute|apply)\]:?\s*$")
ON_RANKS = re.compile(r"^on (ranks? [\d, ]+): (.+)")  # helpers.errors' compact form of a rank's error
ERROR_LINE = re.compile(r"^(?:\[\d+:\w+\]\s*)?[A-Za-z_.]*(?:Error|Failed|Exception|Timeout\w*)\b:?.*")


def summarize(log: str) -> list[str]:
    """The lines worth repeating at the end of a failed build's log, each error with its notebook and rank."""
    errors, warnings = [], []
    # myst-nb logs "X: Executing notebook" as it starts each one, but a failed notebook's traceback only
    # later, after "X: WARNING: Executing notebook failed" and before "X: WARNING: Notebook exception
    # traceback saved". An error outside such a block (a dead kernel stops the build at once) belongs to the
    # last one started.
    started, notebook, rank = "?", "?", None
    for line in (ANSI.sub("", raw).rstrip() for raw in log.splitlines()):
        if executing := EXECUTING.match(line):
            started = notebook = os.path.relpath(executing.group(1))
            rank = None
        elif failed := FAILED.match(line):
            notebook, rank = os.path.relpath(failed.group(1)), None
            warnings.append(line)
        elif SAVED.match(line):
            notebook, rank = started, None
            warnings.append(line)
        elif header := RANK_HEADER.match(line):
            rank = header.group(1)
        elif on_ranks := ON_RANKS.match(line):
            errors.append(f"{notebook}: on {on_ranks.group(1)}: {on_ranks.group(2)}")
        elif re.search(r"(WARNING|ERROR):", line) and "Kernel is running over TCP" not in line:
            warnings.append(line)
        elif ERROR_LINE.match(line) and not NOISE.search(line):
            errors.append(f"{notebook}: " + (f"on rank {rank}: {line}" if rank is not None else line))
            rank = None
    out = [f"  {e}" for e in dict.fromkeys(errors)]
    out += [f"warning: {w}" for w in dict.fromkeys(warnings)]
    return out


# Runs in every kernel of the build: one line per cell, appended to a file of that kernel's own.
CELL_TIMER = """
def _book_cell_times():  # a function, so that nothing is left in the notebook's namespace
    import json, os, re, time

    name = f"{os.getppid()}-{time.time_ns():020d}-{os.getpid()}.jsonl"  # by parent, then by start
    path = os.path.join(os.environ["BOOK_CELL_TIMES"], name)
    started = []

    def kind(source):
        if "start_ranks(" in source:
            return "start ranks"
        if source.lstrip().startswith("%%px"):
            return "on ranks"
        if re.search(r"\\bplt\\.|\\.subplots\\(|savefig|\\bfig\\b", source):
            return "figures"
        return "single process"

    def post(result):
        seconds = time.monotonic() - started.pop()
        if started:  # a cell run inside another (%%px --local runs its body so): the outer one counts
            return
        with open(path, "a") as f:
            f.write(json.dumps([kind(result.info.raw_cell or ""), seconds]) + "\\n")

    get_ipython().events.register("pre_run_cell", lambda info: started.append(time.monotonic()))
    get_ipython().events.register("post_run_cell", post)


_book_cell_times()
del _book_cell_times
"""
KINDS = ("start ranks", "on ranks", "single process", "figures")


def breakdown(executed: list[tuple[str, int, float]], times_dir: str) -> list[str]:
    """Each notebook's seconds, split by kind of cell; the rest is its kernel's start and stop.

    ``executed`` holds (notebook, worker process id, seconds) for each notebook the workers executed; a
    kernel's cell times are in the file its start-up code named after its parent, the worker.
    """
    files = os.listdir(times_dir)
    out = [f"  {'seconds':>7}  {'kernel':>6}  " + "  ".join(f"{k:>14}" for k in KINDS) + "  notebook"]
    for notebook, worker, total in executed:
        by_kind = dict.fromkeys(KINDS, 0.0)
        for name in (f for f in files if f.startswith(f"{worker}-")):
            with open(os.path.join(times_dir, name)) as f:
                for kind, seconds in map(json.loads, f):
                    by_kind[kind] += seconds
        rest = total - sum(by_kind.values())
        out.append(f"  {total:7.1f}  {rest:6.1f}  " + "  ".join(f"{by_kind[k]:14.1f}" for k in KINDS)
                   + f"  {notebook}")
    out.append(f"  {sum(s for _, _, s in executed):7.1f}  in all")
    return out


def load_config(source: str) -> dict:
    with open(os.path.join(source, "_config.yml")) as f:
        return yaml.safe_load(f) or {}


def toc_notebooks(source: str) -> list[str]:
    """The pages of the source's _toc.yml that myst-nb executes: .ipynb files, and MyST Markdown notebooks
    (Markdown with jupytext or mystnb top-matter), as paths relative to ``source``."""
    from myst_nb.core.read import is_myst_markdown_notebook

    def files(node):
        if isinstance(node, dict):
            for key in ("root", "file"):
                if key in node:
                    yield node[key]
            for value in node.values():
                yield from files(value)
        elif isinstance(node, list):
            for value in node:
                yield from files(value)

    with open(os.path.join(source, "_toc.yml")) as f:
        toc = yaml.safe_load(f)
    found = []
    for entry in dict.fromkeys(files(toc)):
        for suffix in (".ipynb", ".md"):
            path = os.path.join(source, entry + suffix)
            if os.path.exists(path):
                if suffix == ".ipynb" or is_myst_markdown_notebook(open(path).read()):
                    found.append(entry + suffix)
                break
    return found


def read_notebook(path: str, config: dict):
    """The notebook as myst-nb reads it for the build, so that jupyter-cache's hash of it is the same."""
    import nbformat
    from myst_nb.core.read import read_myst_markdown_notebook
    from myst_parser.config.main import MdParserConfig

    text = open(path).read()
    if path.endswith(".ipynb"):
        return nbformat.reads(text, as_version=4)
    extensions = set((config.get("parse") or {}).get("myst_enable_extensions") or ())
    return read_myst_markdown_notebook(text, config=MdParserConfig(enable_extensions=extensions),
                                       add_source_map=True, path=path)


def execute_one(path: str, out: str, timeout: int) -> int:
    """In a worker process: execute one notebook as myst-nb would (its folder as working directory), write
    the executed notebook to ``out``; the exit status says whether every cell ran."""
    import nbformat
    from jupyter_cache.executors.utils import single_nb_execution

    nb = read_notebook(path, load_config(os.environ["BOOK_SOURCE"]))
    result = single_nb_execution(nb, cwd=os.path.dirname(os.path.abspath(path)), timeout=timeout,
                                 allow_errors=False, meta_override=True)
    if result.err is not None:
        print(result.exc_string, file=sys.stderr)
        return 1
    nbformat.write(result.nb, out)
    return 0


def weight(path: str) -> tuple[int, int]:
    """How long a notebook is likely to take, to start the longest first: the ranks it starts, then the size
    of its code."""
    text = open(path).read()
    ranks = [int(n) for n in re.findall(r"start_ranks\((\d+)", text)]
    return max(ranks, default=0), len(text)


def runs_alone(path: str) -> bool:
    """Whether the notebook asks to run with no other beside it (``book: {runs_alone: true}`` in its
    metadata): a page that checks what it measures by the clock, such as a pipeline's bubble."""
    return bool(read_notebook(path, {}).metadata.get("book", {}).get("runs_alone"))


def execute_all(source: str, notebooks: list[str], jobs: int, timeout: int, work: str, env: dict):
    """Execute ``notebooks`` (paths relative to ``source``), ``jobs`` at a time, each in a worker process;
    return (notebook, worker pid, seconds) of those that succeeded with their executed copies, and the failed
    ones with their error output."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    order = sorted(notebooks, key=lambda nb: weight(os.path.join(source, nb)), reverse=True)
    alone = [nb for nb in order if runs_alone(os.path.join(source, nb))]
    done, failed, lock = [], {}, threading.Lock()

    def run(i_nb):
        i, notebook = i_nb
        out = os.path.join(work, "executed", f"{i}.ipynb")
        started = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "helpers.tools.build", "--execute-one",
                                 os.path.join(source, notebook), out, str(timeout)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        output = proc.communicate()[0]
        seconds = time.monotonic() - started
        with lock:
            if proc.returncode == 0:
                done.append((notebook, proc.pid, seconds, out))
                print(f"{notebook}: executed in {seconds:.1f} s", flush=True)
            else:
                lines = (ANSI.sub("", line) for line in output.splitlines())
                failed[notebook] = [f"{notebook}: {line}" for line in lines
                                    if ERROR_LINE.match(line) or ON_RANKS.match(line)][-5:]
                print(f"{notebook}: FAILED after {seconds:.1f} s (the build will run it again, alone, and "
                      f"report it)", flush=True)

    os.makedirs(os.path.join(work, "executed"))
    numbered = list(enumerate(order))
    print(f"executing {len(order)} notebooks: {len(alone)} that time themselves, one at a time, then the "
          f"others {jobs} at a time", flush=True)
    for i_nb in numbered:
        if i_nb[1] in alone:
            run(i_nb)
    with ThreadPoolExecutor(jobs) as pool:
        list(pool.map(run, [i_nb for i_nb in numbered if i_nb[1] not in alone]))
    return done, failed


def fill_cache(cache_path: str, done, source: str) -> None:
    """Put each executed notebook into the jupyter-cache that the build then reads instead of executing."""
    import nbformat
    from jupyter_cache import get_cache
    from jupyter_cache.base import CacheBundleIn

    cache = get_cache(cache_path)
    for notebook, _, seconds, out in done:
        executed = nbformat.read(out, as_version=4)
        cache.cache_notebook_bundle(CacheBundleIn(executed, os.path.abspath(os.path.join(source, notebook)),
                                                  data={"execution_seconds": seconds}),
                                   check_validity=False, overwrite=True)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--execute-one"]:
        return execute_one(argv[1], argv[2], int(argv[3]))
    source = argv[0] if argv else "."
    jupyter_book = os.path.join(os.path.dirname(sys.executable), "jupyter-book")
    jobs = int(os.environ.get("BOOK_BUILD_JOBS", "2"))
    if jobs < 1:
        raise ValueError(f"BOOK_BUILD_JOBS={jobs}: the build needs at least one notebook at a time")
    config = load_config(source)
    started = time.monotonic()
    work = tempfile.mkdtemp(prefix="book-build-")
    try:
        startup = os.path.join(work, "ipython", "profile_default", "startup")
        os.makedirs(startup)
        with open(os.path.join(startup, "00-book-cell-times.py"), "w") as f:
            f.write(CELL_TIMER)
        os.makedirs(os.path.join(work, "times"))
        # The same configuration, but the notebooks come from a cache the workers filled (this build's own,
        # removed with it); one that failed there is executed again by jupyter-book, which reports it.
        cache_path = os.path.join(work, "jupyter_cache")
        execute = {**(config.get("execute") or {}), "execute_notebooks": "cache", "cache": cache_path}
        config_path = os.path.join(work, "_config.yml")
        with open(config_path, "w") as f:
            yaml.safe_dump({**config, "execute": execute}, f)
        cmd = [jupyter_book, "build", source, *JB_FLAGS, "--config", config_path, *argv[1:]]
        # a server already shared by the caller (a test session building a book) serves this build too
        shared = os.environ.get(forkserver.ENV)
        server = None if forkserver.reachable(shared) else forkserver.start(work).wait()
        path = shared if server is None else server.path
        env = {**os.environ, "PYTHONUNBUFFERED": "1", forkserver.ENV: path, "BOOK_SOURCE": source,
               "IPYTHONDIR": os.path.join(work, "ipython"), "BOOK_CELL_TIMES": os.path.join(work, "times"),
               "BOOK_SOLUTIONS": "run"}  # the exercises' %%solution cells run (helpers.exercises)
        try:
            notebooks = toc_notebooks(source)
            timeout = int((config.get("execute") or {}).get("timeout", 300))
            done, failed = execute_all(source, notebooks, jobs, timeout, work, env)
            fill_cache(cache_path, done, source)
            env["BOOK_EXECUTED"] = os.path.join(work, "executed.json")  # for helpers.tools.sphinx_fixes
            with open(env["BOOK_EXECUTED"], "w") as f:
                json.dump({os.path.abspath(os.path.join(source, nb)): out for nb, _, _, out in done}, f)
            executed_at = time.monotonic()
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    bufsize=1, env=env)
            lines = []
            for line in proc.stdout:
                sys.stdout.write(line)
                lines.append(line)
            status = proc.wait()
        finally:
            if server is not None:
                server.stop()
        table = breakdown([(nb, pid, s) for nb, pid, s, _ in done], os.path.join(work, "times"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    # a notebook the cache should have served but jupyter-book executed: its hash did not match
    again = sorted({os.path.relpath(m.group(1), source) for line in lines
                    if (m := EXECUTING.match(ANSI.sub("", line)))} - set(failed))
    problems = [f"{nb}: executed twice (the cache did not serve it)" for nb in again]
    if status == 0:  # what failed beside another notebook passed alone: a check that depends on the load
        problems += [f"{nb}: failed beside another notebook, passed alone:" for nb in failed]
        problems += [line for lines_ in failed.values() for line in lines_]
    elapsed = time.monotonic() - started
    if status != 0 or problems:
        status = status or 1
        print(f"\n==== the book build failed (exit status {status}, {elapsed:.0f} s) ====")
        for line in problems + summarize("".join(lines)) or ["(no error line found: read the log above)"]:
            print(line)
    else:
        print(f"book built in {elapsed:.0f} s: its {len(done)} notebooks executed {jobs} at a time in "
              f"{executed_at - started:.0f} s")
    print(f"where the notebooks' time went ({jobs} at a time, so each ran beside another; the rest of the "
          f"build is Sphinx's):")
    print("\n".join(table))
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
