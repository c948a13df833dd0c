# kvxfer developer commands. Each target creates or updates .venv as needed.
#   make demo    the main job (README)
#   make test    every check: ruff, mypy --strict, import-linter, pytest (README, CI)
#
# The package is installed into .venv non-editably, as a user gets it: server/
# and client/ only exist as kvxfer.server / kvxfer.client after installation,
# and tests, mypy and import-linter all see that installed tree.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEPS := $(VENV)/.deps-stamp
# Checks run from a directory without a kvxfer/ source folder in it, so that
# `import kvxfer` means the installed package.
NEUTRAL := $(VENV)

.PHONY: demo test check install lint typecheck imports pytest proto clean

$(DEPS): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt ".[dev]"
	touch $@

install: $(DEPS)
	rm -rf build
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation --force-reinstall .

demo: install
	cd $(NEUTRAL) && $(CURDIR)/$(BIN)/kvxfer-cli demo

lint: $(DEPS)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

typecheck: install
	cd $(NEUTRAL) && $(CURDIR)/$(BIN)/mypy --config-file $(CURDIR)/pyproject.toml -p kvxfer

imports: install
	cd $(NEUTRAL) && $(CURDIR)/$(BIN)/lint-imports --config $(CURDIR)/pyproject.toml

pytest: install
	$(BIN)/pytest

test: lint typecheck imports pytest

check: test

proto: $(DEPS)
	PYTHON=$(BIN)/python scripts/gen_proto.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
