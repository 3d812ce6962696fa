#!/usr/bin/env python3
"""The drift of a GPU stage from the CPU's whole model, for every generated model
(make test-models), each in a process of its own (a graph that asserts aborts its
process): the per-architecture table of issue 50, on whatever GPU engine is built.

    GGML_VK_VISIBLE_DEVICES=0 .venv/bin/python tools/gpu_arch_drift.py [--engine vulkan|cuda]
        [--only REGEX] [--json OUT] [--markdown OUT]

On a machine with no GPU, Mesa's lavapipe (mesa-vulkan-drivers) is a Vulkan device on the
CPU, which ggml takes only where GGML_VK_VISIBLE_DEVICES names it. Each line: the routes
(the whole model on the GPU; a GPU head before a CPU tail and the reverse, for an
architecture that splits) with top-1 agreement and max |logit diff| against the CPU, and
the GPU's own batching figure (max |diff| of a row computed in another chunking).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from arch_parity import run_child  # noqa: E402  (this folder's, beside it)
from meshnet.engine.binding import GPU_LIBRARIES  # noqa: E402

CHILD = """
import json, sys
from meshnet.core.errors import MeshnetError
from meshnet.evidence.gpu_drift import measure
try:
    print(json.dumps(measure(sys.argv[1], n_threads=int(sys.argv[2]))))
except MeshnetError as e:
    print(json.dumps({"error": e.code, "message": str(e)}))
"""
ROUTES = ("GPU whole", "GPU head, CPU tail", "CPU head, GPU tail")


def run_one(path: Path, engine: Path, threads: int, timeout: float) -> dict:
    return run_child(CHILD, [str(path), str(threads)], dict(os.environ, MESHNET_ENGINE_LIB=str(engine)), timeout)


def cells(result: dict) -> list[str]:
    """One table row's cells after the model's name."""
    if "error" in result:
        return [result["arch"] if "arch" in result else "?", f"{result['error']}: {result['message'][:120]}"] + \
               [""] * (len(ROUTES) + 2)
    out = [result["arch"], "yes" if result["splits"] else "no"]
    for name in ROUTES:
        r = result["routes"].get(name)
        out.append("-" if r is None else f"{r['top1_agreement']:.2f} / {r['max_abs_logit_diff']:.2g}")
    out.append(f"{max(result['batching'].values()):.2g}")
    invariant = result.get("batching_invariant") or {}
    out.append("-" if "error" in invariant or not invariant else f"{max(invariant.values()):.2g}")
    return out


def markdown(results: dict[str, dict]) -> str:
    head = ["model", "arch", "splits"] + [f"{r} (top-1 / max diff)" for r in ROUTES] + \
        ["GPU batching max diff", "GPU batching max diff, invariant class"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rows += ["| " + " | ".join([name] + cells(r)) + " |" for name, r in results.items()]
    return "\n".join(rows) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=Path, default=ROOT / "build" / "test-models" / "models")
    ap.add_argument("--engine", choices=sorted(GPU_LIBRARIES), default="vulkan")
    ap.add_argument("--only", default="", help="a regular expression over file names")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--jobs", type=int, default=1, help="models run at once (each in a process of its own)")
    ap.add_argument("--json", type=Path, help="write every result here")
    ap.add_argument("--markdown", type=Path, help="write the table here")
    args = ap.parse_args()
    engine = GPU_LIBRARIES[args.engine]
    if not engine.exists():
        print(f"error: {engine} is not built: make GPU={args.engine}", file=sys.stderr)
        return 2
    paths = sorted(p for p in args.models.glob("*.gguf") if re.search(args.only, p.name))
    results = {}
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for path, result in zip(paths, pool.map(lambda p: run_one(p, engine, args.threads, args.timeout), paths)):
            results[path.stem] = result
            print(f"{path.stem:28} " + " | ".join(cells(result)), flush=True)
    ok = [r for r in results.values() if "error" not in r]
    agree = [r for r in ok if all(x["top1_agreement"] == 1.0 for x in r["routes"].values())]
    exact = [r for r in ok if set((r.get("batching_invariant") or {"-": 1}).values()) == {0.0}]
    print(f"{len(ok)} of {len(results)} models ran on the GPU; {len(agree)} agree with the CPU on every top-1 token; "
          f"{len(exact)} give rows independent of batching in the invariant class")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if args.markdown:
        args.markdown.write_text(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
