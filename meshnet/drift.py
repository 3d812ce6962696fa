"""How far a mixed route's output drifts from the whole model's.

A route whose stages differ in class (another quantization of the model, another
backend) runs only with --allow-mixed, and then each run is compared, step by step,
with the whole model in this process fed the same tokens (teacher forcing): whether
both pick the same top-1 token, the largest |logit difference|, KL(whole || route) and
the first step where the top-1 tokens part. `meshnet drift` measures any route so; on
one backend it must be exactly 0.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Sequence

import numpy as np

from .engine import Entry

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

    def __init__(self, model_path: str | Path, n_ctx: int = 2048, n_threads: int = 0):
        self.model_path, self.n_ctx, self.n_threads = str(model_path), n_ctx, n_threads
        self._pipeline = None
        self._lock = threading.Lock()

    def measure(self, prompt_tokens: Sequence[int], tokens: Sequence[int], logits: Sequence[np.ndarray]) -> dict:
        """Per step k: the whole model's logits after the prompt and tokens[:k], against
        the route's token k and logits k."""
        from .gguf_layout import read_layout
        from .pipeline import LocalPipeline

        with self._lock:
            if self._pipeline is None:
                n_layer = read_layout(self.model_path).n_layer
                self._pipeline = LocalPipeline(self.model_path, [(0, n_layer)], n_ctx=self.n_ctx, max_sessions=1,
                                               n_threads=self.n_threads)
            whole = self._pipeline
            whole.open_session(SESSION)
            try:
                steps, pos, feed = [], 0, list(prompt_tokens)
                for token, route_logits in zip(tokens, logits):
                    out = whole.forward([Entry(SESSION, pos, tokens=np.asarray(feed, dtype=np.int32))])
                    reference = out.logits[0]
                    steps.append({"top1_agrees": int(np.argmax(reference)) == int(token),
                                  "max_abs_logit_diff": float(np.max(np.abs(reference - route_logits))),
                                  "kl": kl_divergence(reference, route_logits)})
                    pos += len(feed)
                    feed = [token]
            finally:
                whole.release_session(SESSION)
        return {
            "reference": self.model_path,
            "steps": steps,
            "top1_agreement": sum(s["top1_agrees"] for s in steps) / len(steps) if steps else None,
            "max_abs_logit_diff": max((s["max_abs_logit_diff"] for s in steps), default=None),
            "max_kl": max((s["kl"] for s in steps), default=None),
            "first_divergence": next((k for k, s in enumerate(steps) if not s["top1_agrees"]), None),
        }

    def close(self) -> None:
        with self._lock:
            if self._pipeline is not None:
                self._pipeline.close()
                self._pipeline = None
