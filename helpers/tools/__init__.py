"""What only ``make`` runs: the book build, one chapter's run, the torchrun export, the reaper, the Sphinx
fixes and the browser test. What a notebook's kernel runs (the janitor :mod:`helpers.ranks` starts) lives
above, in ``helpers/``."""
