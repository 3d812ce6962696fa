"""The session table's vocabulary (sessions.py): what a session's caller gets (TokenEvent,
Done, Failed) and the effects the table returns for the I/O loop to carry out."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from meshnet.core.errors import MeshnetError
from meshnet.route.registry import WorkerRecord
from meshnet.route.requests import RequestKind


# ---- what the caller of a session gets ------------------------------------------------

@dataclass
class TokenEvent:
    token: int
    piece: bytes
    logits: np.ndarray | None
    cached: int = 0              # the prompt tokens restored from a stored prefix (known from the first token)
    # a session opened with logprobs: (this token's log-probability, [(token, logprob, piece
    # bytes)] of the most likely, most likely first)
    logprob: tuple[float, list] | None = None


@dataclass
class Done:
    reason: str                  # eog | length
    metrics: dict
    token_times: list[float]


@dataclass
class Failed:
    error: MeshnetError


CallerEvent = TokenEvent | Done | Failed


# ---- effects ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Request:
    """Send a control request to stage STAGE of session SID (if WORKER is still registered)."""

    worker: WorkerRecord
    kind: RequestKind
    sid: int
    stage: int
    fields: dict = field(default_factory=dict)
    payload: bytes | None = None   # OPEN's grammar (protocol.open_grammar)


@dataclass(frozen=True)
class Push:
    """A data message to the head's data socket; if it cannot go, push_failed(sid)."""

    sid: int
    head: WorkerRecord
    fields: dict


@dataclass(frozen=True)
class Emit:
    sid: int
    event: CallerEvent


@dataclass(frozen=True)
class Leave:
    """Forget the requests session SID has in flight: their replies no longer matter."""

    sid: int


Effect = Request | Push | Emit | Leave
