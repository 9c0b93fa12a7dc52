# Two commands do all the set-up on a fresh machine:
#   make serve   # creates .venv on first use, then serves the embedded tiny MoE model
#   make test    # creates .venv on first use, then runs the whole test suite
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip --disable-pip-version-check
STAMP := $(VENV)/.installed
ARGS ?=
PYTEST_ARGS ?=
# pytest-xdist workers (one file per worker at a time: module fixtures stay shared); 1 for a serial run.
TEST_WORKERS ?= logical
# make loadtest: USERS (a number, or a comma list for a concurrency scan), DURATION per user count,
# LOADTEST_ARGS (more run_loadtest.py flags, e.g. "--model tiny --report-dir loadtest/reports").
USERS ?= 32
DURATION ?= 60s
LOADTEST_ARGS ?=

.PHONY: serve test venv browser loadtest bench clean-venv

venv: $(STAMP)

# Re-installs only when a dependency file changes; quick otherwise.
$(STAMP): requirements.txt requirements-dev.txt constraints.txt pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade "pip>=24"
	$(PIP) install -q --no-deps nvidia-pytriton==0.7.0
	$(PIP) install -q -c constraints.txt -r requirements-dev.txt
	$(PIP) install -q --no-deps --no-build-isolation -e .
	@touch $@

serve: $(STAMP)
	$(BIN)/moe-serve $(ARGS)

test: $(STAMP) browser
	$(BIN)/python -m pytest -q -rs -n $(TEST_WORKERS) --maxprocesses 4 --dist loadfile $(PYTEST_ARGS)

# The dashboard's test (tests/integration/test_expert_load.py) drives a real headless browser: Debian's chromium,
# installed here when missing and run as root (CI is); elsewhere the test says how to install it and is skipped.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing Debian's chromium for the dashboard's browser test"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else echo "chromium not found and not root: the dashboard's browser test will be skipped"; fi

# Starts moe-serve, runs locust headless, scrapes /metrics, plots; results in loadtest/results/<timestamp>/.
loadtest: $(STAMP)
	$(BIN)/python loadtest/load/run_loadtest.py --users $(USERS) --duration $(DURATION) $(LOADTEST_ARGS)

clean-venv:
	rm -rf $(VENV)
