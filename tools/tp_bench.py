#!/usr/bin/env python3
"""Tensor-parallel decode beside the whole model on this machine (engine_c/patches/0019):
the whole model in one process, and a group of --members processes, each member pinned to a
CPU of its own where there are enough, exchanging its rows with the others over TCP streams
keyed from their CURVE keys (sealed unless --insecure) from the engine's compute thread
(net/member_link.py, engine/tp_link.py), spinning --spin-us at a gather before it sleeps. Both
decode the same prompt's --tokens greedy tokens at --threads threads a process, in turns
over --rounds; prints ms per token, whether the tokens agree, and the median ratio, with
each member's exchange (gathers, their time, the part spent waiting, bytes sent); and, as
the bound the exchange leaves room for, the group's members side by side (sharing the
memory bus as the group does) with their gathers given nothing (their tokens are not the
model's).

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
    if args.size > 1 and not args.floor:
        keys = None if args.insecure else KeyPair(*zmq.curve_keypair())
        link = GroupLink(args.rank, args.size, keys, spin_us=args.spin_us)
        driver.send_json({"public": keys.public.decode() if keys else None})
        publics = [p.encode() if p else None for p in driver.recv_json()["publics"]]
        endpoints = {peer: link.bind_for(peer, f"tcp://{args.address}:0", peer_public=publics[peer])
                     for peer in range(args.rank + 1, args.size)}
        driver.send_json({"endpoints": endpoints})
        told = driver.recv_json()
        for peer, endpoint in told["connect"].items():
            link.connect_to(int(peer), endpoint, publics[int(peer)])
    options = dict(n_ctx=512, max_sessions=1, n_threads=args.threads)
    if args.floor:
        # its gathers given nothing: a member's compute without the exchange (its tokens are
        # not the model's)
        stage = Stage(args.model, tp=(args.rank, args.size), tp_gather=lambda *gather: None, **options)
    elif link:
        stage = Stage(args.model, tp=(args.rank, args.size), tp_link=link.engine_link(), **options)
    else:
        stage = Stage(args.model, **options)
    figures = [link.measure().__dict__] if link else []
    driver.send_json({"ready": True, "model_bytes": stage.info().model_bytes, "links": figures})
    stage.open_session(1)
    pos = 0
    while True:
        order = driver.recv_json()
        if order.get("stats"):   # the exchange's figures so far
            driver.send_json(link.engine_link().stats() if link else {})
            continue
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


def hosts(args) -> list[tuple[str, str]]:
    """(network namespace or "", address) for each member in turn."""
    if not args.hosts:
        return [("", "127.0.0.1")]
    return [tuple(h.split(":", 1)) for h in args.hosts.split(",")]


def per_token(before: dict, after: dict, n_tokens: int) -> dict:
    """A member's exchange in decode, a token's worth: its gathers, their time, the part of it
    it waited with nothing to send or read, and what it sent."""
    d = {k: after[k] - before[k] for k in after}
    return {"gathers": d["gathers"] / n_tokens, "exchange_ms": d["gather_ns"] / 1e6 / n_tokens,
            "idle_ms": d["idle_ns"] / 1e6 / n_tokens, "sent_kb": d["bytes_sent"] / 1e3 / n_tokens,
            "us_per_gather": d["gather_ns"] / 1e3 / max(1, d["gathers"])}


def run(model: str, size: int, args, floor: bool = False) -> tuple[float, list[int], list[int], list[dict]]:
    """ms per decoded token, the tokens, and each process's weight bytes."""
    ctx = zmq.Context()
    drivers, procs = [], []
    cpus = sorted(os.sched_getaffinity(0))
    try:
        for rank in range(size):
            sock = ctx.socket(zmq.PAIR)
            sock.setsockopt(zmq.RCVTIMEO, 600_000)
            sock.bind(f"tcp://{hosts(args)[0][1]}:0")
            drivers.append(sock)
            cpu = cpus[rank] if len(cpus) >= size else None
            namespace, address = hosts(args)[rank % len(hosts(args))]
            procs.append(subprocess.Popen(
                (["ip", "netns", "exec", namespace] if namespace else [])
                + [sys.executable, __file__, model, "--member", "--rank", str(rank), "--size", str(size),
                   "--threads", str(args.threads), "--driver", sock.getsockopt_string(zmq.LAST_ENDPOINT),
                   "--address", address, "--spin-us", str(args.spin_us)]
                + (["--cpu", str(cpu)] if cpu is not None else []) + (["--insecure"] if args.insecure else [])
                + (["--floor"] if floor else [])))
        if size > 1 and not floor:
            publics = [sock.recv_json()["public"] for sock in drivers]
            for sock in drivers:
                sock.send_json({"publics": publics})
            offers = [sock.recv_json() for sock in drivers]
            for rank, sock in enumerate(drivers):
                sock.send_json({"connect": {str(low): offers[low]["endpoints"][str(rank)] for low in range(rank)}})
        ready = [sock.recv_json() for sock in drivers]
        sizes = [r["model_bytes"] for r in ready]
        links = [f for r in ready for f in r["links"]]

        def step(tokens):
            for sock in drivers:
                sock.send_json({"tokens": tokens})
            answers = [sock.recv_json()["token"] for sock in drivers]
            assert floor or len(set(answers)) == 1, f"the group's members answered {answers}"
            return answers[0]
        def stats():
            for sock in drivers:
                sock.send_json({"stats": True})
            return [sock.recv_json() for sock in drivers]
        token = step(PROMPT)
        got = [token]
        before = stats()
        began = time.perf_counter()
        for _ in range(args.tokens):
            token = step([token])
            got.append(token)
        ms = (time.perf_counter() - began) * 1e3 / args.tokens
        exchange = [per_token(a, b, args.tokens) for a, b in zip(before, stats()) if a]
        for sock in drivers:
            sock.send_json({"stop": True})
        for proc in procs:
            proc.wait(timeout=120)
        return ms, got, sizes, (exchange, links)
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
    ap.add_argument("--insecure", action="store_true", help="the group's rows not sealed")
    ap.add_argument("--spin-us", type=int, default=20_000, help="how long a member spins at a gather before it sleeps")
    ap.add_argument("--hosts", help="NAMESPACE:ADDRESS,... : member r runs in the r-th network namespace (the "
                    "bench and the whole model in the first) and listens on its address (tools/netns-tp.sh)")
    ap.add_argument("--json", help="write the figures here")
    # one process of a run (this script started by itself)
    ap.add_argument("--member", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--size", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--driver", help=argparse.SUPPRESS)
    ap.add_argument("--cpu", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--address", default="127.0.0.1", help=argparse.SUPPRESS)
    ap.add_argument("--floor", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.member:
        member(args)
        return 0
    from meshnet.core import tp_cost
    from meshnet.engine import models
    from meshnet.engine.gguf_layout import read_layout
    path = str(models.resolve(args.model or "qwen2.5-coder-1.5b")[0])
    layout = read_layout(path)
    shape = tp_cost.group_shape(args.members, layout.n_layer, layout.n_embd, layout.attn_width, layout.n_ff,
                                layout.n_vocab, sum(layout.layer_weights), layout.output_weights)
    rows = []
    for round_ in range(args.rounds):
        whole_ms, whole_tokens, whole_bytes, _ = run(path, 1, args)
        group_ms, group_tokens, group_bytes, (exchange, links) = run(path, args.members, args)
        floor_ms = run(path, args.members, args, floor=True)[0]
        link = tp_cost.LinkCost(max(f["gather_us"] for f in links), min(f["bandwidth"] for f in links))
        # the members' compute in the group: its time less the exchange of the member that waited
        # least for the other (the slower one); the model predicts the exchange on top of it
        compute_ms = group_ms - min(x["exchange_ms"] for x in exchange)
        predicted = tp_cost.group_ms(compute_ms, shape, link)
        apart = tp_cost.group_ms(tp_cost.member_ms_from_whole(whole_ms, shape), shape, link)
        rows.append({"whole_ms": whole_ms, "group_ms": group_ms, "ratio": whole_ms / group_ms, "floor_ms": floor_ms,
                     "floor_ratio": whole_ms / floor_ms,
                     "same_tokens": whole_tokens == group_tokens, "whole_bytes": whole_bytes[0],
                     "member_bytes": group_bytes, "exchange": exchange, "link": link.__dict__,
                     "compute_ms": compute_ms, "predicted_ms": predicted, "predicted_error": predicted / group_ms - 1,
                     "predicted_apart_ms": apart})
        print(f"round {round_ + 1}: whole {whole_ms:.1f} ms/token, group of {args.members} {group_ms:.1f} ms/token, "
              f"{whole_ms / group_ms:.2f}x, same tokens: {whole_tokens == group_tokens}; the members without their "
              f"exchange {floor_ms:.1f} ms/token ({whole_ms / floor_ms:.2f}x)", flush=True)
        print(f"  the link: a gather {link.gather_us:.0f} us, {link.bandwidth / 1e6:.0f} MB/s; the cost model "
              f"({shape.gathers} gathers, {shape.sent_bytes / 1e3:.0f} kB a member a token) predicts "
              f"{predicted:.1f} ms/token from the members' compute of {compute_ms:.1f} ({predicted / group_ms - 1:+.0%} of the "
              f"measured), "
              f"and {apart:.1f} ms/token ({whole_ms / apart:.2f}x) for members on hosts of their own", flush=True)
        for rank, x in enumerate(exchange):
            print(f"  member {rank}: {x['gathers']:.0f} gathers a token, {x['exchange_ms']:.1f} ms in them "
                  f"({x['us_per_gather']:.0f} us each), {x['idle_ms']:.1f} ms of it waiting, "
                  f"{x['sent_kb']:.0f} kB sent", flush=True)
    summary = {"model": os.path.basename(path), "members": args.members, "threads": args.threads,
               "tokens": args.tokens, "hosts": hosts(args), "sealed": not args.insecure, "spin_us": args.spin_us, "rounds": rows,
               "median_whole_ms": statistics.median(r["whole_ms"] for r in rows),
               "median_group_ms": statistics.median(r["group_ms"] for r in rows),
               "median_ratio": statistics.median(r["ratio"] for r in rows),
               "median_floor_ratio": statistics.median(r["floor_ratio"] for r in rows),
               "median_predicted_error": statistics.median(r["predicted_error"] for r in rows)}
    print(f"median: whole {summary['median_whole_ms']:.1f} ms/token, group {summary['median_group_ms']:.1f} ms/token, "
          f"ratio {summary['median_ratio']:.2f}x (without the exchange {summary['median_floor_ratio']:.2f}x), "
          f"the cost model {summary['median_predicted_error']:+.0%}; member weights {rows[0]['member_bytes']} B against "
          f"{rows[0]['whole_bytes']} B")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if all(r["same_tokens"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
