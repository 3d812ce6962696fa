#!/usr/bin/env python3
"""What a long prompt does to the streams already decoding: `meshnet serve` (its defaults,
one numerics class) with STREAMS streaming completions running; their inter-token
latency over WINDOW seconds alone, then while a prompt of LONG tokens is fed (from its
request until its first token). Prints p50/p99 of each, the ratio p99 with / p99 without,
and the long prompt's time to first token; medians over REPEATS, all in one run of one
server. Plain figures, no pass/fail.

    python tools/bench_interference.py [--model smollm2] [--streams 4] [--long 4000] [--window 10]
                                       [--numerics invariant] [--threads 2] [--repeats 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import threading
import time
import urllib.request

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serve import Server   # noqa: E402  (a sibling script)

UNIT = "The river rose slowly all through the night, and by morning the low fields were a grey lake. "


def post(url: str, body: dict, timeout: float = 1800) -> http.client.HTTPResponse:
    connection = http.client.HTTPConnection(url.removeprefix("http://"), timeout=timeout)
    connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    return connection.getresponse()


class Stream:
    """A long sampled completion, streamed; the clock at each of its tokens."""

    def __init__(self, url: str, model: str, seed: int):
        self.times: list[float] = []
        # (a few thousand tokens: within any default context, and past the bench's length)
        self.response = post(url, {"model": model, "prompt": "Once upon a time", "max_tokens": 3000,
                                   "temperature": 1.5, "seed": seed, "stream": True, "user": f"s{seed}"})
        if self.response.status != 200:
            raise SystemExit(f"a stream was refused: {self.response.status} {self.response.read()[:300]!r}")
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        try:
            for line in self.response:
                if line.startswith(b"data: {"):
                    self.times.append(time.monotonic())
        except (OSError, ValueError, AttributeError):   # (closed under it: the bench is done with it)
            pass

    def gaps(self, start: float, end: float) -> list[float]:
        t = [x for x in self.times if start <= x <= end]
        return list(np.diff(t))

    def close(self):
        self.response.close()


def percentile(values, q):
    return float(np.percentile(values, q)) if values else float("nan")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--long", type=int, default=4000)
    parser.add_argument("--window", type=float, default=10.0)
    parser.add_argument("--numerics", default="invariant")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if k != "MESHNET_API_KEY"}
    server = Server("meshnet", [sys.executable, "-m", "meshnet.cli.main", "serve", "--port", "0", "--model",
                                args.model, "--threads", str(max(1, args.threads // 2)), "--numerics", args.numerics],
                    r"on (http://[^ ]+)/v1", env=env)
    runs = []
    try:
        name = json.loads(urllib.request.urlopen(server.url + "/v1/models").read())["data"][0]["id"]
        # tokens per unit of the prompt, as the server counts them (the usage of a short one)
        units = 10
        usage = json.loads(post(server.url, {"model": name, "prompt": UNIT * units, "max_tokens": 1}).read())["usage"]
        per_unit = usage["prompt_tokens"] / units
        for repeat in range(args.repeats):
            streams = [Stream(server.url, name, seed=100 * repeat + i) for i in range(args.streams)]
            while min(len(s.times) for s in streams) < 5:
                time.sleep(0.1)
            t0 = time.monotonic()
            time.sleep(args.window)
            t1 = time.monotonic()
            prompt = UNIT * int(args.long / per_unit)
            response = post(server.url, {"model": name, "prompt": prompt, "max_tokens": 1, "user": f"long{repeat}"})
            body = json.loads(response.read())
            t2 = time.monotonic()
            for s in streams:
                s.close()
            alone = [g for s in streams for g in s.gaps(t0, t1)]
            beside = [g for s in streams for g in s.gaps(t1, t2)]
            run = {"prompt_tokens": body.get("usage", {}).get("prompt_tokens"), "ttft_s": t2 - t1,
                   "itl_p50_ms": percentile(alone, 50) * 1000, "itl_p99_ms": percentile(alone, 99) * 1000,
                   "itl_long_p50_ms": percentile(beside, 50) * 1000, "itl_long_p99_ms": percentile(beside, 99) * 1000}
            run["p99_ratio"] = run["itl_long_p99_ms"] / run["itl_p99_ms"]
            runs.append(run)
            print(json.dumps(run), flush=True)
    finally:
        server.stop()
    median = {k: float(np.median([r[k] for r in runs])) for k in runs[0]}
    print(f"{args.streams} streams, a {median['prompt_tokens']:.0f}-token prompt ({args.numerics}), medians of "
          f"{len(runs)}: inter-token p50 {median['itl_p50_ms']:.1f} -> {median['itl_long_p50_ms']:.1f} ms, p99 "
          f"{median['itl_p99_ms']:.1f} -> {median['itl_long_p99_ms']:.1f} ms (x{median['p99_ratio']:.2f}); the long "
          f"prompt's first token after {median['ttft_s']:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": runs, "median": median}, f, indent=1)


if __name__ == "__main__":
    main()
