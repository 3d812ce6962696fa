"""Generation through a route of stages held in this process.

The route is a list of layer ranges that cover the model. One or several sessions go
through the stages together: each stage runs every step waiting for it in one forward
call (batching.py), and each session follows the generation state machine
(generation.py), the same one the coordinator drives over worker processes. This is
the in-process path of `meshnet run --in-process` and the reference the worker
processes are checked against.
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from meshnet.core import errors as E
from meshnet.core.errors import MeshnetError
from meshnet.core.generation import FeedHead, Generation, StopRule, Token
from meshnet.core.layers import LayerRange
from meshnet.core.sampling import Sampling
from meshnet.engine.batching import Step, run_batch, take_batch
from meshnet.engine.binding import Entry, Stage


@dataclass
class Request:
    prompt_tokens: Sequence[int]
    max_tokens: int
    keep_logits: bool = False
    stop_at_eog: bool = True
    on_token: Callable[[int], None] | None = None
    sampling: Sampling | None = None    # None: the most likely token


@dataclass
class Completion:
    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)   # one row per generated token, when kept
    token_times: list[float] = field(default_factory=list)  # time.perf_counter() as each token came
    stop_reason: str | None = None
    metrics: dict = field(default_factory=dict)
    error: MeshnetError | None = None


@dataclass
class _Running:
    sid: int
    request: Request
    gen: Generation
    completion: Completion
    seam_bytes: int = 0


class LocalPipeline:
    """Stages for consecutive layer ranges, all in this process."""

    def __init__(self, model_path, ranges: Sequence[LayerRange | tuple[int, int]], gpu_stages: Sequence[int] = (),
                 **stage_options):
        self.ranges = [(int(a), int(b)) for a, b in ranges]
        self.stages: list[Stage] = []
        try:
            for i, r in enumerate(self.ranges):
                # the whole model runs the stock graph (no range): any architecture works
                self.stages.append(Stage(model_path, None if len(self.ranges) == 1 else r, gpu=i in gpu_stages,
                                         **stage_options))
        except Exception:
            self.close()
            raise
        n_layer = self.stages[0].info_static.n_layer
        if self.ranges[0][0] != 0 or self.ranges[-1][1] != n_layer:
            self.close()
            raise MeshnetError(E.BAD_RANGE, f"ranges {self.ranges} do not cover the model's {n_layer} layers")
        self._sids = itertools.count(1 << 32)   # above the ids a caller of open_session picks

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

    # one step at a time, for callers that drive sessions themselves

    def open_session(self, session_id: int) -> None:
        for stage in self.stages:
            stage.open_session(session_id)

    def release_session(self, session_id: int) -> None:
        for stage in self.stages:
            stage.release_session(session_id)

    def forward(self, entries: Sequence[Entry], want_logits: bool = True):
        """Entries (token ids) through every stage in one forward call each: the tail's output."""
        out = self.head.forward(entries, want_logits)
        for stage in self.stages[1:]:
            rows, at = [], 0
            for e in entries:
                rows.append(Entry(e.session_id, e.pos, residual=out.residual[at : at + e.n_tokens]))
                at += e.n_tokens
            out = stage.forward(rows, want_logits)
        return out

    # generation

    def generate(self, prompt_tokens: Sequence[int], max_tokens: int, *, keep_logits: bool = False,
                 stop_at_eog: bool = True, prefill_chunk: int | None = None,
                 on_token: Callable[[int], None] | None = None, sampling: Sampling | None = None) -> Completion:
        """One session (greedy unless sampling says otherwise); a failure raises its MeshnetError."""
        done = self.generate_many([Request(prompt_tokens, max_tokens, keep_logits, stop_at_eog, on_token, sampling)],
                                  prefill_chunk=prefill_chunk)[0]
        if done.error is not None:
            raise done.error
        return done

    def generate_many(self, requests: Sequence[Request], prefill_chunk: int | None = None) -> list[Completion]:
        """Several sessions at once, batched at every stage; each gives exactly what it
        gives alone. A failing session ends with its error in its Completion and touches
        no other."""
        chunk = prefill_chunk or self.head.info_static.n_batch
        running: list[_Running] = []
        waiting = [collections.deque() for _ in self.stages]
        try:
            for request in requests:
                gen = Generation(list(request.prompt_tokens), StopRule(request.max_tokens, request.stop_at_eog), chunk,
                                 depth=len(self.stages))
                run = _Running(next(self._sids), request, gen, Completion(list(request.prompt_tokens)))
                for stage in self.stages:
                    stage.open_session(run.sid)
                running.append(run)
                self.tail.set_sampling(run.sid, request.sampling, request.prompt_tokens)
            for run in running:
                self._act(run, run.gen.opened(), waiting)
            while any(waiting):
                for k, stage in enumerate(self.stages):
                    if waiting[k]:
                        self._run_stage(k, stage, waiting)
        finally:
            for run in running:
                for stage in self.stages:
                    try:
                        stage.release_session(run.sid)
                    except MeshnetError:
                        pass
        for run in running:
            run.completion.stop_reason = run.gen.stop_reason
            run.completion.token_times = run.gen.token_times
            run.completion.metrics = run.gen.metrics(self.ranges, run.seam_bytes)
        return [run.completion for run in running]

    def _run_stage(self, k: int, stage: Stage, waiting: list[collections.deque]) -> None:
        info = stage.info_static
        last = len(self.stages) - 1
        for result in run_batch(stage, take_batch(waiting[k], info.max_sessions, info.n_batch)):
            step = result.step
            run, is_prompt = step.meta
            if run.gen.done:
                continue
            if result.error is not None:
                run.completion.error = result.error
                run.gen.failed()
                for queue in waiting:  # its other steps go nowhere
                    kept = [s for s in queue if s.meta[0] is not run]
                    queue.clear()
                    queue.extend(kept)
                continue
            if k == 0 and is_prompt:
                self._act(run, run.gen.head_took(step.pos, step.n), waiting)
            if k < last:
                run.seam_bytes += result.residual.nbytes
                waiting[k + 1].append(Step(step.sid, step.pos, step.n, residual=result.residual,
                                           want_logits=k + 1 == last and run.request.keep_logits, meta=step.meta))
            else:
                if result.logits is not None and step.pos + step.n >= len(run.gen.prompt):
                    run.completion.logits.append(result.logits.copy())
                actions = run.gen.tail_gave(step.pos, step.n, result.token, stage.is_eog(result.token))
                self._act(run, actions, waiting)

    def _act(self, run: _Running, actions: list, waiting: list[collections.deque]) -> None:
        for action in actions:
            if isinstance(action, FeedHead):
                waiting[0].append(Step(run.sid, action.pos, len(action.tokens), tokens=np.asarray(action.tokens, np.int32),
                                       want_logits=len(self.stages) == 1 and run.request.keep_logits,
                                       meta=(run, action.prompt)))
            elif isinstance(action, Token):
                run.completion.tokens.append(action.token)
                if run.request.on_token:
                    run.request.on_token(action.token)
