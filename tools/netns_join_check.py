#!/usr/bin/env python3
"""The checks of tools/netns-join.sh, run in its namespace A: the host others join.

This process is what `meshnet coordinator --model` (or `meshnet serve --mem`) runs on the
first machine: the mesh's keys, the holder of the model's bytes and the mDNS announcement
(launch/mesh_host.MeshHost) beside a coordinator; and its own worker, spawned as `meshnet
serve --mem` spawns it (serve/launch.spawn_joined_worker), within the memory the planner
says the first half of the layers need. Once that worker is registered it writes the join
token (without addresses: host B finds A on the LAN, and with them) to the files the
script named; the script starts B's worker with it, from an empty MESHNET_HOME. Once the
route of two stages is whole it checks:

  the route  two stages, one on each host, covering the model; B's range is reported;
  CURVE      every link of the route runs CURVE, as ZeroMQ reports it (the coordinator's
             sockets, each stage's control, data and push sockets) and so does the holder
             that B fetched from;
  parity     each prompt's greedy tokens through the route are the whole model's in this
             process, and the largest |logit difference| is 0;
  the share  B's fetched file (a sparse GGUF under its MESHNET_HOME) takes on disk about
             the bytes of its range's spans (the header, its layers' tensors and the
             head's or tail's): disk_ratio = disk bytes / share bytes <= 1.05.

Progress goes to stderr, one JSON
object to stdout. Exit status 0 only when every check held."""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from netns_check import _curve_everywhere, _pushes_curve, max_logit_diff  # noqa: E402  (tools/, beside this)

from meshnet.core import defaults  # noqa: E402
from meshnet.core.errors import MeshnetError  # noqa: E402
from meshnet.core.layers import LayerRange  # noqa: E402
from meshnet.core.planner import ModelCost, format_size, stage_need, worker_settings  # noqa: E402
from meshnet.engine import models  # noqa: E402
from meshnet.engine.binding import layer_memory  # noqa: E402
from meshnet.engine.gguf_layout import read_layout  # noqa: E402
from meshnet.engine.pipeline import LocalPipeline  # noqa: E402
from meshnet.evidence.prompts import SHORT  # noqa: E402
from meshnet.launch.mesh_host import MeshHost  # noqa: E402
from meshnet.net.security import mechanism  # noqa: E402
from meshnet.route.config import CoordinatorConfig  # noqa: E402
from meshnet.route.coordinator import Coordinator  # noqa: E402
from meshnet.serve.launch import spawn_joined_worker  # noqa: E402
from meshnet.weights.fetch import STATE_SUFFIX  # noqa: E402

PROMPTS = SHORT
DISK_RATIO_MAX = 1.05


def say(line: str) -> None:
    print(f"join-check: {line}", file=sys.stderr, flush=True)


def write_atomically(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text + "\n")
    os.replace(tmp, path)


def spawn_logged(host: MeshHost, mem: int, log_path: str):
    """spawn_joined_worker as `meshnet serve --mem` calls it, its output in LOG_PATH: the
    child inherits this process's stdout and stderr, pointed at the log for the spawn."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        return spawn_joined_worker(host, mem)
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (fd, *saved):
            os.close(f)


def sparse_file(b_home: str) -> Path | None:
    files = [Path(p) for p in glob.glob(os.path.join(b_home, "models", "mesh", "*", "*"))
             if not p.endswith((STATE_SUFFIX, ".tmp"))]
    return files[0] if len(files) == 1 else None


def check(args, report: dict) -> bool:
    path, sha256 = models.resolve(args.model)
    layout = read_layout(path)
    n_layer = layout.n_layer
    half = n_layer // 2
    # A's worker admits what the planner says [0, half) needs with a worker's default
    # settings (its pool at the floor the planner plans with; stage_need counts the
    # planner's per-process OVERHEAD too): with B's memory announced, the plan gives it
    # that half and B the rest
    settings = worker_settings(layout.n_ctx_train)
    cost = ModelCost.from_layout(layout, layer_memory(path))
    mem = stage_need(cost, 0, half, settings)
    report.update(model=path.name, n_layer=n_layer, a_mem=mem)
    say(f"model {path.name}: {n_layer} layers; A's worker admits {format_size(mem)} (the planner's need for "
        f"layers 0..{half - 1})")

    with MeshHost(args.bind, model=(path, sha256)) as host, \
            Coordinator(CoordinatorConfig(args.bind, **host.coordinator_options())) as coordinator:
        host.started(coordinator.endpoint, announce=True)
        report["announced"] = host.announcement is not None
        report["holder_mechanism"] = mechanism(host.holder.sock)
        manifest = host.holder.manifest
        say(f"coordinator on {coordinator.endpoint}, the model's bytes on {host.holder.endpoint} "
            f"({report['holder_mechanism']}), announced on the LAN: {report['announced']}")
        if not report["announced"]:
            say("FAILED: the coordinator is not announced: B cannot discover it")
            return False
        worker = spawn_logged(host, mem, args.worker_log)
        try:
            return run_checks(args, report, host, coordinator, worker, path, n_layer, half, manifest)
        finally:
            worker.terminate()
            try:
                worker.wait(timeout=10)
            except Exception:
                worker.kill()
                worker.wait()


def run_checks(args, report, host, coordinator, worker, path, n_layer, half, manifest) -> bool:
    began = time.monotonic()
    deadline = began + args.wait
    while True:   # A's worker registered: standby (no plan fits it alone) or loading
        state = coordinator.route_report()
        if state["standby"] or state["route"]:
            break
        if worker.poll() is not None:
            say(f"FAILED: A's worker ended ({worker.returncode}) before it registered: see its log")
            return False
        if time.monotonic() > deadline:
            say(f"FAILED: A's worker did not register within {args.wait:.0f} s")
            return False
        time.sleep(0.1)
    say(f"A's worker registered: {state['standby'] or state['route']}")
    bare = host.token(with_addresses=False)
    full = host.token(with_addresses=True)
    report["token_addresses"] = list(bare.addresses)
    write_atomically(args.token_addr_file, full.encode())
    write_atomically(args.token_file, bare.encode())   # the script waits for this one
    say(f"join tokens written (B gets the one without addresses: it must find A by mDNS); "
        f"with addresses it names {', '.join(full.addresses)}")

    try:
        route = coordinator.wait_for_route(max(1.0, deadline - time.monotonic()), n_stages=2)
    except MeshnetError as e:
        say(f"FAILED: no route of 2 stages within {args.wait:.0f} s: {e.message} "
            f"({coordinator.route_report()})")
        report["error"] = e.to_dict()
        return False
    report["route_s"] = round(time.monotonic() - began, 1)
    stages = coordinator.metrics(timeout=10)["stages"]
    hosts = {s["stage"]: s["host"] for s in stages}
    report["route"] = [o.label for o in route]
    report["route_hosts"] = [hosts.get(o.label) for o in route]
    say(f"route {' '.join(f'{o.label}@{hosts.get(o.label)}' for o in route)} after {report['route_s']} s")
    b_range = [LayerRange(o.start, o.end, n_layer) for o in route if hosts.get(o.label) == args.peer]
    report["b_range"] = b_range[0].label if b_range else None
    covered = [(o.start, o.end) for o in route] == [(0, half), (half, n_layer)]
    both_hosts = report["route_hosts"] == [args.bind.split("://")[1].rsplit(":", 1)[0], args.peer]
    report["route_ok"] = covered and both_hosts
    if not report["route_ok"]:
        say(f"FAILED: the route is not A 0:{half} then B {half}:{n_layer}")

    report["holder_served_bytes"] = host.holder.counters["bytes"]

    # B's share of the file: the spans of its range (the header, its tensors), and its disk
    share_ok = False
    if b_range:
        spans = manifest.spans_for(b_range[0])
        report["b_share_bytes"] = sum(s.size for s in spans)
        report["file_bytes"] = manifest.file_bytes
        fetched = sparse_file(args.b_home)
        report["b_file"] = str(fetched) if fetched else None
        if fetched is not None:
            st = fetched.stat()
            report["b_file_length"] = st.st_size
            report["b_disk_bytes"] = st.st_blocks * 512
            report["disk_ratio"] = report["b_disk_bytes"] / report["b_share_bytes"]
            share_ok = report["disk_ratio"] <= DISK_RATIO_MAX and st.st_size == manifest.file_bytes
            say(f"B's file {fetched}: {report['b_disk_bytes']} bytes on disk ({format_size(report['b_disk_bytes'])}) "
                f"of {st.st_size} ({format_size(st.st_size)}); its share (header + {len(spans) - 1} tensors of "
                f"{b_range[0].label}) {report['b_share_bytes']} bytes: ratio {report['disk_ratio']:.4f}")
        else:
            say(f"FAILED: no single fetched model file under {args.b_home}/models/mesh/")
    report["disk_ok"] = share_ok

    # the truth, computed while the workers sit idle, with the workers' own settings
    whole = {}
    with LocalPipeline(path, [LayerRange(0, n_layer, n_layer)], n_ctx=defaults.N_CTX, max_sessions=1,
                       n_threads=0) as pipe:
        for prompt in PROMPTS:
            tokens = pipe.head.tokenize(prompt)
            whole[prompt] = (tokens, pipe.generate(tokens, args.tokens, keep_logits=True, stop_at_eog=False))
    got = {p: coordinator.generate(whole[p][0], args.tokens, want_logits=True, stop_at_eog=False).result(args.wait)
           for p in PROMPTS}
    parity = all(got[p].tokens == whole[p][1].tokens for p in PROMPTS)
    diff = max(max_logit_diff(got[p].logits, whole[p][1].logits) for p in PROMPTS)
    report.update(parity=parity, max_logit_diff=diff)
    say(f"parity {len(PROMPTS)} prompts x {args.tokens} greedy tokens through the route "
        f"{'equal' if parity else 'DIFFER from'} the whole model's in one process; max |logit diff| {diff:g}")

    stats = coordinator.stage_stats()
    pushes_ok, n_pushes = _pushes_curve(stats)
    links = _curve_everywhere(coordinator)
    report["mechanisms"] = {
        "coordinator": {"control": mechanism(coordinator.router), "data": mechanism(coordinator.data)},
        "stages": {"{}:{}".format(*s["layers"]): s["mechanisms"] for s in stats},
        "holder": report["holder_mechanism"]}
    report["curve"] = links and pushes_ok and report["holder_mechanism"] == "CURVE"
    say(f"curve every link runs CURVE: {report['curve']} (control and data of the coordinator and each stage: "
        f"{links}; the {n_pushes} pushes the sessions opened: {pushes_ok}; the holder: {report['holder_mechanism']})")
    return report["route_ok"] and parity and diff == 0.0 and report["curve"] and share_ok


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bind", required=True, help="the coordinator's address, e.g. tcp://10.77.0.1:5555")
    parser.add_argument("--model", default=None, help="model name or GGUF path [default: smollm2]")
    parser.add_argument("--peer", required=True, help="host B's address: the stage there is B's")
    parser.add_argument("--b-home", required=True, help="B's MESHNET_HOME, where its worker stores what it fetched")
    parser.add_argument("--token-file", required=True, help="written: the join token without addresses")
    parser.add_argument("--token-addr-file", required=True, help="written: the join token with A's addresses")
    parser.add_argument("--worker-log", required=True, help="A's worker's output")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument("--wait", type=float, default=600, help="seconds to wait for the route (and each generation)")
    args = parser.parse_args(argv)

    report: dict = {"ok": False}
    try:
        ok = check(args, report)
    except MeshnetError as e:
        say(f"error: {e}")
        report["error"] = e.to_dict()
        ok = False
    report["ok"] = ok
    print(json.dumps(report), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
