# The two commands a new user runs: `make demo` and `make test`.
# Both create .venv here when missing and install what they need into it.
# TORCH picks the torch to install: the default is the CPU build this project is tested with;
# `make demo TORCH=` keeps whatever torch the venv already has (a CUDA build, say).
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.memfit-installed

.PHONY: demo test test-fast slow-list install clean docs pictures pictures-timeline pictures-snapshot pictures-bench

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# One pip run: one resolve. (Not --no-compile, though pip's byte-compiling of the ~16,000 .py
# files it installs takes about 100 CPU s: where PYTHONDONTWRITEBYTECODE=1 is set, nothing would
# ever write the .pyc files, and every worker and child would compile torch again at import.)
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet $(if $(strip $(TORCH)),"$(TORCH)") -e ".[hf,test,8bit,lightning,peft,torchtitan]"
	@# torch_remat (the [remat] extra, pure Python, a second or two) only beside a torch >= 2.10, and with
	@# --no-deps: its one requirement is torch, which must never be replaced here. Without it its tests skip.
	$(BIN)/python -c "import sys, torch; sys.exit(tuple(int(x) for x in torch.__version__.split('.')[:2]) < (2, 10))" \
	  && $(BIN)/python -m pip install --quiet --no-deps "torch_remat>=0.2.2" \
	  || echo "torch_remat left out: it needs torch >= 2.10 (tests/test_remat.py skips)"
	touch $(STAMP)

# What only the tests need beyond the install: Triton (a 285 MB wheel, about 1 GB installed), so
# that a compiled step on fake CUDA is measured as inductor's CUDA code in CI too
# (tests/test_compiled_triton.py; without it that test skips). --no-deps, pinned: its wheel has
# no requirement torch would not already meet, and torch must never be replaced here.
TEST_STAMP := $(VENV)/.memfit-test-installed
$(TEST_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet --no-deps "triton==3.9.0" \
	  || echo "triton left out (tests/test_compiled_triton.py skips its Triton test)"
	touch $(TEST_STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/memfit demo

# The test tiers (docs/architecture.md, "Test tiers"). `make test`, the full suite as CI runs it,
# is two pytest runs: every test not marked `timing` on WORKERS xdist workers (one torch thread
# each, set in tests/conftest.py), then the `timing` tests (they judge measured step times) alone
# on the machine. Both run even when the first fails; make test fails if either does.
# `make test-fast`: the inner loop, the tests marked neither `slow` nor `timing` (under 2 minutes).
WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q --durations=20

test: $(TEST_STAMP)
	@status=0; \
	echo "$(PYTEST) -n $(WORKERS) --dist loadfile --no-loadscope-reorder -m 'not timing'"; $(PYTEST) -n $(WORKERS) --dist loadfile --no-loadscope-reorder -m "not timing" || status=$$?; \
	echo "$(PYTEST) -m timing"; $(PYTEST) -m timing || status=$$?; \
	exit $$status

test-fast: $(TEST_STAMP)
	$(PYTEST) -n $(WORKERS) --dist loadfile --no-loadscope-reorder -m "not slow and not timing"

# tests/slow.txt, what `slow` means: the tests over 2 CPU seconds, measured on the whole suite.
slow-list: $(TEST_STAMP)
	rm -f .slow-cpu.tsv
	-MEMFIT_TEST_CPU=$(CURDIR)/.slow-cpu.tsv $(PYTEST) -n $(WORKERS) --dist loadfile --no-loadscope-reorder
	$(BIN)/python tools/slow_list.py .slow-cpu.tsv
	rm -f .slow-cpu.tsv

# docs/cli.md, the command-line reference, written from the parser (tests/test_docs.py checks it).
docs: $(STAMP)
	$(BIN)/python tools/gen_cli_docs.py

# The pictures under docs/assets, made by the commands the docs show.
# pictures-timeline and pictures-snapshot take a minute or two; pictures-bench runs every
# configuration of `memfit bench` in fresh processes (tens of minutes on a 2-core CPU), and its
# numbers are a new run's: docs/benchmarks/bench.md records the run those files came from.
ASSETS ?= docs/assets
pictures: pictures-timeline pictures-snapshot pictures-bench

pictures-timeline: $(STAMP)
	$(BIN)/memfit plan gpt --budget 50% --device fake --plot $(ASSETS)/timeline-gpt.png --html $(ASSETS)/timeline-gpt.html

# A synthetic GPU trace (benchmarks/timeline_render.py's synthetic_snapshot, 20,000 events),
# read by `memfit snapshot` from a temporary folder, as the page names the file it read.
pictures-snapshot: $(STAMP)
	tmp=$$(mktemp -d) && \
	PYTHONPATH=benchmarks $(BIN)/python -c "import pickle, sys, timeline_render as t; pickle.dump(t.synthetic_snapshot(20000), open(sys.argv[1], 'wb'))" $$tmp/synthetic_snapshot.pickle && \
	(cd $$tmp && $(abspath $(BIN))/memfit snapshot synthetic_snapshot.pickle --plot $(abspath $(ASSETS))/snapshot-synthetic.png --html $(abspath $(ASSETS))/snapshot-synthetic.html); \
	rc=$$?; rm -rf $$tmp; exit $$rc

pictures-bench: $(STAMP)
	$(BIN)/memfit bench gpt --json $(ASSETS)/bench-gpt.json --plot $(ASSETS)/bench-gpt.png --html $(ASSETS)/bench-gpt.html
	$(BIN)/memfit bench resnet --json $(ASSETS)/bench-resnet.json --plot $(ASSETS)/bench-resnet.png --html $(ASSETS)/bench-resnet.html
	$(BIN)/memfit bench mlp-deep --json $(ASSETS)/bench-mlp-deep.json --plot $(ASSETS)/bench-mlp-deep.png --html $(ASSETS)/bench-mlp-deep.html
	$(BIN)/memfit bench resnet152 --scenario resnet152-layer1-layer2 --json $(ASSETS)/scenario-resnet152.json
	$(BIN)/memfit bench bert-base --scenario bert-per-layer --json $(ASSETS)/scenario-bert.json

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
