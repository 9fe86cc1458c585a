# The distributed training handbook: one command to set up, build and check everything.
#
#   make build         create .venv if needed, execute every notebook, build the HTML into _build/html
#   make test          the linter, the unit tests and the faulty-notebook tests, beside the full book build with
#                      warnings as errors followed by the browser test of the built pages (skipped, loudly, where
#                      no Chromium is installed)
#   make browser       the browser test alone, on the book `make build` built
#   make chapter CH=00 execute and check one chapter (fast feedback while reading or writing)
#   make torchrun CH=00 NPROC=4   run a chapter's %%px cells as a script under torchrun
#   make bench         the from-scratch code against PyTorch's, side by side, as ratios (CH=NN: one chapter's rows)
#   make gpu-check     every chapter on BOOK_BACKEND's backend, one rank per GPU under nccl, as a table of chapter,
#                      ranks, result and seconds (CH="03 04": those chapters)
#   make lab           JupyterLab on the notebooks, with jupytext pairing
#   make sync          write each notebook's .ipynb pair from its .md (and back, whichever is newer), refusing
#                      a pair whose .md has an edit its newer .ipynb never saw
#   make clean         remove _build and the .ipynb pairs
#
# BOOK_BACKEND=nccl switches every chapter to nccl/cuda (one rank per GPU); the default is gloo/cpu.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
NPROC ?= 4
CH ?= 00

# Every command that may start ranks runs under the reaper: whatever it leaves alive is ended.
REAP := $(PY) -m helpers.tools.reap --

# show_source puts module lines on the page, which shows about 110 columns: the linter holds helpers/ and
# tests/ to that, and to pycodestyle's errors and warnings and pyflakes (E, W, F). --no-cache: a run leaves
# no .ruff_cache behind.
LINT := $(VENV)/bin/ruff check --no-cache --line-length 110 --select E,F,W helpers tests

.PHONY: build test unit browser build-and-browser chapter torchrun bench lab sync clean venv

venv: $(STAMP)

# The .pth file makes helpers/ importable from the kernels, the engines and torchrun's workers, wherever
# they start.
$(STAMP): requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt
	echo "$(CURDIR)" > "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/handbook.pth"
	touch $(STAMP)

# A clean build every time: an incremental build skips unchanged pages and would not re-execute them.
build: $(STAMP)
	rm -rf _build
	$(REAP) $(PY) -m helpers.tools.build .
	@echo "HTML: _build/html/index.html"

unit: $(STAMP)
	$(LINT)
	$(REAP) $(PY) -m pytest -q tests --ignore=tests/browser $(if $(LANE),--ignore=$(LONG_TESTS))

# What make test leaves out to stay under 15 minutes on two cores, and make unit runs: chapter 15 as two
# nodes of 8 ranks (two minutes; the multi-node path itself is test_multinode.py's, on chapter 00, and the
# chapter's cells run at every build).
LONG_TESTS := tests/test_multinode_capstone.py

# Headless Chromium opens every built page offline at 1280 and 390 px (helpers/tools/browser_check.py).
BROWSER_TEST := $(REAP) $(PY) -m pytest -q -rs tests/browser
browser: $(STAMP)
	$(BROWSER_TEST)

# The unit tests beside the book build and then the browser test of that build: on two cores each keeps
# about one busy (notebooks and tests wait on their ranks). --output-sync prints each one's output whole as it
# ends.
test: $(STAMP)
	$(MAKE) --no-print-directory -j2 --output-sync=target unit build-and-browser LANE=1

build-and-browser: build
	$(BROWSER_TEST)

chapter: $(STAMP)
	$(REAP) $(PY) -m helpers.tools.run_chapter $(CH)

torchrun: $(STAMP)
	$(REAP) $(PY) -m helpers.tools.px_script $(CH) --nproc $(NPROC)

# Only CH given on the command line picks one chapter's rows; without it, every row. A CH that is no chapter
# is refused in one line first (run_chapter --check), as make chapter and make torchrun refuse it.
bench: $(STAMP)
	$(if $(filter command line,$(origin CH)),@$(PY) -m helpers.tools.run_chapter --check '$(CH)')
	$(REAP) $(PY) -m helpers.tools.bench $(if $(filter command line,$(origin CH)),--chapter $(CH))

# Every chapter (CH given on the command line: those) as make chapter runs it, on BOOK_BACKEND's backend;
# under nccl a chapter needing more ranks than there are GPUs is skipped, its reason in its row
# (helpers/tools/gpu_check.py).
.PHONY: gpu-check
gpu-check: $(STAMP)
	$(REAP) $(PY) -m helpers.tools.gpu_check $(if $(filter command line,$(origin CH)),'$(CH)')

# The .md is the source: jupytext's newest-wins rule alone would let a stale .ipynb saved after an edit of the
# .md (JupyterLab's autosave) overwrite that edit (helpers/tools/sync.py).
sync: $(STAMP)
	$(PY) -m helpers.tools.sync notebooks/[0-9][0-9]_*.md

lab: sync
	$(VENV)/bin/jupyter lab --ServerApp.ip=127.0.0.1 $(if $(filter 0,$(shell id -u)),--allow-root) notebooks

clean:
	rm -rf _build notebooks/*.ipynb notebooks/.ipynb_checkpoints

# Chapter 01's calculator on the command line (helpers/cost/calculator.py), e.g.
#   make calc ARGS="--model llama3-70b --gpus 64 --tp 8 --pp 4"     (ARGS="--help": every flag)
.PHONY: calc
calc: $(STAMP)
	@$(PY) -m helpers.cost.calculator $(ARGS)
