"""The coordinator: a ROUTER socket, the registry of stage workers, and every
session's route through them.

One I/O thread owns the sockets and all state; callers on other threads talk to it
through a command queue (woken by a pipe) and get answers through futures and
per-session event queues. At open the coordinator gives each stage of a session its
next hop and the session's key; from then on activations go head -> ... -> tail
directly, and the tail sends each token here and, in decode, the next step straight
back to the head (a ring): the coordinator is off the per-token path. It feeds the
prompt to the head in bounded chunks (chunk k+1 once the head took chunk k) and
follows each session with the generation state machine (generation.py), whose stop
rule the tail applies too.

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

import msgpack
import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from meshnet.core import errors as E
from meshnet.core import numerics
from meshnet.core.errors import MeshnetError
from meshnet.core.generation import FeedHead, Finish, Generation, StopRule, Token
from meshnet.core.layers import LayerRange
from meshnet.core.metrics import percentiles
from meshnet.core.planner import OVERHEAD, ModelCost, Node, Settings, plan
from meshnet.core.sampling import Sampling
from meshnet.core.text import utf8_or_error
from meshnet.net import addresses
from meshnet.net import protocol as P
from meshnet.net import security, sockets
from meshnet.net.heartbeat import HEARTBEAT_INTERVAL, HEARTBEAT_LIVENESS, Liveness, Pacer, Wakefulness, now
from meshnet.net.security import Gatekeeper, KeyPair
from meshnet.route.tracker import (StageOffer, choose_route, compat_class_of, head_gathers, offer_from_capability,
                                   shape_disagreement)

log = logging.getLogger("meshnet.route.coordinator")
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)

PREFILL_CHUNK = 64             # prompt tokens per forward request
REQUEST_TIMEOUT = 60.0         # seconds a stage may take to answer one request
MAX_PAYLOAD = 32 << 20         # largest payload accepted from a worker: 512 rows of an 16k-wide model fit
MAX_FRAMES = 3                 # a peer's identity, a header and at most one payload
RECV_BATCH = 256               # messages handled per wake-up before looking at the clock again
CLOCK_PERIOD = 0.01            # seconds between checks of heartbeats, liveness and deadlines


@dataclass
class WorkerRecord:
    identity: bytes
    name: str
    capability: dict
    offer: StageOffer | None     # None: started with --layers auto, holds nothing yet
    liveness: Liveness
    assigning: LayerRange | None = None   # the range it was told to load and has not yet offered
    public_key: str | None = None         # its CURVE key, as the handshake proved it (None without CURVE)
    assign_failed: str | None = None      # why loading its range failed: it is not planned for again
    epoch: int = 0                        # its READY's: a higher one says it dropped its sessions
    sessions: set[int] = field(default_factory=set)
    # measured here: hop = round trip minus the worker's own time (its two timestamps)
    hops_us: collections.deque = field(default_factory=lambda: collections.deque(maxlen=10_000))
    seam_bytes: int = 0
    replies: int = 0
    errors: collections.Counter = field(default_factory=collections.Counter)

    @property
    def label(self) -> str:
        if self.offer is not None:
            return self.offer.label
        return f"loading {self.assigning.label}" if self.assigning else "standby"

    @property
    def standby_state(self) -> str:
        return self.label + (f" (failed: {self.assign_failed})" if self.assign_failed else "")

    @property
    def layer_order(self) -> tuple:
        return (0, self.offer.start, self.offer.end) if self.offer else (1, 0, 0)


@dataclass
class Pending:
    kind: str                    # open | release | cancel | query
    sid: int | None
    worker: bytes
    stage: int
    deadline: float
    future: Future | None = None


@dataclass
class TokenEvent:
    token: int
    piece: bytes
    logits: np.ndarray | None


@dataclass
class Session:
    sid: int
    key: int                      # drawn here, given only to the session's stages: data messages carry it
    route: list[WorkerRecord]
    gen: Generation
    want_logits: bool
    events: queue.Queue
    deadline: float               # the next event (open, prompt chunk taken, token) is due by then
    finished: bool = False
    waiting_on: int | None = None  # the stage the session waits on, when known (the head, for a chunk)
    opens_waiting: int = field(init=False)   # stages yet to confirm the session is open
    hops_us: list[list[int]] = field(init=False)   # per seam, where the two stages share a clock
    crossings: list[int] = field(init=False)       # per seam
    seam_bytes: int = 0
    decode_seam_bytes: int = 0    # what crossed the seams for decode steps (after the first token)
    decode_crossings: int = 0
    suspect: tuple[MeshnetError, float] | None = None  # a stage could not pass it on: the error, unless a loss explains it by then
    mixed: bool = False                 # stages of more than one class (allow_mixed): drift is measured
    sampling: Sampling | None = None
    numerics: str | None = None         # its route's numerics class: a resume keeps to it
    lost: tuple[MeshnetError, float] | None = None   # a stage lost, the session waiting for a route: the error, since
    resume_by: float = 0.0              # ... and until when it may wait
    resumes: list[dict] = field(default_factory=list)   # each resume: stage, replayed_tokens, elapsed_ms

    def __post_init__(self):
        self.on_route(self.route)

    def on_route(self, route: list[WorkerRecord]) -> None:
        self.route = route
        self.opens_waiting = len(route)
        self.hops_us = [[] for _ in route[1:]]
        self.crossings = [0 for _ in route[1:]]

    def label(self, stage: int) -> str:
        return self.route[stage].offer.label


class SessionEvents(queue.Queue):
    """A session's events for its caller; `ended` is set with the last one, so that a
    caller waiting for the whole result sleeps until then instead of waking per token."""

    def __init__(self):
        super().__init__()
        self.ended = threading.Event()

    def put(self, item, block=True, timeout=None):
        super().put(item, block, timeout)
        if item[0] != "token":
            self.ended.set()


class SessionHandle:
    """A caller's view of one generation: iterate for tokens as they come, or wait for
    the result. Errors arrive as MeshnetError (code stage_lost, cancelled, ...)."""

    def __init__(self, coordinator: "Coordinator", sid: int, events: SessionEvents, prompt_tokens: list[int]):
        self.coordinator, self.sid, self._events = coordinator, sid, events
        self.prompt_tokens = prompt_tokens
        self.tokens: list[int] = []
        self.token_times: list[float] = []   # time.perf_counter() as each token reached the coordinator
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
                raise MeshnetError(E.TIMEOUT, f"session {self.sid} gave no result in time", session=self.sid) from None
            if kind == "token":
                self.tokens.append(value.token)
                self.text += value.piece
                if value.logits is not None:
                    self.logits.append(value.logits)
                yield value
            elif kind == "done":
                self._done = True
                self.stop_reason, self.metrics, self.token_times = value
                if self.metrics.get("mixed_route"):
                    self.metrics["drift"] = self.coordinator.drift(self.prompt_tokens, self.tokens, self.logits,
                                                                   self.metrics.get("numerics"))
            else:
                self._done = True
                raise value

    def result(self, timeout: float | None = None) -> "SessionHandle":
        """Wait for the whole generation; MeshnetError(timeout) if it takes over `timeout` s."""
        if not self._events.ended.wait(timeout):
            raise MeshnetError(E.TIMEOUT, f"session {self.sid} gave no result in time", session=self.sid)
        for _ in self._events_until(None):
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
        data_bind: str | None = None,
        allow_mixed: bool = False,
        drift_meter=None,
        overhead: int = OVERHEAD,
        keys: KeyPair | None = None,
        allowed_workers: set[bytes] | None = None,
        resume_wait: float = 0.0,
        max_resumes: int = 2,
    ):
        addresses.checked(bind, "--bind")
        if data_bind is not None:
            addresses.checked(data_bind, "--data-bind")
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_liveness = heartbeat_liveness
        self.prefill_chunk = prefill_chunk
        self.request_timeout = request_timeout
        self.max_payload = max_payload
        self.allow_mixed = allow_mixed      # let workers of other classes into a route; runs then report drift
        # the whole model a mixed route is measured against (evidence.drift.DriftMeter, or
        # anything with its measure and close), handed in: the route loads no model itself
        self.drift_meter = drift_meter
        self.overhead = overhead            # per worker process, for the planner
        # a session that loses a stage is replayed on a new route when one exists, or
        # appears within resume_wait seconds; at most max_resumes times
        self.resume_wait = resume_wait
        self.max_resumes = max_resumes
        self.resume_ms: collections.deque[float] = collections.deque(maxlen=1000)

        self.ctx = zmq.Context()
        # with keys, the control socket is a CURVE server: a worker whose public key is not
        # allowed is refused in the handshake, before any message of it reaches this loop
        self.gatekeeper = Gatekeeper(self.ctx, allowed_workers or set()) if keys is not None else None
        self.router = sockets.control_router(self.ctx, max_frame=2 * max_payload)
        if keys is not None:
            security.serve(self.router, keys)
        self.max_message_bytes = max_payload + 2 * P.MAX_HEADER_BYTES
        try:
            self.router.bind(bind)
        except zmq.ZMQError as e:
            self.router.close(linger=0)
            if self.gatekeeper is not None:
                self.gatekeeper.stop()
            self.ctx.term()
            if e.errno == errno.EADDRINUSE:
                raise MeshnetError(E.ADDRESS_IN_USE, f"cannot listen on {bind}: the address is already in use "
                                   "(another coordinator?); choose another port with --bind") from None
            raise MeshnetError(E.BAD_ADDRESS, f"cannot listen on {bind!r}: {e.strerror}; an address looks like "
                               "tcp://127.0.0.1:5555") from None
        self.endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        # a peer refused in the handshake never sends us a message: the socket's monitor is
        # where the refusal shows (no key, a wrong key, a key for another coordinator)
        self.handshakes = self.router.get_monitor_socket(HANDSHAKE_FAILED) if keys is not None else None
        # the data plane: tokens and "chunk taken" from the stages come to this PULL,
        # bound on the control socket's host; prompt chunks go out on a PUSH per head
        self.data = sockets.data_pull(self.ctx, max_frame=2 * max_payload)
        self.keys = keys
        if keys is not None:   # only the allowed workers' tails may send tokens
            security.serve(self.data, keys)
        try:
            self.data.bind(data_bind or _same_host(self.endpoint))
        except zmq.ZMQError as e:
            self.data.close(linger=0)
            self.router.close(linger=0)
            if self.gatekeeper is not None:
                self.gatekeeper.stop()
            self.ctx.term()
            raise MeshnetError(E.BAD_ADDRESS, f"cannot bind the data endpoint {data_bind!r}: {e.strerror}") from None
        self.data_endpoint = self.data.getsockopt_string(zmq.LAST_ENDPOINT)
        self.pushes: dict[str, zmq.Socket] = {}

        self.workers: dict[bytes, WorkerRecord] = {}
        self.sessions: dict[int, Session] = {}
        self.pending: dict[int, Pending] = {}
        self._rids = itertools.count(secrets.randbits(40))
        self._sids = itertools.count(secrets.randbits(40))
        self._registration_order = itertools.count()
        self.plan_note: str | None = None   # why the standby workers were not given ranges
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
            for sock in self.pushes.values():
                sock.close(linger=0)
            if self.drift_meter is not None:
                self.drift_meter.close()
            self.data.close(linger=0)
            if self.handshakes is not None:
                self.router.disable_monitor()
                self.handshakes.close(linger=0)
            self.router.close(linger=0)
            if self.gatekeeper is not None:
                self.gatekeeper.stop()
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

    def drift(self, prompt_tokens: list[int], tokens: list[int], logits: list, numerics_class: str | None) -> dict:
        """A mixed route's run against the whole model (the reference model given), per
        step; the whole model computes in the numerics class the session ran in."""
        if self.drift_meter is None:
            return {"measured": False, "why": "no whole model to compare with: give the coordinator a reference "
                                               "model (meshnet coordinator --reference MODEL)"}
        return dict(self.drift_meter.measure(prompt_tokens, tokens, logits, numerics=numerics_class), measured=True)

    def route_report(self) -> dict:
        """The route (or why there is none) and why each registered worker is not in it."""
        def report(f):
            try:
                chosen = self._choose_route()
                result = {"route": [f"{o.label}@{o.worker}" for o in chosen.stages], "mixed": chosen.mixed,
                          "kept_out": chosen.kept_out}
            except MeshnetError as e:   # the same words a session would get
                result = {"route": None, "error": e.message, "kept_out": {}}
            result["standby"] = {w.name: w.standby_state for w in self.workers.values() if w.offer is None}
            result["plan_note"] = self.plan_note
            f.set_result(result)
        return self._submit(report).result(5)

    def wait_for_route(self, timeout: float = 60.0, n_stages: int | None = None) -> list[StageOffer]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                route = self.route()
                if n_stages is None or len(route) == n_stages:
                    return route
                error = MeshnetError(E.ROUTE_INCOMPLETE, f"route has {len(route)} stages, waiting for {n_stages}")
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
                 stop_at_eog: bool = True, prefill_chunk: int | None = None,
                 sampling: Sampling | None = None) -> SessionHandle:
        """A new session: its tokens come from the tail, the most likely ones or, with
        sampling, llama.cpp's sampler chain's (seeded: the same on any route)."""
        gen = Generation(list(prompt_tokens), StopRule(max_tokens, stop_at_eog), prefill_chunk or self.prefill_chunk,
                         tail_feeds_head=True)   # checks the request before anything starts
        sampling = None if sampling is None or sampling.greedy else sampling
        sid = next(self._sids)
        events = SessionEvents()
        self._submit(lambda f: self._guarded("starting a session", self._start_session, sid, gen, want_logits, events,
                                             sampling, sid=sid, events=events))
        return SessionHandle(self, sid, events, list(prompt_tokens))

    def cancel(self, sid: int) -> None:
        self._submit(lambda f: self._cancel_session(sid))

    def tokenize(self, text: str, timeout: float = 30.0, *, add_special: bool = True,
                 parse_special: bool = False, limit: int | None = None) -> list[int]:
        """As llama.cpp tokenizes for the model; a chat prompt (special tokens written out
        by its template) wants parse_special. With a limit, a text of more tokens is
        refused with context_full, at once when its length alone proves it."""
        data = utf8_or_error(text, "the text")
        answer = self._query_stage(0, P.TOKENIZE, {"add_special": add_special, "parse_special": parse_special,
                                                   "limit": limit}, payload=data,
                                   check=_fits(len(data), limit, "the text", "prompt")).result(timeout)
        return np.frombuffer(answer, dtype="<i4").tolist()

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True, timeout: float = 30.0,
                    limit: int | None = None) -> str:
        """The prompt text for these chat messages ([{"role", "content"}]), by the model's
        own chat template, applied by llama.cpp on the head. With a limit (in tokens),
        messages whose text alone is longer than that many tokens could be are refused
        with context_full before they are sent."""
        if not isinstance(messages, list) or not messages:
            raise MeshnetError(E.INVALID_ARGUMENT, "a chat needs at least one message")
        size = 0
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or set(m) != {"role", "content"} or not all(isinstance(v, str) for v in m.values()):
                raise MeshnetError(E.INVALID_ARGUMENT, f"message {i} is not {{'role': text, 'content': text}}")
            size += len(utf8_or_error(m["role"], f"message {i}'s role")) + len(utf8_or_error(m["content"], f"message {i}'s content"))
        answer = self._query_stage(0, P.TEMPLATE, {"add_generation_prompt": add_generation_prompt},
                                   payload=msgpack.packb(messages, use_bin_type=True),
                                   check=_fits(size, limit, "the messages' text", "messages")).result(timeout)
        return answer.decode("utf-8", errors="replace")

    def detokenize(self, tokens: list[int], timeout: float = 30.0) -> str:
        answer = self._query_stage(-1, P.DETOKENIZE, {}, payload=P.tokens_frame(list(tokens))).result(timeout)
        return answer.decode("utf-8", errors="replace")

    def stage_stats(self, timeout: float = 10.0) -> list[dict]:
        """HEALTH of every registered worker (KV in use, sessions, queue depth), in layer order."""
        def ask(f):
            futures = [self._query(w, P.HEALTH, {}) for w in sorted(self.workers.values(), key=lambda w: w.layer_order)]
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
            workers = sorted(self.workers.values(), key=lambda w: w.layer_order)
            try:   # whether each worker is in the route, and why not
                chosen = self._choose_route()
                in_route, kept_out, route_error = {o.worker for o in chosen.stages}, chosen.kept_out, None
            except MeshnetError as e:
                in_route, kept_out, route_error = set(), {}, e.message
            mine = [{
                "stage": w.label, "worker": w.name, "seam_bytes": w.seam_bytes, "replies": w.replies,
                "reply_errors": dict(w.errors), "last_heard_s": round(w.liveness.silent_for(), 3),
                "in_route": w.name in in_route,
                "kept_out": kept_out.get(w.name) or (None if w.name in in_route else route_error or w.standby_state),
                **{f"hop_us_{k}": v for k, v in percentiles(w.hops_us).items()},
            } for w in workers]
            f.set_result((mine, [self._query(w, P.HEALTH, {}) for w in workers], dict(self.counters), route_error))
        mine, futures, counters, route_error = self._submit(ask).result(timeout)
        if self.gatekeeper is not None:
            counters["refused_peers"] = self.gatekeeper.refusals
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
        resume_ms = percentiles(list(self.resume_ms))
        resumes = {"count": counters.get("resumes", 0), "replayed_tokens": counters.get("replayed_tokens", 0),
                   "ms_p50": resume_ms["p50"], "ms_p99": resume_ms["p99"]}
        return {"stages": stages, "sessions": sessions, "counters": counters, "resumes": resumes,
                "route_error": route_error}

    def shutdown_workers(self) -> None:
        def ask(f):
            for w in list(self.workers.values()):
                self._query(w, P.SHUTDOWN, {})
            f.set_result(None)
        self._submit(ask).result(5)

    def _query_stage(self, index: int, msg_type: str, fields: dict, payload=None,
                     check: Callable[[list[WorkerRecord]], None] | None = None) -> Future:
        """A request to the route's stage INDEX; CHECK, given the route, may refuse it
        first (with a MeshnetError) from what the stages' capabilities say."""
        outer: Future = Future()

        def ask(f):
            try:
                route = self._route()
                if check is not None:
                    check(route)
            except MeshnetError as e:
                outer.set_exception(e)
                return
            inner = self._query(route[index], msg_type, fields, payload)
            inner.add_done_callback(lambda i: outer.set_exception(i.exception()) if i.exception() else outer.set_result(i.result()))
        submitted = self._submit(ask)
        # a failure inside ask itself must reach the caller, not leave it waiting
        submitted.add_done_callback(lambda f: f.exception() and not outer.done() and outer.set_exception(f.exception()))
        return outer

    # ---- the I/O thread ---------------------------------------------------------------

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.data, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        if self.handshakes is not None:
            poller.register(self.handshakes, zmq.POLLIN)
        pacer = Pacer(self.heartbeat_interval)
        tick_ms = max(1, int(self.heartbeat_interval * 1000 / 2))
        clocks_at = 0.0
        awake = Wakefulness(self.heartbeat_interval)
        while self._running:
            try:
                events = dict(poller.poll(tick_ms))
                self._forgive_own_stop(awake.stopped_for())
                if self.router in events:
                    for _ in range(RECV_BATCH):
                        self._receive()
                        if not self.router.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                            break
                if self.data in events:
                    for _ in range(RECV_BATCH):
                        self._receive_data()
                        if not self.data.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                            break
                if self.handshakes is not None and self.handshakes in events:
                    self._on_failed_handshake()
                if self._wake_r in events:
                    self._run_commands()
                # heartbeats, liveness and deadlines work at heartbeat scale, not per message
                if now() >= clocks_at:
                    clocks_at = now() + CLOCK_PERIOD
                    if pacer.due():
                        for w in list(self.workers.values()):
                            self._send(w.identity, P.encode(P.HEARTBEAT, 0))
                    silent = [w for w in self.workers.values() if w.liveness.dead()]
                    if silent and self._forgive_own_stop(awake.stopped_for()):
                        silent = []
                    for w in silent:
                        self._guarded("losing a silent worker", self._lose_worker, w, "stopped answering heartbeats")
                    self._expire_requests()
                    self._expire_sessions()
            except Exception:  # the last line of defence: a bug must not stop every session
                self.counters["internal_errors"] += 1
                log.exception("coordinator: unexpected error in the I/O loop; it goes on")

    def _forgive_own_stop(self, stopped_for: float) -> bool:
        """The workers' silence while this process was stopped was ours, and what they
        sent meanwhile waits to be read: each gets a fresh heartbeat window."""
        if not stopped_for:
            return False
        log.warning("coordinator: this process was stopped for %.1f s; its workers get a fresh heartbeat window",
                    stopped_for)
        for w in self.workers.values():
            w.liveness.heard()
        return True

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
            error = MeshnetError(E.INTERNAL, f"{what} failed: {type(e).__name__}: {e}", session=sid)
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
                self._send(frames[0].bytes, P.error_frames(None, E.OVERSIZED, why))
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

    def _on_failed_handshake(self) -> None:
        event = recv_monitor_message(self.handshakes)
        self.counters["refused_handshakes"] += 1
        why = {zmq.EVENT_HANDSHAKE_FAILED_AUTH: "its key is not allowed (--allow)",
               zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "it does not speak CURVE with this coordinator's key "
                                                    "(no key, or the key of another coordinator)",
               }.get(event["event"], "the CURVE handshake failed")
        if self.counters["refused_handshakes"] <= 100 or self.counters["refused_handshakes"] % 1000 == 0:
            log.warning("coordinator: refused a peer (%s): %s", event.get("endpoint", b"?"), why)

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
            if e.msg_type == P.READY:
                self._refuse_once(identity, e.message)
            self._send(identity, P.error_frames(e.rid, e.code, e.message, sid=e.sid))
            return
        worker = self.workers.get(identity)
        if msg.type == P.READY:
            self._register(identity, msg, _peer_key(frames[0]))
            return
        if worker is None:
            if msg.type in (P.HEARTBEAT, P.OK, P.ERROR):
                self._send(identity, P.encode(P.DISCONNECT, 0))  # a worker we forgot: announce again
            elif msg.type != P.GOODBYE:
                self._send(identity, P.error_frames(msg.rid, E.UNKNOWN_TYPE, f"the coordinator does not serve '{msg.type}'"))
            return
        worker.liveness.heard()
        if msg.type == P.HEARTBEAT:
            return
        if msg.type == P.GOODBYE:
            self._lose_worker(worker, "said goodbye")
            return
        if msg.type in (P.OK, P.ERROR):
            pending = self.pending.get(msg.rid)
            if pending is None and msg.type == P.ERROR and msg.rid == 0 and msg.get("sid") is not None:
                self._guarded("a stage's report of a failed session", self._on_session_error, worker, msg,
                              sid=msg["sid"])
                return
            if pending is None or pending.worker != identity:
                self.counters["late_replies"] += 1  # for a session that already ended
                return
            del self.pending[msg.rid]
            worker.replies += 1
            if msg.type == P.ERROR:
                worker.errors[msg["code"]] += 1
            self._guarded(f"the reply to a {pending.kind}", self._on_reply, worker, pending, msg, sid=pending.sid)
            return
        self._send(identity, P.error_frames(msg.rid, E.UNKNOWN_TYPE, f"the coordinator does not serve '{msg.type}'"))

    def _refuse_once(self, identity: bytes, why: str) -> None:
        """A worker that cannot join: its operator needs to know why, once per peer."""
        if identity in self._refusals_logged:
            return
        self._refusals_logged[identity] = None
        if len(self._refusals_logged) > 1024:
            self._refusals_logged.popitem(last=False)
        log.warning("coordinator: refused a worker (peer %s): %s", identity.hex(), why)

    def _register(self, identity: bytes, msg: P.Message, peer_key: str | None = None) -> None:
        capability = msg["capability"]  # checked field by field in protocol.decode
        current = self.workers.get(identity)
        epoch = msg.get("epoch", 0)
        if current is not None and current.capability == capability:
            current.liveness.heard()  # the same worker saying it again
            if epoch > current.epoch:
                # it dropped every session it held (it lost sight of us, or we of it): they
                # go on where they can, replayed, on this worker again if need be
                current.epoch = epoch
                self._sessions_dropped(current, "dropped its sessions (it had lost sight of the coordinator)")
            return
        known = next((w for w in self.workers.values() if w.identity != identity
                      and w.capability["model_sha256"] == capability["model_sha256"]), None)
        why = known and shape_disagreement(capability, known.capability)
        if why:
            # not a worker of that model file, whatever hash it names: nothing it claims is used
            self.counters["bad_messages"] += 1
            self._refuse_once(identity, f"it claims model {capability['model_sha256'][:12]} but {why} "
                                        f"(as worker {known.name} serves it)")
            self._send(identity, P.error_frames(msg.rid, E.BAD_FIELD, f"ready: {why}"))
            return
        if current is not None and current.offer is None and "layers" in capability:
            del self.workers[identity]   # a standby worker offering the range it loaded: it had no sessions
        elif current is not None:  # this connection now offers something else: what it offered is gone
            self._lose_worker(current, "announced a different capability")
        for other in [w for w in self.workers.values() if w.capability["worker_id"] == capability["worker_id"]]:
            # the worker process connected again: its old connection is dead, whatever it still delivers
            self._lose_worker(other, "connected again")
        # the worker process's id and this connection's: readable, and unique among the registered
        name = f"{capability['worker_id'][:8]}.{identity.hex()[-4:]}"
        order = next(self._registration_order)
        offer = offer_from_capability(name, capability, order) if "layers" in capability else None
        self.workers[identity] = WorkerRecord(identity, name, capability, offer,
                                              Liveness(self.heartbeat_interval, self.heartbeat_liveness),
                                              public_key=peer_key, epoch=epoch)
        self.counters["registrations"] += 1
        self._guarded("planning for the standby workers", self._plan_standby)
        for session in [s for s in self.sessions.values() if s.lost is not None]:
            self._guarded("resuming a session", self._try_resume, session, sid=session.sid)

    def _sessions_dropped(self, worker: WorkerRecord, reason: str) -> None:
        """WORKER is there still, but without the sessions it held: each is lost as if the
        stage were, and so replayed (its other stages are told to drop it first)."""
        for sid in list(worker.sessions):
            session = self.sessions.get(sid)
            if session is not None:
                self._stage_lost(session, MeshnetError(
                    E.STAGE_LOST, f"stage {worker.label} (worker {worker.name}) {reason}",
                    stage=worker.label, worker=worker.name, session=sid), None)

    def _lose_worker(self, worker: WorkerRecord, reason: str) -> None:
        if self.workers.pop(worker.identity, None) is None:
            return
        # a worker that said goodbye left as asked (every run's end): only a loss is news
        log.log(logging.INFO if reason == "said goodbye" else logging.WARNING, "coordinator: lost worker %s (%s): %s",
                worker.name, worker.label, reason)
        self.counters["workers_lost"] += 1
        if worker.offer is not None or worker.assigning is not None:
            self._guarded("planning for the standby workers", self._plan_standby)
        elapsed_ms = int(worker.liveness.silent_for() * 1000)
        for rid in [rid for rid, p in self.pending.items() if p.worker == worker.identity]:
            pending = self.pending.pop(rid)
            if pending.future is not None and not pending.future.done():
                pending.future.set_exception(MeshnetError(E.STAGE_LOST, f"worker {worker.name} {reason}",
                                                          stage=worker.label, worker=worker.name))
        for sid in list(worker.sessions):
            session = self.sessions.get(sid)
            if session is not None:
                stage = next(i for i, w in enumerate(session.route) if w is worker)
                self._stage_lost(session, MeshnetError(
                    E.STAGE_LOST, f"stage {worker.offer.label} (worker {worker.name}) {reason}",
                    stage=worker.offer.label, worker=worker.name, session=sid, elapsed_ms=elapsed_ms), stage)

    # ---- requests ---------------------------------------------------------------------

    def _request(self, worker: WorkerRecord, msg_type: str, pending: Pending, payload=None, **fields) -> int:
        rid = next(self._rids)
        frames = P.encode(msg_type, rid, payload=payload, **fields)
        if len(frames[0]) > P.MAX_HEADER_BYTES:   # the worker could not even read its id: it would never answer
            error = MeshnetError(E.OVERSIZED, f"a {msg_type} request of {len(frames[0])} bytes is over the "
                                 f"{P.MAX_HEADER_BYTES}-byte header limit")
            if pending.future is not None and not pending.future.done():
                pending.future.set_exception(error)
            session = self.sessions.get(pending.sid) if pending.sid is not None else None
            if session is not None:
                self._fail(session, error, cancel=True)
            return rid
        self.pending[rid] = pending
        if not self._send(worker.identity, frames):
            self.pending.pop(rid, None)
            if pending.future is not None and not pending.future.done():
                pending.future.set_exception(MeshnetError(E.STAGE_LOST, f"cannot reach worker {worker.name}"))
        return rid

    def _query(self, worker: WorkerRecord, msg_type: str, fields: dict, payload=None) -> Future:
        future: Future = Future()
        self._request(worker, msg_type, Pending("query", None, worker.identity, -1,
                                                now() + self.request_timeout, future), payload, **fields)
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
        where = f"stage {worker.label} (worker {worker.name})" if worker else "a worker that has since gone"
        error = MeshnetError(E.DEADLINE_EXCEEDED, f"no answer from {where} within {self.request_timeout:.0f} s")
        if pending.future is not None and not pending.future.done():
            pending.future.set_exception(error)
        if pending.kind == "assign" and worker is not None:
            self._assign_failed(worker, error.message)
        session = self.sessions.get(pending.sid) if pending.sid is not None else None
        if session is not None and not session.finished and pending.kind == "open":
            self._fail(session, MeshnetError(E.DEADLINE_EXCEEDED, error.message, stage=session.label(pending.stage),
                                             session=session.sid), cancel=True)

    def _on_reply(self, worker: WorkerRecord, pending: Pending, msg: P.Message) -> None:
        if pending.kind == "query":
            if msg.type == P.ERROR:
                pending.future.set_exception(MeshnetError(msg["code"], msg["message"], stage=worker.label))
            elif msg.payload is not None:   # a text request's answer
                pending.future.set_result(bytes(msg.payload))
            else:
                pending.future.set_result(msg.get("info", {}))
            return
        if pending.kind == "assign":
            if msg.type == P.ERROR:
                self._assign_failed(worker, f"[{msg['code']}] {msg['message']}")
            return   # loaded: its READY, offering the range, follows
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
                self._act(session, session.gen.opened())

    def _on_session_error(self, worker: WorkerRecord, msg: P.Message) -> None:
        """A stage says a session failed on its data plane. Only a stage of that session
        can end it; a stage that could not pass it on may be seeing a peer that just died:
        the heartbeats get one liveness window to name the lost stage first."""
        session = self.sessions.get(msg["sid"])
        if session is None or session.finished or worker not in session.route:
            self.counters["late_replies"] += 1
            return
        error = MeshnetError(msg["code"], msg["message"], stage=worker.offer.label, worker=worker.name,
                             session=session.sid)
        if msg["code"] == E.HOP_UNREACHABLE:
            if session.suspect is None:
                session.suspect = (error, now() + self.heartbeat_interval * self.heartbeat_liveness)
            return
        self._fail(session, error, cancel=True)

    # ---- sessions ---------------------------------------------------------------------

    def _choose_route(self, numerics_class: str | None = None):
        """The tracker's choice among the registered ranges; without one, the refusal also
        names the --layers auto workers and what their plan waits for."""
        try:
            return choose_route([w.offer for w in self.workers.values() if w.offer is not None
                                 and numerics_class in (None, w.offer.compat_class.numerics)],
                                allow_mixed=self.allow_mixed)
        except MeshnetError as e:
            waiting = [w for w in self.workers.values() if w.offer is None]
            if not waiting:
                raise
            raise MeshnetError(e.code, f"{e.message}; {len(waiting)} worker(s) started with --layers auto: "
                               + ", ".join(f"{w.name} {w.standby_state}" for w in waiting)
                               + (f"; {self.plan_note}" if self.plan_note else "")) from None

    def _route(self, numerics_class: str | None = None) -> list[WorkerRecord]:
        """The route; with NUMERICS_CLASS, one of that class only (a session that resumes
        keeps the kernels it ran with: on the other class its tokens would be neither's)."""
        by_name = {w.name: w for w in self.workers.values()}
        return [by_name[o.worker] for o in self._choose_route(numerics_class).stages]

    # ---- planning for --layers auto workers -------------------------------------------

    def _plan_standby(self) -> None:
        """Give standby workers ranges: for each class they belong to, the layers no
        worker of that class holds or is loading are planned over the standby workers of
        that class, in the order they registered, each as large as its memory allows. A
        gap that does not fit waits for more memory to be announced."""
        standby = [w for w in self.workers.values() if w.offer is None and w.assigning is None and not w.assign_failed]
        if not standby:
            return
        notes = []
        for cls in dict.fromkeys(compat_class_of(w.capability) for w in standby):
            nodes = [w for w in standby if compat_class_of(w.capability) == cls]
            held = [w for w in self.workers.values() if compat_class_of(w.capability) == cls]
            cost = ModelCost.from_dict(nodes[0].capability["cost"])
            covered = [0] * cost.n_layer
            for w in held:
                r = w.offer.layers if w.offer is not None else w.assigning
                if r is not None:
                    covered[r.start:r.end] = [1] * (r.end - r.start)
            for start, end in _gaps(covered):
                try:
                    result = plan(cost, [Node(w.name, w.capability["mem_bytes"],
                                              Settings(w.capability["n_ctx"], w.capability["max_sessions"],
                                                       w.capability["n_batch"])) for w in nodes],
                                  self.overhead, start, end)
                except MeshnetError as e:
                    notes.append(f"layers {start}..{end - 1} wait for more memory: {e.message}")
                    continue
                by_name = {w.name: w for w in nodes}
                for stage in result.stages:
                    worker = by_name[stage.node]
                    worker.assigning = stage.layers
                    nodes.remove(worker)
                    self.counters["assigned"] += 1
                    log.info("coordinator: worker %s loads %s (planned %d bytes of its %d)", worker.name,
                             stage.layers.label, stage.bytes, worker.capability["mem_bytes"])
                    self._request(worker, P.ASSIGN, Pending("assign", None, worker.identity, -1,
                                                            now() + self.request_timeout),
                                  layers=[stage.layers.start, stage.layers.end])
        self.plan_note = "; ".join(notes) or None

    def _assign_failed(self, worker: WorkerRecord, why: str) -> None:
        log.warning("coordinator: worker %s could not load %s: %s", worker.name, worker.assigning, why)
        worker.assigning = None
        worker.assign_failed = why
        self._plan_standby()

    def _route_offers(self) -> list[StageOffer]:
        return [w.offer for w in self._route()]

    def _start_session(self, sid: int, gen: Generation, want_logits: bool, events: queue.Queue,
                       sampling: Sampling | None = None) -> None:
        try:
            route = self._route()
        except MeshnetError as e:
            events.put(("error", MeshnetError(e.code, e.message, session=sid)))
            return
        n_ctx = min(w.capability["n_ctx"] for w in route)
        if len(gen.prompt) + gen.rule.max_tokens > n_ctx:
            events.put(("error", MeshnetError(E.CONTEXT_FULL, f"{len(gen.prompt)} prompt + {gen.rule.max_tokens} new "
                                              f"tokens exceed the route's context of {n_ctx}", session=sid)))
            return
        n_batch = min(w.capability["n_batch"] for w in route)
        numerics_class = route[0].capability["numerics"]   # one class per route (the tracker's rule)
        # the stock class feeds a prompt as stock llama.cpp does, in batches of n_batch
        # (whatever prefill chunk was asked): its kernels change with the rows in a call,
        # so other chunks would give other tokens
        gen.chunk = n_batch if numerics_class == numerics.STOCK else min(gen.chunk, n_batch)
        session = Session(sid, 0, [], gen, want_logits, events, 0.0, sampling=sampling, numerics=numerics_class)
        self.sessions[sid] = session
        self._open_route(session, route)

    def _open_route(self, session: Session, route: list[WorkerRecord]) -> None:
        """Open the session on every stage of the route, under a fresh key (what is still
        in flight from a route it had before is then dropped)."""
        gen, sid = session.gen, session.sid
        session.on_route(route)
        session.key = secrets.randbits(63)
        session.deadline = now() + self.request_timeout
        gen.depth = len(route)
        session.mixed = len({compat_class_of(w.capability) for w in route}) > 1
        session.want_logits = session.want_logits or session.mixed   # a mixed route's every step is compared with the whole model
        want_logits = session.want_logits
        last = len(route) - 1
        gather = head_gathers([w.capability for w in route])
        for i, worker in enumerate(route):
            worker.sessions.add(sid)
            self._request(worker, P.OPEN, Pending("open", sid, worker.identity, i, now() + self.request_timeout),
                          sid=sid, key=session.key, stage=i, next=route[(i + 1) % len(route)].capability["data_endpoint"],
                          # a replay's prompt holds the tokens generated so far: the stages count the rest
                          reply=self.data_endpoint, prompt_len=len(gen.prompt),
                          max_tokens=gen.rule.max_tokens - gen.replayed,
                          stop_at_eog=gen.rule.stop_at_eog, logits=True if i == last and want_logits else None,
                          hop_clock=i > 0 and route[i - 1].capability["clock_id"] == worker.capability["clock_id"],
                          gather=True if i == 0 and gather else None,
                          # with CURVE each stage learns the keys of its two neighbours in the ring
                          next_key=route[(i + 1) % len(route)].public_key, prev_key=route[i - 1].public_key,
                          # the tail samples, knowing the tokens so far (its penalties look back on them)
                          sampling=session.sampling.to_wire() if i == last and session.sampling else None,
                          history=list(gen.prompt) if i == last and session.sampling else None)

    def _stage_lost(self, session: Session, error: MeshnetError, stage: int) -> None:
        """A stage of the session is gone. The session leaves the stages left and waits
        for a route (one may stand ready: a spare), to be replayed on it; past its
        resumes, or when no route comes within resume_wait, it ends with the error."""
        if session.finished:
            return
        if len(session.resumes) >= self.max_resumes or session.gen.done:
            self._fail(session, error, skip_stage=stage)
            return
        self._leave_route(session, stage, P.CANCEL)
        session.on_route([])
        session.suspect = None
        session.lost = (error, now())
        session.resume_by = now() + self.resume_wait
        session.deadline = session.resume_by
        self._try_resume(session)

    def _try_resume(self, session: Session) -> None:
        if session.finished or session.lost is None:
            return
        error, lost_at = session.lost
        try:
            route = self._route(session.numerics)
            n_ctx = min(w.capability["n_ctx"] for w in route)
            if session.gen.n_prompt + session.gen.rule.max_tokens > n_ctx:
                raise MeshnetError(E.CONTEXT_FULL, f"the new route's context of {n_ctx} is too small for it")
        except MeshnetError as e:
            if now() >= session.resume_by:
                waited = f" and no route over the model within --resume-wait {self.resume_wait:g} s" if self.resume_wait else ""
                self._fail(session, MeshnetError(error.code, f"{error.message}{waited} ({e.message})", **error.context))
            return
        session.lost = None
        session.gen = session.gen.replay()
        # the prompt's chunks as they were, unless the new route takes less at once
        # (its floats may then differ: the note says which chunking ran)
        n_batch = min(w.capability["n_batch"] for w in route)
        if max(b - a for a, b in zip([0] + session.gen.chunk_ends, session.gen.chunk_ends)) > n_batch:
            session.gen.chunk = n_batch
            session.gen.chunk_ends = None
        session.resumes.append({"stage": error.context.get("stage"), "worker": error.context.get("worker"),
                                "replayed_tokens": len(session.gen.prompt), "generated_before": session.gen.replayed,
                                "lost_at": lost_at})
        self.counters["resumes"] += 1
        self.counters["replayed_tokens"] += len(session.gen.prompt)
        self._open_route(session, route)

    def _act(self, session: Session, actions: list, piece: bytes = b"", logits: np.ndarray | None = None) -> None:
        """Carry out what the session's generation asks for."""
        for action in actions:
            if isinstance(action, FeedHead):
                head = session.route[0]
                frames = P.encode(P.ACT, 0, sid=session.sid, key=session.key, pos=action.pos, n=len(action.tokens),
                                  tokens=list(action.tokens), ack=action.prompt)
                if not self._push(head.capability["data_endpoint"], frames, head.public_key):
                    self._fail(session, MeshnetError(E.HOP_UNREACHABLE, f"cannot pass the prompt to stage "
                                                     f"{head.offer.label} (worker {head.name})", stage=head.offer.label,
                                                     session=session.sid), cancel=True)
                    return
                session.waiting_on = 0   # the coordinator feeds prompt chunks only: decode steps come from the tail
            elif isinstance(action, Token):
                if session.resumes and "elapsed_ms" not in session.resumes[-1]:
                    elapsed_ms = (now() - session.resumes[-1].pop("lost_at")) * 1000
                    session.resumes[-1]["elapsed_ms"] = round(elapsed_ms, 1)
                    self.resume_ms.append(elapsed_ms)
                session.events.put(("token", TokenEvent(action.token, piece, logits)))
            elif isinstance(action, Finish) and action.reason != "error":
                self._finish(session, action.reason)

    def _push(self, endpoint: str, frames: list, server_key: str | None = None) -> bool:
        sock = self.pushes.get(endpoint)
        if sock is None:
            sock = self.pushes[endpoint] = sockets.data_push(self.ctx)
            if self.keys is not None:
                security.client(sock, self.keys, server_key.encode())
            sock.connect(endpoint)
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            return False

    def _receive_data(self) -> None:
        frames, why = P.recv_frames(self.data, 2, self.max_message_bytes)
        if why is not None:
            self.counters["dropped_oversized"] += 1
            return
        self._guarded("handling a data message", self._on_data, frames)

    def _on_data(self, frames: list) -> None:
        """A stage's "chunk taken" or token. Anything that does not name a live session
        with its key is dropped and counted: a PULL has no one to answer."""
        try:
            msg = P.decode(frames, self.max_payload)
        except P.ProtocolError as e:
            self.counters[f"dropped_{e.code}"] += 1
            return
        session = self.sessions.get(msg.get("sid"))
        if msg.type not in (P.TOOK, P.TOKEN):
            self.counters["dropped_unknown_type"] += 1
            return
        if session is None or session.finished:
            self.counters["dropped_late"] += 1
            return
        if session.key != msg["key"]:
            self.counters["dropped_bad_key"] += 1
            return
        session.deadline = now() + self.request_timeout
        if msg.type == P.TOOK:
            if msg.get("head"):
                session.waiting_on = None   # the chunk is past the head (a next chunk for it says so again)
                self._act(session, session.gen.head_took(msg["pos"], msg["n"]))
            if msg.get("tail") and msg["pos"] + msg["n"] < len(session.gen.prompt):
                self._act(session, session.gen.tail_gave(msg["pos"], msg["n"], 0, False))
            return
        decoding = session.gen.state == "decode"
        for seam, hop_us, nbytes in msg.get("seams", ()):
            if seam < len(session.crossings):
                session.crossings[seam] += 1
                session.seam_bytes += nbytes
                if decoding:
                    session.decode_seam_bytes += nbytes
                    session.decode_crossings += 1
                stage = session.route[seam + 1]
                stage.seam_bytes += nbytes
                if hop_us >= 0:
                    session.hops_us[seam].append(hop_us)
                    stage.hops_us.append(hop_us)
        logits = None
        if session.want_logits and msg.payload is not None:
            logits = np.frombuffer(msg.payload, dtype="<f4").copy()
        self._act(session, session.gen.tail_gave(msg["pos"], msg["n"], msg["token"], msg["eog"]),
                  piece=msg.get("piece", b""), logits=logits)

    def _expire_sessions(self) -> None:
        t = now()
        for session in [s for s in self.sessions.values() if s.deadline < t or (s.suspect and s.suspect[1] < t)]:
            self._guarded("expiring a session", self._expire_session, session, sid=session.sid)

    def _expire_session(self, session: Session) -> None:
        if session.finished:
            return
        if session.lost is not None:
            self._try_resume(session)
            return
        if session.suspect is not None and session.suspect[1] < now():
            self._fail(session, session.suspect[0], cancel=True)
            return
        if session.opens_waiting:
            return  # its OPEN requests have their own deadlines
        if session.waiting_on is not None:
            where = session.label(session.waiting_on)
            what = f"stage {where} (worker {session.route[session.waiting_on].name}) did not take the prompt chunk"
        else:
            where = f"[0,{session.route[-1].offer.end})"
            what = f"the route {' '.join(w.offer.label for w in session.route)} gave no token"
        self._fail(session, MeshnetError(E.DEADLINE_EXCEEDED, f"{what} within {self.request_timeout:g} s",
                                         stage=where, session=session.sid), cancel=True)

    def _metrics(self, session: Session) -> dict:
        every_hop = [h for seam in session.hops_us for h in seam]
        hops = percentiles(every_hop)
        per_seam_step = max(len(session.gen.tokens) - 1, 0) * len(session.crossings)
        return {
            **session.gen.metrics([(w.offer.start, w.offer.end) for w in session.route], session.seam_bytes),
            "hop_us_p50": hops["p50"],
            "hop_us_p99": hops["p99"],
            "seam_hop_us_p50": [percentiles(seam)["p50"] for seam in session.hops_us],
            "seam_crossings": session.crossings,
            "decode_seam_bytes_per_token": session.decode_seam_bytes / per_seam_step if per_seam_step else None,
            "decode_crossings_per_token": session.decode_crossings / per_seam_step if per_seam_step else None,
            "numerics": session.numerics,
            **({"mixed_route": True, "route_classes": [str(compat_class_of(w.capability)) for w in session.route]}
               if session.mixed else {}),
            **({"resumed": [{k: v for k, v in r.items() if k != "lost_at"} for r in session.resumes]}
               if session.resumes else {}),
        }

    def _end(self, session: Session, skip_stage: int | None, message_type: str) -> None:
        session.finished = True
        self.sessions.pop(session.sid, None)
        self._leave_route(session, skip_stage, message_type)

    def _leave_route(self, session: Session, skip_stage: int | None, message_type: str) -> None:
        """Tell the session's stages (but skip_stage) to drop it; forget what it asked them."""
        for rid in [rid for rid, p in self.pending.items() if p.sid == session.sid]:
            del self.pending[rid]
        for i, worker in enumerate(session.route):
            worker.sessions.discard(session.sid)
            if i != skip_stage and worker.identity in self.workers:
                self._request(worker, message_type,
                              Pending(message_type, session.sid, worker.identity, i, now() + self.request_timeout),
                              sid=session.sid)

    def _finish(self, session: Session, reason: str) -> None:
        self.counters["sessions_completed"] += 1
        self._end(session, None, P.RELEASE)
        session.events.put(("done", (reason, self._metrics(session), list(session.gen.token_times))))

    def _fail(self, session: Session, error: MeshnetError, skip_stage: int | None = None, cancel: bool = False) -> None:
        if session.finished:
            return
        session.gen.failed()
        self.counters[f"failed_{error.code}"] += 1
        self._end(session, skip_stage, P.CANCEL if cancel else P.RELEASE)
        session.events.put(("error", error))

    def _cancel_session(self, sid: int) -> None:
        session = self.sessions.get(sid)
        if session is not None and not session.finished:
            self._fail(session, MeshnetError(E.CANCELLED, f"session {sid} was cancelled", session=sid), cancel=True)


def _fits(size: int, limit: int | None, what: str, field: str) -> Callable[[list[WorkerRecord]], None]:
    """A text request's check before it is sent: SIZE bytes of text at most MAX_TEXT_BYTES,
    and, with a LIMIT in tokens, no longer than LIMIT tokens could be. The most text one
    token can stand for is twice the longest piece the head reported, and never under 64
    bytes, since the control tokens a chat template writes out are not among the pieces
    measured."""
    def check(route: list[WorkerRecord]) -> None:
        if size > P.MAX_TEXT_BYTES:
            raise MeshnetError(E.CONTEXT_FULL if limit else E.INVALID_ARGUMENT,
                               f"{what} is {size} bytes, more than the {P.MAX_TEXT_BYTES} taken at once", field=field)
        per_token = route[0].capability.get("max_token_bytes")
        if limit and per_token and size > limit * 2 * max(per_token, 32):
            raise MeshnetError(E.CONTEXT_FULL, f"{what} is {size} bytes, so at least {size // (2 * max(per_token, 32))} "
                               f"tokens: more than {limit}", field=field)
    return check


def _same_host(endpoint: str) -> str:
    """tcp://host:port -> tcp://host:0 (a free port on the same interface)."""
    if not endpoint.startswith("tcp://"):
        raise MeshnetError(E.BAD_ADDRESS, f"the coordinator needs a tcp:// address to serve the data plane, "
                           f"not {endpoint!r}")
    return endpoint.rsplit(":", 1)[0] + ":0"


def _gaps(covered: list[int]) -> list[tuple[int, int]]:
    """The half-open runs of zeros in COVERED: layers no worker holds."""
    gaps, start = [], None
    for i, c in enumerate([*covered, 1]):
        if not c and start is None:
            start = i
        elif c and start is not None:
            gaps.append((start, i))
            start = None
    return gaps


def _peer_key(frame) -> str | None:
    """The CURVE public key the ZAP handshake proved for the sender of FRAME (pyzmq's
    authenticator gives it as the User-Id), or None on a link without CURVE."""
    try:
        key = frame.get("User-Id")
    except (zmq.ZMQError, AttributeError):
        return None
    return key if key and len(key) == 40 else None
