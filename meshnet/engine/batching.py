"""Which waiting inputs a stage runs together, and running them so that a failing
entry fails alone. Used by the worker's stage loop and the in-process pipeline alike.

The rule: every waiting decode step (one row, or a round of drafts) of distinct sessions, up to the stage's
limits, plus at most one prompt chunk, the one that has waited longest. So a long
prompt delays other sessions' decode by one chunk at most, and concurrent decode steps
share one forward call (the engine gives each entry exactly what it gives alone).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from meshnet.core import errors as E
from meshnet.core.errors import MeshnetError
from meshnet.engine.binding import Entry, Stage


@dataclass
class Step:
    """One session's input waiting at a stage: token ids (head) or residual rows."""

    sid: int
    pos: int
    n: int
    tokens: np.ndarray | None = None
    residual: np.ndarray | None = None
    want_logits: bool = False
    meta: Any = None               # the driver's own (headers, timestamps, flags)
    verify: bool = False           # the last drawn token and drafts (their ids in tokens): a decode step of n rows

    def entry(self) -> Entry:
        return Entry(self.sid, self.pos, tokens=self.tokens, residual=self.residual, verify=self.verify)

    @property
    def is_chunk(self) -> bool:
        """A prompt chunk, as opposed to a decode step (one row, or a round of drafts)."""
        return self.n > 1 and not self.verify


@dataclass
class StepResult:
    step: Step
    residual: np.ndarray | None = None     # a stage before the tail: the step's rows
    token: int | None = None               # the tail: the greedy next token
    logits: np.ndarray | None = None       # the tail, when the step asked
    error: MeshnetError | None = None
    draws: list[int] | None = None         # the tail, a verify step: its draws kept (token is the last)


def group_size(n_decoding: int, groups: int, max_entries: int) -> int:
    """Entries a head's batch takes so that N_DECODING sessions go round a route of
    pipelining stages as GROUPS micro-batches: while one group is computed here, the
    others are in the stages after, and no stage waits for the rest (one batch of every
    session would leave all stages but one idle)."""
    if groups <= 1 or n_decoding <= 1:
        return max_entries
    return max(1, min(max_entries, -(-n_decoding // groups)))


def take_batch(waiting: collections.deque, max_entries: int, max_rows: int) -> list[Step]:
    """Remove and return the steps to run together (see the module's rule). Steps of
    one session stay in order: once one of a session's steps is left waiting, so are
    its later ones."""
    batch: list[Step] = []
    rows, has_chunk = 0, False
    held: set[int] = set()          # sessions in the batch, or with a step left waiting
    kept = collections.deque()
    while waiting:
        step = waiting.popleft()
        is_chunk = step.is_chunk
        if (step.sid in held or len(batch) >= max_entries or rows + step.n > max_rows
                or (is_chunk and has_chunk)):
            held.add(step.sid)
            kept.append(step)
            continue
        batch.append(step)
        held.add(step.sid)
        rows += step.n
        has_chunk |= is_chunk
    waiting.extend(kept)
    return batch


def run_batch(stage: Stage, steps: Sequence[Step]) -> list[StepResult]:
    """One forward call for the steps; if it fails and there were several, each runs
    alone so that only the failing one fails (the engine keeps nothing of a failed call)."""
    want_logits = any(s.want_logits for s in steps)
    entries = [s.entry() for s in steps]
    try:
        out = stage.forward(entries, want_logits=want_logits)
    except MeshnetError as e:
        if len(steps) == 1 or e.code == E.ABORTED:
            return [StepResult(s, error=e) for s in steps]
        return [r for s in steps for r in run_batch(stage, [s])]
    results, at = [], 0
    for i, step in enumerate(steps):
        if stage.is_tail:
            logits = out.logits[i] if step.want_logits else None
            results.append(StepResult(step, token=int(out.token[i]), logits=logits,
                                      draws=out.draws(entries, i) if step.verify else None))
        else:
            results.append(StepResult(step, residual=out.residual[at : at + step.n]))
            at += step.n
    return results
