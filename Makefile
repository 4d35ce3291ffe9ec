# The two commands a new user runs: `make demo` and `make test`.
# Both create .venv here when missing and install what they need into it.
# TORCH picks the torch to install: the default is the CPU build this project is tested with;
# `make demo TORCH=` keeps whatever torch the venv already has (a CUDA build, say).
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.memfit-installed

.PHONY: demo test install clean docs

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(if $(strip $(TORCH)),$(BIN)/python -m pip install --quiet "$(TORCH)")
	$(BIN)/python -m pip install --quiet -e ".[hf,test,8bit,lightning]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/memfit demo

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=20

# docs/cli.md, the command-line reference, written from the parser (tests/test_docs.py checks it).
docs: $(STAMP)
	$(BIN)/python tools/gen_cli_docs.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
