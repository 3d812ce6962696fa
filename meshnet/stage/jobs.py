"""What the worker's socket loop asks of its stage loop: jobs by kind, each with the
request id and the coordinator connection (epoch) its reply goes to."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from meshnet.net import protocol as P


class JobKind(enum.Enum):
    """What the socket loop asks of the stage loop; the value names it on the pair between them."""
    OPEN = "open"
    RELEASE = "release"
    CANCEL = "cancel"
    RELEASE_ALL = "release_all"   # the worker's own, when its coordinator is gone
    TOKENIZE = "tokenize"
    DETOKENIZE = "detokenize"
    TEMPLATE = "template"
    CHAT = "chat"

    @property
    def queue(self) -> str | None:
        """The bounded queue a job of this kind waits in (None: the worker's own, unbounded)."""
        if self is JobKind.RELEASE_ALL:
            return None
        return "text" if self in (JobKind.TOKENIZE, JobKind.DETOKENIZE, JobKind.TEMPLATE, JobKind.CHAT) else "control"


# the pair's kind frame of a session's failure, which no job asked for
SESSION_FAILED = b"session"


@dataclass
class Job:
    kind: JobKind
    rid: int
    epoch: int                 # which coordinator connection asked; replies to old ones are dropped
    sid: int | None = None
    msg: P.Message | None = None
