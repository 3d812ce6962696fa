"""Greedy generation through a route of stages held in this process.

The route is a list of layer ranges that cover the model; every session goes through
the stages in layer order. This is the in-process path of `meshnet run` and the
reference the worker processes are checked against.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from .engine import Entry, Stage
from .errors import MeshnetError
from .metrics import generation_metrics


def even_ranges(n_layer: int, n_stages: int) -> list[tuple[int, int]]:
    if not 1 <= n_stages <= n_layer:
        raise MeshnetError("bad_range", f"cannot split {n_layer} layers into {n_stages} stages")
    bounds = [round(i * n_layer / n_stages) for i in range(n_stages + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def ranges_from_seams(n_layer: int, seams: Sequence[int]) -> list[tuple[int, int]]:
    """Seams [15] -> [(0, 15), (15, n_layer)]; seams must rise strictly inside the model."""
    bounds = [0, *seams, n_layer]
    if any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise MeshnetError("bad_range", f"seams {list(seams)} must rise strictly between 0 and {n_layer}")
    return list(zip(bounds[:-1], bounds[1:]))


@dataclass
class Generation:
    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)   # one row per generated token, when kept
    stop_reason: str = "length"
    metrics: dict = field(default_factory=dict)


class LocalPipeline:
    """Stages for consecutive layer ranges, all in this process."""

    def __init__(self, model_path, ranges: Sequence[tuple[int, int]], **stage_options):
        self.ranges = list(ranges)
        self.stages: list[Stage] = []
        try:
            for r in self.ranges:
                # the whole model runs the stock graph (no range): any architecture works
                self.stages.append(Stage(model_path, None if len(self.ranges) == 1 else r, **stage_options))
        except Exception:
            self.close()
            raise
        n_layer = self.stages[0].info_static.n_layer
        if self.ranges[0][0] != 0 or self.ranges[-1][1] != n_layer:
            self.close()
            raise MeshnetError("bad_range", f"ranges {self.ranges} do not cover the model's {n_layer} layers")
        self.seam_bytes = 0

    @property
    def head(self) -> Stage:
        return self.stages[0]

    @property
    def tail(self) -> Stage:
        return self.stages[-1]

    def close(self) -> None:
        for stage in self.stages:
            stage.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def open_session(self, session_id: int) -> None:
        for stage in self.stages:
            stage.open_session(session_id)

    def release_session(self, session_id: int) -> None:
        for stage in self.stages:
            stage.release_session(session_id)

    def forward(self, entries: Sequence[Entry], want_logits: bool = True):
        """Run entries (token ids) through every stage; returns the tail's output."""
        out = self.head.forward(entries, want_logits)
        for stage in self.stages[1:]:
            rows, at = [], 0
            for e in entries:
                rows.append(Entry(e.session_id, e.pos, residual=out.residual[at : at + e.n_tokens]))
                at += e.n_tokens
            self.seam_bytes += out.residual.nbytes
            out = stage.forward(rows, want_logits)
        return out

    def generate(
        self,
        prompt_tokens: Sequence[int],
        max_tokens: int,
        *,
        session_id: int = 1,
        keep_logits: bool = False,
        stop_at_eog: bool = True,
        prefill_chunk: int | None = None,
        on_token: Callable[[int], None] | None = None,
    ) -> Generation:
        if not prompt_tokens:
            raise MeshnetError("invalid_argument", "the prompt has no tokens")
        chunk = prefill_chunk or self.head.info_static.n_batch
        gen = Generation(prompt_tokens=list(prompt_tokens))
        seam_bytes_before = self.seam_bytes
        self.open_session(session_id)
        try:
            t0 = time.perf_counter()
            pos = 0
            for at in range(0, len(prompt_tokens), chunk):
                piece = np.asarray(prompt_tokens[at : at + chunk], dtype=np.int32)
                out = self.forward([Entry(session_id, pos, tokens=piece)], want_logits=keep_logits)
                pos += len(piece)
            t_first = time.perf_counter()
            next_token = int(out.greedy[0])
            while True:
                gen.tokens.append(next_token)
                if keep_logits:
                    gen.logits.append(out.logits[0].copy())
                if on_token:
                    on_token(next_token)
                if stop_at_eog and self.tail.is_eog(next_token):
                    gen.stop_reason = "eog"
                    break
                if len(gen.tokens) >= max_tokens:
                    break
                out = self.forward([Entry(session_id, pos, tokens=np.array([next_token], dtype=np.int32))],
                                   want_logits=keep_logits)
                pos += 1
                next_token = int(out.greedy[0])
            t_end = time.perf_counter()
        finally:
            self.release_session(session_id)

        gen.metrics = generation_metrics(self.ranges, len(prompt_tokens), len(gen.tokens), t0, t_first, t_end,
                                         self.seam_bytes - seam_bytes_before)
        return gen
