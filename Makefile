# Two commands: `make demo` and `make test`. Both work on a fresh clone.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_HOME ?= .skiff-demo

.PHONY: demo test install system-deps lint check-protos protos bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

install: $(STAMP)

demo: install
	rm -rf $(DEMO_HOME)
	$(BIN)/skiff demo --home $(DEMO_HOME)

test: install system-deps lint check-protos
	$(BIN)/python -m pytest

# Tools the tests drive from outside Python (Debian packages).
system-deps:
	@command -v strace >/dev/null || { apt-get update -qq && apt-get install -y -qq strace; }

lint: install
	$(BIN)/ruff check .

# Regenerating the committed protos must change nothing.
check-protos: install
	PATH=$(CURDIR)/$(BIN):$$PATH ./scripts/gen_protos.sh
	git diff --exit-code -- protos/ || (echo "protos/ is stale: run make protos and commit" >&2; exit 1)

protos: install
	PATH=$(CURDIR)/$(BIN):$$PATH ./scripts/gen_protos.sh

bench: install
	$(BIN)/python bench/registry.py --quick

clean:
	rm -rf $(VENV) $(DEMO_HOME) .pytest_cache .ruff_cache
