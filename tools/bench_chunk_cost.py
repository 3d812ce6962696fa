#!/usr/bin/env python3
"""What a prompt chunk costs a stage beside decoding sessions, by its rows and the
context it attends over: one stage in a KV pool (as `meshnet serve` opens it), SHORT
sessions decoding, one long session fed to each CONTEXT. For each context it times one
forward call of: the decoding rows alone; the decoding rows with a chunk of R rows of the
long session; the chunk alone. Medians over REPEATS calls, each call undone (the sessions
truncated back) so every call sees the same cache. Plain figures, no pass/fail: the
route's chunk budget (route/sessions.py) is fitted to them.

    python tools/bench_chunk_cost.py [--model smollm2] [--layers 0:15] [--threads 1] [--short 2]
                                     [--contexts 0,1024,2048,4096] [--rows 1,4,8] [--repeats 7]
                                     [--numerics invariant|stock]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from meshnet.core import numerics   # noqa: E402
from meshnet.engine import models   # noqa: E402
from meshnet.engine.binding import Entry, Stage   # noqa: E402

SHORT_PROMPT = 256
FEED = 64


def timed(stage: Stage, entries: list[Entry], undo: dict[int, int], repeats: int) -> float:
    """The median seconds of one forward call of ENTRIES; each call's cells taken back."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        stage.forward(entries, want_logits=False)
        times.append(time.perf_counter() - t0)
        for sid, n in undo.items():
            stage.truncate_session(sid, n)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--layers", default="0:15")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--short", type=int, default=2, help="sessions decoding beside the chunk")
    parser.add_argument("--contexts", default="0,1024,2048,4096")
    parser.add_argument("--rows", default="1,4,8")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--pool", type=int, default=16384)
    parser.add_argument("--numerics", default=numerics.INVARIANT, help="the stage's numerics class")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    start, end = (int(x) for x in args.layers.split(":"))
    contexts = [int(x) for x in args.contexts.split(",")]
    rows = [int(x) for x in args.rows.split(",")]
    rng = np.random.default_rng(0)
    stage = Stage(models.ensure(args.model), (start, end), n_ctx=max(contexts) + 512, max_sessions=args.short + 1,
                  n_threads=args.threads, numerics=args.numerics, pool_cells=args.pool)
    vocab = stage.n_vocab
    shorts = list(range(1, args.short + 1))
    long_sid = args.short + 1
    for sid in shorts + [long_sid]:
        stage.open_session(sid)
    for sid in shorts:
        prompt = rng.integers(0, vocab, SHORT_PROMPT, dtype=np.int32)
        for at in range(0, SHORT_PROMPT, FEED):
            stage.forward([Entry(sid, at, tokens=prompt[at:at + FEED])], want_logits=False)
    fed = 0
    results = []
    for context in contexts:
        while fed < context:
            n = min(FEED, context - fed)
            stage.forward([Entry(long_sid, fed, tokens=rng.integers(0, vocab, n, dtype=np.int32))], want_logits=False)
            fed += n
        undo = {sid: SHORT_PROMPT for sid in shorts} | {long_sid: fed}
        decode = [Entry(sid, SHORT_PROMPT, tokens=rng.integers(0, vocab, 1, dtype=np.int32)) for sid in shorts]
        row = {"context": context, "decode_ms": 1000 * timed(stage, decode, undo, args.repeats)}
        for r in rows:
            chunk = Entry(long_sid, fed, tokens=rng.integers(0, vocab, r, dtype=np.int32))
            row[f"decode+{r}_ms"] = 1000 * timed(stage, decode + [chunk], undo, args.repeats)
            row[f"chunk{r}_ms"] = 1000 * timed(stage, [chunk], undo, args.repeats)
        results.append(row)
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    stage.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
