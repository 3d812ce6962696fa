#!/usr/bin/env bash
# The peer comparison: llama.cpp's own way to run one model over several machines is its
# RPC backend. This builds ggml-rpc-server and llama-bench from the same pinned tree
# (stock build options, no meshnet patches), splits each model over two RPC servers on
# loopback, and prints llama-bench's pp/tg next to `meshnet bench` with two workers.
#   tools/bench-vs-rpc.sh [MODEL ...]      default: smollm2 qwen2.5-coder-1.5b
# Environment: THREADS (per server / worker, default: cores), REPEATS (default 3).
set -euo pipefail
cd "$(dirname "$0")/.."

models=("$@")
[ ${#models[@]} -gt 0 ] || models=(smollm2 qwen2.5-coder-1.5b)
threads=${THREADS:-$(nproc)}
repeats=${REPEATS:-3}
rpc_build=build/rpc

make --no-print-directory build/llama.cpp-pristine/.stamp
if [ ! -x "$rpc_build/bin/llama-bench" ] || [ ! -x "$rpc_build/bin/ggml-rpc-server" ]; then
    echo "building ggml-rpc-server and llama-bench from the pinned tree (stock options) ..." >&2
    cmake -S build/llama.cpp-pristine -B "$rpc_build" -DCMAKE_BUILD_TYPE=Release -DGGML_RPC=ON \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_OPENSSL=OFF > "$rpc_build.log"
    cmake --build "$rpc_build" --target ggml-rpc-server llama-bench -j "$(nproc)" >> "$rpc_build.log"
fi

servers=()
stop_servers() { for pid in "${servers[@]}"; do kill "$pid" 2>/dev/null || true; done; wait 2>/dev/null || true; servers=(); }
trap stop_servers EXIT

for model in "${models[@]}"; do
    path=$(python3 -c "import sys; from meshnet.engine import models; print(models.resolve(sys.argv[1])[0])" "$model")
    echo "== $model: llama.cpp RPC, two ggml-rpc-server on 127.0.0.1, $threads threads each"
    for port in 50052 50053; do
        "$rpc_build/bin/ggml-rpc-server" -H 127.0.0.1 -p "$port" -t "$threads" > "$rpc_build-server-$port.log" 2>&1 &
        servers+=($!)
    done
    for port in 50052 50053; do  # wait until both listen
        for _ in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/$port) 2>/dev/null && break; sleep 0.1; done
    done
    "$rpc_build/bin/llama-bench" -m "$path" --rpc 127.0.0.1:50052,127.0.0.1:50053 -ngl 99 -p 64 -n 64 -r "$repeats" -o md
    stop_servers
    echo "== $model: meshnet, two worker processes, $threads threads each"
    meshnet bench --model "$model" --configs workers --repeats "$repeats" --decode 64 --threads "$threads"
done
