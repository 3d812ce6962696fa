"""What a stage keeps of one session, and what travels with each of its waiting steps."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from meshnet.core.drafts import NgramProposer
from meshnet.core.generation import StopRule

SEAMS_KEPT = 256          # a tail's per-crossing seam records before its first token; beyond, totals per seam
MAX_SEAM_FIELD = (1 << 40) - 1   # the protocol bound of a hop (us) or a byte count in a seam record

@dataclass
class StageSession:
    """What a stage knows of one session: its key, where its outputs go, and (the tail)
    when it ends."""

    sid: int
    key: int
    stage: int                 # this stage's place in the route
    next_hop: str
    reply: str
    prompt_len: int
    rule: StopRule
    want_logits: bool
    hop_clock: bool
    gather: bool = False       # the head: wait for every decoding session's step (stages share the CPUs)
    groups: int = 1            # the head: micro-batches its decoding sessions make (stages that pipeline)
    decoding: bool = False     # the head has had a decode step of it
    restored: int = 0          # tokens restored from the prefix store until its first step (core/prefix.py)
    sampler: tuple | None = None   # ... and the tail's sampling and history, to set again if that cuts back
    speculate: int = 0         # drafts per round at most (core/drafts.py); 0: none
    proposer: NgramProposer | None = None    # the head's, when it drafts
    offered: tuple[int, list[int], float] | None = None   # the head: the round in flight (position, drafts, when)
    n_generated: int = 0
    logprobs: int | None = None   # the tail: each token's log-probability, and of this many most likely
    seams: list = field(default_factory=list)   # the tail: seams crossed since its last TOKEN

    def crossed(self, seams: list) -> None:
        """The tail: a step of this session crossed SEAMS ([seam, hop_us, bytes] each)."""
        self.seams.extend(seams)
        if len(self.seams) > SEAMS_KEPT:  # a long prompt before the first token: keep totals per seam
            totals: dict[int, int] = collections.Counter()
            for seam, _, nbytes in self.seams:
                totals[seam] += nbytes
            self.seams = [[seam, -1, min(nbytes, MAX_SEAM_FIELD)] for seam, nbytes in sorted(totals.items())]


@dataclass
class Input:
    """What travels with a waiting step: its session, the seams it crossed, whether the
    coordinator wants to hear that the head took it."""

    session: StageSession
    seams: list
    ack: bool
    arrived: float = 0.0       # time.monotonic() at receipt
    checked_ns: int = 0        # time.monotonic_ns() once checked and waiting (a trace's "wait" starts there)
