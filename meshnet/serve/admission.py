"""Admission of HTTP requests to the stages' session slots.

A request that finds every slot taken waits in one bounded, first-come queue, as
llama-server's and Ollama's requests wait for a slot; it is refused (429, with
Retry-After) only when the queue is full or its wait runs out, and a client that goes
away while it waits leaves the queue. A slot given back goes to the request that has
waited longest, before any request that arrives after, so nobody waits forever behind
newcomers. The slots given back come from the sessions' own threads, the waits are the
server's asyncio tasks: the state is under one lock, and a waiter is woken on its loop.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque

from meshnet.core import defaults, errors
from meshnet.core.errors import MeshnetError
DISCONNECT_POLL_S = 0.5  # how soon a client gone while it waits leaves the queue
# the upper bounds (seconds) of the queue-wait histogram's buckets (Prometheus)
WAIT_BUCKETS_S = (0.01, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class ClientGone(Exception):
    """The client of a request went away before its answer."""


class Waiter:
    """One request in the queue: its future, resolved on its own loop when a slot is its."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.granted = loop.create_future()


class Admission:
    """The slots this server's sessions hold, counted against the route's session slots
    (the stages' smallest --max-sessions), the queue of requests waiting for one, and the
    live sessions, ended at once when the server stops."""

    def __init__(self, max_queue: int = defaults.MAX_QUEUE, max_wait: float = defaults.QUEUE_WAIT_S):
        if max_queue < 0 or max_wait < 0:
            raise ValueError(f"max_queue ({max_queue}) and max_wait ({max_wait}) cannot be negative")
        self.max_queue, self.max_wait = max_queue, max_wait
        self.lock = threading.Lock()
        self.active = 0
        self.limit = 0   # the route's slots when a request last asked
        self.waiting: deque[Waiter] = deque()
        self.sessions: set = set()
        self.stopped = False
        # what /metrics and the console show
        self.admitted = 0
        self.refused = {"queue_full": 0, "wait_over": 0}
        self.wait_counts = [0] * (len(WAIT_BUCKETS_S) + 1)   # (the last: over every bound)
        self.wait_sum = 0.0

    @property
    def queued(self) -> int:
        return len(self.waiting)

    async def take(self, limit: int, gone) -> None:
        """A slot for one request, at once or after waiting its turn; LIMIT: the route's
        slots now. GONE(): awaitable, true once the client has gone away (polled while the
        request waits). Raises MeshnetError too_many_sessions (429) when the queue is full
        or the wait ran out, shutting_down when the server stops; ClientGone. The request
        leaves the queue on any of them, and on asyncio.CancelledError."""
        started = time.monotonic()
        with self.lock:
            if self.stopped:
                raise MeshnetError(errors.SHUTTING_DOWN, "the server is shutting down")
            self.limit = limit
            self._hand_on()   # (a route with more slots than before frees waiters)
            if self.active < limit and not self.waiting:
                self.active += 1
                self._admitted(0.0)
                return
            if len(self.waiting) >= self.max_queue:
                self.refused["queue_full"] += 1
                raise MeshnetError(errors.TOO_MANY_SESSIONS,
                                   f"all {limit} session slots are in use and {len(self.waiting)} requests already wait "
                                   f"for one (the most this server queues, --max-queue): retry in a moment")
            waiter = Waiter(asyncio.get_running_loop())
            self.waiting.append(waiter)
        try:
            deadline = started + self.max_wait
            while not waiter.granted.done():
                left = deadline - time.monotonic()
                if left <= 0:
                    with self.lock:
                        if waiter in self.waiting:
                            self.waiting.remove(waiter)
                            self.refused["wait_over"] += 1
                            raise MeshnetError(errors.TOO_MANY_SESSIONS,
                                               f"no session slot came free in {self.max_wait:g} s of waiting (the "
                                               f"server's --queue-wait; {limit} slots, {len(self.waiting)} requests "
                                               f"waiting): retry later")
                    # a slot was handed over just now: the wake-up is on its way
                    await waiter.granted
                    break
                await asyncio.wait({waiter.granted}, timeout=min(left, DISCONNECT_POLL_S))
                if not waiter.granted.done() and await gone():
                    raise ClientGone()
            error = waiter.granted.result()
            if error is not None:
                raise error
        except BaseException:
            self._leave(waiter)
            raise
        with self.lock:
            self._admitted(time.monotonic() - started)

    def _leave(self, waiter: Waiter) -> None:
        """WAITER gives up: out of the queue, or, if a slot was already its, the slot on."""
        with self.lock:
            if waiter in self.waiting:
                self.waiting.remove(waiter)
                return
        if waiter.granted.done() and not waiter.granted.cancelled() and waiter.granted.result() is None:
            self.give()
        elif not waiter.granted.done():
            # granted, its wake-up not yet run: the slot goes on from there
            waiter.granted.cancel()

    def _hand_on(self) -> None:
        """Free slots to the longest waiters (the lock held)."""
        while self.waiting and self.active < self.limit:
            waiter = self.waiting.popleft()
            self.active += 1
            waiter.loop.call_soon_threadsafe(self._wake, waiter, None)

    def _wake(self, waiter: Waiter, error: MeshnetError | None) -> None:
        if waiter.granted.done():   # it left meanwhile: the slot is not its
            if error is None:
                self.give()
            return
        waiter.granted.set_result(error)

    def _admitted(self, waited: float) -> None:
        self.admitted += 1
        self.wait_sum += waited
        self.wait_counts[next((i for i, b in enumerate(WAIT_BUCKETS_S) if waited <= b), len(WAIT_BUCKETS_S))] += 1

    def hold(self, session) -> None:
        with self.lock:
            self.sessions.add(session)

    def give(self, session=None) -> None:
        """A slot back (from any thread): to the longest waiter, if one waits."""
        with self.lock:
            self.active -= 1
            self.sessions.discard(session)
            self._hand_on()

    def stop_all(self) -> None:
        """The server stops: waiters get shutting_down, and live sessions' clients get it
        now, not after uvicorn's graceful timeout."""
        stopping = MeshnetError(errors.SHUTTING_DOWN, "the server is shutting down")
        with self.lock:
            self.stopped = True
            waiters, self.waiting = list(self.waiting), deque()
            sessions = list(self.sessions)
        for waiter in waiters:
            try:
                waiter.loop.call_soon_threadsafe(self._wake, waiter, stopping)
            except RuntimeError:
                pass   # its loop has stopped
        for session in sessions:
            session.cancel(stopping)

    def prometheus(self) -> str:
        """The queue's metrics as Prometheus exposition text."""
        with self.lock:
            active, queued, admitted, refused = self.active, len(self.waiting), self.admitted, dict(self.refused)
            counts, total = list(self.wait_counts), self.wait_sum
        lines = ["# HELP meshnet_http_sessions_active sessions open for HTTP requests",
                 "# TYPE meshnet_http_sessions_active gauge", f"meshnet_http_sessions_active{{}} {active}",
                 "# HELP meshnet_http_queue_depth HTTP requests waiting for a session slot",
                 "# TYPE meshnet_http_queue_depth gauge", f"meshnet_http_queue_depth{{}} {queued}",
                 "# HELP meshnet_http_queue_refused_total HTTP requests refused by the queue, by why",
                 "# TYPE meshnet_http_queue_refused_total counter"]
        lines += [f'meshnet_http_queue_refused_total{{reason="{k}"}} {v}' for k, v in refused.items()]
        lines += ["# HELP meshnet_http_queue_wait_seconds how long admitted HTTP requests waited for a session slot",
                  "# TYPE meshnet_http_queue_wait_seconds histogram"]
        running = 0
        for bound, n in zip([*WAIT_BUCKETS_S, "+Inf"], counts):
            running += n
            lines.append(f'meshnet_http_queue_wait_seconds_bucket{{le="{bound}"}} {running}')
        lines += [f"meshnet_http_queue_wait_seconds_sum{{}} {total:.6f}",
                  f"meshnet_http_queue_wait_seconds_count{{}} {admitted}"]
        return "\n".join(lines) + "\n"

    def console(self) -> dict:
        """The queue as the console shows it."""
        with self.lock:
            return {"sessions_active": self.active, "queued": len(self.waiting),
                    "queue_wait_mean_s": round(self.wait_sum / self.admitted, 3) if self.admitted else None,
                    "queue_refused": sum(self.refused.values())}

