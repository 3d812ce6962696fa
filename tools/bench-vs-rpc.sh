#!/usr/bin/env bash
# The peer comparison: llama.cpp's own way to run one model over several machines is its
# RPC backend. This builds ggml-rpc-server and llama-bench from the same pinned tree
# (stock build options, no meshnet patches), splits each model over two RPC servers on
# loopback, and runs `meshnet bench` with two workers beside it, at each thread setting:
# one thread per server / worker (each stage with a core of its own, as across hosts) and
# one per core (two stages sharing the cores). It ends with a table of the ratios.
#   tools/bench-vs-rpc.sh [MODEL ...]      default: smollm2 qwen2.5-coder-1.5b
# Environment: THREADS (the settings, space-separated; default: "1 <cores>"),
# REPEATS (default 3), NUMERICS (meshnet's class, default: meshnet bench's).
set -euo pipefail
cd "$(dirname "$0")/.."

models=("$@")
[ ${#models[@]} -gt 0 ] || models=(smollm2 qwen2.5-coder-1.5b)
read -r -a settings <<< "${THREADS:-1 $(nproc)}"
repeats=${REPEATS:-3}
rpc_build=build/rpc
py=${PYTHON:-python3}
numerics=()
[ -z "${NUMERICS:-}" ] || numerics=(--numerics "$NUMERICS")

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
results=$(mktemp)

for model in "${models[@]}"; do
    path=$("$py" -c "import sys; from meshnet.engine import models; print(models.resolve(sys.argv[1])[0])" "$model")
    for threads in "${settings[@]}"; do
        echo "== $model, $threads thread(s) each: llama.cpp RPC, two ggml-rpc-server on 127.0.0.1"
        for port in 50052 50053; do
            "$rpc_build/bin/ggml-rpc-server" -H 127.0.0.1 -p "$port" -t "$threads" > "$rpc_build-server-$port.log" 2>&1 &
            servers+=($!)
        done
        for port in 50052 50053; do  # wait until both listen
            for _ in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/$port) 2>/dev/null && break; sleep 0.1; done
        done
        rpc=$("$rpc_build/bin/llama-bench" -m "$path" --rpc 127.0.0.1:50052,127.0.0.1:50053 -ngl 99 -p 64 -n 64 \
            -t "$threads" -r "$repeats" -o json)   # the client's threads too: it computes the input embedding
        stop_servers
        echo "== $model, $threads thread(s) each: meshnet, two worker processes"
        ours=$("$py" -m meshnet.cli.main bench --model "$model" --configs whole,workers --repeats "$repeats" --decode 64 \
            --threads "$threads" ${numerics[@]+"${numerics[@]}"} --json | tail -n 1)
        "$py" - "$model" "$threads" "$rpc" "$ours" >> "$results" <<'EOF'
import json, sys
model, threads, rpc, ours = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])[0]
pp = next(r["avg_ts"] for r in rpc if r["n_prompt"] > 0 and r["n_gen"] == 0)
tg = next(r["avg_ts"] for r in rpc if r["n_gen"] > 0 and r["n_prompt"] == 0)
workers = ours["configs"]["workers"]
prefill, decode = workers["prefill_tok_s"]["median"], workers["decode_tok_s"]["median"]
whole = ours["configs"]["whole"]["decode_tok_s"]["median"]
print(f"{model:<22} {threads:>7} {pp:>9.1f} {prefill:>11.1f} {prefill / pp:>6.2f}x {tg:>9.1f} {decode:>11.1f} "
      f"{decode / tg:>6.2f}x {whole:>9.1f} {tg / whole:>6.2f} {decode / whole:>6.2f}")
EOF
        tail -n 1 "$results"
    done
done
echo
echo "meshnet (2 worker processes, median of ${repeats} repeats x 4 prompts) / llama.cpp RPC (2 servers, llama-bench pp64 / tg64)"
printf '%-22s %7s %9s %11s %7s %9s %11s %7s %9s %6s %6s\n' model threads "RPC pp" "meshnet pp" ratio "RPC tg" \
    "meshnet tg" ratio "whole tg" "RPC/w" "ours/w"
echo "whole tg: the whole model in one process, meshnet's engine and class, the same threads (beside the workers);"
echo "RPC/w, ours/w: each split's decode over it. RPC runs stock llama.cpp's kernels (NUMERICS=stock: meshnet's too)."
cat "$results"
rm -f "$results"
