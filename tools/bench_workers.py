#!/usr/bin/env python3
"""Two stages as worker processes over ZeroMQ vs the same two stages in one process.

Prints decode tokens/s (median [min-max] over --repeats runs, interleaved), the ratio,
and the coordinator's per-hop overhead: round trip to a stage minus the stage's own
compute time, p50/p99 over every hop of every run.
    python tools/bench_workers.py [--models smollm2] [--repeats 5] [--decode 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import numpy as np

from meshnet import models
from meshnet.cluster import LocalCluster
from meshnet.gguf_layout import read_layout
from meshnet.pipeline import LocalPipeline, even_ranges

PROMPT = "In the far north, where the winters last for most of the year, a small village of fishermen kept"


def bench(name: str, repeats: int, n_decode: int, threads: int) -> None:
    path, _ = models.resolve(name)
    ranges = even_ranges(read_layout(path).n_layer, 2)
    in_process, workers, hops = [], [], []
    with LocalPipeline(path, ranges, n_ctx=1024, max_sessions=1, n_threads=threads) as pipe, \
            LocalCluster(path, ranges, threads=threads, n_ctx=1024, max_sessions=1) as cluster:
        tokens = pipe.head.tokenize(PROMPT)
        pipe.generate(tokens, 8, stop_at_eog=False)                                  # warm-up
        cluster.coordinator.generate(tokens, 8, stop_at_eog=False).result()
        cluster.coordinator.hop_us.clear()
        for _ in range(repeats):
            in_process.append(pipe.generate(tokens, n_decode + 1, stop_at_eog=False).metrics["decode_tok_s"])
            workers.append(cluster.coordinator.generate(tokens, n_decode + 1, stop_at_eog=False).result()
                           .metrics["decode_tok_s"])
        hops = np.array(cluster.coordinator.hop_us)

    def fmt(values):
        return f"{statistics.median(values):7.1f} [{min(values):.1f}-{max(values):.1f}]"

    ratio = statistics.median(workers) / statistics.median(in_process)
    print(f"{name:<20} {fmt(in_process):>24} {fmt(workers):>24} {ratio:>6.2f}x "
          f"{np.percentile(hops, 50) / 1000:>9.3f} {np.percentile(hops, 99) / 1000:>9.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--decode", type=int, default=64, help="tokens decoded per run")
    parser.add_argument("--threads", type=int, default=0, help="threads per stage (0 = one per core)")
    args = parser.parse_args()
    print(f"{'model':<20} {'in-process tok/s':>24} {'2 workers tok/s':>24} {'ratio':>7} {'hop p50 ms':>10} {'p99 ms':>9}")
    for name in args.models.split(","):
        bench(name, args.repeats, args.decode, args.threads)
    print(f"(2 stages, {args.decode} tokens decoded per run, median [min-max] of {args.repeats}; "
          "hop = round trip coordinator->stage->coordinator minus the stage's compute)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
