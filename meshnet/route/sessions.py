"""Every session's life at the coordinator, with no I/O (the shape of h11): the table
takes events and returns effects, and the I/O loop (io_loop.py) is the only code that
touches a socket.

Events (methods): open, opened, request_failed, open_expired, took / token (a stage's
data message), stage_error, worker_lost, sessions_dropped, routes_changed, push_failed,
cancel, fail, and the clock's due / expire (tick: both at once).
Effects (events.py): Request to a stage, Push a prompt chunk, Emit to the caller, Leave.

A session is OPENING until every stage of its route confirmed it, then RUNNING, and
follows the generation state machine (core/generation.py). A stage lost makes it LOST:
it leaves the stages left and waits for a route (a spare, or a worker that registers
within resume_wait) to be replayed on, at most max_resumes times; then ENDED. A stage
whose KV pool has no room for it makes it PAUSED: it leaves its route, so its cells are
free, and waits its turn (the sessions paused before it first, those opened after it
behind) to be replayed exactly, on the same kind of route, once another session ends or
a resumed one decodes; never another session's loss. Because
the table only returns effects, a send that fails cannot re-enter it while it walks a
route: the loop reports the failure as a later event (the Paranoid Pirate rule).
"""

from __future__ import annotations

import collections
import enum
import secrets
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from meshnet.core import defaults
from meshnet.core import errors as E
from meshnet.core import numerics
from meshnet.core.errors import MeshnetError
from meshnet.core.generation import FeedHead, Finish, Generation, Token
from meshnet.core.metrics import percentiles, speculation_metrics
from meshnet.core.prefix import BLOCK, block_keys, reusable_keys
from meshnet.core.sampling import Sampling
from meshnet.net import protocol as P
from meshnet.net.heartbeat import now
from meshnet.route.chunk_budget import CHUNK_SHARE, chunk_rows, row_cells
from meshnet.route.events import Done, Effect, Emit, Failed, Leave, Push, Request, TokenEvent
from meshnet.route.registry import WorkerRecord
from meshnet.route.requests import RequestKind
from meshnet.route.tracker import compat_class_of, head_gathers


FAILOVERS_KEPT = 50


class State(enum.Enum):
    OPENING = "opening"   # OPEN sent to every stage of the route, not yet confirmed by all
    RUNNING = "running"   # prompt and decode flow; the generation says which
    LOST = "lost"         # a stage is gone: waiting for a route to be replayed on
    PAUSED = "paused"     # a stage's KV pool had no room for it (or others wait for room): off its route, in line
    ENDED = "ended"


@dataclass
class Session:
    sid: int
    gen: Generation
    want_logits: bool
    deadline: float               # the next event (open, prompt chunk taken, token) is due by then
    sampling: Sampling | None = None
    numerics: str | None = None   # its route's numerics class: a resume keeps to it
    state: State = State.OPENING
    key: int = 0                  # drawn here, given only to the session's stages: data messages carry it
    route: list[WorkerRecord] = field(default_factory=list)
    waiting_on: int | None = None  # the stage the session waits on, when known (the head, for a chunk)
    opens_waiting: int = 0        # stages yet to confirm the session is open
    hops_us: list[list[int]] = field(default_factory=list)   # per seam, where the two stages share a clock
    crossings: list[int] = field(default_factory=list)       # per seam
    seam_bytes: int = 0
    decode_seam_bytes: int = 0    # what crossed the seams for decode steps (after the first token)
    decode_crossings: int = 0
    suspect: tuple[MeshnetError, float] | None = None  # a stage could not pass it on: the error, unless a loss explains it by then
    mixed: bool = False           # stages of more than one class (allow_mixed): drift is measured
    lost: tuple[MeshnetError, float] | None = None     # the stage lost (LOST): the error, since when
    resume_by: float = 0.0        # ... and until when it may wait
    resumes: list[dict] = field(default_factory=list)  # each resume: stage, replayed_tokens, elapsed_ms
    started: bool = False         # it has had a route (a session opened while others wait for room has not)
    pauses: int = 0               # times a stage's KV pool had no room for it
    seq: int = 0                  # its turn among the table's sessions: in line for room, the oldest goes first
    salt: str = ""                # what the block keys of its tokens are salted with: the route's class and scope
    scope: str = ""               # whose kept prefixes it may start from: its client's (serve's API key, user)
    prefix: list[int] = field(default_factory=list)    # the block keys its route may start it from
    cached: int = 0               # ... the prompt tokens every stage of it restored
    drafts: int = 0               # drafts per round it asks for (0: none)
    logprobs: int | None = None   # each token's log-probability, and of this many most likely (the tail's)
    speculation: dict | None = None   # speculating: drafts_max, rounds, drafted, accepted (the tail's counts)

    def label(self, stage: int) -> str:
        return self.route[stage].offer.label


class SessionTable:
    def __init__(self, route_for: Callable[[str | None], list[WorkerRecord]], *, reply_endpoint: str,
                 request_timeout: float, suspect_window: float, resume_wait: float = 0.0, max_resumes: int = 2,
                 speculate: int = 0, pause_wait: float = defaults.PAUSE_WAIT_S, clock: Callable[[], float] = now,
                 counters: collections.Counter | None = None):
        # route_for(numerics_class) is the route to open a session on, or MeshnetError
        # saying why there is none (the registry's, or a test's plain function)
        self.route_for = route_for
        self.reply_endpoint = reply_endpoint   # where the stages send tokens and "chunk taken"
        self.request_timeout = request_timeout
        self.suspect_window = suspect_window   # a heartbeat liveness window: a lost stage shows within it
        self.resume_wait = resume_wait
        self.max_resumes = max_resumes
        self.speculate = speculate             # drafts per round at most, where a route can verify them exactly
        self.pause_wait = pause_wait           # seconds a session waits in line for room in the KV pools
        self.chunk_share = CHUNK_SHARE         # a prompt chunk's cost beside a decode batch's (chunk_budget.py)
        self.clock = clock
        self.counters = counters if counters is not None else collections.Counter()
        self.resume_ms: collections.deque[float] = collections.deque(maxlen=1000)
        # the last resumes, newest last: what a console shows of the failovers
        self.failovers: collections.deque[dict] = collections.deque(maxlen=FAILOVERS_KEPT)
        self.sessions: dict[int, Session] = {}
        self._on_worker: dict[bytes, set[int]] = collections.defaultdict(set)
        self._line: list[int] = []   # the sessions waiting for room, in turn (PAUSED)
        self._proving: int | None = None   # the one last let out of the line, until it decodes a token
        self._opened = 0
        self._out: list[Effect] = []

    def sessions_on(self, worker: bytes) -> int:
        return len(self._on_worker.get(worker, ()))

    # ---- events ------------------------------------------------------------------------

    def open(self, sid: int, gen: Generation, want_logits: bool, sampling: Sampling | None = None,
             speculate: int | None = None, logprobs: int | None = None, scope: str = "") -> list[Effect]:
        """SPECULATE: drafts per round at most (None: the table's). LOGPROBS: each token's
        log-probability, and those of this many most likely tokens (None: none). SCOPE:
        only the prefixes of sessions of this scope are reused, so that a client's cached
        tokens never show it what another's prompts began with."""
        try:
            route = self.route_for(None)
        except MeshnetError as e:
            return [Emit(sid, Failed(MeshnetError(e.code, e.message, session=sid)))]
        n_ctx = min(w.capability.n_ctx for w in route)
        if len(gen.prompt) + gen.rule.max_tokens > n_ctx:
            return [Emit(sid, Failed(MeshnetError(E.CONTEXT_FULL, f"{len(gen.prompt)} prompt + {gen.rule.max_tokens} "
                                                  f"new tokens exceed the route's context of {n_ctx}", session=sid)))]
        numerics_class = route[0].capability.numerics   # one class per route (the tracker's rule)
        # the stock class feeds a prompt as stock llama.cpp does, in batches of n_batch
        # (whatever prefill chunk was asked): its kernels change with the rows in a call,
        # so other chunks would give other tokens
        gen.bound_chunks(min(w.capability.n_batch for w in route), fixed=numerics_class == numerics.STOCK)
        session = self.sessions[sid] = Session(sid, gen, want_logits, 0.0, sampling=sampling, numerics=numerics_class,
                                               drafts=self.speculate if speculate is None else speculate,
                                               logprobs=logprobs, scope=scope)
        self._opened += 1
        session.seq = self._opened
        if self._waiting():   # the newest waits behind those that wait for room
            self._wait_in_line(session)
        else:
            self._open_route(session, route)
        return self._effects()

    def opened(self, sid: int, cached: int = 0, drafts: int | None = None) -> list[Effect]:
        """A stage confirmed the session is open, holding the prompt's first CACHED tokens
        (from its prefix store): the route starts from the shortest such prefix. The head
        says how many DRAFTS a round it offers (0: none, its model cannot drop rows)."""
        session = self._live(sid)
        if session is not None and session.state is State.OPENING:
            session.opens_waiting -= 1
            if drafts is not None and session.speculation is not None:
                session.speculation["drafts_max"] = drafts
            session.cached = min(session.cached, cached, len(session.prefix) * BLOCK)
            if session.opens_waiting == 0:
                session.state = State.RUNNING
                self.counters["prefix_hits" if session.cached else "prefix_misses"] += bool(session.prefix)
                self.counters["prefix_hit_tokens"] += session.cached
                self._bound_chunk(session)
                self._act(session, session.gen.opened(session.cached))
        return self._effects()

    def request_failed(self, sid: int, worker: WorkerRecord, code: str, message: str) -> list[Effect]:
        """A stage answered one of the session's requests with an error."""
        session = self._live(sid)
        if session is not None:
            error = MeshnetError(code, message, stage=worker.offer.label, worker=worker.name, session=sid)
            if code != E.KV_FULL:
                self._fail(session, error, cancel=True)
            elif worker in session.route:   # (a pool of a route it had before is no reason to wait)
                self._pause(session, error)
        return self._effects()

    def open_expired(self, sid: int, stage: int, message: str) -> list[Effect]:
        session = self._live(sid)
        if session is not None and session.state is State.OPENING and stage < len(session.route):
            self._fail(session, MeshnetError(E.DEADLINE_EXCEEDED, message, stage=session.label(stage), session=sid),
                       cancel=True)
        return self._effects()

    def took(self, msg: P.Message) -> list[Effect]:
        """A stage took a prompt chunk: the head (the next chunk may enter it) or the tail
        (a chunk before the last is through the route)."""
        session = self._addressed(msg)
        if session is None:
            return []
        session.deadline = self.clock() + self.request_timeout
        self._bound_chunk(session)
        if msg.get("head"):
            session.waiting_on = None   # the chunk is past the head (a next chunk for it says so again)
            self._act(session, session.gen.head_took(msg["pos"], msg["n"]))
        if msg.get("tail") and msg["pos"] + msg["n"] < len(session.gen.prompt):
            self._act(session, session.gen.tail_gave(msg["pos"], msg["n"], 0, False))
        return self._effects()

    def token(self, msg: P.Message) -> list[Effect]:
        """The tail's next token, with what it measured at each seam on the way."""
        session = self._addressed(msg)
        if session is None:
            return []
        session.deadline = self.clock() + self.request_timeout
        self._count_seams(session, msg.get("seams", ()))
        self.counters["tokens"] += 1
        if "drafted" in msg.fields and session.speculation is not None:   # a decode round's first token
            counts = {"rounds": 1, "drafted": msg["drafted"], "accepted": min(msg.get("accepted", 0), msg["drafted"])}
            for name, n in counts.items():
                session.speculation[name] += n
                self.counters[f"speculation_{name}"] += n
        logits = None
        if session.want_logits and msg.payload is not None:
            logits = np.frombuffer(msg.payload, dtype="<f4").copy()
        top = msg.get("top")
        self._act(session, session.gen.tail_gave(msg["pos"], msg["n"], msg["token"], msg["eog"]),
                  piece=msg.get("piece", b""), logits=logits,
                  logprob=(msg["logprob"], [tuple(t) for t in top or ()]) if "logprob" in msg.fields else None)
        return self._effects()

    def stage_error(self, sid: int, worker: WorkerRecord, code: str, message: str) -> list[Effect]:
        """A stage says a session failed on its data plane. Only a stage of that session
        can end it; a stage that could not pass it on may be seeing a peer that just died:
        the heartbeats get one liveness window to name the lost stage first."""
        session = self._live(sid)
        if session is None or worker not in session.route:
            self.counters["late_replies"] += 1
            return []
        error = MeshnetError(code, message, stage=worker.offer.label, worker=worker.name, session=sid)
        if code == E.HOP_UNREACHABLE:
            if session.suspect is None:
                session.suspect = (error, self.clock() + self.suspect_window)
            return []
        if code == E.KV_FULL:
            self._pause(session, error)
        else:
            self._fail(session, error, cancel=True)
        return self._effects()

    def worker_lost(self, worker: WorkerRecord, reason: str, elapsed_ms: int) -> list[Effect]:
        """WORKER is gone (no longer registered): every session on it loses that stage."""
        return self._lose_sessions_on(worker, reason, gone=True, elapsed_ms=elapsed_ms)

    def sessions_dropped(self, worker: WorkerRecord, reason: str) -> list[Effect]:
        """WORKER is there still, but without the sessions it held: each is lost as if the
        stage were, and so replayed (every stage, this one too, is told to drop it first)."""
        return self._lose_sessions_on(worker, reason, gone=False)

    def _lose_sessions_on(self, worker: WorkerRecord, reason: str, gone: bool, **context) -> list[Effect]:
        held = self._on_worker.pop(worker.identity, ()) if gone else self._on_worker.get(worker.identity, ())
        for sid in list(held):
            session = self.sessions.get(sid)
            if session is not None and worker in session.route:
                stage = session.route.index(worker) if gone else None   # a stage gone is not told to drop it
                self._stage_lost(session, MeshnetError(
                    E.STAGE_LOST, f"stage {worker.label} (worker {worker.name}) {reason}",
                    stage=worker.label, worker=worker.name, session=sid, **context), stage)
        return self._effects()

    def routes_changed(self) -> list[Effect]:
        """A worker registered: a session waiting for a route may have one now."""
        for session in [s for s in self.sessions.values() if s.state is State.LOST]:
            self._try_resume(session)
        self._resume_next()   # (one in line for room may have waited for a route)
        return self._effects()

    def push_failed(self, sid: int) -> list[Effect]:
        session = self._live(sid)
        if session is not None and session.route:
            head = session.route[0]
            self._fail(session, MeshnetError(E.HOP_UNREACHABLE, f"cannot pass the prompt to stage {head.offer.label} "
                                             f"(worker {head.name})", stage=head.offer.label, session=sid), cancel=True)
        return self._effects()

    def cancel(self, sid: int) -> list[Effect]:
        return self.fail(sid, MeshnetError(E.CANCELLED, f"session {sid} was cancelled", session=sid))

    def fail(self, sid: int, error: MeshnetError) -> list[Effect]:
        """End the session with ERROR (its stages cancel it); a session not (or no longer)
        in the table still tells its caller."""
        session = self._live(sid)
        if session is None:
            return [] if sid in self.sessions else [Emit(sid, Failed(error))]
        self._fail(session, error, cancel=True)
        return self._effects()

    def due(self) -> list[int]:
        """The sessions the clock has something for: a deadline passed, a suspect window
        closed, or a wait for a route (see expire)."""
        t = self.clock()
        return [s.sid for s in self.sessions.values() if s.deadline < t or (s.suspect and s.suspect[1] < t)]

    def expire(self, sid: int) -> list[Effect]:
        session = self._live(sid)
        if session is not None:
            self._expire(session, self.clock())
        return self._effects()

    def tick(self) -> list[Effect]:
        """The clock, for every session due at once (the I/O loop expires each on its own,
        so that a bug in one fails only that session)."""
        return [effect for sid in self.due() for effect in self.expire(sid)]

    def effects(self) -> list[Effect]:
        """What the table decided and has not returned: after an event raised, the effects
        it made before the error still hold."""
        return self._effects()

    # ---- the session's steps -----------------------------------------------------------

    def _effects(self) -> list[Effect]:
        out, self._out = self._out, []
        return out

    def _live(self, sid: int | None) -> Session | None:
        session = self.sessions.get(sid)
        return session if session is not None and session.state is not State.ENDED else None

    def _addressed(self, msg: P.Message) -> Session | None:
        """The live session a data message names with its key, or None (dropped and counted:
        a PULL has no one to answer)."""
        session = self.sessions.get(msg.get("sid"))
        if session is None or session.state is State.ENDED:
            self.counters["dropped_late"] += 1
            return None
        if session.key != msg["key"]:
            self.counters["dropped_bad_key"] += 1
            return None
        return session

    def _open_route(self, session: Session, route: list[WorkerRecord]) -> None:
        """Open the session on every stage of the route, under a fresh key (what is still
        in flight from a route it had before is then dropped)."""
        gen, sid = session.gen, session.sid
        session.started = True
        self._set_route(session, route)
        session.state = State.OPENING
        session.key = secrets.randbits(63)
        session.deadline = self.clock() + self.request_timeout
        gen.on_route(len(route))
        session.mixed = len({compat_class_of(w.capability) for w in route}) > 1
        session.want_logits = session.want_logits or session.mixed   # a mixed route's every step is compared with the whole model
        last = len(route) - 1
        gather = head_gathers([w.capability for w in route])
        # prefix reuse is exact only where a row's KV is the same however the prompt was
        # cut into calls: the invariant class
        reuse = session.numerics == numerics.INVARIANT
        session.salt = f"{compat_class_of(route[0].capability)}\0{session.scope}" if reuse else ""
        session.prefix = reusable_keys(gen.prompt, session.salt) if reuse else []
        session.cached = len(gen.prompt)
        # speculation is exact where a row's logits do not depend on the rows beside it;
        # a session that ships every token's logits decodes a token at a time
        # (and so does one under a grammar: each refused draft would set the grammar back to the prompt)
        # (and one whose tokens' log-probabilities are asked for: the tail has a round's last row's logits only)
        speculate = session.drafts if reuse and not session.want_logits and session.logprobs is None and not (
            session.sampling and session.sampling.grammar) else 0
        if speculate and session.speculation is None:
            session.speculation = {"drafts_max": speculate, "rounds": 0, "drafted": 0, "accepted": 0}
        sampling_wire, grammar_frame = P.open_grammar(session.sampling)
        for i, worker in enumerate(route):
            self._on_worker[worker.identity].add(sid)
            self._out.append(Request(worker, RequestKind.OPEN, sid, i, payload=grammar_frame if i == last else None,
                                     fields=dict(
                sid=sid, key=session.key, stage=i, next=route[(i + 1) % len(route)].capability.data_endpoint,
                # a replay's prompt holds the tokens generated so far: the stages count the rest
                reply=self.reply_endpoint, prompt_len=len(gen.prompt), max_tokens=gen.rule.max_tokens - gen.replayed,
                stop_at_eog=gen.rule.stop_at_eog, logits=True if i == last and session.want_logits else None,
                hop_clock=i > 0 and route[i - 1].capability.clock_id == worker.capability.clock_id,
                gather=True if i == 0 and gather else None,
                groups=len(route) if i == 0 and not gather and len(route) > 1 else None,
                # with CURVE each stage learns the keys of its two neighbours in the ring
                next_key=route[(i + 1) % len(route)].public_key, prev_key=route[i - 1].public_key,
                # the tail samples, knowing the tokens so far (its penalties look back on them)
                sampling=sampling_wire if i == last else None,
                # the head drafts from the session's tokens: the prompt, then those it is fed
                history=list(gen.prompt) if (i == last and session.sampling) or (i == 0 and speculate) else None,
                grammar_from=max(0, gen.n_prompt - session.sampling.grammar_prefill)
                if i == last and session.sampling and session.sampling.grammar else None,
                prefix=session.prefix or None, speculate=speculate or None,
                logprobs=session.logprobs if i == last else None)))

    def _bound_chunk(self, session: Session) -> None:
        """The next prompt chunk's rows, beside the sessions decoding on its head
        (route/chunk_budget.py). The stock class feeds n_batch chunks, as stock llama.cpp."""
        gen = session.gen
        gen.chunk_limit = None
        if session.numerics != numerics.INVARIANT or not session.route or gen.state not in ("opening", "prefill"):
            return
        decoding_cells = []
        for sid in self._on_worker.get(session.route[0].identity, ()):
            other = self.sessions.get(sid)
            if other is not None and other is not session and other.state is State.RUNNING and \
                    other.gen.state == "decode":
                decoding_cells.append(len(other.gen.prompt) + len(other.gen.tokens))
        head = session.route[0].capability
        gen.chunk_limit = chunk_rows(decoding_cells, len(session.route), gen.prompt_fed, row_cells(head.cost),
                                     self.chunk_share)

    def _set_route(self, session: Session, route: list[WorkerRecord]) -> None:
        session.route = route
        session.opens_waiting = len(route)
        session.hops_us = [[] for _ in route[1:]]
        session.crossings = [0 for _ in route[1:]]

    def _act(self, session: Session, actions: list, piece: bytes = b"", logits: np.ndarray | None = None,
             logprob: tuple | None = None) -> None:
        """Carry out what the session's generation asks for."""
        for action in actions:
            if isinstance(action, FeedHead):
                self._out.append(Push(session.sid, session.route[0], dict(
                    sid=session.sid, key=session.key, pos=action.pos, n=len(action.tokens),
                    tokens=list(action.tokens), ack=action.prompt)))
                session.waiting_on = 0   # the coordinator feeds prompt chunks only: decode steps come from the tail
            elif isinstance(action, Token):
                if self._proving == session.sid:   # it had room: the next in line may try
                    self._proving = None
                    self._resume_next()
                if session.resumes and "elapsed_ms" not in session.resumes[-1]:
                    elapsed_ms = (self.clock() - session.resumes[-1].pop("lost_at")) * 1000
                    session.resumes[-1]["elapsed_ms"] = round(elapsed_ms, 1)
                    self.resume_ms.append(elapsed_ms)
                    self.failovers.append(dict(session.resumes[-1], sid=session.sid, at=time.time()))
                self._out.append(Emit(session.sid, TokenEvent(action.token, piece, logits, session.gen.cached,
                                                              logprob)))
            elif isinstance(action, Finish) and action.reason != "error":
                self.counters["sessions_completed"] += 1
                # the stages keep what it computed for a session that starts the same way: the
                # rows of every token but the last, which was drawn and never fed (a stage may
                # hold more, the refused drafts of a last round: the keys do not name them)
                fed = list(session.gen.prompt) + session.gen.tokens[session.gen.replayed:][:-1]
                keep = block_keys(fed, session.salt) if session.salt else None
                self._end(session, None, RequestKind.RELEASE, keep=keep)
                self._out.append(Emit(session.sid, Done(action.reason, self._metrics(session),
                                                        list(session.gen.token_times))))

    def _count_seams(self, session: Session, seams) -> None:
        decoding = session.gen.state == "decode"
        for seam, hop_us, nbytes in seams:
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

    def _stage_lost(self, session: Session, error: MeshnetError, stage: int | None) -> None:
        """A stage of the session is gone. The session leaves the stages left and waits
        for a route (one may stand ready: a spare), to be replayed on it; past its
        resumes, or when no route comes within resume_wait, it ends with the error."""
        if session.state in (State.ENDED, State.LOST):
            return
        if len(session.resumes) >= self.max_resumes or session.gen.done:
            self._fail(session, error, skip_stage=stage)
            return
        self._leave_route(session, stage, RequestKind.CANCEL)
        self._set_route(session, [])
        session.state = State.LOST
        session.suspect = None
        session.lost = (error, self.clock())
        session.resume_by = session.deadline = self.clock() + self.resume_wait
        self._try_resume(session)

    def _pause(self, session: Session, error: MeshnetError) -> None:
        """A stage's KV pool has no room for the session's next positions: it leaves its
        route (its cells go back to the pools) and waits in line, to be replayed exactly
        once room comes. A pool with no room while no other session of ours holds any
        never will: that ends it with the error."""
        if session.state not in (State.OPENING, State.RUNNING):
            return
        others = any(s is not session and s.state in (State.OPENING, State.RUNNING) for s in self.sessions.values())
        if session.gen.done or not others:
            self._fail(session, error, cancel=True)
            return
        self._leave_route(session, None, RequestKind.CANCEL)
        self._set_route(session, [])
        session.pauses += 1
        session.suspect = None
        self.counters["kv_pauses"] += 1
        self._wait_in_line(session, error)

    def _wait_in_line(self, session: Session, error: MeshnetError | None = None) -> None:
        session.state = State.PAUSED
        session.lost = (error, self.clock()) if error is not None else None
        session.deadline = self.clock() + self.pause_wait
        if self._proving == session.sid:
            self._proving = None
        self._line = sorted(set(self._line) | {session.sid}, key=lambda sid: self.sessions[sid].seq)

    def _waiting(self) -> bool:
        self._line = [sid for sid in self._line if sid in self.sessions and self.sessions[sid].state is State.PAUSED]
        return bool(self._line)

    def _resume_next(self) -> None:
        """The first session in line for room takes its turn: replayed on a route (opened,
        if it never had one). One at a time: the next goes when this one has decoded (so
        it had room) or another session ends."""
        if self._proving is not None and self._live(self._proving) is not None:
            return
        self._proving = None
        if not self._waiting():
            return
        session = self.sessions[self._line[0]]
        try:
            route = self.route_for(session.numerics if session.started else None)
        except MeshnetError:
            return   # (it waits on: a route that comes or its wait's end decides)
        self._line.pop(0)
        session.lost = None
        if session.started:
            session.gen = session.gen.replay(min(w.capability.n_batch for w in route))
            self.counters["replayed_tokens"] += len(session.gen.prompt)
        self._proving = session.sid
        self._open_route(session, route)

    def _try_resume(self, session: Session) -> None:
        error, lost_at = session.lost
        try:
            route = self.route_for(session.numerics)
            n_ctx = min(w.capability.n_ctx for w in route)
            if session.gen.n_prompt + session.gen.rule.max_tokens > n_ctx:
                raise MeshnetError(E.CONTEXT_FULL, f"the new route's context of {n_ctx} is too small for it")
        except MeshnetError as e:
            if self.clock() >= session.resume_by:
                waited = f" and no route over the model within --resume-wait {self.resume_wait:g} s" if self.resume_wait else ""
                self._fail(session, MeshnetError(error.code, f"{error.message}{waited} ({e.message})", **error.context))
            return
        session.lost = None
        # the prompt's chunks as they were, unless the new route takes less at once
        # (its floats may then differ: the note says which chunking ran)
        session.gen = session.gen.replay(min(w.capability.n_batch for w in route))
        session.resumes.append({"stage": error.context.get("stage"), "worker": error.context.get("worker"),
                                "replayed_tokens": len(session.gen.prompt), "generated_before": session.gen.replayed,
                                "lost_at": lost_at})
        self.counters["resumes"] += 1
        self.counters["replayed_tokens"] += len(session.gen.prompt)
        self._open_route(session, route)

    def _expire(self, session: Session, t: float) -> None:
        if session.state is State.ENDED:
            return
        if session.state is State.LOST:
            self._try_resume(session)
            return
        if session.state is State.PAUSED:
            why = f" ({session.lost[0].message})" if session.lost and session.lost[0] else ""
            self._fail(session, MeshnetError(E.KV_FULL, f"session {session.sid} waited {self.pause_wait:g} s for room "
                                             f"in the stages' KV pools, which other sessions held{why}",
                                             session=session.sid))
            return
        if session.suspect is not None and session.suspect[1] < t:
            self._fail(session, session.suspect[0], cancel=True)
            return
        if session.state is State.OPENING:
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
            **({"speculation": speculation_metrics(session.speculation, len(session.gen.tokens))}
               if session.speculation is not None else {}),
            **({"mixed_route": True, "route_classes": [str(compat_class_of(w.capability)) for w in session.route]}
               if session.mixed else {}),
            **({"resumed": [{k: v for k, v in r.items() if k != "lost_at"} for r in session.resumes]}
               if session.resumes else {}),
            **({"kv_pauses": session.pauses} if session.pauses else {}),
        }

    def _end(self, session: Session, skip_stage: int | None, kind: RequestKind, keep: list[int] | None = None) -> None:
        session.state = State.ENDED
        self.sessions.pop(session.sid, None)
        self._leave_route(session, skip_stage, kind, keep)
        if self._proving == session.sid:
            self._proving = None
        self._resume_next()   # its cells are free

    def _leave_route(self, session: Session, skip_stage: int | None, kind: RequestKind,
                     keep: list[int] | None = None) -> None:
        """Tell the session's stages (but skip_stage) to drop it, or to keep its memory
        under KEEP's block keys; forget what it asked them."""
        self._out.append(Leave(session.sid))
        for i, worker in enumerate(session.route):
            held = self._on_worker.get(worker.identity)
            if held is not None:
                held.discard(session.sid)
                if not held:
                    del self._on_worker[worker.identity]
            if i != skip_stage:
                self._out.append(Request(worker, kind, session.sid, i,
                                         {"sid": session.sid, **({"keep": keep} if keep else {})}))

    def _fail(self, session: Session, error: MeshnetError, skip_stage: int | None = None, cancel: bool = False) -> None:
        if session.state is State.ENDED:
            return
        session.gen.failed()
        self.counters[f"failed_{error.code}"] += 1
        self._end(session, skip_stage, RequestKind.CANCEL if cancel else RequestKind.RELEASE)
        self._out.append(Emit(session.sid, Failed(error)))
