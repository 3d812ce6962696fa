"""The coordinator's requests in flight, a plain table: each control request to a worker
(open, release, cancel, a query, an assignment) waits here under its id for the reply,
until its deadline. The I/O loop sends them and settles their futures."""

from __future__ import annotations

import enum
import itertools
import secrets
from concurrent.futures import Future
from dataclasses import dataclass


class RequestKind(enum.Enum):
    OPEN = "open"          # a session's stage: its reply confirms the session is open there
    RELEASE = "release"    # a session's stage: drop it, it ended
    CANCEL = "cancel"      # ... it failed or was cancelled
    QUERY = "query"        # a caller's question (health, tokenize, ...): the reply goes to its future
    ASSIGN = "assign"      # a standby worker: load this range


@dataclass
class Pending:
    kind: RequestKind
    sid: int | None
    worker: bytes
    stage: int
    deadline: float
    future: Future | None = None


class Requests:
    def __init__(self, first_rid: int | None = None):
        # ids start at random, so that a reply meant for another coordinator's run matches nothing
        self._rids = itertools.count(secrets.randbits(40) if first_rid is None else first_rid)
        self._pending: dict[int, Pending] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def next_rid(self) -> int:
        return next(self._rids)

    def add(self, rid: int, pending: Pending) -> None:
        self._pending[rid] = pending

    def take(self, rid: int, worker: bytes) -> Pending | None:
        """The request a reply from WORKER answers, no longer pending; None when there is
        none (it ended already, or the id is another worker's)."""
        pending = self._pending.get(rid)
        if pending is None or pending.worker != worker:
            return None
        return self._pending.pop(rid)

    def forget(self, rid: int) -> None:
        self._pending.pop(rid, None)

    def expired(self, t: float) -> list[Pending]:
        """The requests past their deadline at T, no longer pending."""
        late = [rid for rid, p in self._pending.items() if p.deadline < t]
        return [self._pending.pop(rid) for rid in late]

    def drop_session(self, sid: int) -> None:
        for rid in [rid for rid, p in self._pending.items() if p.sid == sid]:
            del self._pending[rid]

    def drop_worker(self, worker: bytes) -> list[Pending]:
        """WORKER's requests, no longer pending: it is gone and will not answer."""
        gone = [rid for rid, p in self._pending.items() if p.worker == worker]
        return [self._pending.pop(rid) for rid in gone]
