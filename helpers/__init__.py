"""The book's code: the harness every chapter uses and what every chapter builds on, at this level;
``parallel/`` (what talks between ranks, chapters 02-08), ``training/`` (chapters 09 and 11-15) and ``tools/``
(what only ``make`` runs) below it."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository, defined here only
