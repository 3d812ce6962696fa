"""Stock llama.cpp's greedy tokens, the reference each numerics class is held to: the
program in tools/reference over the pinned tree (whole model, none of meshnet's stage
patches), built by `make reference`, run on prompts.

- stock: the pristine tree's default build and kernels, as llama-cpp-python 0.3.36 runs it
  by default (the prompt in batches of 512, no flash attention).
- invariant: the pristine tree with meshnet's CPU kernel patches only (0005, 0015, 0016),
  in their row-invariant mode: the invariant class's kernels, run by plain llama.cpp.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Sequence

from meshnet.core import errors
from meshnet.core import numerics as numerics_classes
from meshnet.core.errors import MeshnetError

REFERENCE_DIR = Path(__file__).resolve().parents[2] / "build" / "reference"


def program(numerics: str) -> Path:
    if numerics not in numerics_classes.CHOICES:
        raise MeshnetError(errors.INVALID_ARGUMENT, f"no stock reference for numerics {numerics!r}")
    path = REFERENCE_DIR / numerics / "meshnet-reference"
    if not path.is_file():
        raise MeshnetError(errors.ENGINE_MISSING, f"the stock llama.cpp reference for the {numerics} class is not "
                           f"built ({path}): run `make reference`")
    return path


def describe(numerics: str) -> str:
    return {numerics_classes.STOCK: "stock llama.cpp (the pristine pin, default build and kernels)",
            numerics_classes.INVARIANT: "llama.cpp (the pin) with meshnet's CPU kernel patches 0005, 0015 and "
                                        "0016 only, in their row-invariant mode"}[numerics]


def agreement(expected: Sequence[int], got: Sequence[int]) -> dict:
    """How far two greedy continuations agree: the first step where they part (None: never)."""
    first = next((k for k, (a, b) in enumerate(zip(expected, got)) if a != b), None)
    if first is None and len(expected) != len(got):
        first = min(len(expected), len(got))
    return {"agrees": first is None, "first_divergence": first}


def greedy(model_path: str | os.PathLike, prompts: Sequence[str], n_predict: int, numerics: str,
           threads: int = 0, timeout: float = 900) -> list[tuple[list[int], list[int]]]:
    """Per prompt: the token ids stock llama.cpp makes of it and its N_PREDICT greedy
    tokens (no stop at an end-of-generation token)."""
    args = [str(program(numerics)), str(model_path), str(n_predict)]
    env = dict(os.environ)
    env.pop("GGML_CPU_TILED_MM", None)   # stock's own default, whatever this process was given
    if numerics == numerics_classes.INVARIANT:
        args.append("--row-invariant")
    if threads:
        args += ["--threads", str(threads)]
    for prompt in prompts:
        if prompt.startswith("--"):
            raise MeshnetError(errors.INVALID_ARGUMENT, "a reference prompt may not start with '--'")
    try:
        done = subprocess.run(args + list(prompts), capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise MeshnetError(errors.TIMEOUT, f"the stock reference took over {timeout:g} s") from None
    if done.returncode != 0:
        raise MeshnetError(errors.INTERNAL, f"the stock reference failed ({done.returncode}): {done.stderr[-500:]}")
    results = []
    for line in done.stdout.splitlines():
        prompt_part, _, generated = line.partition(" |")
        results.append(([int(t) for t in prompt_part.split()], [int(t) for t in generated.split()]))
    if len(results) != len(prompts):
        raise MeshnetError(errors.INTERNAL, f"the stock reference answered {len(results)} of {len(prompts)} prompts")
    return results
