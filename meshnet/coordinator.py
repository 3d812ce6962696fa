"""The coordinator: a ROUTER socket, the registry of stage workers, and every
session's path through them.

One I/O thread owns the socket and all state; callers on other threads talk to it
through a command queue (woken by a pipe) and get answers through futures and
per-session event queues. A session goes coordinator -> head -> coordinator -> next
stage ... -> tail -> coordinator; the residual frame a stage returns is sent on to
the next stage as it is (no copy). The prompt is sent in bounded chunks, pipelined:
chunk k+1 enters the head while chunk k is in the next stage.

A worker that stops answering heartbeats, or says goodbye, is lost: every session
that touches it ends with a structured `stage_lost` error within the heartbeat bound,
its KV is released on the other stages, and the coordinator keeps serving.
"""

from __future__ import annotations

import collections
import errno
import itertools
import logging
import os
import queue
import secrets
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np
import zmq

from . import protocol as P
from .engine import utf8_or_error
from .errors import MeshnetError
from .heartbeat import HEARTBEAT_INTERVAL, HEARTBEAT_LIVENESS, Liveness, Pacer, now
from .metrics import generation_metrics, percentiles
from .tracker import StageOffer, build_route, offer_from_capability

log = logging.getLogger("meshnet.coordinator")

PREFILL_CHUNK = 64             # prompt tokens per forward request
REQUEST_TIMEOUT = 60.0         # seconds a stage may take to answer one request
SOCKET_HWM = 10_000            # ZeroMQ high-water mark, messages
MAX_PAYLOAD = 32 << 20         # largest payload accepted from a worker: 512 rows of an 16k-wide model fit
MAX_FRAMES = 3                 # a peer's identity, a header and at most one payload
RECV_BATCH = 256               # messages handled per wake-up before looking at the clock again
CLOCK_PERIOD = 0.01            # seconds between checks of heartbeats, liveness and deadlines


@dataclass
class WorkerRecord:
    identity: bytes
    name: str
    capability: dict
    offer: StageOffer
    liveness: Liveness
    sessions: set[int] = field(default_factory=set)
    # measured here: hop = round trip minus the worker's own time (its two timestamps)
    hops_us: collections.deque = field(default_factory=lambda: collections.deque(maxlen=10_000))
    seam_bytes: int = 0
    replies: int = 0
    errors: collections.Counter = field(default_factory=collections.Counter)


@dataclass
class Pending:
    kind: str                    # open | forward | release | cancel | query
    sid: int | None
    worker: bytes
    stage: int
    sent_ns: int
    deadline: float
    future: Future | None = None
    pos: int = 0
    n: int = 0


@dataclass
class TokenEvent:
    token: int
    piece: bytes
    logits: np.ndarray | None


@dataclass
class Session:
    sid: int
    route: list[WorkerRecord]
    prompt: list[int]
    max_tokens: int
    want_logits: bool
    stop_at_eog: bool
    chunk: int
    events: queue.Queue
    prompt_sent: int = 0          # prompt tokens handed to the head so far
    tokens: list[int] = field(default_factory=list)
    finished: bool = False
    t_start: float = 0.0
    t_first: float | None = None
    hops_us: list[float] = field(default_factory=list)
    compute_us: list[list[int]] = field(init=False)   # per stage
    opens_waiting: int = field(init=False)             # stages yet to confirm the session is open
    seam_bytes: int = 0

    def __post_init__(self):
        self.opens_waiting = len(self.route)
        self.compute_us = [[] for _ in self.route]

    def label(self, stage: int) -> str:
        return self.route[stage].offer.label


class SessionHandle:
    """A caller's view of one generation: iterate for tokens as they come, or wait for
    the result. Errors arrive as MeshnetError (code stage_lost, cancelled, ...)."""

    def __init__(self, coordinator: "Coordinator", sid: int, events: queue.Queue):
        self.coordinator, self.sid, self._events = coordinator, sid, events
        self.tokens: list[int] = []
        self.logits: list[np.ndarray] = []
        self.text = b""
        self.metrics: dict = {}
        self.stop_reason: str | None = None
        self._done = False

    def __iter__(self) -> Iterator[TokenEvent]:
        return self._events_until(None)

    def _events_until(self, deadline: float | None) -> Iterator[TokenEvent]:
        while not self._done:
            try:
                kind, value = self._events.get(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise MeshnetError("timeout", f"session {self.sid} gave no result in time", session=self.sid) from None
            if kind == "token":
                self.tokens.append(value.token)
                self.text += value.piece
                if value.logits is not None:
                    self.logits.append(value.logits)
                yield value
            elif kind == "done":
                self._done = True
                self.stop_reason, self.metrics = value
            else:
                self._done = True
                raise value

    def result(self, timeout: float | None = None) -> "SessionHandle":
        """Wait for the whole generation; MeshnetError(timeout) if it takes over `timeout` s."""
        for _ in self._events_until(None if timeout is None else time.monotonic() + timeout):
            pass
        return self

    def cancel(self) -> None:
        self.coordinator.cancel(self.sid)


class Coordinator:
    def __init__(
        self,
        bind: str = "tcp://127.0.0.1:0",
        *,
        heartbeat_interval: float = HEARTBEAT_INTERVAL,
        heartbeat_liveness: int = HEARTBEAT_LIVENESS,
        prefill_chunk: int = PREFILL_CHUNK,
        request_timeout: float = REQUEST_TIMEOUT,
        max_payload: int = MAX_PAYLOAD,
    ):
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_liveness = heartbeat_liveness
        self.prefill_chunk = prefill_chunk
        self.request_timeout = request_timeout
        self.max_payload = max_payload

        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)   # an unroutable send raises, never vanishes
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.SNDHWM, SOCKET_HWM)
        self.router.setsockopt(zmq.RCVHWM, SOCKET_HWM)
        # zmq drops a peer whose frame is past this before allocating it (between this and
        # max_payload the peer gets an `oversized` error); a message's frame count and
        # total size are bounded where it is read (protocol.recv_frames)
        self.router.setsockopt(zmq.MAXMSGSIZE, 2 * max_payload)
        self.max_message_bytes = max_payload + 2 * P.MAX_HEADER_BYTES
        try:
            self.router.bind(bind)
        except zmq.ZMQError as e:
            self.router.close(linger=0)
            self.ctx.term()
            if e.errno == errno.EADDRINUSE:
                raise MeshnetError("address_in_use", f"cannot listen on {bind}: the address is already in use "
                                   "(another coordinator?); choose another port with --bind") from None
            raise MeshnetError("bad_address", f"cannot listen on {bind!r}: {e.strerror}; an address looks like "
                               "tcp://127.0.0.1:5555") from None
        self.endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)

        self.workers: dict[bytes, WorkerRecord] = {}
        self.sessions: dict[int, Session] = {}
        self.pending: dict[int, Pending] = {}
        self._rids = itertools.count(secrets.randbits(40))
        self._sids = itertools.count(secrets.randbits(40))
        self.counters: collections.Counter = collections.Counter()
        self._refusals_logged: collections.OrderedDict[bytes, None] = collections.OrderedDict()

        self._commands: queue.Queue = queue.Queue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="meshnet-coordinator", daemon=True)
        self._thread.start()

    # ---- API for other threads -------------------------------------------------------

    def _submit(self, fn: Callable[[Future], None]) -> Future:
        future: Future = Future()
        self._commands.put((fn, future))
        os.write(self._wake_w, b"x")
        return future

    def close(self) -> None:
        if self._running:
            self._submit(lambda f: f.set_result(None))
            self._running = False
            os.write(self._wake_w, b"x")
            self._thread.join(timeout=5)
            self.router.close(linger=0)
            self.ctx.term()
            os.close(self._wake_r)
            os.close(self._wake_w)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def route(self) -> list[StageOffer]:
        """The current route, or MeshnetError(route_incomplete) saying why there is none."""
        return self._submit(lambda f: f.set_result(self._route_offers())).result(5)

    def wait_for_route(self, timeout: float = 60.0, n_stages: int | None = None) -> list[StageOffer]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                route = self.route()
                if n_stages is None or len(route) == n_stages:
                    return route
                error = MeshnetError(P.E_ROUTE, f"route has {len(route)} stages, waiting for {n_stages}")
            except MeshnetError as e:
                error = e
            if time.monotonic() > deadline:
                raise error
            time.sleep(0.05)

    def workers_snapshot(self) -> list[dict]:
        def snap(f):
            f.set_result([dict(w.capability, name=w.name, sessions=len(w.sessions)) for w in self.workers.values()])
        return self._submit(snap).result(5)

    def generate(self, prompt_tokens: list[int], max_tokens: int, *, want_logits: bool = False,
                 stop_at_eog: bool = True, prefill_chunk: int | None = None) -> SessionHandle:
        if not prompt_tokens:
            raise MeshnetError("invalid_argument", "the prompt has no tokens")
        if max_tokens < 1:
            raise MeshnetError("invalid_argument", "max_tokens must be at least 1")
        sid = next(self._sids)
        events: queue.Queue = queue.Queue()
        chunk = prefill_chunk or self.prefill_chunk
        self._submit(lambda f: self._guarded("starting a session", self._start_session, sid, list(prompt_tokens),
                                             max_tokens, want_logits, stop_at_eog, chunk, events, sid=sid, events=events))
        return SessionHandle(self, sid, events)

    def cancel(self, sid: int) -> None:
        self._submit(lambda f: self._cancel_session(sid))

    def tokenize(self, text: str, timeout: float = 30.0) -> list[int]:
        utf8_or_error(text, "the text")
        return self._query_stage(0, P.TOKENIZE, {"text": text}).result(timeout)["tokens"]

    def detokenize(self, tokens: list[int], timeout: float = 30.0) -> str:
        return self._query_stage(-1, P.DETOKENIZE, {"tokens": list(tokens)}).result(timeout)["text"]

    def stage_stats(self, timeout: float = 10.0) -> list[dict]:
        """HEALTH of every registered worker (KV in use, sessions, queue depth), in layer order."""
        def ask(f):
            futures = [self._query(w, P.HEALTH, {}) for w in sorted(self.workers.values(), key=lambda w: w.offer.start)]
            f.set_result(futures)
        futures = self._submit(ask).result(timeout)
        return [dict(fut.result(timeout)) for fut in futures]

    def metrics(self, timeout: float = 2.0) -> dict:
        """Every stage's numbers (the worker's own, from HEALTH, and the hops measured
        here) and the coordinator's counters: what `meshnet status` and /metrics show.
        Answers within `timeout` from what is known: a worker that does not answer its
        HEALTH in time is shown as silent, with how long since it was last heard."""
        deadline = time.monotonic() + timeout

        def ask(f):
            workers = sorted(self.workers.values(), key=lambda w: w.offer.start)
            mine = [{
                "stage": w.offer.label, "worker": w.name, "seam_bytes": w.seam_bytes, "replies": w.replies,
                "reply_errors": dict(w.errors), "last_heard_s": round(w.liveness.silent_for(), 3),
                **{f"hop_us_{k}": v for k, v in percentiles(w.hops_us).items()},
            } for w in workers]
            f.set_result((mine, [self._query(w, P.HEALTH, {}) for w in workers], dict(self.counters)))
        mine, futures, counters = self._submit(ask).result(timeout)
        stages = []
        for here, future in zip(mine, futures):
            try:
                theirs = future.result(max(0.0, deadline - time.monotonic()))
            except MeshnetError as e:
                theirs = {"unreachable": e.message}
            except TimeoutError:
                theirs = {"silent": True, "unreachable": f"no answer to health within {timeout:g} s"}
            stages.append({**theirs, **here, "requests": sum(theirs.get("requests", {}).values())})
        sessions = {k.removeprefix("failed_"): v for k, v in counters.items() if k.startswith("failed_")}
        sessions["completed"] = counters.get("sessions_completed", 0)
        return {"stages": stages, "sessions": sessions, "counters": counters}

    def shutdown_workers(self) -> None:
        def ask(f):
            for w in list(self.workers.values()):
                self._query(w, P.SHUTDOWN, {})
            f.set_result(None)
        self._submit(ask).result(5)

    def _query_stage(self, index: int, msg_type: str, fields: dict) -> Future:
        outer: Future = Future()

        def ask(f):
            try:
                route = self._route()
            except MeshnetError as e:
                outer.set_exception(e)
                return
            inner = self._query(route[index], msg_type, fields)
            inner.add_done_callback(lambda i: outer.set_exception(i.exception()) if i.exception() else outer.set_result(i.result()))
        submitted = self._submit(ask)
        # a failure inside ask itself must reach the caller, not leave it waiting
        submitted.add_done_callback(lambda f: f.exception() and not outer.done() and outer.set_exception(f.exception()))
        return outer

    # ---- the I/O thread ---------------------------------------------------------------

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        pacer = Pacer(self.heartbeat_interval)
        tick_ms = max(1, int(self.heartbeat_interval * 1000 / 2))
        clocks_at = 0.0
        while self._running:
            try:
                events = dict(poller.poll(tick_ms))
                if self.router in events:
                    for _ in range(RECV_BATCH):
                        self._receive()
                        if not self.router.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                            break
                if self._wake_r in events:
                    self._run_commands()
                # heartbeats, liveness and deadlines work at heartbeat scale, not per message
                if now() >= clocks_at:
                    clocks_at = now() + CLOCK_PERIOD
                    if pacer.due():
                        for w in list(self.workers.values()):
                            self._send(w.identity, P.encode(P.HEARTBEAT, 0))
                    for w in [w for w in self.workers.values() if w.liveness.dead()]:
                        self._guarded("losing a silent worker", self._lose_worker, w, "stopped answering heartbeats")
                    self._expire_requests()
            except Exception:  # the last line of defence: a bug must not stop every session
                self.counters["internal_errors"] += 1
                log.exception("coordinator: unexpected error in the I/O loop; it goes on")

    def _guarded(self, what: str, fn, *args, sid: int | None = None, events: queue.Queue | None = None) -> None:
        """Run one piece of the loop's work; an exception in it is logged with its
        traceback and fails only the session it belongs to (sid), never the loop. A
        session that never got registered hears of it through its caller's events."""
        try:
            fn(*args)
        except Exception as e:
            self.counters["internal_errors"] += 1
            log.exception("coordinator: %s failed", what)
            if sid is None:
                return
            error = MeshnetError("internal", f"{what} failed: {type(e).__name__}: {e}", session=sid)
            session = self.sessions.get(sid)
            try:
                if session is not None:
                    self._fail(session, error, cancel=True)
                elif events is not None:
                    events.put(("error", error))
            except Exception:
                log.exception("coordinator: failing session %s after an error failed too", sid)

    def _receive(self) -> None:
        frames, why = P.recv_frames(self.router, MAX_FRAMES, self.max_message_bytes)
        if why is not None:
            self.counters["bad_messages"] += 1
            if frames:
                self._send(frames[0].bytes, P.error_frames(None, P.E_OVERSIZED, why))
            return
        if len(frames) < 2:
            return  # an identity with no message: nothing to answer
        self._guarded("handling a message", self._on_message, frames[0].bytes, frames[1:])

    def _run_commands(self) -> None:
        try:
            os.read(self._wake_r, 4096)
        except BlockingIOError:
            pass
        while not self._commands.empty():
            fn, future = self._commands.get_nowait()
            try:
                fn(future)
            except Exception as e:
                if not future.done():
                    future.set_exception(e)

    def _send(self, identity: bytes, frames: list) -> bool:
        try:
            self.router.send_multipart([identity, *frames], flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.ZMQError as e:  # EHOSTUNREACH (peer gone) or EAGAIN (peer not reading)
            self.counters[f"send_failed_{e.errno}"] += 1
            worker = self.workers.get(identity)
            if worker is not None and e.errno == zmq.EHOSTUNREACH:
                self._lose_worker(worker, "its connection is gone")
            return False

    def _on_message(self, identity: bytes, frames: list) -> None:
        try:
            msg = P.decode(frames, self.max_payload)
        except P.ProtocolError as e:
            self.counters["bad_messages"] += 1
            if e.msg_type == P.READY and identity not in self._refusals_logged:
                # a worker that cannot join: its operator needs to know why, once per peer
                self._refusals_logged[identity] = None
                if len(self._refusals_logged) > 1024:
                    self._refusals_logged.popitem(last=False)
                log.warning("coordinator: refused a worker (peer %s): %s", identity.hex(), e.message)
            self._send(identity, P.error_frames(e.rid, e.code, e.message, sid=e.sid))
            return
        worker = self.workers.get(identity)
        if msg.type == P.READY:
            self._register(identity, msg)
            return
        if worker is None:
            if msg.type in (P.HEARTBEAT, P.OK, P.RESULT, P.ERROR):
                self._send(identity, P.encode(P.DISCONNECT, 0))  # a worker we forgot: announce again
            elif msg.type != P.GOODBYE:
                self._send(identity, P.error_frames(msg.rid, P.E_UNKNOWN_TYPE, f"the coordinator does not serve '{msg.type}'"))
            return
        worker.liveness.heard()
        if msg.type == P.HEARTBEAT:
            return
        if msg.type == P.GOODBYE:
            self._lose_worker(worker, "said goodbye")
            return
        if msg.type in (P.OK, P.RESULT, P.ERROR):
            pending = self.pending.get(msg.rid)
            if pending is None or pending.worker != identity:
                self.counters["late_replies"] += 1  # for a session that already ended
                return
            del self.pending[msg.rid]
            worker.replies += 1
            if msg.type == P.ERROR:
                worker.errors[msg["code"]] += 1
            self._guarded(f"the reply to a {pending.kind}", self._on_reply, worker, pending, msg, sid=pending.sid)
            return
        self._send(identity, P.error_frames(msg.rid, P.E_UNKNOWN_TYPE, f"the coordinator does not serve '{msg.type}'"))

    def _register(self, identity: bytes, msg: P.Message) -> None:
        capability = msg["capability"]  # checked field by field in protocol.decode
        current = self.workers.get(identity)
        if current is not None and current.capability == capability:
            current.liveness.heard()  # the same worker saying it again
            return
        if current is not None:  # this connection now offers something else: what it offered is gone
            self._lose_worker(current, "announced a different capability")
        for other in [w for w in self.workers.values() if w.capability["worker_id"] == capability["worker_id"]]:
            # the worker process connected again: its old connection is dead, whatever it still delivers
            self._lose_worker(other, "connected again")
        # the worker process's id and this connection's: readable, and unique among the registered
        offer = offer_from_capability(f"{capability['worker_id'][:8]}.{identity.hex()[-4:]}", capability)
        self.workers[identity] = WorkerRecord(identity, offer.worker, capability, offer,
                                              Liveness(self.heartbeat_interval, self.heartbeat_liveness))
        self.counters["registrations"] += 1

    def _lose_worker(self, worker: WorkerRecord, reason: str) -> None:
        if self.workers.pop(worker.identity, None) is None:
            return
        self.counters["workers_lost"] += 1
        elapsed_ms = int(worker.liveness.silent_for() * 1000)
        for rid in [rid for rid, p in self.pending.items() if p.worker == worker.identity]:
            pending = self.pending.pop(rid)
            if pending.future is not None and not pending.future.done():
                pending.future.set_exception(MeshnetError(P.E_STAGE_LOST, f"worker {worker.name} {reason}",
                                                          stage=worker.offer.label, worker=worker.name))
        for sid in list(worker.sessions):
            session = self.sessions.get(sid)
            if session is not None:
                stage = next(i for i, w in enumerate(session.route) if w is worker)
                self._fail(session, MeshnetError(
                    P.E_STAGE_LOST, f"stage {worker.offer.label} (worker {worker.name}) {reason}",
                    stage=worker.offer.label, worker=worker.name, session=sid, elapsed_ms=elapsed_ms),
                    skip_stage=stage)

    # ---- requests ---------------------------------------------------------------------

    def _request(self, worker: WorkerRecord, msg_type: str, pending: Pending, payload=None, **fields) -> int:
        rid = next(self._rids)
        pending.sent_ns = time.perf_counter_ns()
        self.pending[rid] = pending
        if not self._send(worker.identity, P.encode(msg_type, rid, payload=payload, **fields)):
            self.pending.pop(rid, None)
            if pending.future is not None and not pending.future.done():
                pending.future.set_exception(MeshnetError(P.E_STAGE_LOST, f"cannot reach worker {worker.name}"))
        return rid

    def _query(self, worker: WorkerRecord, msg_type: str, fields: dict) -> Future:
        future: Future = Future()
        self._request(worker, msg_type, Pending("query", None, worker.identity, -1, 0,
                                                now() + self.request_timeout, future), **fields)
        return future

    def _expire_requests(self) -> None:
        t = now()
        for rid in [rid for rid, p in self.pending.items() if p.deadline < t]:
            # failing one request ends its session, which drops that session's other requests
            pending = self.pending.pop(rid, None)
            if pending is None:
                continue
            self._guarded("expiring a request", self._expire, pending, sid=pending.sid)

    def _expire(self, pending: Pending) -> None:
        worker = self.workers.get(pending.worker)
        where = f"stage {worker.offer.label} (worker {worker.name})" if worker else "a worker that has since gone"
        error = MeshnetError(P.E_DEADLINE, f"no answer from {where} within {self.request_timeout:.0f} s")
        if pending.future is not None and not pending.future.done():
            pending.future.set_exception(error)
        session = self.sessions.get(pending.sid) if pending.sid is not None else None
        if session is not None and not session.finished and pending.kind in ("open", "forward"):
            self._fail(session, MeshnetError(P.E_DEADLINE, error.message, stage=session.label(pending.stage),
                                             session=session.sid), cancel=True)

    def _on_reply(self, worker: WorkerRecord, pending: Pending, msg: P.Message) -> None:
        if pending.kind == "query":
            if msg.type == P.ERROR:
                pending.future.set_exception(MeshnetError(msg["code"], msg["message"], stage=worker.offer.label))
            else:
                pending.future.set_result(msg.get("info", {}))
            return
        session = self.sessions.get(pending.sid)
        if session is None or session.finished or pending.kind in ("release", "cancel"):
            return
        if msg.type == P.ERROR:
            self._fail(session, MeshnetError(msg["code"], msg["message"], stage=worker.offer.label, worker=worker.name,
                                             session=session.sid), cancel=True)
            return
        if pending.kind == "open":
            session.opens_waiting -= 1
            if session.opens_waiting == 0:
                self._send_prompt_chunk(session)
            return
        if msg.type != P.RESULT:
            self._fail(session, MeshnetError("internal", f"stage {worker.offer.label} answered a forward with {msg.type}",
                                             session=session.sid), cancel=True)
            return
        rtt_us = (time.perf_counter_ns() - pending.sent_ns) / 1000
        hop_us = max(0.0, rtt_us - msg.get("worker_us", msg.get("compute_us", 0)))
        worker.hops_us.append(hop_us)
        session.hops_us.append(hop_us)
        session.compute_us[pending.stage].append(msg.get("compute_us", 0))
        self._on_forward_result(session, pending, msg)

    # ---- sessions ---------------------------------------------------------------------

    def _route(self) -> list[WorkerRecord]:
        offers = build_route(w.offer for w in self.workers.values())
        by_name = {w.name: w for w in self.workers.values()}
        return [by_name[o.worker] for o in offers]

    def _route_offers(self) -> list[StageOffer]:
        return [w.offer for w in self._route()]

    def _start_session(self, sid, prompt, max_tokens, want_logits, stop_at_eog, chunk, events) -> None:
        try:
            route = self._route()
        except MeshnetError as e:
            events.put(("error", MeshnetError(e.code, e.message, session=sid)))
            return
        n_ctx = min(w.capability["n_ctx"] for w in route)
        if len(prompt) + max_tokens > n_ctx:
            events.put(("error", MeshnetError("context_full", f"{len(prompt)} prompt + {max_tokens} new tokens exceed "
                                              f"the route's context of {n_ctx}", session=sid)))
            return
        session = Session(sid, route, prompt, max_tokens, want_logits, stop_at_eog,
                          min(chunk, *(w.capability["n_batch"] for w in route)), events, t_start=time.perf_counter())
        self.sessions[sid] = session
        for i, worker in enumerate(route):
            worker.sessions.add(sid)
            self._request(worker, P.OPEN, Pending("open", sid, worker.identity, i, 0, now() + self.request_timeout), sid=sid)

    def _forward(self, session: Session, stage: int, pos: int, n: int, tokens=None, payload=None) -> None:
        worker = session.route[stage]
        if payload is not None:  # a residual crossing the seam into this stage
            worker.seam_bytes += len(payload)
            session.seam_bytes += len(payload)
        last = stage == len(session.route) - 1
        self._request(worker, P.FORWARD,
                      Pending("forward", session.sid, worker.identity, stage, 0, now() + self.request_timeout, pos=pos, n=n),
                      payload=payload, sid=session.sid, pos=pos, n=n, tokens=tokens,
                      shape=None if payload is None else [n, worker.capability["n_embd"]],
                      dtype=None if payload is None else "f32",
                      logits=True if last and session.want_logits else None,
                      deadline_ms=int(self.request_timeout * 1000))

    def _send_prompt_chunk(self, session: Session) -> None:
        at = session.prompt_sent
        piece = session.prompt[at : at + session.chunk]
        session.prompt_sent += len(piece)
        self._forward(session, 0, at, len(piece), tokens=piece)

    def _on_forward_result(self, session: Session, pending: Pending, msg: P.Message) -> None:
        stage, last = pending.stage, len(session.route) - 1
        if stage < last:
            if msg.payload is None:
                self._fail(session, MeshnetError("bad_payload", f"stage {session.label(stage)} returned no residual",
                                                 session=session.sid), cancel=True)
                return
            self._forward(session, stage + 1, pending.pos, pending.n, payload=msg.payload)
            if stage == 0 and session.prompt_sent < len(session.prompt) and pending.pos + pending.n == session.prompt_sent:
                self._send_prompt_chunk(session)
            return
        if pending.pos + pending.n < len(session.prompt):
            if len(session.route) == 1:  # a one-stage route has no seam to pipeline through
                self._send_prompt_chunk(session)
            return  # a prompt chunk other than the last: no token yet
        token = msg.get("token")
        if token is None:
            self._fail(session, MeshnetError("bad_payload", "the tail returned no token", session=session.sid), cancel=True)
            return
        logits = None
        if session.want_logits and msg.payload is not None:
            logits = np.frombuffer(msg.payload, dtype="<f4").copy()
        if session.t_first is None:
            session.t_first = time.perf_counter()
        session.tokens.append(token)
        session.events.put(("token", TokenEvent(token, msg.get("piece", b""), logits)))
        if session.stop_at_eog and msg.get("eog"):
            self._finish(session, "eog")
        elif len(session.tokens) >= session.max_tokens:
            self._finish(session, "length")
        else:
            self._forward(session, 0, len(session.prompt) + len(session.tokens) - 1, 1, tokens=[token])

    def _metrics(self, session: Session) -> dict:
        t_end = time.perf_counter()
        hops = percentiles(session.hops_us or [0.0])
        return {
            **generation_metrics([(w.offer.start, w.offer.end) for w in session.route], len(session.prompt),
                                 len(session.tokens), session.t_start, session.t_first or t_end, t_end,
                                 session.seam_bytes),
            "hop_us_p50": hops["p50"],
            "hop_us_p99": hops["p99"],
            "stage_compute_us_p50": [float(np.median(c)) if c else None for c in session.compute_us],
        }

    def _end(self, session: Session, skip_stage: int | None, message_type: str) -> None:
        session.finished = True
        self.sessions.pop(session.sid, None)
        for rid in [rid for rid, p in self.pending.items() if p.sid == session.sid]:
            del self.pending[rid]
        for i, worker in enumerate(session.route):
            worker.sessions.discard(session.sid)
            if i != skip_stage and worker.identity in self.workers:
                self._request(worker, message_type,
                              Pending(message_type, session.sid, worker.identity, i, 0, now() + self.request_timeout),
                              sid=session.sid)

    def _finish(self, session: Session, reason: str) -> None:
        self.counters["sessions_completed"] += 1
        self._end(session, None, P.RELEASE)
        session.events.put(("done", (reason, self._metrics(session))))

    def _fail(self, session: Session, error: MeshnetError, skip_stage: int | None = None, cancel: bool = False) -> None:
        if session.finished:
            return
        self.counters[f"failed_{error.code}"] += 1
        self._end(session, skip_stage, P.CANCEL if cancel else P.RELEASE)
        session.events.put(("error", error))

    def _cancel_session(self, sid: int) -> None:
        session = self.sessions.get(sid)
        if session is not None and not session.finished:
            self._fail(session, MeshnetError(P.E_CANCELLED, f"session {sid} was cancelled", session=sid), cancel=True)
