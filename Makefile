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
# make loadtest: USERS (a number, or a comma list for a concurrency scan), DURATION per user count,
# LOADTEST_ARGS (more run_loadtest.py flags, e.g. "--model tiny --report-dir loadtest/reports").
USERS ?= 32
DURATION ?= 60s
LOADTEST_ARGS ?=

.PHONY: serve test venv loadtest bench clean-venv

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

test: $(STAMP)
	$(BIN)/python -m pytest -q -rs $(PYTEST_ARGS)

# Starts moe-serve, runs locust headless, scrapes /metrics, plots; results in loadtest/results/<timestamp>/.
loadtest: $(STAMP)
	$(BIN)/python loadtest/load/run_loadtest.py --users $(USERS) --duration $(DURATION) $(LOADTEST_ARGS)

clean-venv:
	rm -rf $(VENV)
