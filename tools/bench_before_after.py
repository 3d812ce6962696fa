#!/usr/bin/env python3
"""`meshnet bench` on the code of an earlier commit and on this checkout, in turns, in one
run: a change that should move nothing (a redesign) shows whether it did, beyond noise.

The machines are noisy (absolute tok/s swing 2x between runs), so each bench run's own
ratios (workers / whole model, stages / whole) are what is compared, medians over the
rounds; the two trees run alternately, so a slow spell of the machine falls on both.

The earlier tree is a git worktree of REV in a temporary folder, sharing this checkout's
build/ (the engine library and models): what differs is the Python above the engine.

    tools/bench_before_after.py 1dde360 --rounds 2 -- --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def entry_point(tree: Path) -> tuple[str, str]:
    """The `meshnet` console script of TREE, as its setup.py names it (module, function)."""
    found = re.search(r"meshnet=([\w.]+):(\w+)", (tree / "setup.py").read_text())
    if found is None:
        raise SystemExit(f"{tree}/setup.py names no meshnet console script")
    return found.group(1), found.group(2)


def bench(tree: Path, bench_args: list[str]) -> dict:
    module, function = entry_point(tree)
    # PYTHONPATH reaches the worker processes bench starts too: all of a run is TREE's code
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run([sys.executable, "-c", f"from {module} import {function}; {function}()", "bench", "--json",
                          *bench_args], cwd=tree, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def ratios(reports: list) -> dict[str, float]:
    """Each model's decode and prefill ratios to its whole model, from one bench run."""
    found = {}
    for report in reports:
        for label, config in report["configs"].items():
            for key in ("decode_tok_s_ratio", "prefill_tok_s_ratio"):
                if key in config and label != "whole":
                    found[f"{report.get('model', '?')} {label} {key}"] = config[key]
        if "workers_over_stages_decode_tok_s" in report:
            found[f"{report.get('model', '?')} workers/stages decode"] = report["workers_over_stages_decode_tok_s"]
        if "workers_over_stages_paired_decode_tok_s" in report:
            found[f"{report.get('model', '?')} workers/stages decode, paired"] = (
                report["workers_over_stages_paired_decode_tok_s"])
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rev", help="the earlier commit")
    parser.add_argument("--rounds", type=int, default=2, help="bench runs of each tree, alternately [2]")
    parser.add_argument("--json", dest="json_path", default=None, help="write both trees' reports here")
    argv = sys.argv[1:]
    bench_args = argv[argv.index("--") + 1:] if "--" in argv else []   # after --: options for meshnet bench
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    runs: dict[str, list] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="meshnet-before-") as tmp:
        before = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet", str(before), args.rev],
                       check=True)
        try:
            (before / "build").symlink_to(ROOT / "build")
            for round_ in range(args.rounds):
                for name, tree in (("before", before), ("after", ROOT)):
                    print(f"round {round_ + 1}/{args.rounds}: {name} ({tree})", file=sys.stderr, flush=True)
                    runs[name].append(bench(tree, bench_args))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)], check=False)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"rev": args.rev, "runs": runs}, indent=1) + "\n")
    per_tree = {name: [ratios(r) for r in reports] for name, reports in runs.items()}
    keys = sorted(set().union(*per_tree["before"]) & set().union(*per_tree["after"]))
    print(f"{'ratio (median over rounds)':52} {'before ' + args.rev:>16} {'after':>10} {'after/before':>13}")
    for key in keys:
        b = statistics.median(r[key] for r in per_tree["before"] if key in r)
        a = statistics.median(r[key] for r in per_tree["after"] if key in r)
        print(f"{key:52} {b:16.3f} {a:10.3f} {a / b:13.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
