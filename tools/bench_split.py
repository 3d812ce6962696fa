#!/usr/bin/env python3
"""Whole model vs the same model split in two stages, both in this process: what the
split itself costs. `meshnet bench` runs the same measurement and worker processes too.
    python tools/bench_split.py [--models smollm2,qwen2.5-coder-1.5b] [--repeats 5]
"""

import argparse
import sys

from meshnet.evidence.bench import format_report, run_bench


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2,qwen2.5-coder-1.5b")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--decode", type=int, default=64, help="tokens decoded per run")
    parser.add_argument("--threads", type=int, default=0, help="threads per stage (0 = one per core)")
    args = parser.parse_args()
    for name in args.models.split(","):
        print(format_report(run_bench(name, 2, args.repeats, args.decode, args.threads, ("whole", "stages"))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
