# meshnet: `make` builds the engine over the pinned llama.cpp and installs meshnet with
# its default model into a virtual environment; `make test` runs the test suite on the
# real models; `make run` runs `meshnet run` (ARGS='--stages 3' passes options).

PYTHON ?= python3
JOBS   ?= $(shell nproc)

# Everything is installed into the active virtual environment, or else into the project's
# own .venv made with $(PYTHON): a Debian/Ubuntu system Python refuses `pip install`
# (PEP 668, externally-managed-environment).
ifdef VIRTUAL_ENV
VENV := $(VIRTUAL_ENV)
else
VENV := .venv
endif
VENV_PYTHON := $(VENV)/bin/python
PIP         := $(VENV_PYTHON) -m pip

# The pin: the llama.cpp tree vendored in this sdist (ggml-org/llama.cpp@0c1e57098).
SDIST_VERSION := 0.3.36
SDIST_SHA256  := 832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
LLAMA_COMMIT  := 0c1e57098

BUILD    := build
SDIST    := $(BUILD)/dl/llama_cpp_python-$(SDIST_VERSION).tar.gz
PRISTINE := $(BUILD)/llama.cpp-pristine
TREE     := $(BUILD)/llama.cpp
CMAKE_DIR:= $(BUILD)/cmake
PATCHES  := $(sort $(wildcard engine_c/patches/*.patch))
PATCHES_SHA256 = $(shell cat $(PATCHES) | sha256sum | cut -c1-64)
ENGINE   := $(BUILD)/libmeshnet_engine.so

.PHONY: all engine engine-cuda cuda-compiler engine-vulkan vulkan-toolchain reference llama-server test-models python model test test-unit run check-patches clean distclean

all: engine python model

# make GPU=cuda: also the engine with ggml's CUDA backend, from the same pinned tree and
# patch stack, in a folder of its own (build/cuda/libmeshnet_engine.so), so the CPU
# engine stays as it is. One GPU architecture only (CUDA_ARCH, e.g. 90 for Hopper;
# default: the GPUs of this machine), and no flash-attention kernels (stages run without
# flash attention: see engine_c/stage.cpp).
GPU       ?=
CUDA_ARCH ?= native
CUDA_CMAKE_ARGS ?=
CUDA_DIR  := $(BUILD)/cuda
# make GPU=vulkan: the engine with ggml's Vulkan backend (build/vulkan), for AMD, Intel and
# NVIDIA GPUs, and Mesa's lavapipe (a Vulkan device on the CPU, what the tests run it on).
# Debian's packages: glslc libvulkan-dev spirv-headers (and mesa-vulkan-drivers for
# lavapipe); about 6 minutes on 2 cores (its shaders, and ggml-vulkan.cpp).
VULKAN_DIR := $(BUILD)/vulkan
ifeq ($(GPU),cuda)
all: engine-cuda
else ifeq ($(GPU),vulkan)
all: engine-vulkan
else ifneq ($(GPU),)
$(error GPU=$(GPU) is not a backend this Makefile builds: GPU=cuda, GPU=vulkan, or nothing for the CPU engine)
endif

$(VENV_PYTHON):
	$(PYTHON) -m venv $(VENV)

# the venv's pip even for the download: a stock Debian python3 has no pip of its own;
# only the sdist itself is taken from source (its build tools come as wheels, in seconds)
$(SDIST): | $(VENV_PYTHON)
	mkdir -p $(BUILD)/dl
	$(PIP) download --quiet --no-binary llama-cpp-python --no-deps -d $(BUILD)/dl llama-cpp-python==$(SDIST_VERSION)
	echo "$(SDIST_SHA256)  $@" | sha256sum -c --quiet || { rm -f $@; echo "error: sdist sha256 mismatch" >&2; exit 1; }

$(PRISTINE)/.stamp: $(SDIST)
	echo "$(SDIST_SHA256)  $<" | sha256sum -c --quiet
	rm -rf $(PRISTINE) $(BUILD)/sdist && mkdir -p $(BUILD)/sdist
	tar -xzf $< -C $(BUILD)/sdist llama_cpp_python-$(SDIST_VERSION)/vendor/llama.cpp
	mv $(BUILD)/sdist/llama_cpp_python-$(SDIST_VERSION)/vendor/llama.cpp $(PRISTINE) && rm -rf $(BUILD)/sdist
	touch $@

$(TREE)/.stamp: $(PRISTINE)/.stamp $(PATCHES) tools/patch_tree.sh
	tools/patch_tree.sh apply $(PRISTINE) $(TREE) $(PATCHES)
	touch $@

check-patches: $(PRISTINE)/.stamp
	tools/patch_tree.sh check $(PRISTINE) $(PATCHES)

# configure again whenever the tree is re-patched, so the baked-in pin stays true
$(CMAKE_DIR)/.configured: $(TREE)/.stamp engine_c/CMakeLists.txt engine_c/cmake/no_amx.cmake
	cmake -S engine_c -B $(CMAKE_DIR) -DCMAKE_BUILD_TYPE=Release \
	    -DLLAMA_CPP_DIR=$(abspath $(TREE)) -DMESHNET_LIB_DIR=$(abspath $(BUILD)) \
	    -DMESHNET_LLAMA_COMMIT=$(LLAMA_COMMIT) -DMESHNET_SDIST_SHA256=$(SDIST_SHA256) \
	    -DMESHNET_PATCHES_SHA256=$(PATCHES_SHA256) \
	    -DMESHNET_TEST_MODEL=$(abspath $(TEST_MODELS_DIR))/models/llama-dense.gguf > $(CMAKE_DIR).log
	touch $@

engine: $(CMAKE_DIR)/.configured
	cmake --build $(CMAKE_DIR) --target meshnet_engine -j $(JOBS)

# (nvcc is looked for first, so that a machine without it hears so before the tree is
# patched or anything configured)
cuda-compiler:
	@command -v nvcc >/dev/null || { echo "error: the CUDA engine needs CUDA's compiler, nvcc, on the PATH: install the CUDA toolkit (or put its bin/ on the PATH); plain make builds the CPU engine" >&2; exit 2; }

engine-cuda: cuda-compiler $(TREE)/.stamp
	cmake -S engine_c -B $(CUDA_DIR)/cmake -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
	    -DCMAKE_CUDA_ARCHITECTURES=$(CUDA_ARCH) -DGGML_CUDA_FA=OFF \
	    -DLLAMA_CPP_DIR=$(abspath $(TREE)) -DMESHNET_LIB_DIR=$(abspath $(CUDA_DIR)) \
	    -DMESHNET_LLAMA_COMMIT=$(LLAMA_COMMIT) -DMESHNET_SDIST_SHA256=$(SDIST_SHA256) \
	    -DMESHNET_PATCHES_SHA256=$(PATCHES_SHA256) $(CUDA_CMAKE_ARGS) > $(CUDA_DIR).log
	cmake --build $(CUDA_DIR)/cmake --target meshnet_engine -j $(JOBS)

vulkan-toolchain:
	@command -v glslc >/dev/null && pkg-config --exists vulkan && [ -d /usr/include/spirv ] || { echo "error: the Vulkan engine needs glslc, the Vulkan headers and SPIR-V's: apt-get install glslc libvulkan-dev spirv-headers (Debian/Ubuntu); plain make builds the CPU engine" >&2; exit 2; }

engine-vulkan: vulkan-toolchain $(TREE)/.stamp
	cmake -S engine_c -B $(VULKAN_DIR)/cmake -DCMAKE_BUILD_TYPE=Release -DGGML_VULKAN=ON \
	    -DLLAMA_CPP_DIR=$(abspath $(TREE)) -DMESHNET_LIB_DIR=$(abspath $(VULKAN_DIR)) \
	    -DMESHNET_LLAMA_COMMIT=$(LLAMA_COMMIT) -DMESHNET_SDIST_SHA256=$(SDIST_SHA256) \
	    -DMESHNET_PATCHES_SHA256=$(PATCHES_SHA256) > $(VULKAN_DIR).log
	cmake --build $(VULKAN_DIR)/cmake --target meshnet_engine -j $(JOBS)

# The reference meshnet's numerics classes are checked against: a small greedy program
# over the pinned tree, built twice: the pristine tree with its default options for the
# stock class; for the invariant class the pristine tree with meshnet's CPU kernel patches
# only (0005, 0015, 0016: the row-invariant mode, which the program turns on), none of the
# stage's (tools/reference).
REFERENCE := $(BUILD)/reference
REFERENCE_SOURCES := tools/reference/greedy.cpp tools/reference/quantize.cpp tools/reference/CMakeLists.txt engine_c/cmake/no_amx.cmake

reference: $(REFERENCE)/stock/meshnet-reference $(REFERENCE)/invariant/meshnet-reference

# the stock build also makes the pin's generator of random-weight models of every
# architecture (tests/test-llama-archs.cpp, with more layers and architectures: tools/test-models), which the
# tests run on
TEST_MODELS_DIR   := $(BUILD)/test-models
ARCHS_GENERATOR_SOURCE := $(TEST_MODELS_DIR)/test-llama-archs.cpp

$(ARCHS_GENERATOR_SOURCE): $(PRISTINE)/.stamp tools/test-models/more-layers.patch tools/test-models/more-architectures.patch
	mkdir -p $(TEST_MODELS_DIR)
	patch --quiet --fuzz=0 -o $@ $(PRISTINE)/tests/test-llama-archs.cpp < tools/test-models/more-layers.patch
	patch --quiet --fuzz=0 $@ < tools/test-models/more-architectures.patch

$(REFERENCE)/stock/meshnet-reference: $(PRISTINE)/.stamp $(REFERENCE_SOURCES) $(ARCHS_GENERATOR_SOURCE)
	cmake -S tools/reference -B $(REFERENCE)/stock -DCMAKE_BUILD_TYPE=Release -DMESHNET_ARCH_MODELS=ON \
	    -DMESHNET_ARCH_MODELS_SOURCE=$(abspath $(ARCHS_GENERATOR_SOURCE)) \
	    -DLLAMA_CPP_DIR=$(abspath $(PRISTINE)) > $(REFERENCE)-stock.log
	cmake --build $(REFERENCE)/stock --target meshnet-reference test-llama-archs meshnet-quantize -j $(JOBS)
	touch $@

# a random-weight model of every architecture the generator knows, seeded, in seconds:
# the default tests' models (no download)
TEST_MODELS_SEED := 42
test-models: $(TEST_MODELS_DIR)/models/.stamp

$(TEST_MODELS_DIR)/models/.stamp: $(REFERENCE)/stock/meshnet-reference
	rm -rf $(TEST_MODELS_DIR)/models && mkdir -p $(TEST_MODELS_DIR)/models
	$(REFERENCE)/stock/test-llama-archs -s $(TEST_MODELS_SEED) -o $(TEST_MODELS_DIR)/models > $(TEST_MODELS_DIR)/models.log 2>&1
	touch $@

REFERENCE_INVARIANT_PATCHES := engine_c/patches/0005-cpu-row-invariant-mode.patch engine_c/patches/0015-cpu-row-invariant-kernels.patch \
                               engine_c/patches/0016-cpu-row-invariant-flash-attn.patch
REFERENCE_INVARIANT_TREE := $(REFERENCE)/invariant-tree

# (offsets allowed, no fuzz: the stage's patches before them are not there)
$(REFERENCE_INVARIANT_TREE)/.stamp: $(PRISTINE)/.stamp $(REFERENCE_INVARIANT_PATCHES)
	rm -rf $(REFERENCE_INVARIANT_TREE) && cp -a $(PRISTINE) $(REFERENCE_INVARIANT_TREE)
	for p in $(REFERENCE_INVARIANT_PATCHES); do patch -d $(REFERENCE_INVARIANT_TREE) -p1 --fuzz=0 --quiet < $$p || exit 1; done
	touch $@

$(REFERENCE)/invariant/meshnet-reference: $(REFERENCE_INVARIANT_TREE)/.stamp $(REFERENCE_SOURCES)
	rm -rf $(REFERENCE)/invariant
	cmake -S tools/reference -B $(REFERENCE)/invariant -DCMAKE_BUILD_TYPE=Release -DMESHNET_ROW_INVARIANT=ON \
	    -DLLAMA_CPP_DIR=$(abspath $(REFERENCE_INVARIANT_TREE)) > $(REFERENCE)-invariant.log
	cmake --build $(REFERENCE)/invariant --target meshnet-reference -j $(JOBS)

# llama-server from the pristine pin with the tree's own options (no web UI): what
# tools/bench_serve.py sets `meshnet serve` beside; and its llama-bench, which
# tools/bench_vs_llama_bench.py sets meshnet's whole model beside. Neither `make` nor `make
# test` needs them.
LLAMA_SERVER_DIR := $(BUILD)/llama-server
llama-server: $(LLAMA_SERVER_DIR)/bin/llama-server

$(LLAMA_SERVER_DIR)/bin/llama-server: $(PRISTINE)/.stamp
	cmake -S $(PRISTINE) -B $(LLAMA_SERVER_DIR) -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
	    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF \
	    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF > $(LLAMA_SERVER_DIR).log
	cmake --build $(LLAMA_SERVER_DIR) --target llama-server llama-bench -j $(JOBS)

# the stamp lives in the venv, so a new or deleted venv gets meshnet installed again
$(VENV)/.meshnet-installed: setup.py | $(VENV_PYTHON)
	$(PIP) install --quiet -e '.[test]'
	touch $@

python: $(VENV)/.meshnet-installed

model: python
	$(VENV_PYTHON) -m meshnet.engine.models ensure smollm2

test: all reference test-models
	$(VENV_PYTHON) -m meshnet.engine.models ensure qwen2.5-coder-1.5b
	$(VENV_PYTHON) -m meshnet.engine.models ensure gemma3-270m
	$(VENV_PYTHON) -m compileall -q meshnet tests tools
	cmake --build $(CMAKE_DIR) --target meshnet_abi_test meshnet_kernel_invariance -j $(JOBS)
	ctest --test-dir $(CMAKE_DIR) --output-on-failure
	MESHNET_ENABLE_REAL_INFERENCE_TESTS=1 $(VENV_PYTHON) -m pytest -q --durations=40 tests

# the pure logic alone: no model, no engine library, no socket, no thread (seconds)
test-unit: python
	$(VENV_PYTHON) -m pytest -q tests/unit

run: all
	$(VENV)/bin/meshnet run $(ARGS)

clean:
	rm -rf $(CMAKE_DIR) $(CMAKE_DIR).log $(ENGINE) $(VENV)/.meshnet-installed

# the project's own .venv only: an active virtual environment is the user's
distclean:
	rm -rf $(BUILD) .venv
