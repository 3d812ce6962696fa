"""`meshnet accept`: run the local two-process acceptance end to end and write what
was measured to evidence/<UTC date>-<short id>/ (manifest.json and a README).

Every check is run and judged in this invocation; a check that could not run is
recorded as not run, with the reason. Nothing is written as passed otherwise.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import secrets
import signal
import sys
import time
import traceback
from pathlib import Path

from meshnet.core import errors as E
from meshnet.core import numerics as numerics_classes
from meshnet.core.errors import MeshnetError
from meshnet.core.layers import LayerRange
from meshnet.core.planner import ModelCost, Node, Settings, format_size, plan
from meshnet.engine import models
from meshnet.engine.binding import engine_pin
from meshnet.engine.gguf_layout import read_layout
from meshnet.engine.pipeline import LocalPipeline
from meshnet.evidence import reference as stock_reference
from meshnet.evidence.prompts import CLASS_CHECK, SHORT
from meshnet.evidence.route_checks import N_TOKENS, RouteChecks, max_diff, run_route_checks
from meshnet.launch.local_cluster import LocalCluster, start_auto_worker
from meshnet.route.config import CoordinatorConfig
from meshnet.route.coordinator import Coordinator

SCHEMA_VERSION = 1
AUTO_CTX, AUTO_SESSIONS = 1024, 4    # what the --layers auto workers keep KV for
CHECK_NAMES = ("whole_model_parity", "greedy_decode_32", "four_session_isolation", "cancellation", "cleanup",
               "kill_worker", "planned_route", "standby_replaces_lost_stage", "stock_llama_cpp_invariant",
               "stock_llama_cpp_stock")


class Checks:
    """Runs each check, catching whatever it raises: one failure never hides the others.
    With ONLY (check names), the others are recorded as not asked for, and not judged."""

    def __init__(self, only: frozenset[str] | None = None):
        self.results: list[dict] = []
        self.only = only

    def run(self, name: str, description: str, fn, *needs: str) -> dict:
        missing = [n for n in needs if self.status(n) != "passed"]
        if self.only is not None and name not in self.only:
            result = {"status": "not_run", "reason": "not asked for (--only)", "not_asked": True}
        elif missing:
            result = {"status": "not_run", "reason": f"needs {', '.join(missing)} to pass first"}
        else:
            t0 = time.monotonic()
            try:
                passed, details = fn()
                result = {"status": "passed" if passed else "failed", **details}
            except Exception as e:
                result = {"status": "failed", "error": f"{type(e).__name__}: {e}",
                          "traceback": traceback.format_exc(limit=4)}
            result["seconds"] = round(time.monotonic() - t0, 3)
        self.results.append({"name": name, "description": description, **result})
        return result

    def not_promised(self, name: str, description: str, reason: str) -> None:
        """A check the run's numerics class does not promise: recorded, not run, and no failure."""
        self.results.append({"name": name, "description": description, "status": "not_run", "reason": reason,
                             "not_promised": True})

    @property
    def passed(self) -> bool:
        return all(r["status"] == "passed" or r.get("not_promised") or r.get("not_asked") for r in self.results)

    def status(self, name: str) -> str | None:
        return next((r["status"] for r in self.results if r["name"] == name), None)


def _identity(model: str, path: Path, sha256: str) -> dict:
    pin = engine_pin()
    spec = models.MODELS.get(model)
    packages = [f"{p.name}=={p.version}" for p in spec.packages] if spec else []
    build_flags = {}
    cache = Path(__file__).resolve().parents[2] / "build" / "cmake" / "CMakeCache.txt"
    if cache.exists():
        for line in cache.read_text().splitlines():
            key, _, value = line.partition("=")
            name = key.split(":")[0]
            if name in ("CMAKE_BUILD_TYPE", "CMAKE_CXX_COMPILER", "GGML_NATIVE", "GGML_OPENMP", "GGML_CUDA",
                        "BUILD_SHARED_LIBS", "GGML_LLAMAFILE"):
                build_flags[name] = value
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor()
    mem_total = next((int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                      if line.startswith("MemTotal")), None) if Path("/proc/meminfo").exists() else None
    os_name = platform.platform()
    if Path("/etc/os-release").exists():
        os_name = next((line.split("=", 1)[1].strip('"') for line in Path("/etc/os-release").read_text().splitlines()
                        if line.startswith("PRETTY_NAME")), os_name) + f" ({platform.release()})"
    versions = {}
    for dist in ("meshnet", "numpy", "pyzmq", "msgpack", "cffi", "click", "gguf"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    parts = dict(part.split("=", 1) for part in pin.split()[1:])
    return {
        "model": {"name": model, "file": str(path), "sha256": sha256, "packages": packages},
        "engine": {"pin": pin, "llama_cpp_commit": pin.split()[0].split("@")[1], "sdist_sha256": parts.get("sdist"),
                   "patch_stack_sha256": parts.get("patches"), "build_flags": build_flags},
        "backend": {"kind": "CPU", "driver": None},
        "hardware": {"cpu": cpu, "cores": os.cpu_count(), "ram_bytes": mem_total},
        "os": os_name,
        "python": platform.python_version(),
        "packages": versions,
        "network": "loopback (127.0.0.1): coordinator and workers on this machine",
    }


def _write_run(out_dir, started, model, path, sha256, ranges, numerics, commands, checks: Checks,
               metrics: dict) -> tuple[dict, Path]:
    """The run's directory under OUT_DIR: its manifest and the README that reads it."""
    run_id = f"{started.strftime('%Y%m%dT%H%M%SZ')}-{secrets.token_hex(3)}"
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "run_id": run_id,
        "started_utc": started.isoformat(),
        "finished_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "identity": _identity(model, path, sha256),
        "stages": [list(r) for r in ranges],
        "numerics": numerics,
        "commands": commands,
        "checks": checks.results,
        "metrics": metrics,
        "passed": checks.passed,
        **({"only": sorted(checks.only)} if checks.only is not None else {}),
    }
    run_dir = Path(out_dir) / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "manifest.json").write_text(json.dumps(manifest, indent=2, default=float) + "\n")
    (run_dir / "README.md").write_text(_readme(manifest))
    return manifest, run_dir


def run_acceptance(model: str = "smollm2", out_dir: str | Path = "evidence", threads: int = 0,
                   numerics: str | None = None, only: frozenset[str] | None = None) -> tuple[dict, Path]:
    """Every check, or those named in ONLY (a partial run, which the manifest says)."""
    unknown = sorted(set(only or ()) - set(CHECK_NAMES))
    if unknown:
        raise MeshnetError(E.INVALID_ARGUMENT, f"no check named {', '.join(unknown)}; the checks: {', '.join(CHECK_NAMES)}")
    started = datetime.datetime.now(datetime.timezone.utc)
    path, sha256 = models.resolve(model)
    layout = read_layout(path)
    ranges = layout.balanced_ranges(2)
    checks = Checks(only)
    metrics: dict = {}
    commands = [" ".join(["meshnet", *sys.argv[1:]]) if Path(sys.argv[0]).name == "meshnet" else " ".join(sys.argv)]

    # the truth: the whole model in this one process
    reference = {}
    numerics = numerics or numerics_classes.DEFAULT
    with LocalPipeline(path, [(0, layout.n_layer)], n_ctx=1024, max_sessions=1, n_threads=threads,
                       numerics=numerics) as whole:
        for prompt in SHORT:
            tokens = whole.head.tokenize(prompt)
            reference[prompt] = (tokens, whole.generate(tokens, N_TOKENS, keep_logits=True, stop_at_eog=False))

    cluster = LocalCluster(path, ranges, threads=threads, n_ctx=1024, max_sessions=4,
                           heartbeat_interval=0.1, heartbeat_liveness=10, numerics=numerics)
    commands += [f"meshnet worker --coordinator {cluster.coordinator.endpoint} --model {path} --layers {a}:{b} "
                 f"--threads {threads} --ctx 1024 --max-sessions 4 --heartbeat-interval 0.1 --heartbeat-liveness 10 "
                 f"--numerics {numerics}"
                 for a, b in ranges]
    try:
        cluster.start()
        run_route_checks(checks, RouteChecks(cluster, ranges, reference, metrics), numerics)
        try:
            metrics["stages"] = cluster.coordinator.metrics()["stages"]
        except MeshnetError as e:
            metrics["stages_error"] = e.message
    except MeshnetError as e:  # the cluster did not start: every check is recorded as not run
        for name in CHECK_NAMES[:6]:
            if checks.status(name) is None:
                checks.results.append({"name": name, "status": "not_run", "reason": f"cluster did not start: {e}"})
    finally:
        cluster.close()

    _planned_route_checks(checks, path, layout, reference, threads, metrics, commands, numerics)
    for numerics_class in numerics_classes.CHOICES:
        _stock_reference_check(checks, path, ranges, numerics_class, threads, commands)

    return _write_run(out_dir, started, model, path, sha256, ranges, numerics, commands, checks, metrics)


def _smallest_split_budget(cost: ModelCost, settings: Settings) -> int:
    """The least memory (in 16 MiB steps) with which two nodes hold the model and one does not."""
    step = 16 << 20
    mem = step
    while True:
        try:
            plan(cost, [Node("a", mem, settings), Node("b", mem, settings)])
            return mem
        except MeshnetError:
            mem += step


def _planned_route_checks(checks: Checks, path, layout, reference: dict, threads: int, metrics: dict,
                          commands: list, numerics: str) -> None:
    """Three --layers auto workers, each with a budget too small for the whole model: the
    coordinator plans the route over the first two, the third stands by and takes the
    range of a stage that is killed."""
    from meshnet.engine.binding import layer_memory

    cost = ModelCost.from_layout(layout, layer_memory(path))
    settings = Settings(AUTO_CTX, AUTO_SESSIONS)
    mem = _smallest_split_budget(cost, settings)
    whole_need = cost.weight_bytes(0, layout.n_layer)
    planned = [s.layers for s in plan(cost, [Node("a", mem, settings), Node("b", mem, settings)]).stages]
    beat = ["--heartbeat-interval", "0.1", "--heartbeat-liveness", "10", "--numerics", numerics]
    coordinator = Coordinator(CoordinatorConfig(heartbeat_interval=0.1, heartbeat_liveness=10))
    commands.append(f"meshnet worker --coordinator {coordinator.endpoint} --model {path} --layers auto --mem {mem} "
                    f"--threads {threads} --ctx {AUTO_CTX} --max-sessions {AUTO_SESSIONS} {' '.join(beat)}  (x3)")
    workers = []

    def route_now():
        return [s.split("@")[0] for s in coordinator.route_report()["route"] or []]

    def wait(predicate, timeout):
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def planned_route():
        for _ in range(3):
            workers.append(start_auto_worker(coordinator.endpoint, str(path), mem, threads=threads, n_ctx=AUTO_CTX,
                                             max_sessions=AUTO_SESSIONS, extra=beat))
        formed = wait(lambda: route_now() == [r.label for r in planned] and coordinator.route_report()["standby"], 90)
        if not formed:
            return False, {"route_report": coordinator.route_report()}
        tokens, expected = reference[SHORT[0]]
        got = coordinator.generate(tokens, N_TOKENS, stop_at_eog=False, want_logits=True).result(120)
        pids = {tuple(w["layers"]): w["pid"] for w in coordinator.workers_snapshot() if "layers" in w}
        rss = {LayerRange(*k).label: _rss_bytes(pid) for k, pid in pids.items()}
        diff = max_diff(got.logits, expected.logits)
        return got.tokens == expected.tokens and diff == 0.0 and all(v <= mem for v in rss.values()), {
            "budget_bytes": mem, "budget": format_size(mem), "one_node_refused": _refused_alone(cost, mem, settings),
            "model_weight_bytes": whole_need, "route": route_now(), "rss_bytes": rss,
            "tokens_equal": got.tokens == expected.tokens, "max_abs_logit_diff": diff}

    def standby_replaces_lost_stage():
        report = coordinator.route_report()
        tail_name = report["route"][-1].split("@")[1]
        pid = next(w["pid"] for w in coordinator.workers_snapshot() if w["name"] == tail_name)
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        whole_again = wait(lambda: not coordinator.route_report()["standby"]
                           and route_now() == [r.label for r in planned], 60)
        seconds = time.monotonic() - t0
        tokens, expected = reference[SHORT[1]]
        got = coordinator.generate(tokens, N_TOKENS, stop_at_eog=False).result(120)
        return whole_again and got.tokens == expected.tokens, {
            "killed": report["route"][-1], "seconds_to_route_whole_again": seconds,
            "route_after": coordinator.route_report()["route"], "new_session_ok": got.tokens == expected.tokens}

    try:
        checks.run("planned_route", "3 --layers auto workers, each too small for the whole model: the coordinator "
                   "plans the route by memory over two, the output equals the whole model's, each RSS within budget",
                   planned_route)
        checks.run("standby_replaces_lost_stage", "kill -9 of the planned tail: the standby worker is planned into "
                   "its range with no restart, and new sessions get the whole model's tokens", standby_replaces_lost_stage,
                   "planned_route")
    finally:
        for w in workers:
            if w.poll() is None:
                w.terminate()
        for w in workers:
            try:
                w.wait(timeout=15)
            except Exception:
                w.kill()
        coordinator.close()


def _stock_reference_check(checks: Checks, path, ranges, numerics_class: str, threads: int, commands: list) -> None:
    """The class's greedy tokens through 2 worker processes against stock llama.cpp built
    as the class says (meshnet/evidence/reference.py), on prompts.CLASS_CHECK."""
    n_tokens = 32

    def agreement():
        expected = stock_reference.greedy(path, CLASS_CHECK, n_tokens, numerics_class, threads=threads)
        with LocalCluster(path, ranges, threads=threads, n_ctx=1024, max_sessions=1, numerics=numerics_class) as cluster:
            per_prompt = []
            for prompt, (ref_prompt, ref_tokens) in zip(CLASS_CHECK, expected):
                tokens = cluster.coordinator.tokenize(prompt)
                got = cluster.coordinator.generate(tokens, n_tokens, stop_at_eog=False).result(600)
                per_prompt.append({"prompt": prompt[:40], "prompt_tokens": len(tokens),
                                   "same_prompt_tokens": tokens == ref_prompt,
                                   **stock_reference.agreement(ref_tokens, got.tokens)})
        agreed = sum(p["agrees"] and p["same_prompt_tokens"] for p in per_prompt)
        return agreed == len(per_prompt), {"reference": stock_reference.describe(numerics_class),
                                           "agreed": f"{agreed} of {len(per_prompt)}", "tokens": n_tokens,
                                           "per_prompt": per_prompt}

    commands.append(f"meshnet worker ... --numerics {numerics_class} (x2), against "
                    f"build/reference/{numerics_class}/meshnet-reference (make reference)")
    checks.run(f"stock_llama_cpp_{numerics_class}",
               f"--numerics {numerics_class}, 2 worker processes: greedy tokens equal "
               f"{'stock llama.cpp' if numerics_class == 'stock' else 'stock llama.cpp built with the class kernels'} "
               f"on {len(CLASS_CHECK)} prompts x {n_tokens} tokens", agreement)


def _refused_alone(cost: ModelCost, mem: int, settings: Settings) -> dict:
    try:
        plan(cost, [Node("alone", mem, settings)])
        return {"refused": False}
    except MeshnetError as e:
        return {"refused": True, "code": e.code, "shortfall_bytes": e.context.get("shortfall_bytes")}


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def _readme(m: dict) -> str:
    ident = m["identity"]
    lines = [f"# meshnet acceptance run {m['run_id']}", "",
             f"Result: **{'PASSED' if m['passed'] else 'FAILED'}** ({sum(c['status'] == 'passed' for c in m['checks'])}"
             f" of {len(m['checks'])} checks passed"
             + (f", {n_np} not promised by numerics {m.get('numerics')}"
                if (n_np := sum(bool(c.get('not_promised')) for c in m['checks'])) else "")
             + f"; numerics {m.get('numerics')}). Everything below was measured in this run; the raw numbers "
             "are in `manifest.json`.", "",
             f"- model: {ident['model']['name']} sha256 `{ident['model']['sha256']}` from {', '.join(ident['model']['packages'][:2])}"
             f"{' ...' if len(ident['model']['packages']) > 2 else ''}",
             f"- engine: `{ident['engine']['pin']}`",
             f"- backend: {ident['backend']['kind']}; hardware: {ident['hardware']['cpu']}, {ident['hardware']['cores']} cores, "
             f"{(ident['hardware']['ram_bytes'] or 0) / 2**30:.1f} GiB; {ident['os']}; Python {ident['python']}",
             f"- network: {ident['network']}; stages {m['stages']}", "",
             *([f"A partial run: only {', '.join(m['only'])} asked for (`--only`).", ""] if "only" in m else []),
             "| check | status | key numbers |", "| --- | --- | --- |"]
    for c in m["checks"]:
        keys = {k: v for k, v in c.items() if k not in ("name", "description", "status", "traceback", "tokens",
                                                         "whole_model_tokens", "text", "stages")}
        summary = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in keys.items())
        lines.append(f"| {c['name']} | {c['status']} | {summary[:300]} |")
    session = m["metrics"].get("session")
    if session:
        lines += ["", f"Parity session: TTFT {session['ttft_ms']:.1f} ms, prefill {session['prefill_tok_s']:.1f} tok/s, "
                      f"decode {session['decode_tok_s']:.1f} tok/s, hop p50 {session['hop_us_p50']:.0f} us / "
                      f"p99 {session['hop_us_p99']:.0f} us, seam {session['seam_bytes']} bytes."]
    memory = [f"{s['stage']} RSS {s['rss_bytes'] / 2**20:.0f} MiB, VRAM {(s.get('vram_bytes') or 0) / 2**20:.0f} MiB"
              for s in m["metrics"].get("stages", []) if s.get("rss_bytes") is not None]
    if memory:
        lines += ["", f"Memory per stage at the end of the run: {'; '.join(memory)}."]
    lines += ["", "Commands:", "", *[f"    {c}" for c in m["commands"]], ""]
    return "\n".join(lines)
