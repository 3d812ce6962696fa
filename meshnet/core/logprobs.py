"""The log-probabilities of a drawn token and of the most likely ones, from the logits
the tail already has: a log-softmax of the model's own distribution (before penalties,
temperature or a grammar, as llama-server reports them)."""

from __future__ import annotations

import numpy as np

MAX_TOP = 20   # OpenAI's top_logprobs bound


def logprobs(logits: np.ndarray, token: int, n_top: int) -> tuple[float, list[tuple[int, float]]]:
    """(TOKEN's log-probability, the N_TOP most likely tokens with theirs, most likely first)."""
    row = np.asarray(logits, dtype=np.float64)
    peak = row.max()
    log_total = peak + np.log(np.exp(row - peak).sum())
    top: list[tuple[int, float]] = []
    if n_top > 0:
        ids = np.argpartition(-row, min(n_top, len(row)) - 1)[:n_top]
        ids = ids[np.lexsort((ids, -row[ids]))]   # most likely first, ties by id
        top = [(int(i), float(row[i] - log_total)) for i in ids]
    return float(row[token] - log_total), top
