"""Execute one chapter and its checks, without building the book: ``python -m helpers.tools.run_chapter 00``.

The cell timeout is the book's (``execute.timeout`` in ``_config.yml``). The executed notebook, outputs
included, is written to ``_build/chapters/`` so it can be opened afterwards; the exit status is non-zero if
any cell failed, and the failing cell's error ends the output. A bad chapter number or setting is refused in
one line, with exit status 2, before a kernel starts (``--check NN`` does only that, for ``make bench``).
Ctrl-C ends the kernel, whose ranks its janitor ends, and says ``interrupted``, with exit status 130.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

from helpers.tools.px_script import ROOT, notebook_path


def check(chapter: str) -> str:
    """The chapter's notebook, once the chapter and the book's settings are known good (else ValueError)."""
    from helpers import dist as book_dist

    path = os.path.abspath(notebook_path(chapter))
    book_dist.backend(), book_dist.collective_timeout()  # read by the ranks, refused here in one line
    return path


def main(argv: list[str]) -> int:
    only_check = argv[:1] == ["--check"]
    argv = argv[1:] if only_check else argv
    if len(argv) != 1:
        print("usage: python -m helpers.tools.run_chapter [--check] NN", file=sys.stderr)
        return 2
    try:
        path = check(argv[0])
    except ValueError as err:
        print(err, file=sys.stderr)
        return 2
    if only_check:
        return 0
    import jupytext
    import yaml
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, DeadKernelError

    with open(os.path.join(ROOT, "_config.yml")) as f:
        timeout = yaml.safe_load(f)["execute"]["timeout"]
    nb = jupytext.read(path)

    def interrupted(*_):
        # nbclient, interrupted, shuts the kernel down from inside its event loop and shows ZMQ's tracebacks
        # and its own: end the kernel (its janitor ends its ranks within half a second) and leave quietly.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        kernel = getattr(getattr(client.km, "provisioner", None), "process", None)
        if kernel is not None and kernel.poll() is None:
            kernel.kill()
            kernel.wait()
        print("interrupted", file=sys.stderr, flush=True)
        os._exit(130)

    class Client(NotebookClient):
        async def async_start_new_kernel(self, **kwargs):
            # in place of nbclient's handler
            asyncio.get_running_loop().add_signal_handler(signal.SIGINT, interrupted)
            return await super().async_start_new_kernel(**kwargs)

    os.environ["BOOK_SOLUTIONS"] = "run"  # the kernel runs the exercises' %%solution cells (exercises.py)
    client = Client(nb, timeout=timeout, kernel_name="python3",
                    resources={"metadata": {"path": os.path.dirname(path)}})
    signal.signal(signal.SIGINT, interrupted)
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
