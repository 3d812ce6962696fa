#!/usr/bin/env bash
# Packs, on a machine with the network, what tools/gpu-check.sh needs on a GPU machine
# without one, into .gpu/ (ignored by git):
#   .gpu/src/llama.cpp.tar.gz  the patched llama.cpp tree that `make` built here from the
#                              pinned sdist and engine_c/patches (sources and build files only)
#   .gpu/src/wheels/           wheels of the Python packages meshnet needs that a CUDA image
#                              seldom has (pyzmq, cffi, pycparser, gguf), for PY_VERSION
#   .gpu/models/NAME.gguf.NN   each model, in pieces of at most CHUNK_MB MiB, for a transfer
#                              that limits the size of one copy; gpu-check.sh joins them
# Usage: tools/gpu-bundle.sh [model name...]   (default: smollm2)
# Environment: PY_VERSION (default 3.12, the GPU machine's python3), CHUNK_MB (default 48).
set -euo pipefail
cd "$(dirname "$0")/.."

PY_VERSION=${PY_VERSION:-3.12}
CHUNK_MB=${CHUNK_MB:-48}
PYTHON=${PYTHON:-.venv/bin/python}
OUT=.gpu
models=("$@")
[ ${#models[@]} -gt 0 ] || models=(smollm2)

[ -e build/llama.cpp/.stamp ] || make build/llama.cpp/.stamp
mkdir -p "$OUT/src/wheels" "$OUT/models"

# the tree without what the engine's build never reads: models' vocab files, docs, tests,
# the tools and examples, other backends' sources stay only where CMake lists them
tar -czf "$OUT/src/llama.cpp.tar.gz" -C build \
    --exclude='llama.cpp/models' --exclude='llama.cpp/docs' --exclude='llama.cpp/media' \
    --exclude='llama.cpp/gguf-py' --exclude='llama.cpp/tests/*.cpp' --exclude='llama.cpp/.git*' \
    --exclude='llama.cpp/ggml/src/ggml-sycl' \
    --exclude='llama.cpp/ggml/src/ggml-cann' --exclude='llama.cpp/ggml/src/ggml-musa' \
    --exclude='llama.cpp/ggml/src/ggml-opencl/kernels' --exclude='llama.cpp/ggml/src/ggml-webgpu/wgsl-shaders' \
    --exclude='llama.cpp/ggml/src/ggml-hexagon' \
    llama.cpp

rm -f "$OUT/src/wheels/"*.whl
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$OUT/src/wheels" pyzmq cffi pycparser gguf

for name in "${models[@]}"; do
    path=$("$PYTHON" -m meshnet.engine.models ensure "$name" | sed -n 's/^[^:]*: \(.*\) (sha256 .*/\1/p')
    base=$(basename "$path")
    rm -f "$OUT/models/$base".*
    split -b "${CHUNK_MB}M" -d -a 2 "$path" "$OUT/models/$base."
    echo "$name: $(ls "$OUT/models/$base".* | wc -l) pieces of $base"
done
du -sh "$OUT/src" "$OUT/models"
