"""Heartbeat liveness, both ways: the knobs and the two small clocks every peer keeps.

As in the ZeroMQ Guide's Paranoid Pirate: heartbeats go out on a clock (not only when
idle), any message from a peer proves it alive, and a peer silent for LIVENESS
intervals is dead. A worker that loses its coordinator keeps its socket, which libzmq
reconnects with exponential back-off (RECONNECT_IVL doubling to RECONNECT_IVL_MAX), and
keeps heartbeating; nothing waits in a sleep. With the defaults a dead peer is noticed
within 2 s (the bound is 3 s).
"""

from __future__ import annotations

import time

HEARTBEAT_INTERVAL = 0.25   # seconds between heartbeats
HEARTBEAT_LIVENESS = 8      # silent intervals before a peer is declared dead
RECONNECT_IVL_MS = 250      # libzmq's first reconnect delay
RECONNECT_IVL_MAX_MS = 8000 # libzmq's reconnect delay cap (it doubles up to this)
PAUSED_AFTER = 4            # heartbeat intervals between two looks at the clock that mean we were stopped


def now() -> float:
    return time.monotonic()


class Liveness:
    """When did we last hear from the peer, and is it dead yet?"""

    def __init__(self, interval: float = HEARTBEAT_INTERVAL, liveness: int = HEARTBEAT_LIVENESS):
        self.timeout = interval * liveness
        self.last_heard = now()

    def heard(self) -> None:
        self.last_heard = now()

    def silent_for(self) -> float:
        return now() - self.last_heard

    def dead(self) -> bool:
        return self.silent_for() > self.timeout


class Pacer:
    """Says when the next heartbeat is due."""

    def __init__(self, interval: float = HEARTBEAT_INTERVAL):
        self.interval = interval
        self.next_at = now()

    def due(self) -> bool:
        t = now()
        if t < self.next_at:
            return False
        self.next_at = t + self.interval
        return True


class Wakefulness:
    """Was this process itself stopped (SIGSTOP, a laptop's suspend, a swap storm)?

    A peer's silence counts only while we were awake to hear it. A loop asks after
    every poll, and asks again after it has found a peer silent and before it acts on
    that: a stop that lands anywhere between two looks, even between the finding and
    the act, is seen before a peer is blamed for it.
    """

    def __init__(self, interval: float = HEARTBEAT_INTERVAL):
        self.limit = PAUSED_AFTER * interval
        self.looked_at = now()

    def stopped_for(self) -> float:
        """Seconds this process was stopped since the last look (0.0 if it was not)."""
        t = now()
        gap, self.looked_at = t - self.looked_at, t
        return gap if gap > self.limit else 0.0
