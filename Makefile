# meshnet: `make` builds the engine over the pinned llama.cpp and installs meshnet with
# its default model; `make test` runs the test suite on the real models.

PYTHON ?= python3
PIP    ?= $(PYTHON) -m pip
JOBS   ?= $(shell nproc)

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

.PHONY: all engine python model test check-patches clean distclean

all: engine python model

$(SDIST):
	mkdir -p $(BUILD)/dl
	$(PIP) download --quiet --no-binary :all: --no-deps -d $(BUILD)/dl llama-cpp-python==$(SDIST_VERSION)
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
$(CMAKE_DIR)/.configured: $(TREE)/.stamp engine_c/CMakeLists.txt
	cmake -S engine_c -B $(CMAKE_DIR) -DCMAKE_BUILD_TYPE=Release \
	    -DLLAMA_CPP_DIR=$(abspath $(TREE)) -DMESHNET_LIB_DIR=$(abspath $(BUILD)) \
	    -DMESHNET_LLAMA_COMMIT=$(LLAMA_COMMIT) -DMESHNET_SDIST_SHA256=$(SDIST_SHA256) \
	    -DMESHNET_PATCHES_SHA256=$(PATCHES_SHA256) > $(CMAKE_DIR).log
	touch $@

engine: $(CMAKE_DIR)/.configured
	cmake --build $(CMAKE_DIR) --target meshnet_engine -j $(JOBS)

$(BUILD)/.python-installed: setup.py
	$(PIP) install --quiet -e '.[test]'
	touch $@

python: $(BUILD)/.python-installed

model: python
	$(PYTHON) -m meshnet.models ensure smollm2

test: all
	$(PYTHON) -m meshnet.models ensure qwen2.5-coder-1.5b
	$(PYTHON) -m pytest -q tests

clean:
	rm -rf $(CMAKE_DIR) $(CMAKE_DIR).log $(ENGINE) $(BUILD)/.python-installed

distclean:
	rm -rf $(BUILD)
