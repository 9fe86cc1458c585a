"""What the tests of every parallelism share, and a mark on every process this test session starts, so the
tests can tell its leftovers from anyone else's. Every engine the session starts, in a test or in a book a
test builds, is forked from one server started for the session (helpers.forkserver), as the book's build does.

- the ``ranks`` and ``eight`` fixtures: two ranks, or eight (a 2 x 2 x 2 mesh), for one test module;
- :func:`small_config`: the small GPT the two-rank tests run, changed where a test needs it;
- :func:`seeded_batch`: a global batch of random tokens, the same in this process and on every rank;
- :func:`assert_close_to_scale`: tensors equal to a reference within ``rtol`` of each tensor's largest entry,
  the tolerance every two-rank test states;
- :func:`myst_notebook`: a tiny notebook's text, the chapters' jupytext header and its code cells.

The functions are plain, so a module can use them in its parametrisations: ``from conftest import ...``
(pytest puts ``tests/`` on the path, as the folder is no package).
"""

import os
import uuid

import pytest
import torch

from helpers.model import GPTConfig

os.environ.setdefault("BOOK_TEST_RUN", uuid.uuid4().hex)  # before the server starts: it carries the mark


def pytest_configure(config):
    from helpers import forkserver

    if not forkserver.reachable(os.environ.get(forkserver.ENV)):
        config.book_forkserver = forkserver.start().wait()
        os.environ[forkserver.ENV] = config.book_forkserver.path
        os.environ["BOOK_FORKSERVER_PID"] = str(config.book_forkserver.process.pid)


def pytest_unconfigure(config):
    server = getattr(config, "book_forkserver", None)
    if server is not None:
        server.stop()


@pytest.fixture(scope="module")
def ranks():
    """Two ranks for one test module; test_ranks.py has its own, which also checks that nothing is left."""
    from helpers.ranks import start_ranks

    r = start_ranks(2, timeout_s=20, activate=False)
    yield r
    r.stop()


@pytest.fixture(scope="module")
def eight():
    """Eight ranks for one test module: the meshes of chapter 10."""
    from helpers.ranks import start_ranks

    r = start_ranks(8, timeout_s=30, activate=False)
    yield r
    r.stop()


@pytest.fixture(scope="module")
def sixteen():
    """Sixteen ranks for one test module: chapter 15's five-dimensional run (a long collective timeout: 16
    ranks share two cores)."""
    from helpers.ranks import start_ranks

    r = start_ranks(16, timeout_s=120, activate=False)
    yield r
    r.stop()


def small_config(**changes) -> GPTConfig:
    """Two layers of d_model 32, four query heads over two KV heads: every degree 2 divides what it must, and
    a step takes milliseconds on two ranks."""
    base = dict(vocab_size=16, seq_len=8, n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64)
    return GPTConfig(**{**base, **changes})


def seeded_batch(cfg: GPTConfig, rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets, ``rows`` sequences of random tokens drawn from one seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.vocab_size, (rows, cfg.seq_len), generator=gen)
    y = torch.randint(0, cfg.vocab_size, (rows, cfg.seq_len), generator=gen)
    return x, y


def assert_close_to_scale(got: dict, want: dict, rtol: float, what: str = "") -> None:
    """The same names, and each tensor within ``rtol * max |want|`` of the reference: relative to the
    tensor's scale, so near-zero entries do not decide. The message names the tensor and the error."""
    assert sorted(got) == sorted(want), f"{what}: names differ"
    for name, w in want.items():
        g = got[name]
        assert g.shape == w.shape, f"{what} {name}: shape {tuple(g.shape)}, want {tuple(w.shape)}"
        if not w.numel():
            continue
        error, scale = (g - w).abs().max().item(), w.abs().max().item()
        assert error <= rtol * scale, f"{what} {name}: max abs error {error:.3e} > {rtol:.0e} x {scale:.3e}"


NOTEBOOK_HEADER = """\
---
jupytext:
  text_representation:
    extension: .md
    format_name: myst
kernelspec:
  display_name: Python 3
  language: python
  name: python3
---
"""


def myst_notebook(*cells: str) -> str:
    """A MyST notebook as the chapters are written: the jupytext header, then each cell's code as a code
    cell (a cell starting ``%%px`` runs on the ranks)."""
    return NOTEBOOK_HEADER + "".join(f"\n```{{code-cell}} ipython3\n{code.strip()}\n```\n" for code in cells)
