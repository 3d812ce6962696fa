#!/usr/bin/env python3
"""The planner's memory per stage against the RSS measured: each stage as a worker
process, one session filled to the end of its context in full batches, then the peak RSS (VmHWM) of
each worker beside what the planner predicts for it, with per-layer memory (the engine's
layer_memory) and without it (every layer counted as full-context attention).

    .venv/bin/python tools/plan_rss.py MODEL --ranges 0:1,1:2,2:4 [--ctx 8192] [--sessions 4]

Prints one line per stage and the ratio predicted / measured.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from meshnet.core.planner import OVERHEAD, ModelCost, Settings, format_size, stage_need  # noqa: E402
from meshnet.engine.binding import layer_memory  # noqa: E402
from meshnet.engine.gguf_layout import read_layout  # noqa: E402
from meshnet.launch.local_cluster import LocalCluster  # noqa: E402


def peak_rss(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for {pid}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--ranges", required=True, help="e.g. 0:1,1:2,2:4")
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--batch", type=int, default=512)
    args = ap.parse_args()
    ranges = [tuple(int(x) for x in r.split(":")) for r in args.ranges.split(",")]
    layout = read_layout(args.model)
    per_layer = ModelCost.from_layout(layout, layer_memory(args.model))
    uniform = ModelCost.from_layout(layout)
    settings = Settings(n_ctx=args.ctx, n_sessions=args.sessions, n_batch=args.batch)
    with LocalCluster(args.model, ranges, threads=1, n_ctx=args.ctx, max_sessions=args.sessions) as cluster:
        # one session to the end of its context, in full batches: the last one attends over
        # the whole context, as large a pass as the engine reserves its compute buffers for
        # (every session's KV is written when the cache is cleared, so one is enough)
        prompt = np.random.default_rng(0).integers(0, layout.n_vocab, args.ctx - 2).tolist()
        cluster.coordinator.generate(prompt, 2, stop_at_eog=False, prefill_chunk=args.batch).result(900)
        print(f"{layout.arch}: n_ctx {args.ctx}, {args.sessions} sessions, n_batch {args.batch}, overhead "
              f"{format_size(OVERHEAD)}")
        for r in ranges:
            measured = peak_rss(cluster.processes[r].pid)
            new, old = stage_need(per_layer, *r, settings), stage_need(uniform, *r, settings)
            print(f"  [{r[0]},{r[1]})  peak RSS {format_size(measured):>11}  predicted {format_size(new):>11} "
                  f"({new / measured:.3f})  uniform KV {format_size(old):>11} ({old / measured:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
