#!/usr/bin/env python3
"""Serving under load, side by side in one run: `meshnet serve` over S stages, `meshnet
serve` over one stage, and llama-server built from the pin (`make llama-server`: stock
options, the whole model), each on the same cores with the same session slots. All are
started first and measured in turn, each repeat going round them all (an idle server
takes no CPU), so that the machine's slow minutes fall on each alike. At each
concurrency C, C clients (the openai client, a thread each) send streaming chat requests
of a few hundred prompt tokens and MAX_TOKENS new ones, each client one request after
another, for ROUNDS requests each. Prints, per server and
concurrency, the medians over REPEATS of: aggregate tokens/s, time to first token p50/p99,
inter-token latency p50/p99, and errors; then meshnet / llama-server throughput. Plain
figures, no pass/fail.

    python tools/bench_serve.py [--model smollm2] [--concurrency 1,4,16,64] [--classes invariant,stock]
                                [--stages 2] [--threads 2] [--slots 16] [--max-tokens 128] [--repeats 3]
                                [--prompts shared|unique] [--flash-attn] [--url http://HOST:PORT] [--json FILE]

--prompts unique starts each request's context with its own line, so that no server
reuses a cached prefix of another request's (llama-server's prompt cache, meshnet's
prefix store): every prompt is prefilled whole, and the table compares the serving
itself; shared (the default) is a system prompt every request has, as a chat UI sends.

With --url it measures that one server only (any OpenAI-compatible endpoint).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import openai

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA_SERVER = os.path.join(ROOT, "build", "llama-server", "bin", "llama-server")
TOPICS = ["the sea", "a cat", "winter", "bread", "trains", "the moon", "music", "a garden", "rain", "a clock",
          "mountains", "coffee", "a library", "bees", "the desert", "a bridge"]
# a few hundred tokens of context before each question (the same for every request, as a
# system prompt is; each question differs)
CONTEXT = (
    "You are a careful writer. In the far north, where the winters last for most of the year, a small village "
    "of fishermen kept an old tradition: every evening, one of them would climb the hill and light a fire so that "
    "the boats could find their way home. The fire was built of driftwood and dry heather, and it burned until "
    "the last boat had come in. The history of mathematics begins with counting. Long before writing, people kept "
    "tallies on bones and sticks, and the first numbers were simply marks, one for each sheep or each day. Later, "
    "in Mesopotamia and Egypt, scribes needed to measure fields, divide harvests and predict the floods of the "
    "rivers. A good recipe for bread needs only four things: flour, water, salt and yeast. The baker's skill lies "
    "in time and temperature, and in knowing when the dough is ready. The river rose slowly all through the night, "
    "and by morning the low fields along its banks had become a single grey lake, with only the tops of the fences "
    "showing where the roads had been. ") * 2


class Server:
    """A server started for the bench, stopped after: its URL and how it was started."""

    def __init__(self, name: str, command: list[str], ready_pattern: str | None, url: str | None = None,
                 env: dict | None = None):
        self.name, self.url = name, url
        self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
        if ready_pattern is not None:
            for line in self.process.stderr:
                found = re.search(ready_pattern, line)
                if found:
                    self.url = found.group(1)
                    break
            else:
                raise SystemExit(f"{name} exited with status {self.process.wait()}")
        threading.Thread(target=self.process.stderr.read, daemon=True).start()   # drained, unread
        deadline = time.monotonic() + 600
        while True:   # ready once /health says so
            try:
                urllib.request.urlopen(self.url + "/health", timeout=5)
                return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"{name} did not become ready (status {self.process.poll()})")
                time.sleep(0.2)

    def stop(self):
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def meshnet_server(args, stages: int, numerics: str) -> Server:
    command = [sys.executable, "-m", "meshnet.cli.main", "serve", "--port", "0", "--model", args.model,
               "--stages", str(stages), "--threads", str(max(1, args.threads // stages)),
               "--max-sessions", str(args.slots), "--ctx", str(args.ctx), "--numerics", numerics]
    if numerics == "stock" and args.flash_attn:
        command.append("--flash-attn")
    if args.kv_pool is not None:
        command += ["--kv-pool", str(args.kv_pool)]
    env = {k: v for k, v in os.environ.items() if k != "MESHNET_API_KEY"}
    return Server(f"meshnet {stages} stage{'s' if stages > 1 else ''} ({class_label(args, numerics)})", command,
                  r"on (http://[^ ]+)/v1", env=env)


def class_label(args, numerics: str) -> str:
    return numerics + (" + flash attn" if numerics == "stock" and args.flash_attn else "")


def llama_server(args) -> Server:
    from meshnet.engine import models
    path, _ = models.resolve(args.model)
    port = free_port()
    # llama-server's own defaults but for what the comparison fixes: the cores, the slots
    # and each slot's context (-c is all slots' together)
    command = [args.llama_server, "-m", path, "--host", "127.0.0.1", "--port", str(port), "-t", str(args.threads),
               "-tb", str(args.threads), "-np", str(args.slots), "-c", str(args.ctx * args.slots), "--no-webui"]
    return Server("llama-server (stock)", command, None, url=f"http://127.0.0.1:{port}")


def one_client(client, model, client_no: int, rounds: int, max_tokens: int, records: list, lock,
               shared: bool = True) -> None:
    for r in range(rounds):
        topic = TOPICS[(client_no * rounds + r) % len(TOPICS)]
        context = CONTEXT if shared else f"Conversation {client_no}.{r} of {time.time_ns()}. {CONTEXT}"
        started = time.perf_counter()
        arrivals, n_tokens, error = [], 0, None
        try:
            stream = client.chat.completions.create(
                model=model, max_tokens=max_tokens, stream=True, stream_options={"include_usage": True},
                temperature=0.8, seed=client_no * 1000 + r,
                messages=[{"role": "system", "content": context},
                          {"role": "user", "content": f"Request {client_no}.{r}: write a long story about {topic}."}])
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    arrivals.append(time.perf_counter())
                if chunk.usage:
                    n_tokens = chunk.usage.completion_tokens
        except Exception as e:   # counted, not raised: the bench reports errors
            error = f"{type(e).__name__}: {e}"
        with lock:
            records.append({"start": started, "arrivals": arrivals, "end": time.perf_counter(),
                            "tokens": n_tokens, "error": error})


def measure(url: str, concurrency: int, rounds: int, max_tokens: int, shared: bool = True) -> dict:
    client = openai.OpenAI(base_url=url + "/v1", api_key=os.environ.get("MESHNET_API_KEY", "none"), max_retries=0,
                           timeout=900)
    model = client.models.list().data[0].id
    records, lock = [], threading.Lock()
    threads = [threading.Thread(target=one_client, args=(client, model, c, rounds, max_tokens, records, lock, shared))
               for c in range(concurrency)]
    began = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - began
    ok = [r for r in records if r["error"] is None and r["arrivals"]]
    ttft = [(r["arrivals"][0] - r["start"]) * 1e3 for r in ok]
    itl = [(b - a) * 1e3 for r in ok for a, b in zip(r["arrivals"], r["arrivals"][1:])]
    pct = (lambda xs, q: float(np.percentile(xs, q)) if xs else None)
    return {"tokens_per_s": sum(r["tokens"] for r in ok) / elapsed, "ttft_ms_p50": pct(ttft, 50),
            "ttft_ms_p99": pct(ttft, 99), "itl_ms_p50": pct(itl, 50), "itl_ms_p99": pct(itl, 99),
            "errors": len(records) - len(ok), "requests": len(records),
            "first_error": next((r["error"] for r in records if r["error"]), None)}


def median_of(runs: list[dict]) -> dict:
    out = {}
    for key in runs[0]:
        values = [r[key] for r in runs if isinstance(r[key], (int, float))]
        out[key] = float(np.median(values)) if values else runs[0][key]
    out["errors"] = sum(r["errors"] for r in runs)
    return out


def fmt(value, digits=0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="model name or GGUF path [default: smollm2]")
    parser.add_argument("--url", default=None, help="measure this running server only")
    parser.add_argument("--concurrency", default="1,4,16,64")
    parser.add_argument("--classes", default="invariant,stock", help="meshnet's numerics classes to run ('': none)")
    parser.add_argument("--stages", type=int, default=2, help="meshnet over this many stages, and over one [1: one only]")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="cores for each server in all")
    parser.add_argument("--slots", type=int, default=16, help="sessions at once, for every server")
    parser.add_argument("--ctx", type=int, default=1024, help="context tokens per slot")
    parser.add_argument("--kv-pool", type=int, default=None,
                        help="meshnet's KV pool per stage (0: each session its own --ctx cells, as llama-server's slots) "
                             "[default: serve's]")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="requests per client, one after another")
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure (their median is shown)")
    parser.add_argument("--prompts", choices=("shared", "unique"), default="shared",
                        help="a system prompt every request shares, or each its own (no cached prefix)")
    parser.add_argument("--flash-attn", action="store_true",
                        help="meshnet's stock class with flash attention, as llama-server runs by default")
    parser.add_argument("--llama-server", default=LLAMA_SERVER)
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]

    plans = []   # (name, start)
    if args.url:
        plans.append((args.url, None))
    else:
        for numerics in filter(None, args.classes.split(",")):   # ('': llama-server alone)
            if args.stages > 1:
                plans.append((f"meshnet {args.stages} stages ({class_label(args, numerics)})",
                              lambda n=numerics: meshnet_server(args, args.stages, n)))
            plans.append((f"meshnet 1 stage ({class_label(args, numerics)})", lambda n=numerics: meshnet_server(args, 1, n)))
        if os.path.exists(args.llama_server):
            plans.append(("llama-server (stock)", lambda: llama_server(args)))
        else:
            print(f"(no llama-server at {args.llama_server}: `make llama-server` builds it from the pin)")

    table = {}
    # every server started first, idle while another is measured; each repeat goes round
    # them all, so that a slow minute of this noisy machine falls on each of them alike
    servers, urls = [], {}
    try:
        for name, start in plans:
            if start is not None:
                servers.append(start())
            urls[name] = servers[-1].url if start is not None else args.url
            measure(urls[name], 1, 1, 8)   # warm-up
        for c in levels:
            runs = {name: [] for name in urls}
            for _ in range(args.repeats):
                for name, url in urls.items():
                    runs[name].append(measure(url, c, args.rounds, args.max_tokens, args.prompts == "shared"))
            for name in urls:
                table[(name, c)] = row = median_of(runs[name])
                print(f"{name:28} c={c:<3} {fmt(row['tokens_per_s'], 1):>7} tok/s  ttft p50 {fmt(row['ttft_ms_p50']):>6} "
                      f"p99 {fmt(row['ttft_ms_p99']):>6} ms  itl p50 {fmt(row['itl_ms_p50']):>5} "
                      f"p99 {fmt(row['itl_ms_p99']):>5} ms  errors {row['errors']}"
                      + (f" ({row['first_error']})" if row["first_error"] else ""), flush=True)
    finally:
        for server in servers:
            server.stop()

    base = "llama-server (stock)"
    for name, _ in plans:
        if name == base:
            continue
        ratios = [f"c={c} {table[(name, c)]['tokens_per_s'] / table[(base, c)]['tokens_per_s']:.2f}"
                  for c in levels if (base, c) in table and table[(base, c)]["tokens_per_s"]]
        if ratios:
            print(f"{name} / llama-server throughput: {', '.join(ratios)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": [dict(server=n, concurrency=c, **row) for (n, c), row in table.items()]},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
