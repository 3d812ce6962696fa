#!/usr/bin/env python3
"""Kill stages at random while sessions run, with a spare for every range, and count
what became of each session: the same tokens as a run with no failure, a structured
error, or a hang (which must never happen).

One LocalCluster (a worker per range, plus one spare per range) serves every round.
Each round starts --sessions sessions at once (greedy and seeded sampling, alternately),
waits a seeded random moment (mid-prefill or mid-decode), SIGKILLs the route's worker of
a random range, then waits for every session with a bound; a new spare for that range is
started before the next round. The expected tokens of each request come from a round
with no kill, first.

    python tools/failover_loop.py                          # 100 kills, 8 sessions, seed 1
    python tools/failover_loop.py --kills 10 --threads 1

A measuring tool for the record, not a test: it prints a line per round and a summary.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from meshnet.core.errors import MeshnetError  # noqa: E402
from meshnet.core.sampling import Sampling  # noqa: E402
from meshnet.engine import models  # noqa: E402
from meshnet.engine.gguf_layout import read_layout  # noqa: E402
from meshnet.launch.local_cluster import LocalCluster  # noqa: E402

TOPICS = ["the lighthouse keeper", "a village baker", "a small robot", "the printing press", "a mountain road",
          "the night train", "an old library", "a river delta"]


def requests(n: int) -> list[tuple[str, Sampling | None]]:
    return [(f"Tell me about {TOPICS[i % len(TOPICS)]}. " * 6,
             None if i % 2 == 0 else Sampling(temperature=0.8, top_p=0.95, seed=1000 + i)) for i in range(n)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--kills", type=int, default=100)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=120.0, help="a session not ended by then is a hang")
    args = parser.parse_args()

    rng = random.Random(args.seed)
    path, _ = models.resolve(args.model)
    ranges = [r.as_tuple() for r in read_layout(path).balanced_ranges(2)]
    work = requests(args.sessions)
    outcomes = collections.Counter()
    resume_ms, codes = [], collections.Counter()

    with LocalCluster(path, ranges, threads=args.threads, n_ctx=1024, max_sessions=args.sessions,
                      heartbeat_interval=0.1, heartbeat_liveness=10) as cluster:
        coordinator = cluster.coordinator
        queues = {r: collections.deque([cluster.processes[r]]) for r in ranges}
        every = list(cluster.processes.values())

        def add_spare(layers):
            process = cluster.spawn_worker(layers)
            queues[layers].append(process)
            every.append(process)
            cluster.wait_offered(process)

        try:
            prompts = [coordinator.tokenize(text) for text, _ in work]
            handles = [coordinator.generate(p, args.max_tokens, sampling=s, stop_at_eog=False)
                       for p, (_, s) in zip(prompts, work)]
            expected = [h.result(args.timeout).tokens for h in handles]
            for r in ranges:
                add_spare(r)
            print(f"failover loop: {path.name} {ranges}, {args.sessions} sessions x {args.max_tokens} tokens per round, "
                  f"{args.kills} kills, seed {args.seed}", flush=True)
            for round_no in range(1, args.kills + 1):
                layers = rng.choice(ranges)
                delay = rng.uniform(0.0, 1.5)
                handles = [coordinator.generate(p, args.max_tokens, sampling=s, stop_at_eog=False)
                           for p, (_, s) in zip(prompts, work)]
                results = [None] * len(handles)

                def wait(i):
                    try:
                        results[i] = ("tokens", handles[i].result(args.timeout))
                    except MeshnetError as e:
                        results[i] = ("error", e)

                threads = [threading.Thread(target=wait, args=(i,), daemon=True) for i in range(len(handles))]
                for t in threads:
                    t.start()
                time.sleep(delay)
                os.kill(queues[layers].popleft().pid, signal.SIGKILL)
                for t in threads:
                    t.join(args.timeout + 5)
                line = collections.Counter()
                for i, result in enumerate(results):
                    if result is None:
                        line["hung"] += 1
                    elif result[0] == "error":
                        line["failed"] += 1
                        codes[result[1].code] += 1
                    elif result[1].tokens == expected[i]:
                        line["identical"] += 1
                        resume_ms += [r["elapsed_ms"] for r in result[1].metrics.get("resumed", [])
                                      if "elapsed_ms" in r]
                    else:
                        line["different"] += 1
                outcomes.update(line)
                print(f"round {round_no:3d}: kill [{layers[0]},{layers[1]}) after {delay:.2f} s: "
                      + ", ".join(f"{k} {v}" for k, v in sorted(line.items())), flush=True)
                if line["hung"]:
                    print("a session hung: stopping", flush=True)
                    break
                add_spare(layers)
        finally:
            for process in every:
                if process.poll() is None:
                    process.kill()

    total = sum(outcomes.values())
    print(f"sessions: {total}; identical {outcomes['identical']}, different {outcomes['different']}, "
          f"failed with a structured error {outcomes['failed']} {dict(codes)}, hung {outcomes['hung']}")
    if resume_ms:
        resume_ms.sort()
        print(f"resume time (loss to the first token after it): p50 {statistics.median(resume_ms):.0f} ms, "
              f"p99 {resume_ms[min(len(resume_ms) - 1, int(0.99 * len(resume_ms)))]:.0f} ms, max {resume_ms[-1]:.0f} ms "
              f"over {len(resume_ms)} resumes")
    return 0 if outcomes["hung"] == 0 and outcomes["different"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
