#!/usr/bin/env python3
"""How fast this machine's memory is read by one process, and by N processes at once, each
pinned to a CPU of its own: the bound a tensor-parallel group of N members on one machine
shares (a decode step on a CPU is the read of the weights). Each process multiplies a matrix
far larger than the caches by a vector (float32, numpy's BLAS, one thread), --rounds times;
prints GB/s per process and in all, medians over --repeats, alone and together in turns.

    python tools/mem_bus.py [--processes 2] [--mib 1024] [--rounds 5] [--repeats 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # (before numpy: one BLAS thread a process)
import numpy as np  # noqa: E402


def reader(cpu: int | None, mib: int, rounds: int, start, out) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    # a matrix-vector product (BLAS, SIMD, one thread), as a decode step's matmuls read weights
    data = np.ones((mib << 10, 256), dtype=np.float32)   # MIB MiB
    vector = np.ones(256, dtype=np.float32)
    data @ vector   # (its pages touched before the clock starts)
    start.wait()
    began = time.perf_counter()
    for _ in range(rounds):
        data @ vector
    out.put(rounds * data.nbytes / (time.perf_counter() - began) / 1e9)


def run(n: int, mib: int, rounds: int) -> list[float]:
    cpus = sorted(os.sched_getaffinity(0))
    start, out = mp.Barrier(n), mp.Queue()
    procs = [mp.Process(target=reader, args=(cpus[i] if len(cpus) >= n else None, mib, rounds, start, out))
             for i in range(n)]
    for p in procs:
        p.start()
    rates = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    alone, together = [], []
    for _ in range(args.repeats):   # in turns: the machine's noise falls on both
        alone.append(run(1, args.mib, args.rounds)[0])
        together.append(run(args.processes, args.mib, args.rounds))
    one = statistics.median(alone)
    each = statistics.median(statistics.median(r) for r in together)
    total = statistics.median(sum(r) for r in together)
    print(f"one process: {one:.1f} GB/s; {args.processes} at once: {each:.1f} GB/s each, {total:.1f} GB/s in all "
          f"({total / one:.2f}x one): a group of {args.processes} here reads at most {total / one:.2f}x as fast as "
          f"the whole model alone")


if __name__ == "__main__":
    main()
