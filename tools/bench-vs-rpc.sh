#!/usr/bin/env bash
# The peer comparison: llama.cpp's own way to run one model over several machines is its
# RPC backend. This builds ggml-rpc-server and llama-bench from the same pinned tree
# (stock build options, no meshnet patches), splits each model over two RPC servers on
# loopback, and runs `meshnet bench` with two workers beside it, at each thread setting:
# one thread per server / worker (each stage with a core of its own, as across hosts) and
# one per core (two stages sharing the cores). It ends with a table of the ratios.
#   tools/bench-vs-rpc.sh [MODEL ...]      default: smollm2 qwen2.5-coder-1.5b
# RPC and meshnet run in turns, REPEATS rounds of each (one llama-bench run, one
# `meshnet bench --repeats 1`), so that the machine's slow spells fall on both.
# Environment: THREADS (the settings, space-separated; default: "1 <cores>"),
# REPEATS (rounds, default 3), NUMERICS (meshnet's class, default: meshnet bench's).
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

rpc_run() {  # one llama-bench run (pp64 and tg64) over two fresh RPC servers: its JSON
    local path=$1 threads=$2 port
    for port in 50052 50053; do
        "$rpc_build/bin/ggml-rpc-server" -H 127.0.0.1 -p "$port" -t "$threads" > "$rpc_build-server-$port.log" 2>&1 &
        servers+=($!)
    done
    for port in 50052 50053; do  # wait until both listen
        for _ in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/$port) 2>/dev/null && break; sleep 0.1; done
    done
    # the client's threads too: it computes the input embedding
    "$rpc_build/bin/llama-bench" -m "$path" --rpc 127.0.0.1:50052,127.0.0.1:50053 -ngl 99 -p 64 -n 64 \
        -t "$threads" -r 1 -o json
    stop_servers
}

# RPC and meshnet in turns, REPEATS rounds: a slow spell of the machine falls on both
for model in "${models[@]}"; do
    path=$("$py" -c "import sys; from meshnet.engine import models; print(models.resolve(sys.argv[1])[0])" "$model")
    for threads in "${settings[@]}"; do
        for round in $(seq "$repeats"); do
            echo "== $model, $threads thread(s) each, round $round of $repeats: llama.cpp RPC, two ggml-rpc-server"
            rpc=$(rpc_run "$path" "$threads")
            echo "== $model, $threads thread(s) each, round $round of $repeats: meshnet, two worker processes"
            ours=$("$py" -m meshnet.cli.main bench --model "$model" --configs whole,workers --repeats 1 --decode 64 \
                --threads "$threads" ${numerics[@]+"${numerics[@]}"} --json | tail -n 1)
            "$py" - "$model" "$threads" "$rpc" "$ours" >> "$results" <<'EOF'
import json, sys
model, threads, rpc, ours = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])[0]
workers, whole = ours["configs"]["workers"], ours["configs"]["whole"]
print(json.dumps({"model": model, "threads": int(threads),
                  "rpc_pp": next(r["avg_ts"] for r in rpc if r["n_prompt"] > 0 and r["n_gen"] == 0),
                  "rpc_tg": next(r["avg_ts"] for r in rpc if r["n_gen"] > 0 and r["n_prompt"] == 0),
                  "pp": workers["prefill_tok_s"]["median"], "tg": workers["decode_tok_s"]["median"],
                  "whole_tg": whole["decode_tok_s"]["median"]}))
EOF
            tail -n 1 "$results"
        done
    done
done
echo
"$py" - "$repeats" "$results" <<'EOF'
import json, statistics, sys
repeats, rows = sys.argv[1], [json.loads(line) for line in open(sys.argv[2])]
print(f"meshnet (2 worker processes, 4 prompts) / llama.cpp RPC (2 servers, llama-bench pp64 / tg64), in turns, "
      f"medians of {repeats} rounds; paired: the median of each round's ratio")
print(f"{'model':<22} {'threads':>7} {'RPC pp':>9} {'meshnet pp':>11} {'ratio':>7} {'RPC tg':>9} {'meshnet tg':>11} "
      f"{'ratio':>7} {'paired':>7} {'whole tg':>9} {'RPC/w':>6} {'ours/w':>6}  RPC tg by round")
for key in dict.fromkeys((r["model"], r["threads"]) for r in rows):
    runs = [r for r in rows if (r["model"], r["threads"]) == key]
    m = {k: statistics.median(r[k] for r in runs) for k in ("rpc_pp", "rpc_tg", "pp", "tg", "whole_tg")}
    paired = statistics.median(r["tg"] / r["rpc_tg"] for r in runs)
    print(f"{key[0]:<22} {key[1]:>7} {m['rpc_pp']:>9.1f} {m['pp']:>11.1f} {m['pp'] / m['rpc_pp']:>6.2f}x "
          f"{m['rpc_tg']:>9.1f} {m['tg']:>11.1f} {m['tg'] / m['rpc_tg']:>6.2f}x {paired:>6.2f}x {m['whole_tg']:>9.1f} "
          f"{m['rpc_tg'] / m['whole_tg']:>6.2f} {m['tg'] / m['whole_tg']:>6.2f}  "
          + " ".join(f"{r['rpc_tg']:.1f}" for r in runs))
print("whole tg: the whole model in one process, meshnet's engine and class, the same threads (beside the workers);")
print("RPC/w, ours/w: each split's decode over it. RPC runs stock llama.cpp's kernels (NUMERICS=stock: meshnet's too).")
EOF
rm -f "$results"
