"""Mark every process this test session starts, so the tests can tell its leftovers from anyone else's."""

import os
import uuid

os.environ.setdefault("BOOK_TEST_RUN", uuid.uuid4().hex)
