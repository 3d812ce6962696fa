"""A GPU stage against the whole model on the CPU, one architecture at a time, in this
process (which loads a GPU engine: it runs CPU stages too).

The CPU's whole model decodes greedily; each GPU route is fed the same tokens (teacher
forcing) and every step's logits are compared: top-1 agreement, the largest |logit
difference|, KL(CPU || GPU) and the first step where the top-1 tokens part. The routes: the
whole model on the GPU, and for an architecture that splits, a GPU head before a CPU tail
and the reverse. And whether the GPU's rows are independent of batching (what makes
failover, prefix reuse and speculation exact): the GPU's whole model fed the prompt in one
chunk, in uneven chunks and token by token, the rows they share compared, in the stock class
and in the invariant one (Vulkan's row-invariant mode, patch 0018).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from meshnet.core import errors
from meshnet.core.errors import MeshnetError
from meshnet.engine.binding import Entry
from meshnet.engine.pipeline import LocalPipeline
from meshnet.evidence import parity
from meshnet.evidence.drift import kl_divergence

STEPS = 8


def forced(pipeline: LocalPipeline, tokens: np.ndarray, followers: Sequence[int], sid: int = 1) -> list[np.ndarray]:
    """The logits after TOKENS (one chunk) and after each of FOLLOWERS, fed whatever this
    route would have picked."""
    pipeline.open_session(sid)
    try:
        rows = [pipeline.forward([Entry(sid, 0, tokens=tokens)]).logits[0]]
        for pos, token in enumerate(followers, len(tokens)):
            rows.append(pipeline.forward([Entry(sid, pos, tokens=np.array([token], dtype=np.int32))]).logits[0])
        return rows
    finally:
        pipeline.release_session(sid)


def compare(whole: parity.Run, rows: list[np.ndarray]) -> dict:
    """The drift of ROWS (a route fed WHOLE's tokens) from WHOLE's own logits."""
    agree = [int(np.argmax(a)) == int(np.argmax(b)) for a, b in zip(whole.logits, rows)]
    return {"top1_agreement": sum(agree) / len(agree),
            "max_abs_logit_diff": max(float(np.abs(a - b).max()) for a, b in zip(whole.logits, rows)),
            "max_kl": max(kl_divergence(a, b) for a, b in zip(whole.logits, rows)),
            "first_divergence": next((i for i, same in enumerate(agree) if not same), None)}


def batching(gpu: LocalPipeline, tokens: np.ndarray, steps: int) -> dict:
    """The batching figures: the largest |diff| of rows the GPU computed in other company
    (the prompt in uneven chunks, token by token) from the same rows in one chunk."""
    one_chunk = parity.generate(gpu, tokens, [0], steps)
    return {"chunked against one chunk": parity.max_diff(one_chunk, parity.generate(gpu, tokens, parity.CHUNKS, steps),
                                                         tail=steps + 1),
            "token by token against one chunk": parity.max_diff(
                one_chunk, parity.generate(gpu, tokens, range(len(tokens)), steps), tail=steps + 1)}


def measure(path: str, n_threads: int = 2, steps: int = STEPS) -> dict:
    """PATH's GPU routes against its CPU whole model, and the GPU's batching figures."""
    options = dict(n_ctx=128, max_sessions=1, n_threads=n_threads)
    with parity.route(path, None, **options) as cpu:
        info = cpu.head.info()
        tokens = parity.prompt(info.n_vocab)
        whole = parity.generate(cpu, tokens, [0], steps)
    report = {"arch": info.arch, "n_layer": info.n_layer, "routes": {}}
    with LocalPipeline(path, [(0, info.n_layer)], gpu_stages=[0], **options) as gpu:
        report["device"] = gpu.head.info().device
        report["routes"]["GPU whole"] = compare(whole, forced(gpu, tokens, whole.tokens))
        report["batching"] = batching(gpu, tokens, steps)
    try:
        with LocalPipeline(path, [(0, info.n_layer)], gpu_stages=[0], numerics="invariant", **options) as gpu:
            report["batching_invariant"] = batching(gpu, tokens, steps)
    except MeshnetError as e:   # a GPU backend without the mode (CUDA's)
        report["batching_invariant"] = {"error": str(e)}
    half = info.n_layer // 2
    report["splits"] = half > 0
    for name, on_gpu in (("GPU head, CPU tail", [0]), ("CPU head, GPU tail", [1])):
        if half == 0:
            break
        try:
            with LocalPipeline(path, [(0, half), (half, info.n_layer)], gpu_stages=on_gpu, **options) as mixed:
                report["routes"][name] = compare(whole, forced(mixed, tokens, whole.tokens))
        except MeshnetError as e:
            if e.code != errors.UNSUPPORTED_ARCH:
                raise
            report["splits"] = False
            break
    return report
