#!/usr/bin/env python3
"""The checks of tools/netns-two-host.sh, run in its namespace A. This process is the
coordinator of a route whose workers run in two network namespaces; once the route is
whole it checks, against the whole model run in this one process:

  parity     each prompt's greedy tokens through the route are the whole model's
             (and the largest |logit difference| is reported);
  isolation  the prompts run as concurrent sessions give exactly what each gave alone;
  the wire   the ICMP round trip to the other namespace is at least twice --delay-us;
  drafts     with --speculate, each prompt's tokens through the route drafting are the
             route's without drafts (and the whole model's);

prints the route's decode tokens/s and hop latency next to the whole model's (timed
runs of their own, the two in turns), and one JSON object on the last line. Exit status
0 only when every check held."""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import statistics
import struct
import sys
import time

import numpy as np

from meshnet.core.errors import MeshnetError
from meshnet.core.layers import LayerRange
from meshnet.core.metrics import paired_ratio
from meshnet.engine import models
from meshnet.engine.gguf_layout import read_layout
from meshnet.engine.pipeline import LocalPipeline
from meshnet.core.drafts import parse_speculate
from meshnet.evidence.prompts import REPETITIVE, SHORT
from meshnet.route.config import CoordinatorConfig
from meshnet.route.coordinator import Coordinator

PROMPTS = SHORT
PINGS = 20


def say(line: str) -> None:
    print(line, flush=True)


def icmp_checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    total = (total >> 16) + (total & 0xFFFF)
    total += total >> 16
    return ~total & 0xFFFF


def ping_ms(host: str, count: int = PINGS, timeout: float = 1.0) -> list[float]:
    """ICMP echo round trips in ms; a raw socket (we are root: the namespaces need it)
    so that no ping binary is needed. The first echo also resolves the neighbour (ARP)
    and is left out."""
    ident = os.getpid() & 0xFFFF
    rtts = []
    with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP) as sock:
        for seq in range(count + 1):
            body = b"meshnet-netns-ping".ljust(56, b".")
            header = struct.pack("!BBHHH", 8, 0, 0, ident, seq)
            packet = struct.pack("!BBHHH", 8, 0, icmp_checksum(header + body), ident, seq) + body
            sent = time.perf_counter()
            sock.sendto(packet, (host, 0))
            while (left := sent + timeout - time.perf_counter()) > 0:
                if not select.select([sock], [], [], left)[0]:
                    break
                reply = sock.recv(2048)
                at = (reply[0] & 0x0F) * 4   # past the IP header
                kind, _, _, rid, rseq = struct.unpack("!BBHHH", reply[at:at + 8])
                if kind == 0 and rid == ident and rseq == seq:
                    if seq > 0:
                        rtts.append((time.perf_counter() - sent) * 1e3)
                    break
            time.sleep(0.01)
    return rtts


def max_logit_diff(got: list[np.ndarray], expected: list[np.ndarray]) -> float:
    if len(got) != len(expected):
        return float("inf")
    return max((float(np.abs(a - b).max()) for a, b in zip(got, expected)), default=0.0)


def _curve_everywhere(coordinator) -> bool:
    """Every link of the route runs CURVE, as ZeroMQ reports it: the coordinator's own
    sockets, and each stage's control and data endpoint (its pushes exist only from a
    session's open: see _pushes_curve)."""
    from meshnet.net.security import mechanism

    mine = {mechanism(coordinator.router), mechanism(coordinator.data)}
    theirs = {m for s in coordinator.stage_stats() for m in (s["mechanisms"]["control"], s["mechanisms"]["data"])}
    return mine | theirs == {"CURVE"}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bind", required=True, help="the coordinator's address, e.g. tcp://10.77.0.1:5555")
    parser.add_argument("--model", default=None, help="model name or GGUF path [default: smollm2]")
    parser.add_argument("--layers", required=True, help="the ranges the workers hold, e.g. 0:19,19:30")
    parser.add_argument("--threads", type=int, default=1, help="the workers' --threads: the whole model runs with as many")
    parser.add_argument("--ctx", type=int, default=1024, help="the workers' --ctx")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument("--rounds", type=int, default=3, help="timed runs of each prompt on the whole model and "
                                                               "on the route, in turns")
    parser.add_argument("--peer", required=True, help="the other namespace's address, pinged")
    parser.add_argument("--delay-us", type=int, default=0, help="the wire's one-way delay")
    parser.add_argument("--keys", default=None, help="a directory from `meshnet keys generate`: coordinator.key_secret "
                                                     "and the workers' public keys under allowed/ (CURVE on every link)")
    parser.add_argument("--wait", type=float, default=60, help="seconds to wait for the route")
    parser.add_argument("--speculate", type=speculate_arg, default=0, metavar="ngram[:K]|off",
                        help="also decode drafting up to K tokens a round, timed beside the rest")
    args = parser.parse_args(argv)

    report: dict = {"ok": False}
    try:
        ok = check(args, report)
    except MeshnetError as e:
        say(f"error: {e}")
        report["error"] = e.to_dict()
        ok = False
    report["ok"] = ok
    say(json.dumps(report))
    return 0 if ok else 1


def speculate_arg(text: str) -> int:
    try:
        return parse_speculate(text)
    except MeshnetError as e:
        raise argparse.ArgumentTypeError(e.message) from None


def _pushes_curve(stats: list[dict]) -> tuple[bool, int]:
    """Every push a stage opened for the sessions so far (to the next stage, the
    coordinator, the head) ran CURVE; and how many there were."""
    opened = [s["mechanisms"]["pushes_opened"] for s in stats]
    return all(o and set(o) == {"CURVE"} for o in opened), sum(sum(o.values()) for o in opened)


def decode_side_by_side(pipe: LocalPipeline, coordinator: Coordinator, prompts: list, n_tokens: int,
                        rounds: int, speculate: int = 0) -> dict[str, list[float]]:
    """Decode tokens/s of the whole model here and of the route (and, with SPECULATE, of
    the route drafting), each prompt run on one and then the next, ROUNDS times: a slow
    spell of the machine falls on all. No logits travel (the parity runs carry them; a
    user's session does not)."""
    coordinator.generate(prompts[0][:16], 4, stop_at_eog=False, speculate=0).result(120)   # first-touch allocations
    speeds: dict[str, list[float]] = {"whole": [], "route": [], **({"drafting": []} if speculate else {})}
    for _ in range(rounds):
        for tokens in prompts:
            speeds["whole"].append(pipe.generate(tokens, n_tokens, stop_at_eog=False).metrics["decode_tok_s"])
            for name, drafts in (("route", 0), ("drafting", speculate)):
                if name in speeds:
                    speeds[name].append(coordinator.generate(tokens, n_tokens, stop_at_eog=False, speculate=drafts)
                                        .result(120).metrics["decode_tok_s"])
    return speeds


def report_speeds(speeds: dict[str, list[float]], what: str, report: dict, key: str, threads: int, n: str) -> None:
    whole = statistics.median(speeds["whole"])
    figures = {name: {"decode_tok_s": statistics.median(v), "over_whole": statistics.median(v) / whole,
                      "over_whole_paired": paired_ratio(v, speeds["whole"])}
               for name, v in speeds.items() if name != "whole"}
    if "drafting" in speeds:
        figures["drafting"]["over_route"] = statistics.median(speeds["drafting"]) / statistics.median(speeds["route"])
        figures["drafting"]["over_route_paired"] = paired_ratio(speeds["drafting"], speeds["route"])
    report[key] = dict(whole_decode_tok_s=whole, **figures)
    for name, f in figures.items():
        extra = (f", {f['over_route']:.3f} of the route without drafts (side by side: {f['over_route_paired']:.3f})"
                 if "over_route" in f else "")
        say(f"decode    {what}: {'route drafting' if name == 'drafting' else 'route'} {f['decode_tok_s']:.1f} tok/s, "
            f"whole model in one process {whole:.1f} tok/s: {f['over_whole']:.3f} (median of the runs side by side: "
            f"{f['over_whole_paired']:.3f}){extra}; one session, {threads} thread(s) per stage, {n}, no logits")


def check(args, report: dict) -> bool:
    path, _ = models.resolve(args.model)
    n_layer = read_layout(path).n_layer
    ranges = [LayerRange.parse(r, n_layer) for r in args.layers.split(",")]
    keys = allowed = None
    if args.keys:
        from meshnet.net import security
        keys = security.load_secret(f"{args.keys}/coordinator.key_secret")
        allowed = security.load_allowed(f"{args.keys}/allowed")
    with Coordinator(CoordinatorConfig(args.bind, keys=keys, allowed_workers=allowed)) as coordinator:
        route = coordinator.wait_for_route(args.wait, n_stages=len(ranges))
        report["curve"] = _curve_everywhere(coordinator) if keys is not None else False
        if keys is not None:
            say(f"curve     every link of the route runs CURVE: {report['curve']}")
            if not report["curve"]:
                return False
        labels = [o.label for o in route]
        report["route"] = labels
        say(f"route     {' '.join(f'{o.label}@{o.worker}' for o in route)} (coordinator {coordinator.endpoint})")
        if labels != [r.label for r in ranges]:
            say(f"FAILED: the route is {labels}, not the ranges the workers were given")
            return False

        rtts = ping_ms(args.peer)
        rtt_ok = bool(rtts) and statistics.median(rtts) >= 2 * args.delay_us / 1e3
        report["delay_us"] = args.delay_us
        report["rtt_ms"] = {"min": min(rtts), "median": statistics.median(rtts), "max": max(rtts),
                            "n": len(rtts)} if rtts else None
        if rtts:
            say(f"ping      {args.peer}: rtt min {min(rtts):.3f} / median {statistics.median(rtts):.3f} / max "
                f"{max(rtts):.3f} ms over {len(rtts)} echoes (one-way delay set: {args.delay_us / 1e3:g} ms)")
        if not rtt_ok:
            say(f"FAILED: the round trip to {args.peer} is not at least 2 x {args.delay_us} us")

        # the truth, computed while the workers sit idle: the same thread count and context
        # as theirs give the same floats
        whole = {}
        with LocalPipeline(path, [LayerRange(0, n_layer, n_layer)], n_ctx=args.ctx, max_sessions=1,
                           n_threads=args.threads) as pipe:
            for prompt in PROMPTS:
                tokens = pipe.head.tokenize(prompt)
                whole[prompt] = (tokens, pipe.generate(tokens, args.tokens, keep_logits=True, stop_at_eog=False))
            speeds = decode_side_by_side(pipe, coordinator, [whole[p][0] for p in PROMPTS], args.tokens, args.rounds,
                                         args.speculate)
            repetitive = [pipe.head.tokenize(p) for p in REPETITIVE]
            repetitive_speeds = decode_side_by_side(pipe, coordinator, repetitive, args.tokens, args.rounds,
                                                    args.speculate) if args.speculate else None
            wanted = {tuple(t): pipe.generate(t, args.tokens, stop_at_eog=False).tokens for t in repetitive} \
                if args.speculate else {}

        alone = {}
        for prompt in PROMPTS:
            alone[prompt] = coordinator.generate(whole[prompt][0], args.tokens, want_logits=True,
                                                 stop_at_eog=False).result(120)
        parity = all(alone[p].tokens == whole[p][1].tokens for p in PROMPTS)
        diff = max(max_logit_diff(alone[p].logits, whole[p][1].logits) for p in PROMPTS)
        report["parity"] = parity
        report["max_logit_diff"] = diff
        say(f"parity    {len(PROMPTS)} prompts x {args.tokens} greedy tokens through the route "
            f"{'equal' if parity else 'DIFFER from'} the whole model's in one process; max |logit diff| {diff:g}")

        drafts_ok = True
        if args.speculate:   # the same tokens drafting as without, on every prompt
            drafted = {tuple(t): coordinator.generate(list(t), args.tokens, stop_at_eog=False, speculate=args.speculate)
                       .result(120) for t in [*wanted, *(tuple(whole[p][0]) for p in PROMPTS)]}
            want = {**wanted, **{tuple(whole[p][0]): whole[p][1].tokens for p in PROMPTS}}
            drafts_ok = all(drafted[t].tokens == want[t] for t in want)
            kept = [d.metrics["speculation"] for d in drafted.values()]
            report["drafts"] = {"identical": drafts_ok, "drafted": sum(k["drafted"] for k in kept),
                                "accepted": sum(k["accepted"] for k in kept), "rounds": sum(k["rounds"] for k in kept)}
            say(f"drafts    {len(want)} prompts x {args.tokens} greedy tokens through the route drafting (up to "
                f"{args.speculate} a round) {'equal' if drafts_ok else 'DIFFER from'} the whole model's; "
                f"{report['drafts']['accepted']} of {report['drafts']['drafted']} drafts kept")

        sessions = [coordinator.generate(whole[p][0], args.tokens, stop_at_eog=False) for p in PROMPTS]
        together = [s.result(120) for s in sessions]
        isolation = all(s.tokens == alone[p].tokens for s, p in zip(together, PROMPTS))
        report["isolation"] = isolation
        stats = coordinator.stage_stats()
        shared = sum(s["batched_entries"] - s["forwards"] for s in stats)
        say(f"isolation {len(PROMPTS)} concurrent sessions {'each gave' if isolation else 'did NOT each give'} "
            f"exactly its tokens alone ({shared} steps shared a forward call with another)")
        if keys is not None:
            pushes_ok, n_pushes = _pushes_curve(stats)
            report["curve"] = report["curve"] and pushes_ok
            say(f"curve     every push the sessions opened ({n_pushes}) runs CURVE: {pushes_ok}")

        if repetitive_speeds is not None:
            report_speeds(repetitive_speeds, "repetitive prompts", report, "repetitive", args.threads,
                          f"{len(REPETITIVE)} prompts x {args.rounds} rounds")
            if "drafting" in speeds:
                report_speeds(speeds, "prose prompts", report, "prose", args.threads,
                              f"{len(PROMPTS)} prompts x {args.rounds} rounds")
        route_decode, whole_decode = statistics.median(speeds["route"]), statistics.median(speeds["whole"])
        paired = paired_ratio(speeds["route"], speeds["whole"])
        # one session's hops, as its decode rate is one session's: medians over the prompts
        hop_p50 = statistics.median(alone[p].metrics["hop_us_p50"] for p in PROMPTS)
        hop_p99 = statistics.median(alone[p].metrics["hop_us_p99"] for p in PROMPTS)
        report.update(route_decode_tok_s=route_decode, whole_decode_tok_s=whole_decode,
                      route_over_whole=route_decode / whole_decode, route_over_whole_paired=paired,
                      hop_us_p50=hop_p50, hop_us_p99=hop_p99)
        say(f"decode    route {route_decode:.1f} tok/s, whole model in one process {whole_decode:.1f} tok/s: "
            f"{route_decode / whole_decode:.3f} (median of the runs side by side: {paired:.3f}; one session, "
            f"{args.threads} thread(s) per stage, {len(PROMPTS)} prompts x {args.rounds} rounds, no logits)")
        say(f"hop       one session: p50 {hop_p50:.0f} us, p99 {hop_p99:.0f} us (medians of {len(PROMPTS)} prompts)")
        for s in coordinator.metrics()["stages"]:
            if s.get("hop_us_p50") is not None:
                say(f"hop       into {s['stage']}, every crossing (concurrent sessions included): "
                    f"p50 {s['hop_us_p50']:.0f} us, p99 {s['hop_us_p99']:.0f} us")
        return parity and isolation and rtt_ok and drafts_ok and (keys is None or report["curve"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
