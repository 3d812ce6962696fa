"""Split against whole, in this process: does a route of stages give the whole model's
logits bit for bit?

The check an architecture passes before the support table lists it as splitting
(engine_c/architectures.tsv; tests/engine/test_architectures.py): a prompt fed in uneven
chunks, then greedy steps, through the whole model and through each split, every
logit compared; two sessions batched together; the prompt fed token by token; a
session gone on from another's saved memory, cut back (prefix reuse). Pure
engine, no sockets: each stage is a meshnet.engine.binding.Stage of this process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from meshnet.core import errors
from meshnet.core.errors import MeshnetError
from meshnet.engine.binding import Entry
from meshnet.engine.gguf_layout import read_layout
from meshnet.engine.pipeline import LocalPipeline

PROMPT_TOKENS = 24
GREEDY_STEPS = 16
CHUNKS = (0, 7, 8, 19)          # where the prompt is cut: chunks of 7, 1, 11 and 5 tokens


def prompt(n_vocab: int, n_tokens: int = PROMPT_TOKENS, seed: int = 0) -> np.ndarray:
    """Token ids drawn from the whole vocabulary, fixed by SEED."""
    return np.random.default_rng(seed).integers(0, n_vocab, n_tokens, dtype=np.int32)


def splits(n_layer: int) -> list[list[tuple[int, int]]]:
    """The 2- and 3-stage splits the check runs: halves, and thirds as even as they go."""
    out = []
    if n_layer >= 2:
        half = n_layer // 2
        out.append([(0, half), (half, n_layer)])
    if n_layer >= 3:
        a, b = n_layer // 3, (2 * n_layer) // 3
        a, b = max(a, 1), max(b, a + 1)
        out.append([(0, a), (a, b), (b, n_layer)])
    return out


def route(path: str, ranges: Sequence[tuple[int, int]] | None, **stage_options) -> LocalPipeline:
    """Stages of PATH for RANGES in this process; None: the whole model (no range)."""
    return LocalPipeline(path, ranges or [(0, read_layout(path).n_layer)], **stage_options)


def _last_logits(pipeline: LocalPipeline, feeds: Sequence[tuple[int, int, Sequence[int]]]) -> np.ndarray:
    """FEEDS: (session, position, tokens) each; the last row's logits of each, in order."""
    entries = [Entry(sid, pos, tokens=np.asarray(tokens, dtype=np.int32)) for sid, pos, tokens in feeds]
    return pipeline.forward(entries).logits


@dataclass
class Run:
    """What one route gave for one session: the logits after each prompt chunk and each step."""

    logits: list[np.ndarray] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)


def generate(pipeline: LocalPipeline, tokens: np.ndarray, cuts: Sequence[int], steps: int, sid: int = 1) -> Run:
    """TOKENS in the chunks that CUTS starts, then STEPS greedy tokens, one session alone."""
    run = Run()
    pipeline.open_session(sid)
    try:
        bounds = list(cuts) + [len(tokens)]
        for start, end in zip(bounds, bounds[1:]):
            run.logits.append(_last_logits(pipeline, [(sid, start, tokens[start:end])])[0])
        pos = len(tokens)
        for _ in range(steps):
            token = int(np.argmax(run.logits[-1]))
            run.tokens.append(token)
            run.logits.append(_last_logits(pipeline, [(sid, pos, [token])])[0])
            pos += 1
    finally:
        pipeline.release_session(sid)
    return run


def generate_batched(pipeline: LocalPipeline, prompts: Sequence[np.ndarray], steps: int) -> list[Run]:
    """Each prompt as a session of its own, all of them in every forward call together."""
    runs = [Run() for _ in prompts]
    sids = list(range(1, len(prompts) + 1))
    for sid in sids:
        pipeline.open_session(sid)
    try:
        for run, logits in zip(runs, _last_logits(pipeline, [(sid, 0, p) for sid, p in zip(sids, prompts)])):
            run.logits.append(logits)
        for step in range(steps):
            feeds = []
            for sid, p, run in zip(sids, prompts, runs):
                token = int(np.argmax(run.logits[-1]))
                run.tokens.append(token)
                feeds.append((sid, len(p) + step, [token]))
            for run, logits in zip(runs, _last_logits(pipeline, feeds)):
                run.logits.append(logits)
    finally:
        for sid in sids:
            pipeline.release_session(sid)
    return runs


def generate_restored(pipeline: LocalPipeline, tokens: np.ndarray, keep: int, steps: int) -> Run | None:
    """TOKENS through one session whose memory each stage saves; a second session restores
    it, cut back to KEEP tokens, and goes on from there: the rest of the prompt, then STEPS
    greedy tokens (what prefix reuse across sessions does). None where the memory cannot be
    cut back (a recurrent state): the prefix store keeps none of those."""
    pipeline.open_session(1)
    try:
        _last_logits(pipeline, [(1, 0, tokens)])
        saved = [stage.save_session(1) for stage in pipeline.stages]
    finally:
        pipeline.release_session(1)
    pipeline.open_session(2)
    try:
        for stage, memory in zip(pipeline.stages, saved):
            stage.restore_session(2, memory, len(tokens))
            try:
                stage.truncate_session(2, keep)
            except MeshnetError as e:
                if e.code == errors.CANNOT_ROLL_BACK:
                    return None
                raise
        run = Run(logits=[_last_logits(pipeline, [(2, keep, tokens[keep:])])[0]])
        for pos in range(len(tokens), len(tokens) + steps):
            run.tokens.append(int(np.argmax(run.logits[-1])))
            run.logits.append(_last_logits(pipeline, [(2, pos, [run.tokens[-1]])])[0])
        return run
    finally:
        pipeline.release_session(2)


def max_diff(a: Run, b: Run, tail: int | None = None) -> float:
    """The largest |logit difference| over the rows both runs have (their last TAIL rows
    when their prompts were cut differently); inf when their tokens part."""
    if a.tokens != b.tokens:
        return float("inf")
    rows_a, rows_b = (a.logits, b.logits) if tail is None else (a.logits[-tail:], b.logits[-tail:])
    if len(rows_a) != len(rows_b):
        return float("inf")
    return max(float(np.abs(x - y).max()) for x, y in zip(rows_a, rows_b))


@dataclass
class Report:
    arch: str
    n_layer: int
    results: dict[str, float] = field(default_factory=dict)   # check -> max |diff| (0 = exact)

    @property
    def exact(self) -> bool:
        return bool(self.results) and all(v == 0.0 for v in self.results.values())

    def failures(self) -> dict[str, float]:
        return {k: v for k, v in self.results.items() if v != 0.0}


def check(path: str, n_threads: int = 2, steps: int = GREEDY_STEPS) -> Report:
    """Every split of PATH against its whole model (same engine, no range), bit for bit."""
    args = dict(n_ctx=128, max_sessions=2, n_threads=n_threads)
    with route(path, None, **args) as whole:
        info = whole.head.info()
        report = Report(info.arch, info.n_layer)
        tokens = prompt(info.n_vocab)
        others = prompt(info.n_vocab, PROMPT_TOKENS - 5, seed=1)
        one_chunk = generate(whole, tokens, [0], steps)
        chunked = generate(whole, tokens, CHUNKS, steps)
        by_token = generate(whole, tokens, range(len(tokens)), steps)
        other = generate(whole, others, [0], steps)
    # the numerics issue's invariance: a row's logits do not depend on how rows are grouped
    report.results["whole: chunked against one chunk"] = max_diff(one_chunk, chunked, tail=steps + 1)
    report.results["whole: token by token against one chunk"] = max_diff(one_chunk, by_token, tail=steps + 1)
    for ranges in splits(report.n_layer):
        name = f"{len(ranges)} stages {ranges}"
        with route(path, ranges, **args) as pipeline:
            report.results[name + ": chunked"] = max_diff(chunked, generate(pipeline, tokens, CHUNKS, steps))
            batched = generate_batched(pipeline, [tokens, others], steps)
            report.results[name + ": 2 sessions batched"] = max(max_diff(one_chunk, batched[0]),
                                                               max_diff(other, batched[1]))
            if len(ranges) == 2:   # prefix reuse: the memory of another session, cut back and gone on from
                restored = generate_restored(pipeline, tokens, CHUNKS[2], steps)
                if restored is not None:
                    report.results[name + ": restored prefix"] = max_diff(one_chunk, restored, tail=steps + 1)
    return report
