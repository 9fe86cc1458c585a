"""Execute one chapter and its checks, without building the book: ``python -m helpers.tools.run_chapter 00``.

The cell timeout is the book's (``execute.timeout`` in ``_config.yml``). The executed notebook, outputs
included, is written to ``_build/chapters/`` so it can be opened afterwards; the exit status is non-zero if
any cell failed, and the failing cell's error ends the output.
"""

from __future__ import annotations

import os
import sys
import time

import jupytext
import yaml
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, DeadKernelError

from helpers.tools.px_script import ROOT, notebook_path


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m helpers.tools.run_chapter NN", file=sys.stderr)
        return 2
    path = os.path.abspath(notebook_path(argv[0]))
    with open(os.path.join(ROOT, "_config.yml")) as f:
        timeout = yaml.safe_load(f)["execute"]["timeout"]
    nb = jupytext.read(path)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": os.path.dirname(path)}})
    out_dir = os.path.join(ROOT, "_build", "chapters")
    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(out_dir, os.path.basename(path)[:-3] + ".ipynb")
    started = time.monotonic()
    status = 0
    try:
        client.execute()
    except (CellExecutionError, DeadKernelError) as err:
        print(err, file=sys.stderr)
        status = 1
    finally:
        jupytext.write(nb, out, fmt="ipynb")
    verdict = "failed" if status else "passed"
    print(f"{os.path.relpath(path, ROOT)}: {verdict} in {time.monotonic() - started:.1f} s; "
          f"executed notebook: {os.path.relpath(out, ROOT)}")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
