#!/usr/bin/env python3
"""meshnet's whole model beside the pin's own llama-bench on the same machine: the user who
tries llama.cpp next to meshnet sees these two numbers. meshnet runs the model in one
process (a Stage of every layer, the given numerics class); llama-bench is the pristine
pin's (`make llama-server` builds it), with flash attention off (the kernels meshnet's
invariant class runs) and at its default (auto: on for a CPU), and meshnet with flash
attention too: each beside its like. Same threads, a 128-token prompt and 32 tokens
decoded from an empty context (llama-bench's pp128 and tg32), the four in turns, medians of
ROUNDS.
    python tools/bench_vs_llama_bench.py MODEL[,MODEL...] [--rounds 3] [--threads 2]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from meshnet.engine.binding import Entry, Stage
from meshnet.stage.config import THREAD_POLL

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA_BENCH = os.path.join(ROOT, "build", "llama-server", "bin", "llama-bench")
N_PROMPT, N_GEN = 128, 32


def meshnet_once(path: str, threads: int, numerics: str, flash_attn: bool = False) -> tuple[float, float]:
    # (its threads poll for the next pass as llama-bench's do: nothing else computes here)
    with Stage(path, None, n_ctx=512, max_sessions=1, n_threads=threads, numerics=numerics,
               flash_attn=flash_attn, thread_poll=THREAD_POLL) as stage:
        # a warm-up pass first, as llama-bench runs one: the buffers' first touch is not the model's speed
        stage.open_session(2)
        stage.forward([Entry(2, 0, tokens=np.arange(1000, 1000 + N_PROMPT, dtype=np.int32))])
        stage.release_session(2)
        stage.open_session(0)
        prompt = np.arange(1000, 1000 + N_PROMPT, dtype=np.int32)
        start = time.perf_counter()
        stage.forward([Entry(0, 0, tokens=prompt)])
        prefill = N_PROMPT / (time.perf_counter() - start)
        stage.release_session(0)
        # (as llama-bench's tg: from an empty context)
        stage.open_session(1)
        token = 1000
        start = time.perf_counter()
        for i in range(N_GEN):
            out = stage.forward([Entry(1, i, tokens=np.asarray([token], dtype=np.int32))])
            token = int(out.token[0])
        return prefill, N_GEN / (time.perf_counter() - start)


def llama_bench_once(path: str, threads: int, flash_attn: str) -> tuple[float, float]:
    out = subprocess.run([LLAMA_BENCH, "-m", path, "-t", str(threads), "-p", str(N_PROMPT), "-n", str(N_GEN),
                          "-r", "1", "-fa", flash_attn, "-o", "jsonl"], capture_output=True, text=True,
                         check=True, timeout=900).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.strip()]
    prefill = next(r["avg_ts"] for r in rows if r["n_prompt"] == N_PROMPT)
    decode = next(r["avg_ts"] for r in rows if r["n_gen"] == N_GEN)
    return prefill, decode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", help="comma-separated GGUF paths")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--numerics", default="invariant")
    args = parser.parse_args()
    if not os.path.isfile(LLAMA_BENCH):
        print(f"{LLAMA_BENCH} is missing: run `make llama-server`", file=sys.stderr)
        return 2
    for path in args.models.split(","):
        ours, ours_fa = f"meshnet {args.numerics}", f"meshnet {args.numerics} -fa"
        runs = {ours: [], "llama-bench -fa off": [], ours_fa: [], "llama-bench -fa auto": []}
        for _ in range(args.rounds):
            runs[ours].append(meshnet_once(path, args.threads, args.numerics))
            runs["llama-bench -fa off"].append(llama_bench_once(path, args.threads, "off"))
            runs[ours_fa].append(meshnet_once(path, args.threads, args.numerics, flash_attn=True))
            runs["llama-bench -fa auto"].append(llama_bench_once(path, args.threads, "auto"))
        medians = {name: (statistics.median(p for p, _ in r), statistics.median(d for _, d in r))
                   for name, r in runs.items()}
        print(f"{os.path.basename(path)}: medians of {args.rounds} rounds in turns, {args.threads} threads, "
              f"pp{N_PROMPT} / tg{N_GEN} tok/s")
        for name, (prefill, decode) in medians.items():
            print(f"  {name:22s} pp{N_PROMPT} {prefill:7.1f}  tg{N_GEN} {decode:6.1f}")
        for mine, theirs in ((ours, "llama-bench -fa off"), (ours, "llama-bench -fa auto"),
                             (ours_fa, "llama-bench -fa auto")):
            print(f"  {mine} / {theirs}: prefill {medians[mine][0] / medians[theirs][0]:.3f}, "
                  f"decode {medians[mine][1] / medians[theirs][1]:.3f}")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
