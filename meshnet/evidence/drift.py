"""How far a mixed route's output drifts from the whole model's.

A route whose stages differ in class (another quantization of the model, another
backend) runs only with --allow-mixed, and then each run is compared, step by step,
with the whole model in this process fed the same tokens (teacher forcing): whether
both pick the same top-1 token, the largest |logit difference|, KL(whole || route) and
the first step where the top-1 tokens part. `meshnet drift` measures any route so; on
one backend it must be exactly 0.
"""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from meshnet.core import defaults
from meshnet.core import numerics as numerics_classes
from meshnet.engine.binding import Entry

SESSION = 1


def kl_divergence(whole: np.ndarray, route: np.ndarray) -> float:
    """KL(whole || route) of the two softmaxes, in nats, in float64; 0 when the logits are
    equal, which is what a route on one backend gives."""
    if np.array_equal(whole, route):
        return 0.0
    def log_softmax(x):
        x = x.astype(np.float64)
        x = x - x.max()
        return x - np.log(np.exp(x).sum())
    p_log, q_log = log_softmax(whole), log_softmax(route)
    return float(max(0.0, np.sum(np.exp(p_log) * (p_log - q_log))))


class DriftMeter:
    """The whole model, loaded on first use and kept; one measurement at a time."""

    def __init__(self, model_path: str | Path, n_ctx: int = defaults.N_CTX, n_threads: int = 0):
        self.model_path, self.n_ctx, self.n_threads = str(model_path), n_ctx, n_threads
        self._pipeline = None
        self._numerics = None
        self._lock = threading.Lock()

    def measure(self, prompt_tokens: Sequence[int], tokens: Sequence[int], logits: Sequence[np.ndarray],
                numerics: str | None = None) -> dict:
        """Per step k: the whole model's logits after the prompt and tokens[:k], against
        the route's token k and logits k. The whole model computes in the route's numerics
        class (the prompt in one step, as the stock class feeds it)."""
        from meshnet.engine.gguf_layout import read_layout
        from meshnet.engine.pipeline import LocalPipeline

        numerics = numerics or numerics_classes.DEFAULT
        with self._lock:
            if self._pipeline is not None and self._numerics != numerics:
                self._pipeline.close()
                self._pipeline = None
            if self._pipeline is None:
                n_layer = read_layout(self.model_path).n_layer
                self._pipeline = LocalPipeline(self.model_path, [(0, n_layer)], n_ctx=self.n_ctx, max_sessions=1,
                                               n_threads=self.n_threads, numerics=numerics)
                self._numerics = numerics
            whole = self._pipeline
            whole.open_session(SESSION)
            try:
                steps, pos, feed = [], 0, list(prompt_tokens)
                t_decode = None   # from the end of the prompt's step: the rest are one-token decode steps
                for token, route_logits in zip(tokens, logits):
                    out = whole.forward([Entry(SESSION, pos, tokens=np.asarray(feed, dtype=np.int32))])
                    t_decode = t_decode or time.perf_counter()
                    reference = out.logits[0]
                    steps.append({"top1_agrees": int(np.argmax(reference)) == int(token),
                                  "max_abs_logit_diff": float(np.max(np.abs(reference - route_logits))),
                                  "kl": kl_divergence(reference, route_logits)})
                    pos += len(feed)
                    feed = [token]
                decode_s = time.perf_counter() - t_decode if t_decode else 0.0
            finally:
                whole.release_session(SESSION)
        return {
            "reference": self.model_path,
            "steps": steps,
            "top1_agreement": sum(s["top1_agrees"] for s in steps) / len(steps) if steps else None,
            "max_abs_logit_diff": max((s["max_abs_logit_diff"] for s in steps), default=None),
            "max_kl": max((s["kl"] for s in steps), default=None),
            "first_divergence": next((k for k, s in enumerate(steps) if not s["top1_agrees"]), None),
            "decode_tok_s": (len(steps) - 1) / decode_s if len(steps) > 1 and decode_s > 0 else None,
        }

    def close(self) -> None:
        with self._lock:
            if self._pipeline is not None:
                self._pipeline.close()
                self._pipeline = None


def measure_route(cluster, model_path: str | Path, n_tokens: int, n_threads: int = 0) -> dict:
    """`meshnet drift`: the bench prompts through CLUSTER's route, greedy, and the whole
    model (on the CPU, in this process) teacher-forced with the route's tokens. Each prompt
    runs twice on the route: once for its logits, once without them for the decode rate.
    Raises what the route raises when it cannot form (a mixed one without allow_mixed)."""
    from meshnet.evidence.prompts import PROSE

    meter = DriftMeter(model_path, n_ctx=1024, n_threads=n_threads)
    try:
        with cluster:
            coordinator = cluster.coordinator
            prompts = []
            for prompt in PROSE:
                tokens = coordinator.tokenize(prompt)
                timed = coordinator.generate(tokens, n_tokens, stop_at_eog=False).result(600)
                run = coordinator.generate(tokens, n_tokens, want_logits=True, stop_at_eog=False).result(600)
                measured = meter.measure(tokens, run.tokens, run.logits, numerics=cluster.numerics)
                prompts.append({"prompt": prompt, **{k: measured[k] for k in (
                    "top1_agreement", "max_abs_logit_diff", "max_kl", "first_divergence")},
                    "route_decode_tok_s": timed.metrics["decode_tok_s"], "whole_decode_tok_s": measured["decode_tok_s"],
                    "runs_agree": timed.tokens == run.tokens})
            route = route_stages(coordinator)
    finally:
        meter.close()
    return {
        "route": route,
        "mixed": len({s["backend"] for s in route}) > 1,
        "tokens": n_tokens,
        "prompts": prompts,
        "top1_agreement": min(p["top1_agreement"] for p in prompts),
        "max_abs_logit_diff": max(p["max_abs_logit_diff"] for p in prompts),
        "max_kl": max(p["max_kl"] for p in prompts),
        "first_divergence": min((p["first_divergence"] for p in prompts if p["first_divergence"] is not None),
                                default=None),
        "route_decode_tok_s": statistics.median(p["route_decode_tok_s"] for p in prompts),
        "whole_decode_tok_s": statistics.median(p["whole_decode_tok_s"] for p in prompts),
    }


def route_stages(coordinator) -> list[dict]:
    """Each stage of the route: its layers, backend and device (from the worker's
    capability) and its memory: RSS and, on a GPU, VRAM (from its HEALTH)."""
    capabilities = {w["name"]: w for w in coordinator.workers_snapshot()}
    stages = []
    for stage in coordinator.metrics()["stages"]:
        capability = capabilities.get(stage["worker"], {})
        forwards = stage.get("forwards") or 0
        stages.append({"layers": stage["stage"], "backend": capability.get("backend"),
                       "device": capability.get("device"), "rss_bytes": stage.get("rss_bytes"),
                       "vram_bytes": stage.get("vram_bytes"), "model_bytes": stage.get("model_bytes"),
                       # nearly all of a drift run's forwards are one-token decode steps
                       "compute_us_per_forward": stage.get("compute_us_total", 0) / forwards if forwards else None,
                       "hop_us_p50": stage.get("hop_us_p50")})
    return stages
