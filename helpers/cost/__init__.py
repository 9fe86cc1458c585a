"""The cost model: what a run holds and how long its step takes, computed, never run. Chapter 01's calculator
(shapes, the memory budget, the time model, published runs), the bytes and alpha-beta time of each collective
(02), pipeline schedules as data with their bubble and in-flight formulas (06) and the layout search (10).

Pure Python, importable without torch (the page "Try the calculator" runs it in Pyodide). It sits below
``parallel/`` and ``training/``: they may import it, it imports neither (``tests/test_imports.py``)."""
