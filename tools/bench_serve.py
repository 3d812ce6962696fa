#!/usr/bin/env python3
"""`meshnet serve` under load: C concurrent streaming chat clients (the openai client, a
thread each) for R rounds; prints requests/s, time to first token (p50/p99) and tokens/s.
Plain figures, no pass/fail.
    python tools/bench_serve.py [--url http://127.0.0.1:8080] [--clients 8] [--rounds 3] [--max-tokens 32]
Without --url it starts `meshnet serve` on a free loopback port (two local stages) and stops it after.
"""

import argparse
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

TOPICS = ["the sea", "a cat", "winter", "bread", "trains", "the moon", "music", "a garden", "rain", "a clock",
          "mountains", "coffee", "a library", "bees", "the desert", "a bridge"]


def start_server(args, extra=()) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "meshnet.cli.main", "serve", "--port", "0", "--stages", str(args.stages),
               "--max-sessions", str(max(args.clients, 1)), "--ctx", "1024", *extra]
    if args.model:
        command += ["--model", args.model]
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True, env={k: v for k, v in os.environ.items() if k != "MESHNET_API_KEY"})
    for line in process.stderr:
        found = re.search(r"on (http://[^ ]+)/v1", line)
        if found:
            threading.Thread(target=process.stderr.read, daemon=True).start()   # drained, unread
            url = found.group(1)
            break
    else:
        raise SystemExit(f"meshnet serve exited with status {process.wait()}")
    while True:   # ready once /health says so
        try:
            urllib.request.urlopen(url + "/health", timeout=5)
            return process, url
        except OSError:
            time.sleep(0.1)


def one_request(client, model, i, max_tokens, results):
    start = time.perf_counter()
    first, n_tokens = None, 0
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": f"Write a short paragraph about {TOPICS[i % len(TOPICS)]}."}],
        max_tokens=max_tokens, stream=True, stream_options={"include_usage": True}, temperature=0.8, seed=i)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content and first is None:
            first = time.perf_counter()
        if chunk.usage:
            n_tokens = chunk.usage.completion_tokens
    results.append((start, first, time.perf_counter(), n_tokens))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="a running meshnet serve (else one is started)")
    parser.add_argument("--api-key", default=os.environ.get("MESHNET_API_KEY", "none"))
    parser.add_argument("--model", default=None, help="with --url: the model id [default: the server's only one]")
    parser.add_argument("--stages", type=int, default=2, help="without --url: stages of the server started")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    process, url = (None, args.url.rstrip("/")) if args.url else start_server(args)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key=args.api_key, max_retries=0, timeout=300)
        model = args.model if args.url and args.model else client.models.list().data[0].id
        one_request(client, model, 0, 4, [])   # warm-up
        results: list = []
        began = time.perf_counter()
        for r in range(args.rounds):
            threads = [threading.Thread(target=one_request, args=(client, model, r * args.clients + c, args.max_tokens,
                                                                  results)) for c in range(args.clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        elapsed = time.perf_counter() - began
    finally:
        if process is not None:
            process.send_signal(signal.SIGINT)
            process.wait(timeout=30)

    ttft = np.array([(first - start) * 1e3 for start, first, _, _ in results if first is not None])
    tokens = sum(n for *_, n in results)
    per_stream = [n / (end - first) for _, first, end, n in results if first is not None and end > first and n > 1]
    print(f"meshnet serve at {url}, model {model}: {args.clients} concurrent streaming chat clients x {args.rounds} "
          f"rounds, max_tokens {args.max_tokens}")
    print(f"requests        {len(results)} in {elapsed:.2f} s: {len(results) / elapsed:.2f} requests/s")
    print(f"ttft ms         p50 {np.percentile(ttft, 50):.0f}  p99 {np.percentile(ttft, 99):.0f}  "
          f"max {ttft.max():.0f}")
    print(f"tokens          {tokens} generated: {tokens / elapsed:.1f} tokens/s in all, "
          f"{np.median(per_stream):.1f} tokens/s per stream (median, after its first token)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
