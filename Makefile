# shardkit — every set-up step lives here, so a fresh machine needs only `make test` or `make demo`.
#
#   make test        apt deps + .venv (torch 2.13.0 CPU) + build, then GoogleTest (ctest), pytest and make lint
#   make lint        ruff (python/, tests/, benchmarks/, examples/) and mypy on the package (pyproject.toml's settings)
#   make matrix      every front x setting x entry point combination (make test runs the pairwise cover)
#   make demo        same set-up, then the estimator, a GPT trained under shardkit.auto and under DDP, collectives
#   make cuda-check  .venv-cuda (torch 2.14.1, CUDA 13) + the CUDA extension compiled, linked and imported
#   make gpu-test    on a GPU machine, with its own torch: the CUDA build, the tests marked cuda, the GPU benchmark
#   make bench       the benchmarks under benchmarks/ (results in benchmarks/results/)
#   make bench-peers .venv-peers (torch 2.13.0 CPU + DeepSpeed from PyPI, no shardkit), then shardkit's allreduce
#                    against DeepSpeed's CPU shm allreduce (benchmarks/collectives.py --peer deepspeed)
#   make peer-test   torch's own distributed_test.py on gloo and on shardkit side by side (tests/peer/)
#   make chaos       kill-and-restart cycles under real torchrun (tests/chaos/; not part of make test: many minutes)
#   make torchft     every case of training through a death under torchft (make test runs three of the seven)
#   make clean-venv-check  the wheel installed into a venv holding only torch (no numpy), examples run there

PYTHON       ?= python3
VENV         := .venv
VENV_CUDA    := .venv-cuda
VENV_PEERS   := .venv-peers
DEEPSPEED    := deepspeed==0.19.8
TORCH_CPU    := torch==2.13.0
TORCH_CUDA   := torch==2.14.1
PIP_FLAGS    := --disable-pip-version-check -q
LINT_DEPS    := ruff==0.17.6 mypy==2.4.1
# torchft: tests/python/test_torchft*.py (its Rust Lighthouse ships in the wheel and is started in-process);
# ray[train]: tests/python/test_ray_train.py (a local cluster started by the test)
BUILD_DEPS   := ninja 'setuptools>=77' wheel numpy
TEST_DEPS    := pytest pytest-timeout $(BUILD_DEPS) transformers==5.23.0 accelerate==1.15.0 lightning==2.6.6 matplotlib==3.11.2 torchft==0.2.0 'ray[train]==2.60.0' $(LINT_DEPS)
# iproute2 (ip netns, veth) and util-linux (unshare): the namespace hosts of tests/python/test_two_hosts.py
APT_PACKAGES := libgtest-dev cmake ninja-build g++ iproute2 util-linux
BUILD_CPP    := build/cpp
# torch guesses CUDA_HOME from nvcc's path, which a wrapper script in /usr/local/bin defeats.
CUDA_HOME    ?= $(if $(wildcard /usr/local/cuda/include/cuda_runtime.h),/usr/local/cuda)
# Compiling torch extensions takes ~2 GB per job; the machines here have 2 cores.
export MAX_JOBS ?= 2
CSRC := $(shell find csrc -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' 2>/dev/null) setup.py pyproject.toml

.PHONY: test lint matrix demo cuda-check gpu-test bench bench-peers peer-test apt-deps venv build cpp-test py-test clean-venv clean-venv-torch clean-venv-check clean

# --- set-up -------------------------------------------------------------------------------------------
apt-deps:
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q $$missing; \
	fi

# Two steps, so the extension compiles while the test deps install: .torch holds what the build imports (torch, the
# build tools, and numpy, which torch imports when present: it must not be half-installed while the build runs);
# .deps adds the rest, torch pinned again so that nothing moves it.
$(VENV)/.torch: Makefile
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install $(PIP_FLAGS) $(TORCH_CPU) $(BUILD_DEPS)
	touch $@

$(VENV)/.deps: $(VENV)/.torch
	$(VENV)/bin/pip install $(PIP_FLAGS) $(TORCH_CPU) $(TEST_DEPS)
	touch $@

venv: apt-deps $(VENV)/.deps

$(VENV)/.built: $(VENV)/.torch $(CSRC)
	$(VENV)/bin/pip install $(PIP_FLAGS) --no-build-isolation --no-deps -e .
	touch $@

build: venv $(VENV)/.built

# --- tests --------------------------------------------------------------------------------------------
cpp-test: apt-deps
	cmake -S tests/cpp -B $(BUILD_CPP) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
	cmake --build $(BUILD_CPP)
	ctest --test-dir $(BUILD_CPP) --output-on-failure -j 2

py-test: build
	$(VENV)/bin/python -m pytest tests/python -ra --durations=25

# The lint and type gate: reads the sources only (mypy reads python/shardkit/_C.pyi for the extension).
lint: venv
	$(VENV)/bin/ruff check python tests/python tests/chaos benchmarks examples
	$(VENV)/bin/mypy --cache-dir $(VENV)/.mypy_cache

# Set-up in three jobs: the C++ tests build and run; pip installs torch into .venv, then the extension compiles
# while the test deps install; torch installs into the clean-install venv (test_clean_install.py) meanwhile
# (pip's downloads and unpacking leave a core mostly idle). Then pytest, with the lint beside it (~40 s of one
# core, while pytest's ranks leave about a fifth of the cores idle).
test:
	$(MAKE) --no-print-directory -j3 cpp-test build clean-venv-torch
	$(MAKE) --no-print-directory -j2 py-test lint

# The everyday matrix whole (every combination of front x settings, per entry point; make test runs its pairwise
# cover): tests/python/test_matrix.py with SHARDKIT_MATRIX=whole; compile cells use inductor here.
matrix: build
	SHARDKIT_MATRIX=whole SHARDKIT_MATRIX_COMPILE=inductor $(VENV)/bin/python -m pytest tests/python/test_matrix.py -ra

# torch's test utilities (torch.testing._internal) import expecttest, which the wheel does not depend on.
$(VENV)/.peer-deps: $(VENV)/.deps
	$(VENV)/bin/pip install $(PIP_FLAGS) expecttest
	touch $@

# torch's own peer suite (DistributedTest._DistTestBase from the installed wheel), world 3, CPU, on gloo and
# shardkit; PEER_ARGS="--lift" adds a shardkit run with torch's backend-name checks lifted (see tests/peer/).
PEER_ARGS ?=
peer-test: build $(VENV)/.peer-deps
	$(VENV)/bin/python tests/peer/run_peer_suite.py $(PEER_ARGS)
# --- chaos: ranks killed at random moments, jobs restarted by torchrun ------------------------------------------
# One script a line; each prints its summary and exits non-zero on a failed assertion.
.PHONY: chaos
chaos: build
	$(VENV)/bin/python tests/chaos/restart_cycles.py
	$(VENV)/bin/python tests/chaos/resume_chaos.py

# --- torchft: all seven cases of tests/python/test_torchft_recovery.py (fronts x process groups x group sizes) -------
.PHONY: torchft
torchft: build
	SHARDKIT_TORCHFT_FULL=1 $(VENV)/bin/python -m pytest tests/python/test_torchft_recovery.py -ra

# --- clean install: the wheel in a venv holding only torch, as docs/install.md says --------------------------
# tests/python/test_clean_install.py runs `make clean-venv` (so `make test` covers it) and then the examples
# from that venv. The wheel is rebuilt when a source changes (ninja recompiles only what changed, in
# build/temp.*); the venv's torch is installed once; `import numpy` must fail there, or the check proves nothing.
CLEAN_VENV := build/clean-venv
WHEEL_DIR  := build/wheel
WHEEL_SRC  := $(wildcard python/shardkit/*.py python/shardkit/*/*.py) python/shardkit/py.typed python/shardkit/_C.pyi LICENSE MANIFEST.in README.md
CLEAN_TORCH := $(CLEAN_VENV)/.$(subst ==,-,$(TORCH_CPU))

# build/lib.* goes too: a module deleted from python/shardkit/ must not linger in the wheel.
$(WHEEL_DIR)/.built: $(VENV)/.deps $(CSRC) $(WHEEL_SRC)
	rm -rf $(WHEEL_DIR) build/lib.* build/bdist.*
	$(VENV)/bin/pip wheel $(PIP_FLAGS) --no-build-isolation --no-deps -w $(WHEEL_DIR) .
	touch $@

$(CLEAN_TORCH):
	rm -rf $(CLEAN_VENV)
	$(PYTHON) -m venv $(CLEAN_VENV)
	$(CLEAN_VENV)/bin/pip install $(PIP_FLAGS) $(TORCH_CPU)
	@if $(CLEAN_VENV)/bin/python -c "import numpy" 2>/dev/null; then \
	  echo "$(CLEAN_VENV) has numpy: it cannot show that shardkit runs without it"; exit 1; fi
	touch $@

# Installed with its dependencies resolved (torch is already there), as a user's `pip install` would.
$(CLEAN_VENV)/.shardkit: $(CLEAN_TORCH) $(WHEEL_DIR)/.built
	$(CLEAN_VENV)/bin/pip uninstall $(PIP_FLAGS) -y shardkit
	$(CLEAN_VENV)/bin/pip install $(PIP_FLAGS) $(WHEEL_DIR)/shardkit-*.whl
	touch $@

clean-venv: $(CLEAN_VENV)/.shardkit
clean-venv-torch: $(CLEAN_TORCH)

clean-venv-check: venv
	$(VENV)/bin/python -m pytest tests/python/test_clean_install.py -ra

# --- demo ---------------------------------------------------------------------------------------------
# The estimator's table; then a 3.3M-parameter GPT on 2 ranks: shardkit.auto under a 0.03 GB budget per rank
# (DDP would need 0.053 GB, ZeRO-2 0.033: it picks ZeRO-3, wrapped with fully_shard, the README's recommended
# front), and the same model under DDP for comparison, each ending with its memory table (held vs estimated
# model-state bytes per rank) and throughput; then the collectives demo.
demo: build
	$(VENV)/bin/python -m shardkit estimate --params 7b --gpus 4 --gpu-memory-gb 80
	$(VENV)/bin/torchrun --standalone --nproc_per_node=2 examples/train_gpt.py --strategy auto --memory-budget-gb 0.03 --steps 300 --log-every 50
	$(VENV)/bin/torchrun --standalone --nproc_per_node=2 examples/train_gpt.py --strategy ddp --steps 300 --log-every 50
	$(VENV)/bin/torchrun --standalone --nproc_per_node=2 examples/collectives_demo.py

# --- CUDA compile check (no GPU needed) -----------------------------------------------------------------
$(VENV_CUDA)/.deps: Makefile
	$(PYTHON) -m venv $(VENV_CUDA)
	$(VENV_CUDA)/bin/pip install $(PIP_FLAGS) $(TORCH_CUDA) ninja 'setuptools>=77' wheel numpy
	touch $@

# Built from a copy of the sources, so its objects never mix with the CPU build's in ./build.
cuda-check: apt-deps $(VENV_CUDA)/.deps
	rm -rf build/cuda-check && mkdir -p build/cuda-check/src
	tar cf - --exclude=./build --exclude=./.venv --exclude=./.venv-cuda --exclude=./.git . | tar xf - -C build/cuda-check/src
	cd build/cuda-check/src && SHARDKIT_CUDA=1 TORCH_CUDA_ARCH_LIST="$${TORCH_CUDA_ARCH_LIST:-9.0}" \
	  $(if $(CUDA_HOME),CUDA_HOME=$(CUDA_HOME)) \
	  ../../../$(VENV_CUDA)/bin/pip wheel $(PIP_FLAGS) --no-build-isolation --no-deps -w .. .
	$(VENV_CUDA)/bin/pip install $(PIP_FLAGS) --no-deps --force-reinstall build/cuda-check/shardkit-*.whl
	cd build/cuda-check && ../../$(VENV_CUDA)/bin/python ../../tests/cuda_check.py

# On a GPU machine: its own Python and torch (a CUDA build, e.g. 2.11+cu130), the CUDA extension built in place,
# then the tests marked `cuda` (tests/python/test_cuda_kernels.py, ...) and the GPU benchmark (kernels, PowerSGD, FSDP).
# GPU machines have many cores: one compile job per core, and pytest-xdist's workers where it is installed
# (on the lent H200: a 40 s build, 55 s of tests with 6 workers).
gpu-test:
	SHARDKIT_CUDA=1 MAX_JOBS=$$(nproc) $(PYTHON) -m pip install $(PIP_FLAGS) --no-build-isolation --no-deps -e .
	$(PYTHON) -m pytest tests/python -m cuda -rs $$($(PYTHON) -c "import xdist" 2>/dev/null && echo "-n 6")
	$(PYTHON) benchmarks/gpu_kernels.py

$(VENV)/.bench-deps: $(VENV)/.deps
	$(VENV)/bin/pip install $(PIP_FLAGS) matplotlib
	touch $@

bench: build $(VENV)/.bench-deps
	$(VENV)/bin/python benchmarks/collectives.py
	$(VENV)/bin/python benchmarks/collectives.py --hosts 2x2
	$(VENV)/bin/python benchmarks/ddp_step.py
	$(VENV)/bin/python benchmarks/powersgd.py
	$(VENV)/bin/python benchmarks/fsdp_step.py
	$(VENV)/bin/python benchmarks/checkpoint.py
	$(VENV)/bin/python benchmarks/checkpoint_integrity.py

# DeepSpeed in a venv of its own (torch pinned as in .venv; DS_BUILD_OPS=0: its CPU shm op is built at first use
# with ninja), so it never touches the test venv; the comparison runs shardkit's ranks from .venv and
# DeepSpeed's from this venv in interleaved rounds.
$(VENV_PEERS)/.deps: Makefile
	$(PYTHON) -m venv $(VENV_PEERS)
	$(VENV_PEERS)/bin/pip install $(PIP_FLAGS) $(TORCH_CPU)
	DS_BUILD_OPS=0 $(VENV_PEERS)/bin/pip install $(PIP_FLAGS) $(DEEPSPEED) ninja py-cpuinfo
	touch $@

bench-peers: build $(VENV_PEERS)/.deps
	$(VENV)/bin/python benchmarks/collectives.py --peer deepspeed --world 2 4 --sizes 4K 64K 1M 16M 64M

clean:
	rm -rf build *.egg-info python/*.egg-info python/shardkit/*.so $(VENV)/.built

# --- AddressSanitizer: the FSDP1 front's and ZeRO's state-dict tests against an ASAN build ------------------------
# A copy of the sources under build/asan/src, its extension built in place there with -fsanitize=address (never
# the .venv's editable build), imported first through PYTHONPATH by .venv's Python; libasan is preloaded (Python is
# not instrumented), and libstdc++ with it: Python does not link it, and ASAN's __cxa_throw interceptor, resolved at
# start-up, would otherwise abort at the first C++ exception ("CHECK failed: ... real___cxa_throw"). Leak checks are
# off (Python keeps objects until exit by design). Its build/ is kept, so a rerun recompiles only what changed (the
# first build took 46 min on the 2-core machine shared with other jobs).
ASAN_DIR   := build/asan/src
ASAN_TESTS := tests/python/test_fsdp_checkpoint.py tests/python/test_fsdp_activation_checkpointing.py \
              tests/python/test_checkpoint_resharding.py "tests/python/test_zero.py::test_full_state_dicts_are_copies_unchanged_by_the_next_step" \
              "tests/python/test_zero.py::test_checkpoint_resume_is_bit_identical" \
              --deselect "tests/python/test_fsdp_checkpoint.py::test_full_state_dict_peak_memory_is_one_unit_above_the_sharded_state"
# (deselected: it bounds the process's peak RSS, which ASAN's redzones and quarantine of freed memory inflate)

.PHONY: asan
asan: venv
	mkdir -p $(ASAN_DIR) && find $(ASAN_DIR) -mindepth 1 -maxdepth 1 ! -name build -exec rm -rf {} +
	tar cf - --exclude=./build --exclude=./.venv --exclude=./.venv-cuda --exclude=./.venv-peers --exclude=./.git \
	  --exclude='*.so' . | tar xf - -C $(ASAN_DIR)
	cd $(ASAN_DIR) && SHARDKIT_CUDA=0 SHARDKIT_DEBUG=1 CFLAGS="-fsanitize=address -fno-omit-frame-pointer -g" \
	  LDFLAGS="-fsanitize=address" $(CURDIR)/$(VENV)/bin/python setup.py -q build_ext --inplace
	cd $(ASAN_DIR) && PYTHONPATH=$(CURDIR)/$(ASAN_DIR)/python \
	  LD_PRELOAD="$$(g++ -print-file-name=libasan.so) $$(g++ -print-file-name=libstdc++.so)" \
	  ASAN_OPTIONS=detect_leaks=0:abort_on_error=0:print_summary=1 \
	  $(CURDIR)/$(VENV)/bin/python -m pytest -p no:cacheprovider $(ASAN_TESTS) -ra
