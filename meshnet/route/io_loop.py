"""The coordinator's I/O thread: the only code that touches its sockets. It reads what
workers and stages send, hands it to the tables (registry.py, requests.py,
sessions.py) and carries out the effects they return; callers on other threads reach
it through a command queue (woken by a pipe).

A send that finds a worker's connection gone marks the worker; the next clock pass
loses it, once (the Paranoid Pirate rule), so no loss runs inside another session's
step. A worker that stops answering heartbeats, or says goodbye, is lost the same way:
every session on it resumes on another route or ends with `stage_lost`.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable

import zmq

from meshnet.core import errors as E
from meshnet.core.errors import MeshnetError
from meshnet.core.trace import Timeline
from meshnet.net import protocol as P
from meshnet.net.heartbeat import Liveness, Pacer, Wakefulness, now
from meshnet.route.config import MIN_FETCH_RATE, CoordinatorConfig
from meshnet.route.registry import Registry, WorkerRecord
from meshnet.route.requests import Pending, RequestKind, Requests
from meshnet.route.events import Emit, Failed, Leave, Push, Request, TokenEvent
from meshnet.route.listener import Listener, peer_key
from meshnet.route.sessions import SessionTable
from meshnet.route.standby import plan_standby

log = logging.getLogger("meshnet.route.coordinator")
MAX_FRAMES = 3                 # a peer's identity, a header and at most one payload
RECV_BATCH = 256               # messages handled per wake-up before looking at the clock again
CLOCK_PERIOD = 0.01            # seconds between checks of heartbeats, liveness and deadlines


class IOLoop:
    def __init__(self, config: CoordinatorConfig):
        self.config = config
        self.sockets = Listener(config)
        self.counters: collections.Counter = collections.Counter()
        self.registry = Registry(allow_mixed=config.allow_mixed)
        self.requests = Requests()
        self.table = SessionTable(self.registry.route, reply_endpoint=self.sockets.data_endpoint,
                                  request_timeout=config.request_timeout,
                                  suspect_window=config.heartbeat_interval * config.heartbeat_liveness,
                                  resume_wait=config.resume_wait, max_resumes=config.max_resumes,
                                  speculate=config.speculate, counters=self.counters)
        self.callers: dict[int, queue.Queue] = {}
        self.voucher = config.holders() if config.holders is not None else None
        self.timeline = Timeline("coordinator") if config.trace else None
        self._refusals_logged: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._commands: queue.Queue = queue.Queue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="meshnet-coordinator", daemon=True)
        self._thread.start()

    # ---- for the facade (coordinator.py), from other threads ---------------------------

    def submit(self, fn: Callable[[Future], None]) -> Future:
        future: Future = Future()
        self._commands.put((fn, future))
        os.write(self._wake_w, b"x")
        return future

    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        if not self._running:
            return
        self.submit(lambda f: f.set_result(None))
        self._running = False
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=5)
        if self.voucher is not None:
            self.voucher.close()
        self.sockets.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # ---- in this thread: what the facade's commands call -------------------------------

    def start_session(self, sid: int, events: queue.Queue, *args) -> None:
        self.callers[sid] = events
        self._guarded("starting a session", lambda: self.table.open(sid, *args), sid=sid)

    def cancel_session(self, sid: int) -> None:
        self._carry_out(self.table.cancel(sid))

    def query(self, worker: WorkerRecord, msg_type: str, fields: dict, payload=None) -> Future:
        future: Future = Future()
        self._request(worker, msg_type, Pending(RequestKind.QUERY, None, worker.identity, -1,
                                                now() + self.config.request_timeout, future), payload, **fields)
        return future

    # ---- the loop ----------------------------------------------------------------------

    def _loop(self) -> None:
        if self.config.cpu is not None:
            os.sched_setaffinity(0, {self.config.cpu})   # this thread only: the caller's threads keep theirs
        poller = zmq.Poller()
        router, data, handshakes = self.sockets.router, self.sockets.data, self.sockets.handshakes
        for sock in (router, data, self._wake_r, handshakes):
            if sock is not None:
                poller.register(sock, zmq.POLLIN)
        pacer = Pacer(self.config.heartbeat_interval)
        tick_ms = max(1, int(self.config.heartbeat_interval * 1000 / 2))
        clocks_at = 0.0
        awake = Wakefulness(self.config.heartbeat_interval)
        while self._running:
            try:
                events = dict(poller.poll(tick_ms))
                self._forgive_own_stop(awake.stopped_for())
                if router in events:
                    self._drain(router, self._receive)
                if data in events:
                    self._drain(data, self._receive_data)
                if handshakes is not None and handshakes in events:
                    self._on_failed_handshake()
                if self._wake_r in events:
                    self._run_commands()
                # heartbeats, liveness and deadlines work at heartbeat scale, not per message
                if now() >= clocks_at:
                    clocks_at = now() + CLOCK_PERIOD
                    self._clock_pass(pacer, awake)
            except Exception:  # the last line of defence: a bug must not stop every session
                self.counters["internal_errors"] += 1
                log.exception("coordinator: unexpected error in the I/O loop; it goes on")

    @staticmethod
    def _drain(sock: zmq.Socket, receive: Callable[[], None]) -> None:
        for _ in range(RECV_BATCH):
            receive()
            if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                break

    def _clock_pass(self, pacer: Pacer, awake: Wakefulness) -> None:
        if pacer.due():
            for w in self.registry.all():
                self._send(w.identity, P.encode(P.HEARTBEAT, 0))
        for w in [w for w in self.registry.all() if w.unreachable]:
            self._guarded("losing an unreachable worker", self._lose_worker, w, "its connection is gone")
        silent = [w for w in self.registry.all() if w.liveness.dead()]
        if silent and self._forgive_own_stop(awake.stopped_for()):
            silent = []
        for w in silent:
            self._guarded("losing a silent worker", self._lose_worker, w, "stopped answering heartbeats")
        for pending in self.requests.expired(now()):
            self._guarded("expiring a request", self._expire, pending, sid=pending.sid)
        for sid in self.table.due():
            self._guarded("expiring a session", self.table.expire, sid, sid=sid)

    def _forgive_own_stop(self, stopped_for: float) -> bool:
        """The workers' silence while this process was stopped was ours, and what they
        sent meanwhile waits to be read: each gets a fresh heartbeat window."""
        if not stopped_for:
            return False
        log.warning("coordinator: this process was stopped for %.1f s; its workers get a fresh heartbeat window",
                    stopped_for)
        for w in self.registry.all():
            w.liveness.heard()
        return True

    def _guarded(self, what: str, fn, *args, sid: int | None = None) -> None:
        """Run one piece of the loop's work and carry out the effects it returns; an
        exception in it is logged with its traceback and fails only the session it belongs
        to (sid), never the loop."""
        try:
            effects = fn(*args)
            if effects:
                self._carry_out(effects)
        except Exception as e:
            self.counters["internal_errors"] += 1
            log.exception("coordinator: %s failed", what)
            try:
                self._carry_out(self.table.effects())   # what the table decided before the error still holds
                if sid is None:
                    return
                self._carry_out(self.table.fail(sid, MeshnetError(
                    E.INTERNAL, f"{what} failed: {type(e).__name__}: {e}", session=sid)))
            except Exception:
                log.exception("coordinator: failing session %s after an error failed too", sid)

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

    # ---- effects -----------------------------------------------------------------------

    def _carry_out(self, effects: list) -> None:
        """Do what the session table asked, in order; a push that cannot go is one more
        event for the table, handled after the effects before it."""
        todo = collections.deque(effects)
        while todo:
            effect = todo.popleft()
            if isinstance(effect, Emit):
                events = self.callers.get(effect.sid)
                if isinstance(effect.event, Failed) and effect.event.error.code != E.CANCELLED:
                    self._log_failure(effect.sid, effect.event.error)
                if events is not None:
                    if not isinstance(effect.event, TokenEvent):
                        del self.callers[effect.sid]
                    events.put(effect.event)
            elif isinstance(effect, Leave):
                self.requests.drop_session(effect.sid)
            elif isinstance(effect, Request):
                if effect.worker.identity in self.registry:
                    self._request(effect.worker, effect.kind.value, Pending(
                        effect.kind, effect.sid, effect.worker.identity, effect.stage,
                        now() + self.config.request_timeout), payload=effect.payload, **effect.fields)
            elif isinstance(effect, Push):
                if not self.sockets.push(effect.head.capability.data_endpoint, effect.head.public_key,
                                         P.encode(P.ACT, 0, **effect.fields)):
                    todo.extend(self.table.push_failed(effect.sid))

    def _log_failure(self, sid: int, error: MeshnetError) -> None:
        """Why a session ended other than by its caller: the log that explains a client's
        error (a flood of them is sampled, as refused handshakes are)."""
        self.counters["sessions_failed"] += 1
        n = self.counters["sessions_failed"]
        if n <= 100 or n % 1000 == 0:
            log.warning("coordinator: session %x ended with %s: %s", sid, error.code, error.message)

    def _send(self, identity: bytes, frames: list) -> bool:
        failed = self.sockets.send(identity, frames)
        if failed is None:
            return True
        self.counters[f"send_failed_{failed}"] += 1
        worker = self.registry.get(identity)
        if worker is not None and failed == zmq.EHOSTUNREACH:
            worker.unreachable = True   # lost at the next clock pass, not inside this step
        return False

    def _on_failed_handshake(self) -> None:
        endpoint, why = self.sockets.failed_handshake()
        self.counters["refused_handshakes"] += 1
        if self.counters["refused_handshakes"] <= 100 or self.counters["refused_handshakes"] % 1000 == 0:
            log.warning("coordinator: refused a peer (%s): %s", endpoint, why)

    def _request(self, worker: WorkerRecord, msg_type: str, pending: Pending, payload=None, **fields) -> None:
        rid = self.requests.next_rid()
        frames = P.encode(msg_type, rid, payload=payload, **fields)
        if len(frames[0]) > P.MAX_HEADER_BYTES:   # the worker could not even read its id: it would never answer
            error = MeshnetError(E.OVERSIZED, f"a {msg_type} request of {len(frames[0])} bytes is over the "
                                 f"{P.MAX_HEADER_BYTES}-byte header limit")
            if pending.future is not None and not pending.future.done():
                pending.future.set_exception(error)
            if pending.sid is not None:
                self._carry_out(self.table.fail(pending.sid, error))
            return
        self.requests.add(rid, pending)
        if not self._send(worker.identity, frames):
            self.requests.forget(rid)
            if pending.future is not None and not pending.future.done():
                pending.future.set_exception(MeshnetError(E.STAGE_LOST, f"cannot reach worker {worker.name}"))

    # ---- the control socket ------------------------------------------------------------

    def _receive(self) -> None:
        frames, why = P.recv_frames(self.sockets.router, MAX_FRAMES, self.sockets.max_message_bytes)
        if why is not None:
            self.counters["bad_messages"] += 1
            if frames:
                self._send(frames[0].bytes, P.error_frames(None, E.OVERSIZED, why))
            return
        if len(frames) < 2:
            return  # an identity with no message: nothing to answer
        self._guarded("handling a message", self._on_message, frames[0].bytes, frames[1:])

    def _on_message(self, identity: bytes, frames: list) -> None:
        try:
            msg = P.decode(frames, self.config.max_payload)
        except P.ProtocolError as e:
            self.counters["bad_messages"] += 1
            if e.msg_type == P.READY:
                self._refuse_once(identity, e.message)
            self._send(identity, P.error_frames(e.rid, e.code, e.message, sid=e.sid))
            return
        worker = self.registry.get(identity)
        if msg.type == P.READY:
            self._register(identity, msg, peer_key(frames[0]))
        elif msg.type == P.HOLDERS:
            # asked before a worker registers: it has no model file yet, only a token
            info, manifest = self.voucher.answer(identity, [
                (w.capability.weights, w.public_key, w.capability.model_sha256) for w in self.registry.all()
                if w.capability.weights]) if self.voucher is not None else ({"model_sha256": None, "holders": []}, None)
            self._send(identity, P.encode(P.OK, msg.rid, manifest, info=info))
        elif worker is None:
            if msg.type in (P.HEARTBEAT, P.OK, P.ERROR):
                self._send(identity, P.encode(P.DISCONNECT, 0))  # a worker we forgot: announce again
            elif msg.type != P.GOODBYE:
                self._send(identity, P.error_frames(msg.rid, E.UNKNOWN_TYPE, f"the coordinator does not serve '{msg.type}'"))
        elif msg.type == P.HEARTBEAT:
            worker.liveness.heard()
        elif msg.type == P.GOODBYE:
            self._lose_worker(worker, "said goodbye")
        elif msg.type in (P.OK, P.ERROR):
            worker.liveness.heard()
            self._on_reply(worker, msg)
        else:
            worker.liveness.heard()
            self._send(identity, P.error_frames(msg.rid, E.UNKNOWN_TYPE, f"the coordinator does not serve '{msg.type}'"))

    def _on_reply(self, worker: WorkerRecord, msg: P.Message) -> None:
        pending = self.requests.take(msg.rid, worker.identity)
        if pending is None:
            if msg.type == P.ERROR and msg.rid == 0 and msg.get("sid") is not None:
                # a stage's report of a session that failed on its data plane
                self._guarded("a stage's report of a failed session", self.table.stage_error, msg["sid"], worker,
                              msg["code"], msg["message"], sid=msg["sid"])
            else:
                self.counters["late_replies"] += 1  # for a session that already ended
            return
        worker.replies += 1
        if msg.type == P.ERROR:
            worker.errors[msg["code"]] += 1
        if pending.kind is RequestKind.QUERY:
            if msg.type == P.ERROR:
                pending.future.set_exception(MeshnetError(msg["code"], msg["message"], stage=worker.label))
            elif msg.payload is not None:   # a text request's answer
                pending.future.set_result(bytes(msg.payload))
            else:
                pending.future.set_result(msg.get("info", {}))
        elif pending.kind is RequestKind.ASSIGN:
            if msg.type == P.ERROR:
                self._assign_failed(worker, f"[{msg['code']}] {msg['message']}")
            # loaded: its READY, offering the range, follows
        elif pending.kind is RequestKind.OPEN:
            if msg.type == P.ERROR:
                self._guarded("a stage's refusal to open", self.table.request_failed, pending.sid, worker,
                              msg["code"], msg["message"], sid=pending.sid)
            else:
                self._guarded("a stage's open", self.table.opened, pending.sid, msg.get("cached", 0),
                              msg.get("speculate", 0) if pending.stage == 0 else None, sid=pending.sid)

    def _expire(self, pending: Pending) -> None:
        worker = self.registry.get(pending.worker)
        where = f"stage {worker.label} (worker {worker.name})" if worker else "a worker that has since gone"
        error = MeshnetError(E.DEADLINE_EXCEEDED, f"no answer from {where} within {self.config.request_timeout:.0f} s")
        if pending.future is not None and not pending.future.done():
            pending.future.set_exception(error)
        if pending.kind is RequestKind.ASSIGN and worker is not None:
            self._assign_failed(worker, error.message)
        if pending.kind is RequestKind.OPEN:
            self._carry_out(self.table.open_expired(pending.sid, pending.stage, error.message))

    def _refuse_once(self, identity: bytes, why: str) -> None:
        """A worker that cannot join: its operator needs to know why, once per peer."""
        if identity in self._refusals_logged:
            return
        self._refusals_logged[identity] = None
        if len(self._refusals_logged) > 1024:
            self._refusals_logged.popitem(last=False)
        log.warning("coordinator: refused a worker (peer %s): %s", identity.hex(), why)

    # ---- the registry ------------------------------------------------------------------

    def _register(self, identity: bytes, msg: P.Message, peer_key: str | None = None) -> None:
        capability = msg["capability"]  # parsed and checked in protocol.decode
        epoch = msg.get("epoch", 0)
        admission = self.registry.admit(identity, capability, epoch)
        if admission.outcome == "again":
            if admission.dropped:
                # it dropped every session it held (it lost sight of us, or we of it): they
                # go on where they can, replayed, on this worker again if need be
                self._carry_out(self.table.sessions_dropped(
                    self.registry.get(identity), "dropped its sessions (it had lost sight of the coordinator)"))
            return
        if admission.outcome == "refused":
            self.counters["bad_messages"] += 1
            self._refuse_once(identity, admission.detail)
            self._send(identity, P.error_frames(msg.rid, E.BAD_FIELD, f"ready: {admission.why}"))
            return
        for worker, reason in admission.lose:
            self._lose_worker(worker, reason)
        self.registry.add(identity, capability, Liveness(self.config.heartbeat_interval,
                                                         self.config.heartbeat_liveness), peer_key, epoch)
        self.counters["registrations"] += 1
        self._guarded("planning for the standby workers", self._plan_standby)
        self._guarded("resuming sessions", self.table.routes_changed)

    def _lose_worker(self, worker: WorkerRecord, reason: str) -> None:
        if self.registry.remove(worker.identity) is None:
            return
        # a worker that said goodbye left as asked (every run's end): only a loss is news
        log.log(logging.INFO if reason == "said goodbye" else logging.WARNING, "coordinator: lost worker %s (%s): %s",
                worker.name, worker.label, reason)
        self.counters["workers_lost"] += 1
        if worker.offer is not None or worker.assigning is not None:
            self._guarded("planning for the standby workers", self._plan_standby)
        for pending in self.requests.drop_worker(worker.identity):
            if pending.future is not None and not pending.future.done():
                pending.future.set_exception(MeshnetError(E.STAGE_LOST, f"worker {worker.name} {reason}",
                                                          stage=worker.label, worker=worker.name))
        if worker.offer is not None:
            self._carry_out(self.table.worker_lost(worker, reason, int(worker.liveness.silent_for() * 1000)))

    def _plan_standby(self) -> None:
        if not any(w.assigning is None and not w.assign_failed for w in self.registry.standby()):
            return
        assignments, self.registry.plan_note = plan_standby(self.registry.all(), self.config.overhead)
        for a in assignments:
            a.worker.assigning = a.layers
            self.counters["assigned"] += 1
            log.info("coordinator: worker %s loads %s (planned %d bytes of its %d)", a.worker.name, a.layers.label,
                     a.planned_bytes, a.worker.capability.mem_bytes)
            # a worker that fetches its range's bytes first is given the time the slowest link takes
            timeout = self.config.request_timeout + (a.planned_bytes / MIN_FETCH_RATE if a.worker.capability.fetches
                                                     else 0)
            self._request(a.worker, P.ASSIGN, Pending(RequestKind.ASSIGN, None, a.worker.identity, -1,
                                                      now() + timeout),
                          layers=[a.layers.start, a.layers.end])

    def _assign_failed(self, worker: WorkerRecord, why: str) -> None:
        log.warning("coordinator: worker %s could not load %s: %s", worker.name, worker.assigning, why)
        worker.assigning = None
        worker.assign_failed = why
        self._plan_standby()

    # ---- the data socket ---------------------------------------------------------------

    def _receive_data(self) -> None:
        t0_ns = time.monotonic_ns()
        frames, why = P.recv_frames(self.sockets.data, 2, self.sockets.max_message_bytes)
        if why is not None:
            self.counters["dropped_oversized"] += 1
            return
        try:
            msg = P.decode(frames, self.config.max_payload)
        except P.ProtocolError as e:
            self.counters[f"dropped_{e.code}"] += 1
            return
        if msg.type == P.TOOK:
            self._guarded("a stage's chunk taken", self.table.took, msg, sid=msg.get("sid"))
        elif msg.type == P.TOKEN:
            self._guarded("a stage's token", self.table.token, msg, sid=msg.get("sid"))
            if self.timeline is not None:
                self.timeline.span("coordinator", msg["sid"], msg["pos"], msg["n"], t0_ns, time.monotonic_ns())
        else:
            self.counters["dropped_unknown_type"] += 1
