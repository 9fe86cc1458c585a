"""Shared fixtures, and a mark on every process this test session starts, so the tests can tell its leftovers
from anyone else's."""

import os
import uuid

import pytest

os.environ.setdefault("BOOK_TEST_RUN", uuid.uuid4().hex)


@pytest.fixture(scope="module")
def ranks():
    """Two ranks for one test module; test_ranks.py has its own, which also checks that nothing is left."""
    from helpers.ranks import start_ranks

    r = start_ranks(2, timeout_s=20, activate=False)
    yield r
    r.stop()
