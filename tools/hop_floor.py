#!/usr/bin/env python3
"""The floor under meshnet's hop: a bare pyzmq PUSH -> PULL one-way latency between two
processes on this machine, the receiver idle for --gap seconds before each message (as a
stage is while the previous stage computes), with meshnet's frame sizes (a header and
one n_embd f32 row). Both ends stamp CLOCK_MONOTONIC, which processes on one host share.
    python tools/hop_floor.py [--gap 0.005] [--n 2000] [--n-embd 576] [--pin]
--pin puts each end (its thread and ZeroMQ's I/O thread) on its own CPU, as meshnet's
local workers are.
"""

import argparse
import os
import subprocess
import sys
import time

import numpy as np
import zmq


def receiver(endpoint: str, n: int, cpu: int | None) -> None:
    ctx = zmq.Context()
    if cpu is not None:
        ctx.set(zmq.THREAD_AFFINITY_CPU_ADD, cpu)
        os.sched_setaffinity(0, {cpu})
    pull = ctx.socket(zmq.PULL)
    pull.bind(endpoint)
    print("ready", flush=True)
    hops = []
    for _ in range(n):
        frames = pull.recv_multipart(copy=False)
        hops.append((time.monotonic_ns() - int.from_bytes(frames[0].bytes[:8], "little")) / 1000)
    print(f"{np.median(hops):.0f} {np.percentile(hops, 99):.0f}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gap", type=float, default=0.005, help="seconds the receiver idles before each message")
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--n-embd", type=int, default=576)
    parser.add_argument("--pin", action="store_true")
    parser.add_argument("--receive", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.receive:
        receiver(args.receive, args.n, 1 if args.pin else None)
        return 0
    endpoint = "tcp://127.0.0.1:47311"
    child = subprocess.Popen([sys.executable, __file__, "--receive", endpoint, "--n", str(args.n)]
                             + (["--pin"] if args.pin else []), stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    ctx = zmq.Context()
    if args.pin:
        ctx.set(zmq.THREAD_AFFINITY_CPU_ADD, 0)
        os.sched_setaffinity(0, {0})
    push = ctx.socket(zmq.PUSH)
    push.connect(endpoint)
    time.sleep(0.3)
    header, row = bytes(64), np.zeros(args.n_embd, np.float32).tobytes()
    for _ in range(args.n):
        time.sleep(args.gap)
        push.send_multipart([time.monotonic_ns().to_bytes(8, "little") + header[8:], row])
    p50, p99 = child.stdout.readline().split()
    child.wait()
    print(f"bare pyzmq one-way, receiver idle {args.gap * 1000:g} ms before each message"
          f"{', each end on its own CPU' if args.pin else ''}: p50 {p50} us, p99 {p99} us ({args.n} messages)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
