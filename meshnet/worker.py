"""A stage worker: one layer range of one model, served to a coordinator over ZeroMQ.

The socket loop (this module's main thread) never computes: it validates requests,
answers heartbeats and health, and hands work to one compute thread through a bounded
queue. Results come back over an inproc pair and go out on the DEALER. The worker
holds no routing knowledge: it runs its fixed layer range on what it is given, and
nothing else (no generic tensor or graph execution).
"""

from __future__ import annotations

import collections
import os
import queue
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from . import protocol as P
from .engine import Entry, Stage
from .errors import MeshnetError
from .heartbeat import HEARTBEAT_INTERVAL, HEARTBEAT_LIVENESS, RECONNECT_IVL_MAX_MS, RECONNECT_IVL_MS, Liveness, Pacer
from .metrics import rss_bytes

MAX_QUEUE = 16            # forward requests waiting for compute before "busy"
MAX_TEXT_JOBS = 8         # tokenize/detokenize requests waiting before "busy"
STATS_PERIOD = 0.05       # seconds between refreshes of the stage statistics while forwards run
GIVEN_UP_AFTER = 0.5      # seconds after a disconnect with no reconnect scheduled: libzmq gave up
SOCKET_HWM = 1000         # ZeroMQ high-water mark, messages, both directions
RECENT_RIDS = 4096        # request ids remembered to refuse duplicates
DEFAULT_DEADLINE_MS = 60_000
# test-only fault switch: "wrong_logits" makes a tail worker corrupt the logits it returns,
# so that tests can prove `meshnet accept` notices; never set outside tests
TEST_FAULT = os.environ.get("MESHNET_TEST_FAULT")


@dataclass
class WorkerConfig:
    coordinator: str
    model_path: str
    layers: tuple[int, int] | None
    model_sha256: str
    n_ctx: int = 2048
    max_sessions: int = 8
    n_batch: int = 512
    n_threads: int = 0
    max_queue: int = MAX_QUEUE
    heartbeat_interval: float = HEARTBEAT_INTERVAL
    heartbeat_liveness: int = HEARTBEAT_LIVENESS


@dataclass
class Job:
    kind: str                  # the Compute method that runs it: forward, open, release, cancel, health, ...
    rid: int
    epoch: int                 # which coordinator connection asked; replies to old ones are dropped
    sid: int | None = None
    msg: P.Message | None = None
    entry: Entry | None = None
    deadline: float = 0.0
    fields: dict = field(default_factory=dict)
    t_recv_ns: int = 0         # when the socket loop received the request


class Compute(threading.Thread):
    """Owns the stage: every engine call happens on this thread, one job at a time."""

    def __init__(self, stage: Stage, ctx: zmq.Context, endpoint: str):
        super().__init__(name="meshnet-compute", daemon=True)
        self.stage = stage
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.sock = ctx.socket(zmq.PAIR)
        self.sock.connect(endpoint)
        self.lock = threading.Lock()
        self.running_sid: int | None = None
        # sessions whose queued forwards must not run: set by a CANCEL, cleared when its
        # cancel job has run (after them) and on OPEN, so an id is never poisoned
        self.cancelled: set[int] = set()
        self.open_sids: set[int] = set()
        self.epoch = 0            # the socket loop's current coordinator connection
        self.errors: collections.Counter = collections.Counter()   # compute-side failures by code
        self.forwards = 0
        self.compute_us_total = 0
        self.stats: dict = {}     # the stage's statistics as of the last job, read by the socket loop
        self._stats_at = 0.0
        self._refresh_stats()

    # called from the socket loop
    def cancel(self, sid: int) -> None:
        with self.lock:
            self.cancelled.add(sid)
            if self.running_sid == sid:
                self.stage.abort()

    def _refresh_stats(self) -> None:
        info = self.stage.info()
        # one assignment: the socket loop reads whole snapshots, never a half-written one
        self.stats = {
            "layers": [info.layer_start, info.layer_end],
            "n_sessions": info.n_sessions,
            "kv_bytes": info.kv_bytes,
            "kv_bytes_used": info.kv_bytes_used,
            "model_bytes": info.model_bytes,
            "compute_bytes": info.compute_bytes,
            "forwards": self.forwards,
            "compute_us_total": self.compute_us_total,
            "errors": dict(self.errors),
        }
        self._stats_at = time.monotonic()

    def _reply(self, job: Job, frames: list) -> None:
        # the loop needs to know which connection asked and whether a forward slot frees up
        self.sock.send_multipart([job.epoch.to_bytes(8, "little"), job.kind.encode(), *frames], copy=False)

    def _error(self, job: Job, error: MeshnetError) -> None:
        self.errors[error.code] += 1
        self._reply(job, P.error_frames(job.rid, error.code, error.message, sid=job.sid))

    def run(self) -> None:
        while (job := self.jobs.get()) is not None:
            try:
                getattr(self, "_do_" + job.kind)(job)
            except MeshnetError as e:
                self._error(job, e)
            except Exception as e:  # a bug must not kill the worker: report it and go on
                self._error(job, MeshnetError("internal", f"{type(e).__name__}: {e}"))
            try:
                # forwards come every few ms: their KV growth is shown at most STATS_PERIOD late
                if job.kind != "forward" or time.monotonic() - self._stats_at > STATS_PERIOD:
                    self._refresh_stats()
            except MeshnetError:
                pass
        self.sock.close(linger=0)

    def _do_open(self, job: Job) -> None:
        self.stage.open_session(job.sid)
        self.open_sids.add(job.sid)
        with self.lock:
            self.cancelled.discard(job.sid)  # a new session under this id starts clean
        self._reply(job, P.encode(P.OK, job.rid, sid=job.sid))

    def _do_release(self, job: Job) -> None:
        self.stage.release_session(job.sid)
        self.open_sids.discard(job.sid)
        self._reply(job, P.encode(P.OK, job.rid, sid=job.sid))

    def _do_cancel(self, job: Job) -> None:
        if job.sid in self.open_sids:
            self.stage.release_session(job.sid)
            self.open_sids.discard(job.sid)
        with self.lock:  # the forwards queued before this job have seen the cancel: forget it
            self.cancelled.discard(job.sid)
        self._reply(job, P.encode(P.OK, job.rid, sid=job.sid))

    def _do_tokenize(self, job: Job) -> None:
        m = job.msg
        tokens = self.stage.tokenize(m["text"], m.get("add_special", True), m.get("parse_special", False))
        self._reply(job, P.encode(P.OK, job.rid, info={"tokens": tokens}))

    def _do_detokenize(self, job: Job) -> None:
        self._reply(job, P.encode(P.OK, job.rid, info={"text": self.stage.detokenize(job.msg["tokens"])}))

    def _do_release_all(self, job: Job) -> None:
        for sid in list(self.open_sids):
            self.stage.release_session(sid)
        self.open_sids.clear()
        with self.lock:
            self.cancelled.clear()

    def _do_forward(self, job: Job) -> None:
        if job.epoch != self.epoch:
            raise MeshnetError(P.E_CANCELLED, "the coordinator that asked for this is gone")
        if time.monotonic() > job.deadline:
            raise MeshnetError(P.E_DEADLINE, "the request's deadline passed while it waited in the queue")
        with self.lock:  # from here on a cancel aborts this very computation
            if job.sid in self.cancelled:
                raise MeshnetError(P.E_CANCELLED, f"session {job.sid} was cancelled")
            self.running_sid = job.sid
        try:
            started = time.perf_counter_ns()
            out = self.stage.forward([job.entry], want_logits=bool(job.fields.get("logits")))
            compute_us = (time.perf_counter_ns() - started) // 1000
            self.forwards += 1
            self.compute_us_total += compute_us
        except MeshnetError as e:
            if e.code == "aborted":
                raise MeshnetError(P.E_CANCELLED, f"session {job.sid} was cancelled mid-computation") from None
            raise
        finally:
            with self.lock:
                self.running_sid = None
                cancelled = job.sid in self.cancelled
        if cancelled:  # the cancel came just before the computation could see it
            raise MeshnetError(P.E_CANCELLED, f"session {job.sid} was cancelled")
        n = job.entry.n_tokens
        if self.stage.is_tail:
            logits = out.logits[0] if out.logits is not None else None
            if TEST_FAULT == "wrong_logits" and logits is not None:
                logits = logits + 0.25
            token = int(out.greedy[0])
            self._reply(job, P.encode(P.RESULT, job.rid, payload=None if logits is None else P.f32_payload(logits),
                                      sid=job.sid, n=n, token=token, eog=self.stage.is_eog(token),
                                      piece=self.stage.detokenize_bytes([token]), compute_us=compute_us,
                                      worker_us=(time.perf_counter_ns() - job.t_recv_ns) // 1000,
                                      logits_n=None if logits is None else len(logits)))
        else:
            self._reply(job, P.encode(P.RESULT, job.rid, payload=P.f32_payload(out.residual), sid=job.sid, n=n,
                                      shape=list(out.residual.shape), dtype="f32", compute_us=compute_us,
                                      worker_us=(time.perf_counter_ns() - job.t_recv_ns) // 1000))


# which bound each compute job counts against (see StageWorker._queue)
QUEUE_OF = {"forward": "forward", "tokenize": "text", "detokenize": "text"}


class StageWorker:
    def __init__(self, config: WorkerConfig):
        self.config = config
        self.stage = Stage(config.model_path, config.layers, n_ctx=config.n_ctx, max_sessions=config.max_sessions,
                           n_batch=config.n_batch, n_threads=config.n_threads)
        info = self.stage.info()
        self.info = info
        self.capability = {
            "model_sha256": config.model_sha256,
            "arch": info.arch,
            "layers": [info.layer_start, info.layer_end],
            "n_layer": info.n_layer,
            "n_embd": info.n_embd,
            "n_vocab": info.n_vocab,
            "engine_pin": info.engine_pin,
            "backend": "CPU",
            "wire_dtype": "f32",
            "max_sessions": info.max_sessions,
            "n_ctx": info.n_ctx,
            "n_batch": info.n_batch,
            "admitted_bytes": info.model_bytes + info.kv_bytes + info.compute_bytes,
            "pid": os.getpid(),
            # one id for every connection this process makes: a coordinator that gets a
            # READY from a new connection drops the old one, whatever it still delivers
            "worker_id": uuid.uuid4().hex,
        }
        self.max_payload = max(info.n_batch * info.n_embd, 1) * 4
        self.ctx = zmq.Context()
        self.results = self.ctx.socket(zmq.PAIR)
        endpoint = f"inproc://meshnet-results-{uuid.uuid4().hex}"
        self.results.bind(endpoint)
        self.compute = Compute(self.stage, self.ctx, endpoint)
        self.dealer: zmq.Socket | None = None
        self.epoch = 0
        # requests waiting for the compute thread, by kind, each with its own bound
        self.queued: collections.Counter = collections.Counter()
        self.queue_limits = {"forward": config.max_queue, "text": MAX_TEXT_JOBS,
                             "control": 4 * config.max_sessions + 16}
        self.recent_rids: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.stopping = False
        self.requests: collections.Counter = collections.Counter()   # by message type
        self.errors: collections.Counter = collections.Counter()     # refused at the socket loop, by code
        self.handlers = {
            P.HEALTH: self._health,
            P.CAPABILITY: self._capability,
            P.OPEN: self._control,
            P.RELEASE: self._control,
            P.CANCEL: self._cancel,
            P.FORWARD: self._forward,
            P.SHUTDOWN: self._shutdown,
            P.TOKENIZE: self._tokenize,
            P.DETOKENIZE: self._detokenize,
        }

    # connection

    def _connect(self) -> None:
        """One DEALER, kept: libzmq reconnects it with its own back-off when the
        coordinator goes away; IMMEDIATE queues nothing while there is no connection, so a
        coordinator that comes back gets no stale backlog, only our heartbeats, and
        answers the first of them with DISCONNECT: we announce again. Only when libzmq
        gives a connection up for good (a protocol error, such as a frame over
        MAXMSGSIZE) is the socket made anew; its monitor says when."""
        if self.dealer is not None:
            self.dealer.disable_monitor()
            self.monitor.close(linger=0)
            self.dealer.close(linger=0)
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
        sock.setsockopt(zmq.SNDHWM, SOCKET_HWM)
        sock.setsockopt(zmq.RCVHWM, SOCKET_HWM)
        # a hard cap far above any valid frame: zmq drops such a peer before we allocate
        # (between the two the peer gets an `oversized` error)
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * (self.max_payload + P.MAX_HEADER_BYTES))
        try:
            sock.connect(self.config.coordinator)
        except zmq.ZMQError as e:
            sock.close(linger=0)
            raise MeshnetError("bad_address", f"cannot connect to {self.config.coordinator!r}: {e.strerror}; "
                               "an address looks like tcp://127.0.0.1:5555") from None
        self.dealer = sock
        self.monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED)
        self.disconnected_at: float | None = None
        self.coordinator_alive = Liveness(self.config.heartbeat_interval, self.config.heartbeat_liveness)
        self._send(P.encode(P.READY, 0, capability=self.capability))

    def _on_link_event(self) -> None:
        event = recv_monitor_message(self.monitor)["event"]
        # libzmq announces a reconnect (CONNECT_RETRIED) right after an ordinary disconnect
        self.disconnected_at = time.monotonic() if event == zmq.EVENT_DISCONNECTED else None

    def _coordinator_lost(self) -> None:
        """Its sessions are over: free them and drop the replies still owed to it."""
        self.compute.jobs.put(Job("release_all", 0, self.epoch))
        self.epoch += 1
        self.compute.epoch = self.epoch
        self.recent_rids.clear()

    def _send(self, frames: list) -> None:
        try:
            self.dealer.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            pass  # the coordinator is not reading: heartbeats will tell whether it is gone

    # requests

    def _refuse(self, rid, code: str, message: str, sid=None) -> None:
        self.errors[code] += 1
        self._send(P.error_frames(rid, code, message, sid=sid))

    def _handle(self, frames: list) -> None:
        t_recv_ns = time.perf_counter_ns()
        try:
            msg = P.decode(frames, self.max_payload)
        except P.ProtocolError as e:
            self._refuse(e.rid, e.code, e.message, e.sid)
            return
        self.coordinator_alive.heard()
        if msg.type == P.HEARTBEAT:
            return
        if msg.type == P.DISCONNECT:
            self._send(P.encode(P.READY, 0, capability=self.capability))
            return
        self.requests[msg.type] += 1
        if msg.rid in self.recent_rids:
            self._refuse(msg.rid, P.E_DUPLICATE, f"request id {msg.rid} was already used", msg.get("sid"))
            return
        self.recent_rids[msg.rid] = None
        if len(self.recent_rids) > RECENT_RIDS:
            self.recent_rids.popitem(last=False)

        handler = self.handlers.get(msg.type)
        if handler is None:
            self._refuse(msg.rid, P.E_UNKNOWN_TYPE, f"a worker does not serve '{msg.type}' messages")
            return
        try:
            handler(msg, t_recv_ns)
        except MeshnetError as e:
            self._refuse(msg.rid, e.code, e.message, msg.get("sid"))

    def _queue(self, queue_kind: str, job: Job) -> None:
        """Hand a job to the compute thread, or refuse it with `busy` when its kind's
        bound is reached: no kind of request can grow the worker's memory without end."""
        if self.queued[queue_kind] >= self.queue_limits[queue_kind]:
            raise MeshnetError(P.E_BUSY, f"{self.queued[queue_kind]} {queue_kind} requests are already waiting; "
                               "try again later")
        self.queued[queue_kind] += 1
        self.compute.jobs.put(job)

    def _health(self, msg: P.Message, t_recv_ns: int = 0) -> None:
        # answered here, never queued behind work: the compute thread's last snapshot
        # of the stage plus the socket loop's own counters
        stats = dict(self.compute.stats)
        errors = collections.Counter(stats.pop("errors", {}))
        errors.update(self.errors)
        self._send(P.encode(P.OK, msg.rid, info=dict(
            stats, requests=dict(self.requests), errors=dict(errors), stopping=self.stopping,
            queue_depth=self.queued["forward"], queued=dict(self.queued), rss_bytes=rss_bytes())))

    def _capability(self, msg: P.Message, t_recv_ns: int = 0) -> None:
        self._send(P.encode(P.OK, msg.rid, info=self.capability))

    def _control(self, msg: P.Message, t_recv_ns: int = 0) -> None:
        if msg.type == P.OPEN and self.stopping:
            raise MeshnetError(P.E_SHUTTING_DOWN, "this worker is shutting down and takes no new sessions")
        self._queue("control", Job(msg.type, msg.rid, self.epoch, sid=msg["sid"]))

    def _cancel(self, msg: P.Message, t_recv_ns: int = 0) -> None:
        sid = msg["sid"]
        self._queue("control", Job("cancel", msg.rid, self.epoch, sid=sid))
        self.compute.cancel(sid)  # after the job is queued: its job is what forgets the cancel again

    def _forward(self, msg: P.Message, t_recv_ns: int = 0) -> None:
        if self.stopping:
            raise MeshnetError(P.E_SHUTTING_DOWN, "this worker is shutting down")
        sid, pos, n = msg["sid"], msg["pos"], msg["n"]
        if self.info.is_head:
            tokens = msg.get("tokens")
            if tokens is None or len(tokens) != n or msg.payload is not None:
                raise P.ProtocolError(P.E_BAD_PAYLOAD, f"the head stage takes n={n} token ids and no payload", msg.rid, sid)
            entry = Entry(sid, pos, tokens=np.asarray(tokens, dtype=np.int32))
        else:
            if msg.get("tokens") is not None:
                raise P.ProtocolError(P.E_BAD_PAYLOAD, "this stage takes residual rows, not token ids", msg.rid, sid)
            entry = Entry(sid, pos, residual=P.residual_from(msg, self.info.n_embd))
        if n > self.info.n_batch:
            raise P.ProtocolError(P.E_BAD_FIELD, f"n={n} is over this stage's n_batch {self.info.n_batch}", msg.rid, sid)
        deadline = time.monotonic() + msg.get("deadline_ms", DEFAULT_DEADLINE_MS) / 1000
        self._queue("forward", Job("forward", msg.rid, self.epoch, sid=sid, entry=entry, deadline=deadline,
                                   fields={"logits": msg.get("logits", False)}, t_recv_ns=t_recv_ns))

    def _tokenize(self, msg: P.Message, t_recv_ns: int = 0) -> None:
        self._queue("text", Job("tokenize", msg.rid, self.epoch, msg=msg))

    def _detokenize(self, msg: P.Message, t_recv_ns: int = 0) -> None:
        self._queue("text", Job("detokenize", msg.rid, self.epoch, msg=msg))

    def _shutdown(self, msg: P.Message, t_recv_ns: int = 0) -> None:
        self._send(P.encode(P.OK, msg.rid))
        self.stopping = True

    def _relay_result(self) -> None:
        epoch_frame, kind_frame, *frames = self.results.recv_multipart()
        kind = kind_frame.decode()
        if kind != "release_all":  # the worker's own job, never counted against a bound
            self.queued[QUEUE_OF.get(kind, "control")] -= 1
        if int.from_bytes(epoch_frame, "little") == self.epoch:
            self._send(frames)

    # the loop

    def run(self) -> int:
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        self.compute.start()
        self._connect()
        pacer = Pacer(self.config.heartbeat_interval)
        poller = zmq.Poller()
        poller.register(self.results, zmq.POLLIN)
        poller.register(self.dealer, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        interval_ms = int(self.config.heartbeat_interval * 1000)
        while True:
            events = dict(poller.poll(interval_ms))
            if self.results in events:
                self._relay_result()
            if self.dealer in events:
                frames, why = P.recv_frames(self.dealer, 2, self.max_payload + P.MAX_HEADER_BYTES)
                if why is not None:
                    self._refuse(None, P.E_OVERSIZED, why)
                else:
                    self._handle(frames)
            if self.stopping and sum(self.queued.values()) == 0 and self.compute.jobs.empty():
                break
            if self.monitor in events:
                self._on_link_event()
            if self.disconnected_at is not None and time.monotonic() - self.disconnected_at > GIVEN_UP_AFTER:
                self._coordinator_lost()
                for sock in (self.dealer, self.monitor):
                    poller.unregister(sock)
                self._connect()  # announces us on the new socket
                poller.register(self.dealer, zmq.POLLIN)
                poller.register(self.monitor, zmq.POLLIN)
            elif self.coordinator_alive.dead():
                # nothing here blocks: the socket stays (libzmq reconnects it), heartbeats go on
                self._coordinator_lost()
                self.coordinator_alive = Liveness(self.config.heartbeat_interval, self.config.heartbeat_liveness)
                self._send(P.encode(P.READY, 0, capability=self.capability))  # dropped unless connected
            if pacer.due():
                self._send(P.encode(P.HEARTBEAT, 0))
        return self._stop()

    def _stop(self) -> int:
        self.compute.jobs.put(Job("release_all", 0, self.epoch))
        self.compute.jobs.put(None)
        self.compute.join(timeout=30)
        self._send(P.encode(P.GOODBYE, 0))
        time.sleep(0.05)  # let the goodbye leave before the socket closes
        self.dealer.disable_monitor()
        self.monitor.close(linger=0)
        self.dealer.close(linger=100)
        self.results.close(linger=0)
        self.ctx.term()
        self.stage.close()
        return 0
