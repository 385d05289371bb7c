# shardkit — every set-up step lives here, so a fresh machine needs only `make test` or `make demo`.
#
#   make test        apt deps + .venv (torch 2.13.0 CPU) + build, then GoogleTest (ctest) and pytest
#   make demo        same set-up, then the estimator and two demos under torchrun (training, collectives)
#   make cuda-check  .venv-cuda (torch 2.14.1, CUDA 13) + the CUDA extension compiled, linked and imported
#   make bench       the benchmarks under benchmarks/ (results in benchmarks/results/)

PYTHON       ?= python3
VENV         := .venv
VENV_CUDA    := .venv-cuda
TORCH_CPU    := torch==2.13.0
TORCH_CUDA   := torch==2.14.1
PIP_FLAGS    := --disable-pip-version-check -q
TEST_DEPS    := pytest pytest-timeout numpy ninja setuptools wheel
APT_PACKAGES := libgtest-dev cmake ninja-build g++
BUILD_CPP    := build/cpp
# torch guesses CUDA_HOME from nvcc's path, which a wrapper script in /usr/local/bin defeats.
CUDA_HOME    ?= $(if $(wildcard /usr/local/cuda/include/cuda_runtime.h),/usr/local/cuda)
# Compiling torch extensions takes ~2 GB per job; the machines here have 2 cores.
export MAX_JOBS ?= 2
CSRC := $(shell find csrc -name '*.cpp' -o -name '*.h' -o -name '*.cu' 2>/dev/null) setup.py pyproject.toml

.PHONY: test demo cuda-check bench apt-deps venv build cpp-test py-test clean

# --- set-up -------------------------------------------------------------------------------------------
apt-deps:
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q $$missing; \
	fi

$(VENV)/.deps: Makefile
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install $(PIP_FLAGS) $(TORCH_CPU) $(TEST_DEPS)
	touch $@

venv: apt-deps $(VENV)/.deps

$(VENV)/.built: $(VENV)/.deps $(CSRC)
	$(VENV)/bin/pip install $(PIP_FLAGS) --no-build-isolation --no-deps -e .
	touch $@

build: venv $(VENV)/.built

# --- tests --------------------------------------------------------------------------------------------
cpp-test: apt-deps
	cmake -S tests/cpp -B $(BUILD_CPP) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
	cmake --build $(BUILD_CPP)
	ctest --test-dir $(BUILD_CPP) --output-on-failure -j 2

py-test: build
	$(VENV)/bin/python -m pytest tests/python -ra

test: cpp-test py-test

# --- demo ---------------------------------------------------------------------------------------------
demo: build
	$(VENV)/bin/python -m shardkit estimate --params 7b --gpus 4 --gpu-memory-gb 80
	$(VENV)/bin/torchrun --standalone --nproc_per_node=2 examples/train_ddp.py
	$(VENV)/bin/torchrun --standalone --nproc_per_node=2 examples/collectives_demo.py

# --- CUDA compile check (no GPU needed) -----------------------------------------------------------------
$(VENV_CUDA)/.deps: Makefile
	$(PYTHON) -m venv $(VENV_CUDA)
	$(VENV_CUDA)/bin/pip install $(PIP_FLAGS) $(TORCH_CUDA) ninja setuptools wheel numpy
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

$(VENV)/.bench-deps: $(VENV)/.deps
	$(VENV)/bin/pip install $(PIP_FLAGS) matplotlib
	touch $@

bench: build $(VENV)/.bench-deps
	$(VENV)/bin/python benchmarks/collectives.py
	$(VENV)/bin/python benchmarks/collectives.py --hosts 2x2
	$(VENV)/bin/python benchmarks/ddp_step.py
	$(VENV)/bin/python benchmarks/powersgd.py

clean:
	rm -rf build *.egg-info python/*.egg-info python/shardkit/*.so $(VENV)/.built
