# dtrain: `make run` trains on localhost, `make test` runs the suite; both set up .venv first.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
DTRAIN := $(VENV)/bin/dtrain
export OMP_NUM_THREADS ?= 1

.PHONY: install bytecode sysdeps test test-kernels run bench bench-peers lint docs clean

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
	@$(PY) -m compileall -q launcher trainer bench testbed workerenv.py records.py

# The tests start real sshd and network namespaces; as root we install what they need.
sysdeps:
	@bash testbed/install_sysdeps.sh

# The tests whose tolerances are derived from summation orders (tests/support/numerics.py):
# layouts against the single-process model, MoE, sparse embeddings, TP/PP/DP/ZeRO, resume. `make test`
# runs them again under each of KERNEL_VARIANTS, other BLAS and ATen kernels than this CPU's
# defaults, so a tolerance that holds for one instruction set only fails on any machine.
NUMERICS_TESTS := $(addprefix tests/trainer/,test_kernel_variants.py test_moe_layer.py test_model.py \
	test_llama_hf.py test_pp_runtime.py test_tp_layers.py test_sparse_embedding.py test_moe_training.py \
	test_tp_training.py test_pp_training.py test_data_parallel.py test_zero.py \
	test_resume_matrix.py test_llama_tp.py test_llama_training.py test_activations.py \
	test_recsys_training.py test_zero2.py test_zero3.py test_padded_vocab_training.py \
	test_context_parallel.py test_context_parallel_attention.py test_context_parallel_training.py \
	test_linear.py)
# What a variant changes (torch 2.13's CPU wheel: MKL for BLAS, ATen's own vector kernels):
# - MKL_CBWR=COMPATIBLE: MKL's SSE2 code path, other GEMM blocking and summation orders, on any
#   x86-64 (MKL ignores MKL_ENABLE_INSTRUCTIONS on AMD CPUs, but honours this);
# - ATEN_CPU_CAPABILITY=default: ATen's scalar kernels (sums, softmax, norms) instead of the
#   CPU's best (torch.backends.cpu.get_cpu_capability() shows the choice);
# - ONEDNN_MAX_CPU_ISA=SSE41: oneDNN's SSE4.1 kernels for the models' fp32 CPU linears
#   (trainer/model/linear.py), other blocking and summation orders than the CPU's best;
# - MKL_ENABLE_INSTRUCTIONS=AVX2 (or SSE4_2): MKL's AVX2 kernels on an Intel CPU with AVX-512.
# `make test` runs the first three together: another kernel set than the default on every CPU,
# at the cost of one more pass over NUMERICS_TESTS. More: make test-kernels KERNEL_VARIANTS='"A=1"
# "B=2 C=3"' (with MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 they pass too).
KERNEL_VARIANTS := "MKL_CBWR=COMPATIBLE ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41"
# Two workers, a file per worker: a file's MPI run is shared by its tests
# (tests/support/mpi_runs.py).
NUMERICS_WORKERS ?= 2

# Two passes: the tests that time real processes against each other (marked `alone`,
# tests/conftest.py) with the machine to themselves, the rest on TEST_WORKERS workers, a file per
# worker, as the numerics tests.
TEST_WORKERS ?= 2

test: install sysdeps bytecode
	$(PY) -m pytest -q -ra --durations=10 -n $(TEST_WORKERS) --dist loadfile -m "not alone" tests
	$(PY) -m pytest -q -ra --durations=10 -p no:cacheprovider -m alone tests
	$(MAKE) --no-print-directory test-kernels

test-kernels: install
	@for variant in $(KERNEL_VARIANTS); do \
		echo "numerics tests again with $$variant"; \
		env $$variant $(PY) -m pytest -q -ra -p no:cacheprovider -n $(NUMERICS_WORKERS) \
			--dist loadfile $(NUMERICS_TESTS) || exit 1; \
	done

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

# ruff everywhere; mypy (strict) on what pyproject.toml's [tool.mypy] lists: launcher, trainer,
# workerenv, records.
lint: install
	$(VENV)/bin/ruff check launcher trainer tests bench testbed workerenv.py records.py docs
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) *.egg-info
