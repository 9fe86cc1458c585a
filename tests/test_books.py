"""Whole builds: faulty notebooks fail it with their messages, the exercise machinery passes under -W."""

import os
import shutil
import subprocess
import sys

from test_ranks import book_processes, wait_until_gone

from helpers import ROOT
BOOKS = os.path.join(ROOT, "tests", "books")


def build(source: str, out: str) -> subprocess.CompletedProcess:
    """Build as `make build` does: under the reaper, through helpers.tools.build (-W -n --keep-going)."""
    cmd = [sys.executable, "-m", "helpers.tools.reap", "--", sys.executable, "-m", "helpers.tools.build",
           source, "--path-output", out]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)


def test_faulty_notebooks_fail_the_build_and_say_why(tmp_path):
    assert not book_processes()
    done = build(os.path.join(BOOKS, "faulty"), str(tmp_path))
    print(done.stdout[-4000:], done.stderr[-2000:])
    assert done.returncode != 0
    summary = done.stdout[done.stdout.index("==== the book build failed"):]

    def failed(name):
        return f"{name}.md: WARNING: Executing notebook failed" in summary

    # a mismatch raised on one rank in a %%px cell: the rank, the check and its numbers
    assert failed("1_rank_mismatch")
    assert "1_rank_mismatch.md: on rank 1: CheckFailed: check 'planted rank mismatch' failed on rank 1: " \
           "max abs error 1.500e+00" in summary
    # a failed comparison in the kernel
    assert failed("2_kernel_mismatch")
    assert "2_kernel_mismatch.md: CheckFailed: check 'planted kernel mismatch' failed on kernel: " \
           "max abs error 5.000e-01" in summary
    # one rank waiting in a collective the others never join: a bounded failure, not a hang
    assert failed("3_hung_collective")
    assert "3_hung_collective.md: on rank 0: RuntimeError:" in summary
    assert "Timed out waiting 5000ms" in summary

    # the kernel itself killed while its ranks run: this one stops the build
    assert "4_killed_kernel.md: nbclient.exceptions.DeadKernelError: Kernel died" in summary
    assert wait_until_gone(5) == [], "a faulty build left processes behind"


def test_exercise_solution_runs_at_build_time(tmp_path):
    done = build(os.path.join(BOOKS, "exercise"), str(tmp_path / "good"))
    assert done.returncode == 0, done.stdout[-4000:]
    html = open(tmp_path / "good" / "_build" / "html" / "mean_exercise.html").read()
    assert "dropdown" in html and "solution" in html
    # the reader's stub, run as shipped, gets one "not yet" line, not a traceback
    assert "not yet: `my_average` is still the stub" in html and "Traceback" not in html
    assert "the checker rejects &#39;sums without dividing&#39;" in html or \
           "the checker rejects 'sums without dividing'" in html

    # a wrong solution must fail the build: the solution really is executed and checked
    broken = tmp_path / "broken"
    shutil.copytree(os.path.join(BOOKS, "exercise"), broken)
    page = broken / "mean_exercise.md"
    page.write_text(page.read_text().replace("return sum(grads) / len(grads)", "return sum(grads)"))
    done = build(str(broken), str(tmp_path / "broken-out"))
    assert done.returncode != 0
    assert "check \"average of 4 ranks' gradients\" failed on kernel" in done.stdout


NOTEBOOK = """---
{alone}jupytext:
  text_representation: {{extension: .md, format_name: myst}}
kernelspec: {{display_name: Python 3, language: python, name: python3}}
---

# {title}

```{{code-cell}} ipython3
{code}
```
"""

# "first" holds a marker file while it runs; "second" fails if it sees one: it fails only beside "first"
HOLDS = """import os, time
open("running", "w").close()
time.sleep(4)
os.remove("running")"""
SEES = """import os, time
time.sleep(1)
assert not os.path.exists("running"), "ran beside the other notebook"
"""


def two_notebooks(book, second_alone: bool = False) -> None:
    book.mkdir()
    (book / "_config.yml").write_text("title: two at a time\nonly_build_toc_files: true\n"
                                      "execute:\n  execute_notebooks: force\n  run_in_temp: false\n")
    (book / "_toc.yml").write_text("format: jb-book\nroot: index\nchapters:\n  - file: first\n"
                                   "  - file: second\n")
    (book / "index.md").write_text("# Two notebooks\n")
    (book / "first.md").write_text(NOTEBOOK.format(title="First", code=HOLDS, alone=""))
    alone = "book: {runs_alone: true}\n" if second_alone else ""
    (book / "second.md").write_text(NOTEBOOK.format(title="Second", code=SEES, alone=alone))


def test_the_notebooks_run_two_at_a_time_and_a_load_dependent_failure_fails_the_build(tmp_path):
    from helpers.tools.build import runs_alone, toc_notebooks

    book = tmp_path / "book"
    two_notebooks(book)
    assert toc_notebooks(str(book)) == ["first.md", "second.md"]  # index.md is no notebook
    assert not runs_alone(str(book / "second.md"))
    done = build(str(book), str(tmp_path / "out"))
    assert done.returncode != 0, done.stdout[-3000:]
    out = done.stdout
    summary = out[out.index("==== the book build failed"):out.index("where the notebooks'")]
    assert "second.md: failed beside another notebook, passed alone:" in summary
    assert "ran beside the other notebook" in summary
    assert "first.md" not in summary.replace("second.md", "")  # the one that passed is not blamed
    assert not (book / "running").exists()


def test_a_notebook_that_times_itself_runs_with_no_other_beside_it(tmp_path):
    from helpers.tools.build import runs_alone

    book = tmp_path / "book"
    two_notebooks(book, second_alone=True)
    assert runs_alone(str(book / "second.md"))
    done = build(str(book), str(tmp_path / "out"))
    assert done.returncode == 0, done.stdout[-3000:]
    assert "1 that time themselves, one at a time" in done.stdout
