#!/usr/bin/env bash
# The GPU check, on a machine with an NVIDIA GPU and CUDA's compiler but no network:
# builds the CPU engine and the GPU engine (make GPU=cuda, one architecture, all cores),
# then runs tools/gpu_check.py: the whole model on the GPU and on the CPU, a route with the
# head on the GPU and the tail on the CPU and the reverse, each with --allow-mixed and
# without (then refused by the tracker), and the drift of each against the whole model on
# the CPU, for every model given; one evidence manifest.
#
# What the machine lacks comes from tools/gpu-bundle.sh, run where the network is:
#   tools/gpu-check.sh [--bundle DIR] [--models DIR] [--out DIR] [--build-only | --no-build]
#   --bundle DIR   .gpu/src from gpu-bundle.sh: the patched llama.cpp tree and the wheels
#                  (default .gpu/src; skipped where build/llama.cpp and the packages are here)
#   --models DIR   the GGUF files, or gpu-bundle.sh's pieces NAME.gguf.NN, which are joined
#                  (default .gpu/models)
#   --out DIR      where manifest.json, README.md and the logs go (default evidence/<UTC>-gpu-check)
#   --build-only   build and stop; --no-build: use the engines built before
# Then stock llama.cpp's own GPU/CPU drift beside meshnet's GPU stage (tools/gpu_stock.py,
# over tools/reference built with CUDA from the pristine pin), and where the generated models are (ARCH_MODELS, default build/test-models/models), the
# per-architecture drift of a GPU stage (tools/gpu_arch_drift.py) on each GPU engine built:
# CUDA, and Vulkan where glslc is here.
# Environment: CUDA_ARCH (default: the first GPU's compute capability), JOBS (default: all
# cores), PYTHON (default python3), GPU_CHECK_TOKENS (default 64), ARCH_MODELS.
set -euo pipefail
cd "$(dirname "$0")/.."

bundle=.gpu/src models=.gpu/models out="" build=yes check=yes
while [ $# -gt 0 ]; do
    case "$1" in
        --bundle) bundle=$2; shift 2 ;;
        --models) models=$2; shift 2 ;;
        --out) out=$2; shift 2 ;;
        --build-only) check=no; shift ;;
        --no-build) build=no; shift ;;
        *) echo "gpu-check: unknown option $1" >&2; exit 2 ;;
    esac
done
out=${out:-evidence/$(date -u +%Y%m%dT%H%M%SZ)-gpu-check}
mkdir -p "$out"
PYTHON=${PYTHON:-python3}
JOBS=${JOBS:-$(nproc)}
export PATH="$PATH:/usr/local/cuda/bin"

command -v nvidia-smi >/dev/null || { echo "gpu-check: no nvidia-smi: this machine has no NVIDIA driver" >&2; exit 2; }
command -v nvcc >/dev/null || { echo "gpu-check: no nvcc: the GPU engine needs CUDA's compiler" >&2; exit 2; }
if [ -z "${CUDA_ARCH:-}" ]; then
    CUDA_ARCH=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '. ')
fi

# the Python packages the image lacks, from the bundle's wheels, beside this checkout
if ! "$PYTHON" -c "import zmq, cffi, gguf, msgpack, click, numpy" 2>/dev/null; then
    [ -d "$bundle/wheels" ] || { echo "gpu-check: $PYTHON lacks meshnet's packages and $bundle/wheels is missing" >&2; exit 2; }
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/meshnet-site \
        "$bundle"/wheels/*.whl
    export PYTHONPATH="/tmp/meshnet-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# cuBLAS from a pip package when the toolkit has none: CMake wants its plain .so name
cuda_cmake_args=""
nvcc_root=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
toolkit_cublas=no
for candidate in "$nvcc_root"/lib64 "$nvcc_root"/lib /usr/local/cuda/lib64 /usr/lib/x86_64-linux-gnu; do
    [ -e "$candidate/libcublas.so" ] && toolkit_cublas=yes
done
if [ "$toolkit_cublas" = no ]; then
    found=$(find / -xdev -name 'libcublas.so.*' -path '*nvidia*' 2>/dev/null | head -1 || true)
    if [ -n "$found" ]; then
        libdir=$(dirname "$found")
        mkdir -p /tmp/meshnet-cublas
        for f in "$libdir"/libcublas*.so.*; do ln -sf "$f" "/tmp/meshnet-cublas/$(basename "$f" | sed 's/\.so\..*/.so/')"; done
        cuda_cmake_args="-DCMAKE_LIBRARY_PATH=/tmp/meshnet-cublas -DCMAKE_CUDA_FLAGS=-I$libdir/../include -DCMAKE_CXX_FLAGS=-I$libdir/../include"
        export LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        echo "gpu-check: cuBLAS from $libdir"
    fi
fi

if [ "$build" = yes ]; then
    if [ ! -e build/llama.cpp/.stamp ]; then
        [ -e "$bundle/llama.cpp.tar.gz" ] || { echo "gpu-check: no build/llama.cpp and no $bundle/llama.cpp.tar.gz" >&2; exit 2; }
        mkdir -p build && tar -xzf "$bundle/llama.cpp.tar.gz" -C build
    fi
    # -o: the carried tree is the patched one; never fetch the sdist again (no network)
    start=$(date +%s)
    make -o build/llama.cpp/.stamp engine JOBS="$JOBS" >"$out/build-cpu.log" 2>&1 &
    cpu_build=$!
    make -o build/llama.cpp/.stamp engine-cuda GPU=cuda CUDA_ARCH="$CUDA_ARCH" JOBS="$JOBS" \
        CUDA_CMAKE_ARGS="$cuda_cmake_args" >"$out/build-cuda.log" 2>&1 \
        || { tail -30 "$out/build-cuda.log" build/cuda.log 2>/dev/null; echo "gpu-check: the GPU engine did not build" >&2; exit 1; }
    wait $cpu_build || { tail -30 "$out/build-cpu.log"; echo "gpu-check: the CPU engine did not build" >&2; exit 1; }
    echo "gpu-check: both engines built in $(( $(date +%s) - start )) s (CUDA_ARCH=$CUDA_ARCH, $JOBS jobs)" \
        | tee "$out/build-time.txt"
    # the Vulkan engine too, where the machine has its tools (the same GPU through its Vulkan driver)
    if command -v glslc >/dev/null; then
        start=$(date +%s)
        make -o build/llama.cpp/.stamp engine-vulkan GPU=vulkan JOBS="$JOBS" >"$out/build-vulkan.log" 2>&1 \
            && echo "gpu-check: the Vulkan engine built in $(( $(date +%s) - start )) s" | tee -a "$out/build-time.txt" \
            || echo "gpu-check: the Vulkan engine did not build (build-vulkan.log); going on without it" >&2
    fi
    # stock llama.cpp with its CUDA backend: tools/reference's greedy program over the pristine
    # pin (the patched tree with the stack reversed), for stock's own GPU/CPU drift
    pristine=build/llama.cpp-pristine
    if [ ! -d "$pristine" ]; then
        pristine=/tmp/meshnet-pristine
        rm -rf "$pristine" && cp -a build/llama.cpp "$pristine" && rm -rf "$pristine/.meshnet-applied"
        for p in $(ls engine_c/patches/*.patch | sort -r); do
            patch -d "$pristine" -p1 -R --quiet --batch < "$p" || echo "gpu-check: $p does not reverse" >&2
        done
    fi
    start=$(date +%s)
    { cmake -S tools/reference -B build/reference/cuda -DCMAKE_BUILD_TYPE=Release -DLLAMA_CPP_DIR="$PWD/$pristine" \
          -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCH" -DGGML_CUDA_FA=OFF $cuda_cmake_args \
      && cmake --build build/reference/cuda --target meshnet-reference -j "$JOBS"; } >"$out/build-reference-cuda.log" 2>&1 \
        && echo "gpu-check: stock's CUDA reference built in $(( $(date +%s) - start )) s" | tee -a "$out/build-time.txt" \
        || echo "gpu-check: stock's CUDA reference did not build (build-reference-cuda.log)" >&2
fi
[ "$check" = yes ] || exit 0

# the models: whole files, or the bundle's pieces joined once (and checked by gpu_check.py)
mkdir -p /tmp/meshnet-models
paths=()
for first in "$models"/*.gguf "$models"/*.gguf.00; do
    [ -e "$first" ] || continue
    case "$first" in
        *.00) name=$(basename "${first%.00}"); [ -e "/tmp/meshnet-models/$name" ] || cat "${first%.00}".[0-9][0-9] >"/tmp/meshnet-models/$name"
              paths+=("/tmp/meshnet-models/$name") ;;
        *) paths+=("$first") ;;
    esac
done
[ ${#paths[@]} -gt 0 ] || { echo "gpu-check: no models in $models" >&2; exit 2; }
"$PYTHON" tools/gpu_check.py --out "$out" --tokens "${GPU_CHECK_TOKENS:-64}" "${paths[@]}"
# stock's GPU against stock's CPU, and meshnet's GPU stage against stock's GPU, token for token
if [ -x build/reference/cuda/meshnet-reference ]; then
    "$PYTHON" tools/gpu_stock.py --reference build/reference/cuda/meshnet-reference --engine cuda \
        --tokens "${GPU_CHECK_TOKENS:-64}" --json "$out/stock.json" "${paths[@]}" | tee "$out/stock.log" \
        || echo "gpu-check: the stock comparison failed" >&2
fi
# the drift of a GPU stage per architecture, on each GPU engine built, where the generated
# models are here (make test-models, or the bundle's)
archs=${ARCH_MODELS:-build/test-models/models}
if [ -d "$archs" ]; then
    for engine in cuda vulkan; do
        [ -e "build/$engine/libmeshnet_engine.so" ] || continue
        "$PYTHON" tools/gpu_arch_drift.py --engine "$engine" --models "$archs" --jobs 4 --json "$out/archs-$engine.json" \
            --markdown "$out/archs-$engine.md" >"$out/archs-$engine.log" 2>&1 \
            || echo "gpu-check: the per-architecture drift on $engine failed ($out/archs-$engine.log)" >&2
        tail -1 "$out/archs-$engine.log"
    done
fi
