# dtrain: `make run` trains on localhost, `make test` runs the suite; both set up .venv first.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
DTRAIN := $(VENV)/bin/dtrain
export OMP_NUM_THREADS ?= 1

.PHONY: install bytecode sysdeps test run bench bench-peers lint docs clean

install: $(VENV)/.installed

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned, so the CPU wheel on local disk is used instead of a CUDA download.
	$(PY) -m pip install -q torch==2.13.0
	# compat: a plain path entry in a .pth file. The default editable finder is a module every
	# Python process of the venv imports at start-up (~0.1 s: head, agents and ranks alike).
	# The constraint keeps torch at the CPU wheel: the dev extra's frameworks (lightning-fabric,
	# accelerate, deepspeed) accept any torch, and their builds must not fetch another one.
	echo 'torch==2.13.0' > $(VENV)/constraints.txt
	PIP_CONSTRAINT=$(VENV)/constraints.txt $(PY) -m pip install -q -e '.[dev]' \
		--config-settings editable_mode=compat
	touch $@

# Compiled modules for every Python process of a launch and of the tests (head, agents, ranks):
# pip compiles an installed package, an editable install leaves it to the first import, and where
# PYTHONDONTWRITEBYTECODE is set that writes nothing, so every process compiled every module again
# (~20 ms of a launch's head, ~0.15 s of each rank's start). Up-to-date files are skipped.
bytecode: install
	@$(PY) -m compileall -q launcher trainer bench testbed workerenv.py

# The tests start real sshd and network namespaces; as root we install what they need.
sysdeps:
	@bash testbed/install_sysdeps.sh

test: install sysdeps bytecode
	$(PY) -m pytest -q -ra --durations=15 tests

RUN_DIR ?= runs/$(shell date +%Y%m%d-%H%M%S)

run: install bytecode
	$(DTRAIN) launch --nproc-per-node 2 -- $(PY) -m trainer.train --model tiny --steps 300 \
		--log-every 25 --save-every 100 --run-dir $(RUN_DIR)
	@echo "run folder: $(RUN_DIR) (metrics.jsonl, loss.png, checkpoints/)"

bench: install sysdeps bytecode bench-peers
	$(PY) -m bench.run_all

# The peers bench/llama_step.py races (setup.cfg's bench extra: torchtitan and what it brings,
# datasets, wandb and a huggingface_hub that transformers accepts), under the same torch pin.
bench-peers: install
	@$(PY) -c "import torchtitan.models.llama3" 2>/dev/null || \
		PIP_CONSTRAINT=$(VENV)/constraints.txt $(PY) -m pip install -q -e '.[dev,bench]' \
		--config-settings editable_mode=compat

# The documentation site (MkDocs with Material) into build/site; strict: a broken link, a page
# missing from the navigation or a bad anchor fails the build. The reference pages are
# regenerated from the code first (docs/generate.py).
docs: install
	$(PY) docs/generate.py
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# ruff everywhere; mypy on what pyproject.toml's [tool.mypy] lists (strict on launcher/).
lint: install
	$(VENV)/bin/ruff check launcher trainer tests bench testbed workerenv.py docs
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) *.egg-info
