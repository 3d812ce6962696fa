#!/usr/bin/env python3
"""Split against whole for every generated model (make test-models), each in a process of
its own (a graph that asserts aborts its process): the table of what splits exactly.

    .venv/bin/python tools/arch_parity.py [--models build/test-models/models] [--only REGEX] [--json OUT] [--table]

Prints one line per model: exact, differs (the worst check and its max |diff|), or the
error. Every architecture is tried, listed as splitting or not (the engine's refusal is
lifted with MESHNET_TRIAGE_ANY_ARCH=1 in the children); --table keeps the refusal. This is how a new pin is triaged before engine_c/architectures.tsv is updated;
the tests (tests/engine/test_architectures.py) hold the table to it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import json, sys
from meshnet.core.errors import MeshnetError
from meshnet.evidence.parity import check
try:
    r = check(sys.argv[1])
    print(json.dumps({"arch": r.arch, "n_layer": r.n_layer, "exact": r.exact, "results": r.results}))
except MeshnetError as e:
    print(json.dumps({"error": e.code, "message": str(e)}))
"""


def run_one(path: Path, timeout: float, any_arch: bool) -> dict:
    return run_child(CHILD, [str(path)], dict(os.environ, MESHNET_TRIAGE_ANY_ARCH="1" if any_arch else "0"), timeout)


def run_child(code: str, args: list[str], env: dict, timeout: float) -> dict:
    """CODE in a Python process of its own (a graph that asserts aborts only it): the last
    JSON line it printed, or {"error": "timeout" or "crash", "message": ...}."""
    try:
        done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                              timeout=timeout, cwd=ROOT, env=env)
    except subprocess.TimeoutExpired:
        return {"error": "timeout", "message": f"no answer in {timeout:.0f} s"}
    lines = [l for l in done.stdout.splitlines() if l.startswith("{")]
    if done.returncode == 0 and lines:
        return json.loads(lines[-1])
    lines = [l for l in done.stderr.splitlines() if l.strip()]
    tail = [l for l in lines if re.search(r"GGML_ASSERT|error|what\(\)|Error", l)][:3] or lines[-3:]
    return {"error": "crash", "message": f"exit {done.returncode}: " + " | ".join(tail)}


def summary(result: dict) -> str:
    if "error" in result:
        return f"{result['error']}: {result['message'][:300]}"
    if result["exact"]:
        return f"exact ({result['n_layer']} layers)"
    worst = max(result["results"].items(), key=lambda kv: kv[1])
    return f"differs: {worst[0]}: {worst[1]:.3g}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=Path, default=ROOT / "build" / "test-models" / "models")
    ap.add_argument("--only", default="", help="a regular expression over file names")
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("--json", type=Path, help="write every result here")
    ap.add_argument("--table", action="store_true", help="keep the engine's refusal of what the table does not list")
    args = ap.parse_args()
    paths = sorted(p for p in args.models.glob("*.gguf") if re.search(args.only, p.name))
    results = {}
    for path in paths:
        results[path.name] = run_one(path, args.timeout, not args.table)
        print(f"{path.name:32} {summary(results[path.name])}", flush=True)
    n_exact = sum(1 for r in results.values() if r.get("exact"))
    print(f"{n_exact} of {len(results)} models split exactly")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
