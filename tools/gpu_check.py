"""The runs of tools/gpu-check.sh, once both engines are built: for each model,

  cpu        the whole model in one CPU worker         (CPU-only decode rate; drift exactly 0)
  gpu        the whole model in one GPU worker         (GPU-only decode rate; drift vs the CPU)
  head-gpu   head on the GPU, tail on the CPU          (--allow-mixed; mixed decode rate; drift)
  tail-gpu   head on the CPU, tail on the GPU          (the reverse)
  tail-gpu-vcpus  tail-gpu with a thread on every vCPU  (the default before meshnet_default_threads,
                                                       beside tail-gpu's new default in the same run)
  vulkan-stock, vulkan-invariant  the whole model on the same GPU through the Vulkan engine, where
                                   built, in each numerics class (what GPU rows independent of
                                   batching cost on a real GPU)
  head-gpu without --allow-mixed, tail-gpu likewise    (refused by the tracker, naming both classes)

each through `meshnet drift --json`, which compares the route with the whole model on the
CPU in its own process (4 prompts x --tokens, teacher-forced). Writes manifest.json and
README.md (the drift table) to --out and prints the table.

  python tools/gpu_check.py --out DIR [--tokens N] [--only RUN,...] [--gpu-backend CUDA] MODEL.gguf...
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from meshnet.engine.binding import GPU_LIBRARIES, default_threads  # noqa: E402
from meshnet.engine.models import MODELS  # noqa: E402

class Run(NamedTuple):
    stages: int
    gpu: str | None               # --gpu positions
    allow_mixed: bool
    threads: int = 0              # 0: the default
    engine: str | None = None     # MESHNET_GPU_ENGINE; None: the first built (CUDA)
    numerics: str | None = None   # None: drift's default class


CONFIGS = {
    "cpu": Run(1, None, False),
    "gpu": Run(1, "all", True),
    "head-gpu": Run(2, "0", True),
    "tail-gpu": Run(2, "1", True),
    # a CPU head beside a GPU tail took 17.8 ms per token with a thread on each of 16 vCPUs
    # and 4.3 ms with 4 (evidence/20261130T225745Z-gpu-check): the old default, side by side
    "tail-gpu-vcpus": Run(2, "1", True, threads=len(os.sched_getaffinity(0))),
    # the Vulkan engine on the same GPU, where built: the invariant class's cost on a real GPU
    "vulkan-stock": Run(1, "all", True, engine="vulkan", numerics="stock"),
    "vulkan-invariant": Run(1, "all", True, engine="vulkan", numerics="invariant"),
}
REFUSALS = {"head-gpu-refused": (2, "0"), "tail-gpu-refused": (2, "1")}
RUN_TIMEOUT = int(os.environ.get("GPU_CHECK_RUN_TIMEOUT", "600"))   # seconds per drift run


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def known_model(path: Path) -> tuple[str, str]:
    """(name, sha256) of a model meshnet knows, or a refusal: the check runs on pinned bytes."""
    sha = sha256_of(path)
    for name, spec in MODELS.items():
        if spec.sha256 == sha:
            return name, sha
    sys.exit(f"gpu_check: {path} (sha256 {sha}) is none of meshnet's models ({', '.join(MODELS)})")


def drift(model: Path, run: Run, tokens: int, log: Path) -> tuple[int, dict | None, str]:
    args = [sys.executable, "-m", "meshnet.cli.main", "drift", "--model", str(model), "--stages", str(run.stages),
            "--tokens", str(tokens), "--threads", str(run.threads), "--json"]
    if run.gpu is not None:
        args += ["--gpu", run.gpu]
    if run.allow_mixed:
        args.append("--allow-mixed")
    if run.numerics is not None:
        args += ["--numerics", run.numerics]
    env = dict(os.environ, **({"MESHNET_GPU_ENGINE": run.engine} if run.engine else {}))
    started = time.monotonic()
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=RUN_TIMEOUT, cwd=REPO, env=env)
        code, stdout, stderr = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as e:
        code, stdout, stderr = 124, e.stdout or "", (e.stderr or "") + f"\ntimed out after {RUN_TIMEOUT} s"
    with open(log, "a") as f:
        f.write(f"$ {'MESHNET_GPU_ENGINE=' + run.engine + ' ' if run.engine else ''}{' '.join(args)}\n[{time.monotonic() - started:.1f} s, exit {code}]\n" + (stderr.rstrip() + "\n" if stderr.strip() else ""))
    report = None
    if code == 0:
        report = json.loads(stdout.strip().splitlines()[-1])
    return code, report, stderr.strip().splitlines()[-1] if stderr.strip() else ""


def gpu_identity() -> dict:
    def run(*args):
        try:
            return subprocess.run(args, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return None
    return {
        "gpu": run("nvidia-smi", "--query-gpu=name,memory.total,driver_version,compute_cap", "--format=csv,noheader"),
        "nvcc": (run("nvcc", "--version") or "").splitlines()[-1:],
        "cpu": next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), None),
        "cores": os.cpu_count(),
        # a CPU stage's threads unless told (llama.cpp's default: one per physical core)
        "default_threads": default_threads(),
        "python": platform.python_version(),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--only", help="these runs (comma-separated names) instead of all: "
                        + ", ".join([*CONFIGS, *REFUSALS]))
    parser.add_argument("--gpu-backend", default="CUDA",
                        help="the backend the first GPU engine built reports (Vulkan to try this on lavapipe)")
    parser.add_argument("models", nargs="+")
    args = parser.parse_args()
    chosen = set(args.only.split(",")) if args.only else {*CONFIGS, *REFUSALS}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "runs.log"
    manifest = {"kind": "gpu-check", "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                # a copy without .git (a device machine's) is told its commit
                "commit": os.environ.get("GPU_CHECK_COMMIT") or subprocess.run(
                    ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip() or None, "machine": gpu_identity(), "tokens": args.tokens, "models": {}, "checks": []}
    build_time = out / "build-time.txt"
    if build_time.exists():
        manifest["build"] = build_time.read_text().strip()

    def check(name: str, passed: bool, **detail) -> None:
        manifest["checks"].append({"name": name, "status": "passed" if passed else "failed", **detail})
        print(f"{'passed' if passed else 'FAILED':>8}  {name}", flush=True)

    for model_arg in args.models:
        model = Path(model_arg)
        name, sha = known_model(model)
        runs = manifest["models"][name] = {"file": model.name, "sha256": sha, "runs": {}}
        for config, run in CONFIGS.items():
            if config not in chosen or (run.engine and not GPU_LIBRARIES[run.engine].exists()):
                continue
            code, report, last_words = drift(model, run, args.tokens, log)
            runs["runs"][config] = report if report is not None else {"exit": code, "error": last_words}
            if report is None:
                check(f"{name} {config}: the route runs", False, error=last_words)
                continue
            backends = [s["backend"] for s in report["route"]]
            gpu_backend = "Vulkan" if run.engine == "vulkan" else args.gpu_backend
            want = {1: ["CPU"] if run.gpu is None else [gpu_backend],
                    2: [gpu_backend if str(i) == run.gpu else "CPU" for i in range(2)]}[run.stages]
            check(f"{name} {config}: stages report backends {want}", backends == want, backends=backends,
                  devices=[s["device"] for s in report["route"]])
            if config == "cpu":
                check(f"{name} cpu: a CPU route drifts exactly 0 from the whole model",
                      report["max_abs_logit_diff"] == 0.0 and report["top1_agreement"] == 1.0)
            if gpu_backend in backends:
                check(f"{name} {config}: each GPU stage reports its VRAM",
                      all(s["vram_bytes"] for s in report["route"] if s["backend"] == gpu_backend),
                      vram_bytes=[s["vram_bytes"] for s in report["route"]])
        for refusal, (stages, gpu) in REFUSALS.items():
            if refusal not in chosen:
                continue
            code, report, last_words = drift(model, Run(stages, gpu, False), args.tokens, log)
            runs["runs"][refusal] = {"exit": code, "error": last_words}
            check(f"{name} {refusal}: without --allow-mixed the tracker refuses the route, naming both classes",
                  code != 0 and args.gpu_backend in last_words and "CPU" in last_words, exit=code, error=last_words)

    manifest["passed"] = all(c["status"] == "passed" for c in manifest["checks"])
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    table = drift_table(manifest)
    (out / "README.md").write_text(f"# GPU check, {manifest['started']}\n\n"
                                   f"- machine: {manifest['machine']}\n- build: {manifest.get('build')}\n"
                                   f"- commit: {manifest['commit']}\n- checks: "
                                   f"{sum(c['status'] == 'passed' for c in manifest['checks'])}/{len(manifest['checks'])} "
                                   f"passed\n\n{table}\n")
    print(table)
    print("PASSED" if manifest["passed"] else "FAILED", f"({out})")
    return 0 if manifest["passed"] else 1


def drift_table(manifest: dict) -> str:
    rows = ["| model | route | top-1 agreement | max abs logit diff | max KL | first divergence | decode tok/s | VRAM MiB "
            "| compute ms per forward, by stage |",
            "|---|---|---|---|---|---|---|---|---|"]
    for name, model in manifest["models"].items():
        for config, report in model["runs"].items():
            if "route" not in report:
                rows.append(f"| {name} | {config} | exit {report['exit']}: {report['error'][:120]} | | | | | | |")
                continue
            route = " + ".join(f"{s['layers']} {s['backend']}" for s in report["route"])
            vram = sum(s["vram_bytes"] or 0 for s in report["route"]) / (1 << 20)
            first = "-" if report["first_divergence"] is None else report["first_divergence"]
            compute = " / ".join(f"{(s['compute_us_per_forward'] or 0) / 1e3:.2f}" for s in report["route"])
            rows.append(f"| {name} | {config}: {route} | {report['top1_agreement']:.3f} | {report['max_abs_logit_diff']:.4g} "
                        f"| {report['max_kl']:.3g} | {first} | {report['route_decode_tok_s']:.1f} | {vram:.0f} "
                        f"| {compute} |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
