#!/usr/bin/env python3
"""A soak of `meshnet serve`: MINUTES at concurrency C with clients that disconnect mid-
stream and stage workers killed while spares stand by. Prints, and writes as JSON:

- requests by outcome: complete and equal to their seeded reference, complete and NOT
  equal (must be 0), cut short by their own client on purpose, refused or failed (by
  code: none is expected, since a killed worker's sessions resume on its spare);
- per process (serve, each worker), resident memory and open file descriptors after
  warm-up (the run's first fifth, or a minute after a spare took its first sessions) and
  at the end, and their change (target: RSS within 5%);
- each stage's KV in use once the load has stopped (must be 0: nothing leaked).

The route: `meshnet serve --coordinator` (loopback, no keys) with two workers for each
half of the model, one of them the spare; every KILL_EVERY seconds one worker in the route
gets SIGKILL and a new one is started for its range, to be the next spare. The references
are each (prompt, seed) asked once, alone, before the load starts.

    python tools/soak.py [--minutes 30] [--concurrency 16] [--model smollm2] [--json evidence/soak.json]

A measuring tool for the record, not a test.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import openai

PROMPTS = ["Write a short poem about the sea.", "Explain how bread rises.", "List three uses of a bridge.",
           "Describe a quiet library.", "What makes coffee bitter?", "Tell a story about a clock."]
SEEDS = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_figures(pid: int) -> tuple[int, int] | None:
    """(resident bytes, open descriptors) of PID, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            rss = int(re.search(r"^VmRSS:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024
        return rss, len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, AttributeError):
        return None


class Mesh:
    """The server (a coordinator) and its workers: two per half of the model."""

    def __init__(self, model: str, threads: int, sessions: int, logs: str | None):
        self.model, self.threads, self.sessions, self.logs = model, threads, sessions, logs
        self.coordinator = f"tcp://127.0.0.1:{free_port()}"
        self.port = free_port()
        self.server = subprocess.Popen(
            [sys.executable, "-m", "meshnet.cli.main", "serve", "--model", model, "--port", str(self.port),
             "--coordinator", self.coordinator, "--insecure", "--resume-wait", "30"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self.log("serve"), start_new_session=True)
        self.workers: dict[str, list[subprocess.Popen]] = {"0:15": [], "15:30": []}
        for layers in self.workers:
            for _ in range(2):
                self.start_worker(layers)
        self.url = f"http://127.0.0.1:{self.port}"

    def start_worker(self, layers: str) -> None:
        self.workers[layers].append(subprocess.Popen(
            [sys.executable, "-m", "meshnet.cli.main", "worker", "--coordinator", self.coordinator, "--model",
             self.model, "--layers", layers, "--threads", str(self.threads), "--max-sessions", str(self.sessions),
             "--insecure"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self.log(f"worker-{layers}"),
            start_new_session=True))

    def log(self, name: str):
        """Where a process's stderr goes: a file of its own under --logs (to explain a
        failure), else nowhere."""
        if self.logs is None:
            return subprocess.DEVNULL
        os.makedirs(self.logs, exist_ok=True)
        return open(os.path.join(self.logs, f"{name.replace(':', '-')}-{time.time_ns()}.log"), "w")

    def kill_one(self, rng: random.Random) -> None:
        """SIGKILL a live worker of a random half (the route's or the spare: either is a
        loss the mesh must take), and start its successor."""
        layers = rng.choice(sorted(self.workers))
        live = [w for w in self.workers[layers] if w.poll() is None]
        victim = rng.choice(live)
        victim.kill()
        victim.wait()
        self.workers[layers].remove(victim)
        self.start_worker(layers)

    def pids(self) -> dict[str, int]:
        out = {"serve": self.server.pid}
        for layers, ws in self.workers.items():
            for i, w in enumerate(ws):
                if w.poll() is None:
                    out[f"worker {layers} #{w.pid}"] = w.pid
        return out

    def close(self) -> None:
        for w in [w for ws in self.workers.values() for w in ws] + [self.server]:
            if w.poll() is None:
                w.send_signal(signal.SIGINT)
        for w in [w for ws in self.workers.values() for w in ws] + [self.server]:
            try:
                w.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(w.pid, signal.SIGKILL)


def ask(client, model: str, prompt: str, seed: int, max_tokens: int, cut_after: int | None) -> tuple[str, str]:
    """(outcome, text): 'complete', 'cut' (the client left after CUT_AFTER chunks) or an error code."""
    try:
        stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=max_tokens, temperature=0.8, seed=seed, stream=True)
        text, n = "", 0
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
                n += 1
                if cut_after is not None and n >= cut_after:
                    stream.close()
                    return "cut", text
        return "complete", text
    except openai.APIStatusError as e:
        return f"http {e.status_code} {(e.body or {}).get('code') if isinstance(e.body, dict) else ''}", ""
    except Exception as e:   # counted, not raised: the soak reports errors
        return type(e).__name__, ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--kill-every", type=float, default=60, help="seconds between worker kills")
    parser.add_argument("--cut-share", type=float, default=0.2, help="the share of requests whose client leaves")
    parser.add_argument("--threads", type=int, default=1, help="compute threads per worker")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", default=None)
    parser.add_argument("--logs", default=None, help="a folder for each process's stderr")
    args = parser.parse_args()
    rng = random.Random(args.seed)

    mesh = Mesh(args.model, args.threads, args.concurrency, args.logs)
    try:
        client = openai.OpenAI(base_url=mesh.url + "/v1", api_key="none", max_retries=0, timeout=600)
        deadline = time.monotonic() + 600
        while True:
            try:
                model = client.models.list().data[0].id
                if ask(client, model, PROMPTS[0], 0, 2, None)[0] == "complete":
                    break
            except Exception:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the mesh did not serve within 600 s")
            time.sleep(1)
        references = {(p, s): ask(client, model, p, s, args.max_tokens, None) for p in PROMPTS for s in range(SEEDS)}
        assert all(o == "complete" for o, _ in references.values()), "a reference failed"

        outcomes: collections.Counter = collections.Counter()
        lock, stop = threading.Lock(), threading.Event()

        def client_loop(k: int) -> None:
            local = random.Random(args.seed * 1000 + k)
            while not stop.is_set():
                key = (local.choice(PROMPTS), local.randrange(SEEDS))
                cut = local.randrange(1, 8) if local.random() < args.cut_share else None
                outcome, text = ask(client, model, key[0], key[1], args.max_tokens, cut)
                if outcome == "complete":
                    outcome = "complete, equal" if text == references[key][1] else "complete, NOT EQUAL"
                with lock:
                    outcomes[outcome] += 1
        threads = [threading.Thread(target=client_loop, args=(k,), daemon=True) for k in range(args.concurrency)]
        began = time.monotonic()
        for t in threads:
            t.start()
        samples: dict[str, list] = collections.defaultdict(list)
        end = began + args.minutes * 60
        next_kill = began + args.kill_every
        while time.monotonic() < end:
            time.sleep(5)
            now = time.monotonic()
            for name, pid in mesh.pids().items():
                figures = proc_figures(pid)
                if figures is not None:
                    samples[name].append((now - began, *figures))
            if now >= next_kill:
                mesh.kill_one(rng)
                next_kill = now + args.kill_every
        stop.set()
        for t in threads:
            t.join(timeout=600)
        time.sleep(5)
        health = json.loads(urllib_get(mesh.url + "/health"))
        # what the coordinator did for the caller when a worker was lost under a request
        counted = {m.group(1): int(float(m.group(2))) for m in re.finditer(
            r"^meshnet_(resumes_total|text_retries_total)\{\} (\S+)$", urllib_get(mesh.url + "/metrics"), re.M)}
        processes = {}
        for name, points in samples.items():
            warm = warmed_at(points, args.minutes * 60 / 5, worker=name.startswith("worker"))
            after = [p for p in points if p[0] >= warm]
            if len(after) >= 2:
                processes[name] = {"rss_warm": after[0][1], "rss_end": after[-1][1],
                                   "rss_change": after[-1][1] / after[0][1] - 1,
                                   "fds_warm": after[0][2], "fds_end": after[-1][2]}
        report = {"args": vars(args), "outcomes": dict(outcomes), "coordinator": counted, "processes": processes,
                  "not_measured": sorted(set(samples) - set(processes)),
                  "kv_in_use_after": [s.get("kv_bytes_used") for s in health.get("stages", [])],
                  "samples": dict(samples)}
    finally:
        mesh.close()
    for outcome, n in sorted(report["outcomes"].items()):
        print(f"{outcome:24} {n}")
    for name, p in sorted(report["processes"].items()):
        print(f"{name:28} RSS {p['rss_warm'] >> 20} -> {p['rss_end'] >> 20} MiB ({p['rss_change']:+.1%}), "
              f"fds {p['fds_warm']} -> {p['fds_end']}")
    for name in report["not_measured"]:
        print(f"{name:28} joined in the run's last minute, or was killed before its warm-up ended: not measured")
    print("KV in use after the load:", report["kv_in_use_after"])
    print("sessions resumed on a spare:", report["coordinator"].get("resumes_total", 0),
          "| text requests asked again:", report["coordinator"].get("text_retries_total", 0))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def warmed_at(points: list[tuple[float, int, int]], run_warm_up: float, worker: bool = True) -> float:
    """When a process's warm-up ends: the run's first fifth, or for a worker that joined the
    route later (a spare), a minute after it did: when its open descriptors first reached
    their most (it opened its links to its neighbours; a spare sampled while it still loaded
    rises once when it has loaded and again when it joins). Without the second rule a
    spare's first sessions count as growth. (serve's descriptors follow its clients.)"""
    if not worker:
        return run_warm_up
    most = max(fds for _, _, fds in points)
    joined = next(t for t, _, fds in points if fds == most)
    return max(run_warm_up, joined + 60) if most > points[0][2] else run_warm_up


def urllib_get(url: str) -> str:
    import urllib.error
    import urllib.request
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.read().decode()
    except urllib.error.HTTPError as e:
        return e.read().decode()


if __name__ == "__main__":
    sys.exit(main())
