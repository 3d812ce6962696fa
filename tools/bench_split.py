#!/usr/bin/env python3
"""Whole model vs the same model split in two stages, both in this process.

Prints prefill and decode tokens/s (median and spread over --repeats runs, the two
configurations interleaved so machine noise hits both) and the split's cost.
    python tools/bench_split.py [--models smollm2,qwen2.5-coder-1.5b] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys

from meshnet import models
from meshnet.gguf_layout import read_layout
from meshnet.pipeline import LocalPipeline, even_ranges

PROMPT = ("In the far north, where the winters last for most of the year, a small village of fishermen "
          "kept an old tradition: every evening, one of them would climb the hill and light a fire so "
          "that the boats could find their way home. ") * 2


def measure(pipe: LocalPipeline, prompt_tokens, n_decode) -> tuple[float, float]:
    gen = pipe.generate(prompt_tokens, n_decode + 1, stop_at_eog=False)
    return gen.metrics["prefill_tok_s"], gen.metrics["decode_tok_s"]


def bench(name: str, repeats: int, n_decode: int, threads: int) -> dict:
    path, _ = models.resolve(name)
    layout = read_layout(path)
    options = dict(n_ctx=1024, max_sessions=1, n_threads=threads)
    configs = {"whole": [(0, layout.n_layer)], "2 stages": even_ranges(layout.n_layer, 2)}
    pipes = {label: LocalPipeline(path, ranges, **options) for label, ranges in configs.items()}
    try:
        prompt_tokens = pipes["whole"].head.tokenize(PROMPT)
        for pipe in pipes.values():  # warm-up: first-touch allocations, caches
            measure(pipe, prompt_tokens[:16], 4)
        runs = {label: [] for label in pipes}
        for _ in range(repeats):
            for label, pipe in pipes.items():
                runs[label].append(measure(pipe, prompt_tokens, n_decode))
    finally:
        for pipe in pipes.values():
            pipe.close()

    result = {"model": name, "prompt_tokens": len(prompt_tokens), "decode_tokens": n_decode}
    for label, samples in runs.items():
        for i, kind in enumerate(("prefill", "decode")):
            values = [s[i] for s in samples]
            result[f"{label} {kind}"] = (statistics.median(values), min(values), max(values))
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2,qwen2.5-coder-1.5b")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--decode", type=int, default=64, help="tokens decoded per run")
    parser.add_argument("--threads", type=int, default=0, help="threads per stage (0 = one per core)")
    args = parser.parse_args()

    print(f"{'model':<20} {'phase':<8} {'whole tok/s':>22} {'2 stages tok/s':>22} {'split cost':>10}")
    for name in args.models.split(","):
        r = bench(name, args.repeats, args.decode, args.threads)
        for kind in ("prefill", "decode"):
            whole, split = r[f"whole {kind}"], r[f"2 stages {kind}"]
            cost = 1 - split[0] / whole[0]
            print(f"{name:<20} {kind:<8} {whole[0]:>9.1f} [{whole[1]:.1f}-{whole[2]:.1f}] "
                  f"{split[0]:>9.1f} [{split[1]:.1f}-{split[2]:.1f}] {cost:>+9.1%}")
        print(f"{'':<20} ({r['prompt_tokens']} prompt tokens, {r['decode_tokens']} decoded, median [min-max] of {args.repeats})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
