#!/usr/bin/env python3
"""Stock llama.cpp's own GPU against its CPU, and meshnet's whole-model GPU stage against
stock's GPU, on the bench prompts (issue 50, item 4): how far the GPU drifts when no
meshnet patch is there, and whether meshnet's GPU stage gives stock's GPU's greedy tokens.

    python tools/gpu_stock.py --reference BIN [--engine cuda|vulkan] [--tokens N] [--json OUT] MODEL...

BIN is tools/reference's greedy program over the pristine pin, built with the GPU's backend
(tools/gpu-check.sh builds it; a CPU build runs --gpu on the CPU, which is how this is
tested without a GPU). For each model and prompt: the prompt's tokens and N greedy tokens
from BIN on the GPU (--gpu) and on the CPU, and N greedy tokens from meshnet's whole-model
GPU stage (this process, the GPU engine) over the same prompt tokens. Figures: the first
step where two runs' tokens part (none: equal), per pair.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from meshnet.engine.binding import GPU_LIBRARIES  # noqa: E402
from meshnet.evidence.prompts import PROSE  # noqa: E402


def stock(binary: Path, model: Path, n_tokens: int, gpu: bool) -> list[tuple[list[int], list[int]]]:
    """(prompt tokens, generated tokens) per bench prompt, from the reference program."""
    done = subprocess.run([str(binary), str(model), str(n_tokens), *(["--gpu"] if gpu else []), *PROSE],
                          capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        sys.exit(f"gpu_stock: {binary} failed on {model}: {done.stderr[-2000:]}")
    runs = []
    for line in done.stdout.splitlines():
        prompt, _, generated = line.partition(" |")
        runs.append(([int(t) for t in prompt.split()], [int(t) for t in generated.split()]))
    return runs


def meshnet_gpu(model: Path, prompts: list[list[int]], n_tokens: int) -> list[list[int]]:
    """meshnet's whole-model GPU stage's greedy tokens after each prompt (token ids)."""
    from meshnet.engine.gguf_layout import read_layout
    from meshnet.engine.pipeline import LocalPipeline

    with LocalPipeline(model, [(0, read_layout(model).n_layer)], gpu_stages=[0], n_ctx=1024, max_sessions=1) as gpu:
        return [gpu.generate(p, n_tokens, stop_at_eog=False).tokens for p in prompts]


def parted(a: list[int], b: list[int]) -> int | None:
    """The first step where A and B differ; None where they are equal."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reference", type=Path, required=True, help="the pristine pin's greedy program, GPU build")
    ap.add_argument("--engine", choices=sorted(GPU_LIBRARIES), default="cuda")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json", type=Path)
    ap.add_argument("models", nargs="+", type=Path)
    args = ap.parse_args()
    os.environ["MESHNET_ENGINE_LIB"] = str(GPU_LIBRARIES[args.engine])   # the GPU engine named, whatever was set
    report = {"engine": args.engine, "reference": str(args.reference), "tokens": args.tokens, "models": {}}
    for model in args.models:
        on_gpu, on_cpu = stock(args.reference, model, args.tokens, True), stock(args.reference, model, args.tokens, False)
        ours = meshnet_gpu(model, [p for p, _ in on_gpu], args.tokens)
        rows = []
        for prompt, (p, stock_gpu), (_, stock_cpu), mesh in zip(PROSE, on_gpu, on_cpu, ours):
            rows.append({"prompt": prompt[:40], "prompt_tokens": len(p),
                         "stock_gpu_vs_stock_cpu": parted(stock_gpu, stock_cpu),
                         "meshnet_gpu_vs_stock_gpu": parted(mesh, stock_gpu)})
        report["models"][model.name] = rows
        for r in rows:
            print(f"{model.name:40} {r['prompt']:40} stock GPU/CPU part at {r['stock_gpu_vs_stock_cpu']}, "
                  f"meshnet GPU/stock GPU part at {r['meshnet_gpu_vs_stock_gpu']}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
