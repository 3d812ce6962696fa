#!/usr/bin/env python3
"""Tensor-parallel decode beside the whole model on this machine (engine_c/patches/0019):
the whole model in one process, and a group of --members processes, each member pinned to a
CPU of its own where there are enough, exchanging its rows with the others over ZeroMQ PAIR
sockets (CURVE unless --insecure) from the engine's compute thread (engine/tp_link.py). Both
decode the same prompt's --tokens greedy tokens at --threads threads a process, in turns
over --rounds; prints ms per token, whether the tokens agree, and the median ratio; and, as the bound the exchange leaves room for, one member alone whose
gathers are given nothing (its tokens are not the model's).

    python tools/tp_bench.py MODEL [--members 2] [--threads 1] [--tokens 32] [--rounds 3]

A process here is driven by the bench over a PAIR socket of its own: it is given the prompt
and then each step's token, and answers with its greedy token (the group's member 0 answers
for the group; every member computes the same).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
import zmq

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PROMPT = [int(t) for t in np.arange(1000, 1032)]   # 32 tokens of any vocabulary past 1032


def member(args) -> None:
    """One process: the whole model (--size 1) or member --rank of a group of --size."""
    from meshnet.engine.binding import Entry, Stage
    from meshnet.stage.tp_group import GroupLink
    from meshnet.net.security import KeyPair

    ctx = zmq.Context()
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
        ctx.set(zmq.THREAD_AFFINITY_CPU_ADD, args.cpu)   # its I/O thread wakes it on its own CPU
    driver = ctx.socket(zmq.PAIR)
    driver.connect(args.driver)
    link = None
    if args.size > 1:
        keys = None if args.insecure else KeyPair(*zmq.curve_keypair())
        link = GroupLink(ctx, args.rank, args.size, keys)
        endpoints = {peer: link.bind_for(peer) for peer in range(args.rank + 1, args.size)}
        driver.send_json({"endpoints": endpoints, "public": keys.public.decode() if keys else None})
        told = driver.recv_json()
        for peer, (endpoint, public) in told["connect"].items():
            link.connect_to(int(peer), endpoint, public.encode() if public else None)
    options = dict(n_ctx=512, max_sessions=1, n_threads=args.threads)
    if args.floor:
        # member 0 alone, its gathers given nothing: a member's compute without the exchange
        # (its tokens are not the model's)
        stage = Stage(args.model, tp=(0, args.floor), tp_gather=lambda *gather: None, **options)
    elif link:
        stage = Stage(args.model, tp=(args.rank, args.size), tp_link=link.engine_link(), **options)
    else:
        stage = Stage(args.model, **options)
    driver.send_json({"ready": True, "model_bytes": stage.info().model_bytes})
    stage.open_session(1)
    pos = 0
    while True:
        order = driver.recv_json()
        if order.get("stop"):
            break
        tokens = np.array(order["tokens"], dtype=np.int32)
        out = stage.forward([Entry(1, pos, tokens=tokens)])
        pos += len(tokens)
        driver.send_json({"token": int(out.token[0])})
    stage.close()
    if link:
        link.close()
    driver.close(linger=0)
    ctx.term()


def run(model: str, size: int, threads: int, n_tokens: int, insecure: bool,
        floor: int = 0) -> tuple[float, list[int], list[int]]:
    """ms per decoded token, the tokens, and each process's weight bytes."""
    ctx = zmq.Context()
    drivers, procs = [], []
    cpus = sorted(os.sched_getaffinity(0))
    try:
        for rank in range(size):
            sock = ctx.socket(zmq.PAIR)
            sock.setsockopt(zmq.RCVTIMEO, 600_000)
            sock.bind("tcp://127.0.0.1:0")
            drivers.append(sock)
            cpu = cpus[rank] if len(cpus) >= size else None
            procs.append(subprocess.Popen(
                [sys.executable, __file__, model, "--member", "--rank", str(rank), "--size", str(size),
                 "--threads", str(threads), "--driver", sock.getsockopt_string(zmq.LAST_ENDPOINT)]
                + (["--cpu", str(cpu)] if cpu is not None else []) + (["--insecure"] if insecure else [])
                + (["--floor", str(floor)] if floor else [])))
        if size > 1:
            offers = [sock.recv_json() for sock in drivers]
            for rank, sock in enumerate(drivers):
                sock.send_json({"connect": {str(low): (offers[low]["endpoints"][str(rank)], offers[low]["public"])
                                            for low in range(rank)}})
        sizes = [sock.recv_json()["model_bytes"] for sock in drivers]

        def step(tokens):
            for sock in drivers:
                sock.send_json({"tokens": tokens})
            answers = [sock.recv_json()["token"] for sock in drivers]
            assert len(set(answers)) == 1, f"the group's members answered {answers}"
            return answers[0]
        token = step(PROMPT)
        got = [token]
        began = time.perf_counter()
        for _ in range(n_tokens):
            token = step([token])
            got.append(token)
        ms = (time.perf_counter() - began) * 1e3 / n_tokens
        for sock in drivers:
            sock.send_json({"stop": True})
        for proc in procs:
            proc.wait(timeout=120)
        return ms, got, sizes
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for sock in drivers:
            sock.close(linger=0)
        ctx.term()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--members", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--insecure", action="store_true", help="the group's links without CURVE")
    ap.add_argument("--json", help="write the figures here")
    # one process of a run (this script started by itself)
    ap.add_argument("--member", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--size", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--driver", help=argparse.SUPPRESS)
    ap.add_argument("--cpu", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--floor", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.member:
        member(args)
        return 0
    from meshnet.engine import models
    path = str(models.resolve(args.model or "qwen2.5-coder-1.5b")[0])
    rows = []
    for round_ in range(args.rounds):
        whole_ms, whole_tokens, whole_bytes = run(path, 1, args.threads, args.tokens, args.insecure)
        group_ms, group_tokens, group_bytes = run(path, args.members, args.threads, args.tokens, args.insecure)
        floor_ms = run(path, 1, args.threads, args.tokens, args.insecure, floor=args.members)[0]
        rows.append({"whole_ms": whole_ms, "group_ms": group_ms, "ratio": whole_ms / group_ms, "floor_ms": floor_ms,
                     "floor_ratio": whole_ms / floor_ms,
                     "same_tokens": whole_tokens == group_tokens, "whole_bytes": whole_bytes[0],
                     "member_bytes": group_bytes})
        print(f"round {round_ + 1}: whole {whole_ms:.1f} ms/token, group of {args.members} {group_ms:.1f} ms/token, "
              f"{whole_ms / group_ms:.2f}x, same tokens: {whole_tokens == group_tokens}; a member without its "
              f"exchange {floor_ms:.1f} ms/token ({whole_ms / floor_ms:.2f}x)", flush=True)
    summary = {"model": os.path.basename(path), "members": args.members, "threads": args.threads,
               "tokens": args.tokens, "curve": not args.insecure, "rounds": rows,
               "median_whole_ms": statistics.median(r["whole_ms"] for r in rows),
               "median_group_ms": statistics.median(r["group_ms"] for r in rows),
               "median_ratio": statistics.median(r["ratio"] for r in rows),
               "median_floor_ratio": statistics.median(r["floor_ratio"] for r in rows)}
    print(f"median: whole {summary['median_whole_ms']:.1f} ms/token, group {summary['median_group_ms']:.1f} ms/token, "
          f"ratio {summary['median_ratio']:.2f}x (without the exchange {summary['median_floor_ratio']:.2f}x); member weights {rows[0]['member_bytes']} B against "
          f"{rows[0]['whole_bytes']} B")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if all(r["same_tokens"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
