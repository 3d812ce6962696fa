"""A stage worker's compute thread: the data plane of one stage.

It owns the stage (every engine call happens here), the PULL socket its inputs come to,
and a PUSH socket per next hop. The hot path has no thread hand-off: this thread reads
an activation from its data socket, runs it (batched with every other waiting decode
step), and sends the result on itself: residual rows to the next stage, or, at the
tail, the token to the coordinator and, in decode, the next step straight back to the
head. Control (open, release, cancel, text) reaches it from the worker's socket loop
through a job queue, woken by an inproc pair that also carries the replies back.
"""

from __future__ import annotations

import collections
import json
import math
import os
import threading
import time

import zmq

from meshnet.core import errors as E
from meshnet.core.drafts import NgramProposer
from meshnet.core.errors import MeshnetError
from meshnet.core.generation import StopRule, tail_step
from meshnet.core.logprobs import logprobs
from meshnet.core.metrics import percentiles
from meshnet.core.prefix import BLOCK
from meshnet.core.trace import Timeline
from meshnet.engine.batching import Step, StepResult, group_size, run_batch, take_batch
from meshnet.engine.binding import Stage
from meshnet.net import protocol as P
from meshnet.net import security, sockets
from meshnet.net.pushes import Pushes
from meshnet.net.security import DataCurve
from meshnet.stage.jobs import SESSION_FAILED, Job, JobKind
from meshnet.stage.prefix_store import PrefixStore
from meshnet.stage.session import MAX_SEAM_FIELD, Input, StageSession

STATS_PERIOD = 0.05       # seconds between refreshes of the stage statistics the socket loop reads
HOPS_PERIOD = 1.0         # seconds between hop percentiles in them (a sort of up to HOPS_KEPT values)
RECV_BURST = 256          # data messages read before computing: all that is waiting, within reason
GATHER_MAX = 0.03         # seconds a gathering head holds decode steps back for the other decoding sessions
HOPS_KEPT = 10_000


class StageLoop(threading.Thread):
    def __init__(self, stage: Stage, ctx: zmq.Context, control_endpoint: str, data_bind: str,
                 max_queue: int, max_payload: int, test_fault: str | None = None, cpu: int | None = None,
                 curve: DataCurve | None = None, timeline: Timeline | None = None, spin_ms: float = 0.0,
                 prefix_store: PrefixStore | None = None, rolls_back: bool = True):
        super().__init__(name="meshnet-stage", daemon=True)
        self.stage = stage
        self.info = stage.info()
        self.ctx = ctx
        self.max_queue = max_queue
        self.max_payload = max_payload
        self.test_fault = test_fault
        self.cpu = cpu
        self.curve = curve
        self.timeline = timeline   # the per-token spans, when tracing (core/trace.py)
        self.spin_ns = int(spin_ms * 1e6)
        self.prefix_store = prefix_store   # ended sessions' memory, for the next ones that start the same way
        self.rolls_back = rolls_back       # every stage of the model can drop rows: it may take drafts
        self.jobs: collections.deque[Job | None] = collections.deque()
        self._handlers = {JobKind.OPEN: self._do_open, JobKind.RELEASE: self._do_release,
                          JobKind.CANCEL: self._do_cancel, JobKind.RELEASE_ALL: self._do_release_all,
                          JobKind.TOKENIZE: self._do_tokenize, JobKind.DETOKENIZE: self._do_detokenize,
                          JobKind.TEMPLATE: self._do_template, JobKind.CHAT: self._do_chat}
        self.pair = ctx.socket(zmq.PAIR)
        self.pair.connect(control_endpoint)
        self.data = sockets.data_pull(ctx, max_frame=2 * (max_payload + P.MAX_HEADER_BYTES))
        if curve is not None:
            security.serve(self.data, curve.keys)
        try:
            self.data.bind(data_bind)
        except zmq.ZMQError as e:
            self.data.close(linger=0)
            self.pair.close(linger=0)
            raise MeshnetError(E.BAD_ADDRESS, f"cannot bind the data endpoint {data_bind!r}: {e.strerror}") from None
        self.data_endpoint = self.data.getsockopt_string(zmq.LAST_ENDPOINT)
        self.pushes = Pushes(ctx, curve.keys if curve else None)
        self.sessions: dict[int, StageSession] = {}
        self.waiting: collections.deque[Step] = collections.deque()
        self.lock = threading.Lock()
        # sessions whose steps must not run: set by a CANCEL at once, cleared by its job
        self.cancelled: set[int] = set()
        self.running: set[int] = set()
        self.epoch = 0             # the socket loop's current coordinator connection
        self.errors: collections.Counter = collections.Counter()    # sessions failed here, by code
        self.dropped: collections.Counter = collections.Counter()   # data messages not used, by reason
        self.forwards = 0
        self.batched_entries = 0
        self.largest_batch = 0   # the most entries one forward call took
        self.compute_us_total = 0
        self.seam_bytes_in = 0
        self.hops_us: collections.deque = collections.deque(maxlen=HOPS_KEPT)
        self.stats: dict = {}      # a snapshot, read by the socket loop
        self._stats_at = self._hops_at = 0.0
        self._hops = percentiles(())
        self._refresh_stats()

    # ---- called from the socket loop ---------------------------------------------------

    def submit(self, job: Job | None) -> None:
        self.jobs.append(job)

    def cancel(self, sid: int) -> None:
        """Stop a session at once: its waiting steps will not run, and a forward call
        running for it alone is aborted (one shared with other sessions runs on; the
        session's part of it is dropped)."""
        with self.lock:
            self.cancelled.add(sid)
            if self.running and self.running <= self.cancelled:
                self.stage.abort()

    def step_seconds(self) -> float:
        """How long this thread has been away from its loop: the step (or job) under way.
        Between steps it comes round every STATS_PERIOD and takes a new snapshot; one
        much older says the stage is stuck in one call, though its worker answers."""
        return max(0.0, time.monotonic() - self._stats_at)

    # ---- the loop ------------------------------------------------------------------------

    def run(self) -> None:
        if self.cpu is not None:
            os.sched_setaffinity(0, {self.cpu})   # this thread only; the engine's other threads keep theirs
        poller = zmq.Poller()
        poller.register(self.pair, zmq.POLLIN)
        poller.register(self.data, zmq.POLLIN)
        spin_until = 0
        while True:
            hold = self._gather_wait() if self.waiting else STATS_PERIOD
            events = None
            if not self.waiting and time.monotonic_ns() < spin_until:
                events = self._spin(poller, spin_until)
            if not events:
                events = dict(poller.poll(math.ceil(hold * 1000) if hold else 0))
            if self.spin_ns and self.data in events:
                spin_until = time.monotonic_ns() + self.spin_ns
            if self.pair in events:
                while self.pair.poll(0):
                    self.pair.recv()     # wake-ups: the jobs themselves are in the deque
            if self.jobs and not self._run_jobs():
                break
            if self.data in events:
                self._receive_burst()
            if self.waiting and not self._gather_wait():
                self._run_one_batch()
            if time.monotonic() - self._stats_at > STATS_PERIOD:
                self._refresh_stats()
        self._close()

    @staticmethod
    def _spin(poller: zmq.Poller, until_ns: int) -> dict:
        """Poll without sleeping until something comes or UNTIL_NS (each poll lets the GIL go:
        the socket loop's heartbeats go on). Between polls the CPU is offered to whatever
        waits for it: this process's ZeroMQ I/O thread shares it, and a poller that never
        yields kept it waiting for the scheduler's slice (2-4 ms in 1 hop of 10-20)."""
        while time.monotonic_ns() < until_ns:
            events = dict(poller.poll(0))
            if events:
                return events
            os.sched_yield()
        return {}

    def _run_jobs(self) -> bool:
        while self.jobs:
            job = self.jobs.popleft()
            if job is None:
                return False
            try:
                self._handlers[job.kind](job)
            except MeshnetError as e:
                self._error_reply(job, e)
            except Exception as e:  # a bug must not kill the worker: report it and go on
                self._error_reply(job, MeshnetError(E.INTERNAL, f"{type(e).__name__}: {e}"))
        self._refresh_stats()
        return True

    def _close(self) -> None:
        self.pushes.close()
        self.data.close(linger=0)
        self.pair.close(linger=0)

    def _refresh_stats(self) -> None:
        try:
            info = self.stage.info()
        except MeshnetError:
            return
        now = time.monotonic()
        if now - self._hops_at > HOPS_PERIOD:
            self._hops = percentiles(self.hops_us)
            self._hops_at = now
        hops = self._hops
        # one assignment: the socket loop reads whole snapshots, never a half-written one
        self.stats = {
            "layers": [info.layer_start, info.layer_end],
            "n_sessions": info.n_sessions,
            "kv_bytes": info.kv_bytes,
            "kv_bytes_used": info.kv_bytes_used,
            "model_bytes": info.model_bytes,
            "compute_bytes": info.compute_bytes,
            "vram_bytes": info.device_bytes,
            "forwards": self.forwards,
            "batched_entries": self.batched_entries,
            "largest_batch": self.largest_batch,
            "compute_us_total": self.compute_us_total,
            "waiting": len(self.waiting),
            "seam_bytes_in": self.seam_bytes_in,
            "hop_in_us_p50": hops["p50"],
            "hop_in_us_p99": hops["p99"],
            "dropped": dict(self.dropped),
            "errors": dict(self.errors),
            "data_endpoint": self.data_endpoint,
            # what each data link really runs, as ZeroMQ reports it
            "mechanisms": {"data": security.mechanism(self.data),
                           "pushes": self.pushes.mechanisms(), "pushes_opened": dict(self.pushes.opened)},
            "refused_peers": self.curve.gatekeeper.refusals if self.curve else 0,
            "prefix_cache": self.prefix_store.stats() if self.prefix_store is not None else None,
        }
        self._stats_at = now

    # ---- control jobs --------------------------------------------------------------------

    def _reply(self, job: Job, frames: list) -> None:
        # a HEALTH that comes after this reply must see what the job did (a session opened)
        self._refresh_stats()
        # the socket loop needs to know which connection asked and which bound frees up
        self.pair.send_multipart([job.epoch.to_bytes(8, "little"), job.kind.value.encode(), *frames], copy=False)

    def _error_reply(self, job: Job, error: MeshnetError) -> None:
        self.errors[error.code] += 1
        self._reply(job, P.error_frames(job.rid, error.code, error.message, sid=job.sid))

    def _do_open(self, job: Job) -> None:
        m = job.msg
        if (m["stage"] == 0) != self.info.is_head:
            raise MeshnetError(E.BAD_FIELD, f"open: stage {m['stage']} is not this stage's place: it "
                               + ("is the head (stage 0)" if self.info.is_head else "comes after the head"))
        if self.curve is not None:
            if m.get("next_key") is None or m.get("prev_key") is None:
                raise MeshnetError(E.BAD_FIELD, "open: a stage serving CURVE needs the keys of its neighbours "
                                   "(next_key, prev_key)")
            self.curve.gatekeeper.allow(m["prev_key"].encode())
        sampling = P.open_sampling(m)
        history = m.get("history")
        if sampling is not None and not self.info.is_tail:
            raise MeshnetError(E.BAD_FIELD, "open: sampling is the tail's: this stage comes before it")
        speculate = m.get("speculate", 0) if self.rolls_back else 0
        if (sampling is not None or (speculate and self.info.is_head)) and \
                (history is None or len(history) != m["prompt_len"]):
            raise MeshnetError(E.BAD_FIELD, f"open: {'sampling' if sampling is not None else 'drafting'} needs the "
                               f"prompt's {m['prompt_len']} tokens as history, got {None if history is None else len(history)}")
        self.stage.open_session(job.sid)
        try:
            cached = self._restore_prefix(job.sid, m.get("prefix") or [])
            # a replay's history holds the tokens generated before it: the grammar takes those too
            grammar_from = m.get("grammar_from", m["prompt_len"])
            self.stage.set_sampling(job.sid, sampling, history if sampling is not None else (), grammar_from)
        except MeshnetError:
            self.stage.release_session(job.sid)
            raise
        self.sessions[job.sid] = StageSession(
            job.sid, m["key"], m["stage"], m["next"], m["reply"], m["prompt_len"],
            StopRule(m["max_tokens"], m["stop_at_eog"]), m.get("logits", False), m.get("hop_clock", False),
            gather=m.get("gather", False), groups=m.get("groups", 1), restored=cached,
            sampler=(sampling, history, grammar_from) if cached and sampling is not None else None,
            speculate=speculate, logprobs=m.get("logprobs") if self.info.is_tail else None)
        if speculate and self.info.is_head:
            self.sessions[job.sid].proposer = NgramProposer(speculate)
            self.sessions[job.sid].proposer.extend(history)
        self.pushes.expect(m["next"], m.get("next_key", "").encode())
        self.pushes.expect(m["reply"], self.curve.coordinator_key if self.curve else b"")
        with self.lock:
            self.cancelled.discard(job.sid)  # a new session under this id starts clean
        self._reply(job, P.encode(P.OK, job.rid, sid=job.sid, cached=cached, speculate=speculate))

    def _restore_prefix(self, sid: int, keys: list[int]) -> int:
        """Start the new session from the longest prefix of KEYS this stage stored: the
        tokens it then holds (0: none). The route starts from the shortest of its stages'
        (its first step's position), to which a stage that restored more cuts back."""
        found = self.prefix_store.find(keys) if self.prefix_store is not None and keys else None
        if found is None:
            return 0
        stored, n_blocks = found
        self.stage.restore_session(sid, stored.memory, stored.n_tokens)
        if n_blocks < len(stored.keys):
            self.stage.truncate_session(sid, n_blocks * BLOCK)
        return n_blocks * BLOCK

    def _store_prefix(self, sid: int, keys: list[int]) -> None:
        """Keep an ending session's memory under its block KEYS, cut to its last whole
        block; a session that cannot be kept is only released (counted, never an error)."""
        try:
            n_blocks = min(len(keys), self.stage.session_length(sid) // BLOCK)
            if n_blocks == 0 or self.prefix_store.refresh(keys[:n_blocks]):
                return
            self.stage.truncate_session(sid, n_blocks * BLOCK)
            self.prefix_store.put(keys[:n_blocks], self.stage.save_session(sid))
        except MeshnetError as e:
            self.prefix_store.counters[f"not_stored_{e.code}"] += 1

    def _forget(self, sid: int) -> None:
        session = self.sessions.pop(sid, None)
        if any(s.sid == sid for s in self.waiting):
            self.waiting = collections.deque(s for s in self.waiting if s.sid != sid)
        if session is not None:
            self.stage.release_session(sid)
            in_use = {e for s in self.sessions.values() for e in (s.next_hop, s.reply)}
            for endpoint in (session.next_hop, session.reply):
                if endpoint not in in_use:
                    self.pushes.forget(endpoint)

    def _do_release(self, job: Job) -> None:
        if job.sid not in self.sessions:
            raise MeshnetError(E.UNKNOWN_SESSION, f"session {job.sid} is not open on this stage")
        keys = job.msg.get("keep") if job.msg is not None else None
        if keys and self.prefix_store is not None:
            self._store_prefix(job.sid, keys)
        self._forget(job.sid)
        self._reply(job, P.encode(P.OK, job.rid, sid=job.sid))

    def _do_cancel(self, job: Job) -> None:
        self._forget(job.sid)
        with self.lock:  # the steps received before this job have seen the cancel: forget it
            self.cancelled.discard(job.sid)
        self._reply(job, P.encode(P.OK, job.rid, sid=job.sid))

    def _do_release_all(self, job: Job) -> None:
        for sid in list(self.sessions):
            self._forget(sid)
        with self.lock:
            self.cancelled.clear()

    def _do_tokenize(self, job: Job) -> None:
        m = job.msg
        tokens = self.stage.tokenize(P.text_payload(m), m.get("add_special", True), m.get("parse_special", False))
        limit = m.get("limit")
        if limit is not None and len(tokens) > limit:   # the caller wants no text it cannot use
            raise MeshnetError(E.CONTEXT_FULL, f"the text is {len(tokens)} tokens, more than the {limit} asked for",
                               n_tokens=len(tokens))
        self._reply(job, P.encode(P.OK, job.rid, payload=P.tokens_frame(tokens)))

    def _do_detokenize(self, job: Job) -> None:
        tokens = P.tokens_payload(job.msg, self.stage.n_vocab)
        self._reply(job, P.encode(P.OK, job.rid, payload=self.stage.detokenize(tokens).encode()))

    def _do_template(self, job: Job) -> None:
        text = self.stage.chat_template(P.messages_payload(job.msg), job.msg.get("add_generation_prompt", True))
        self._reply(job, P.encode(P.OK, job.rid, payload=text.encode(errors="surrogatepass")))

    def _do_chat(self, job: Job) -> None:
        answer = self.stage.chat_apply(P.chat_payload(job.msg))
        self._reply(job, P.encode(P.OK, job.rid, payload=json.dumps(answer).encode()))

    # ---- the data plane ------------------------------------------------------------------

    def _session_failed(self, session: StageSession, error: MeshnetError) -> None:
        """Tell the coordinator, which ends the session everywhere; the stage goes on."""
        self.errors[error.code] += 1
        self.pair.send_multipart([self.epoch.to_bytes(8, "little"), SESSION_FAILED,
                                  *P.error_frames(0, error.code, error.message, sid=session.sid,
                                                  stage=f"[{self.info.layer_start},{self.info.layer_end})")])

    def _receive_burst(self) -> None:
        for _ in range(RECV_BURST):
            if not self.data.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                return
            t0_ns = time.monotonic_ns()
            frames, why = P.recv_frames(self.data, 2, self.max_payload + P.MAX_HEADER_BYTES)
            if why is not None:
                self.dropped[E.OVERSIZED] += 1
                continue
            self._accept(frames, time.monotonic_ns(), t0_ns)

    def _accept(self, frames: list, t_ns: int, t0_ns: int) -> None:
        """Check one data message; only one that names an open session with its key can
        touch that session (anything else is dropped and counted: a PULL has no one to
        answer)."""
        try:
            msg = P.decode(frames, self.max_payload)
        except P.ProtocolError as e:
            self.dropped[e.code] += 1
            return
        if msg.type != P.ACT:
            self.dropped[E.UNKNOWN_TYPE] += 1
            return
        session = self.sessions.get(msg["sid"])
        if session is None:
            self.dropped[E.UNKNOWN_SESSION] += 1   # a stranger's, or a session just ended
            return
        if session.key != msg["key"]:
            self.dropped[E.BAD_KEY] += 1
            return
        if msg["sid"] in self.cancelled:
            self.dropped[E.CANCELLED] += 1
            return
        try:
            step = self._step(session, msg, sum(len(f) for f in frames), t_ns)
        except MeshnetError as e:
            self._session_failed(session, e)
            return
        if self.timeline is not None:
            step.meta.checked_ns = time.monotonic_ns()
            self.timeline.span("receive", step.sid, step.pos, step.n, t0_ns, t_ns)
            self.timeline.span("decode", step.sid, step.pos, step.n, t_ns, step.meta.checked_ns)
        self.waiting.append(step)

    def _step(self, session: StageSession, msg: P.Message, nbytes: int, t_ns: int) -> Step:
        n = msg["n"]
        if n > self.info.n_batch:
            raise MeshnetError(E.BAD_FIELD, f"n={n} is over this stage's n_batch {self.info.n_batch}")
        if len(self.waiting) >= self.max_queue:
            raise MeshnetError(E.BUSY, f"{len(self.waiting)} steps are already waiting on this stage; try again later")
        if session.restored:   # its first step: the route starts from the prefix all its stages hold
            if msg["pos"] < session.restored:
                self.stage.truncate_session(session.sid, msg["pos"])
                if session.sampler is not None:   # the cut took the sampler's history with it
                    self.stage.set_sampling(session.sid, *session.sampler)
            session.restored, session.sampler = 0, None
        if session.speculate and not self.info.is_tail and msg["pos"] < self.stage.session_length(session.sid):
            self.stage.truncate_session(session.sid, msg["pos"])   # the rows of the last round's refused drafts
        # a step into stage k has crossed seams 0..k-1 at most: anything more is not ours to keep
        seams = list(msg.get("seams", ()))[: max(session.stage - 1, 0)]
        if self.info.is_head:
            tokens = msg.get("tokens")
            if tokens is None or len(tokens) != n or msg.payload is not None:
                raise MeshnetError(E.BAD_PAYLOAD, f"the head stage takes n={n} token ids and no payload")
            step = Step(msg["sid"], msg["pos"], n, tokens=tokens)
            if session.proposer is not None:
                self._draft(session, step, prompt_chunk=bool(msg.get("ack")))
        else:
            step = Step(msg["sid"], msg["pos"], n, residual=P.residual_from(msg, self.info.seam_width))
            if msg.get("verify"):
                tokens = msg.get("tokens")
                if not session.speculate or tokens is None or len(tokens) != n:
                    raise MeshnetError(E.BAD_FIELD, f"a verify step needs the n={n} token ids of its rows, in a "
                                       "session opened to take drafts")
                step.tokens, step.verify = tokens, True
            hop_us = (t_ns - msg["ts"]) // 1000 if session.hop_clock and "ts" in msg.fields else -1
            hop_us = -1 if not 0 <= hop_us <= MAX_SEAM_FIELD else hop_us   # a sender's odd clock is not a measurement
            if hop_us >= 0:
                self.hops_us.append(hop_us)
            self.seam_bytes_in += nbytes
            seams.append([session.stage - 1, hop_us, nbytes])
        step.want_logits = self.info.is_tail and (session.want_logits or session.logprobs is not None)
        step.meta = Input(session, seams, bool(msg.get("ack")), time.monotonic())
        if self.info.is_head and not msg.get("ack"):
            session.decoding = True
        return step

    def _draft(self, session: StageSession, step: Step, prompt_chunk: bool) -> None:
        """The head of a speculating session: learn what the last round kept from where the
        tail's next step starts, and give the step the proposer's drafts for the rows after
        it, within what the session may still generate and the stage may hold."""
        proposer = session.proposer
        if prompt_chunk:
            return   # the prompt came whole with the open
        now = time.monotonic()
        if session.offered is not None:
            round_pos, offered, began = session.offered
            accepted = step.pos - round_pos - 1
            proposer.extend(offered[:accepted])
            proposer.kept(len(offered), accepted)
            proposer.timed(len(offered), now - began)
            session.offered = None
        if len(proposer.tokens) != step.pos:
            raise MeshnetError(E.BAD_FIELD, f"a decode step at position {step.pos}, where the head knows "
                               f"{len(proposer.tokens)} tokens of the session")
        proposer.extend(step.tokens)
        generated = step.pos + 1 - session.prompt_len
        limit = min(session.rule.max_tokens - generated - 1, self.info.n_ctx - step.pos - 1, self.info.n_batch - 1)
        drafts = proposer.propose(limit)
        session.offered = (step.pos, drafts, now)
        if drafts:
            step.tokens, step.n, step.verify = list(step.tokens) + drafts, 1 + len(drafts), True

    def _gather_wait(self) -> float:
        """Seconds to hold the waiting decode steps back, 0 to compute now. A head whose
        stages share this machine's CPUs gathers every decoding session's step into one
        forward call: the sessions then go round the ring together, one stage computing at a
        time, as they would in one process, instead of splitting into groups whose stages
        compute at once and fight for the same cores."""
        if not self.info.is_head or any(s.is_chunk or not s.meta.session.gather for s in self.waiting):
            return 0.0
        here = {s.sid for s in self.waiting}
        if all(sid in here for sid, session in self.sessions.items() if session.gather and session.decoding):
            return 0.0
        return max(0.0, GATHER_MAX - (time.monotonic() - min(s.meta.arrived for s in self.waiting)))

    def _batch_entries(self) -> int:
        """Entries one forward call takes: the stage's sessions, or, at the head of a route
        whose stages pipeline, the decoding sessions' share of one of its micro-batches."""
        if not self.info.is_head:
            return self.info.max_sessions
        decoding = [s for s in self.sessions.values() if s.decoding]
        return group_size(len(decoding), max((s.groups for s in decoding), default=1), self.info.max_sessions)

    def _run_one_batch(self) -> None:
        with self.lock:
            steps = [s for s in take_batch(self.waiting, self._batch_entries(), self.info.n_batch)
                     if s.sid not in self.cancelled]
            self.running = {s.sid for s in steps}
        if not steps:
            return
        started = time.monotonic_ns()
        if self.test_fault is not None and self.test_fault.startswith("stall:"):   # tests: a wedged step
            time.sleep(float(self.test_fault.split(":", 1)[1]))
        try:
            results = run_batch(self.stage, steps)
        finally:
            with self.lock:
                self.running = set()
        ended = time.monotonic_ns()
        self.compute_us_total += (ended - started) // 1000
        if self.timeline is not None:
            for s in steps:
                self.timeline.span("wait", s.sid, s.pos, s.n, s.meta.checked_ns, started)
                self.timeline.span("forward", s.sid, s.pos, s.n, started, ended)
        self.forwards += 1
        self.batched_entries += len(steps)
        self.largest_batch = max(self.largest_batch, len(steps))
        for result in results:
            self._pass_on(result)

    def _pass_on(self, result: StepResult) -> None:
        step, inp = result.step, result.step.meta
        session = inp.session
        if step.sid in self.cancelled or self.sessions.get(step.sid) is not session:
            self.dropped[E.CANCELLED] += 1   # cancelled while it ran: its part goes nowhere
            return
        if result.error is not None:
            if result.error.code != E.ABORTED:
                self._session_failed(session, result.error)
            return
        head_took = self.info.is_head and inp.ack
        # the tail says when it finished a prompt chunk before the last: the coordinator
        # feeds the head no faster than the stages after it can follow
        tail_took = self.info.is_tail and step.pos + step.n < session.prompt_len
        if head_took or tail_took:
            t0_ns = time.monotonic_ns()
            self._send(session, session.reply, P.encode(P.TOOK, 0, sid=step.sid, key=session.key, pos=step.pos,
                                                        n=step.n, head=head_took or None, tail=tail_took or None))
            self._traced("send_reply", step.sid, step.pos, step.n, t0_ns)
        if not self.info.is_tail:
            t0_ns = time.monotonic_ns()
            self._send(session, session.next_hop,
                       P.encode(P.ACT, 0, payload=P.f32_payload(result.residual), sid=step.sid, key=session.key,
                                pos=step.pos, n=step.n, seams=inp.seams or None, ts=time.monotonic_ns(),
                                tokens=list(step.tokens) if step.verify else None, verify=step.verify or None))
            self._traced("send_next", step.sid, step.pos, step.n, t0_ns)
            return
        # the tokens of this step: one, or a round's draws kept, each ending the session or not
        # by the stop rule (the draws after one that ends it are not the session's)
        rows = [(step.pos + j, 1) for j in range(len(result.draws))] if step.verify else [(step.pos, step.n)]
        tokens, feed_head = [], False
        for token, (pos, n) in zip(result.draws or [result.token], rows):
            is_eog = self.stage.is_eog(token)
            is_token, feed_head = tail_step(session.prompt_len, session.rule, session.n_generated + len(tokens),
                                            pos, n, is_eog)
            if is_token:
                tokens.append((token, pos, n, is_eog))
            if not feed_head:
                break
        session.crossed(inp.seams)
        if feed_head:  # the next decode step first: it is the critical path
            t0_ns = time.monotonic_ns()
            token, pos, n, _ = tokens[-1]
            self._send(session, session.next_hop,
                       P.encode(P.ACT, 0, sid=step.sid, key=session.key, pos=pos + n, n=1, tokens=[token]))
            self._traced("send_next", step.sid, pos + n, 1, t0_ns)
        decode_round = session.speculate and step.pos >= session.prompt_len
        for i, (token, pos, n, is_eog) in enumerate(tokens):
            t0_ns = time.monotonic_ns()
            session.n_generated += 1
            logits = result.logits if i == len(tokens) - 1 else None
            logprob, top = None, None
            if session.logprobs is not None and logits is not None:   # (a session with them drafts nothing)
                logprob, top = logprobs(logits, token, session.logprobs)
                top = [[t, p, self.stage.detokenize_bytes([t])] for t, p in top]
            if not session.want_logits:
                logits = None
            if self.test_fault == "wrong_logits" and logits is not None:
                logits = logits + 0.25
            drafted = step.n - 1 if decode_round and i == 0 else None
            self._send(session, session.reply, P.encode(
                P.TOKEN, 0, payload=None if logits is None else P.f32_payload(logits), sid=step.sid, key=session.key,
                pos=pos, n=n, token=token, eog=is_eog, piece=self.stage.detokenize_bytes([token]),
                logits_n=None if logits is None else len(logits), seams=session.seams or None,
                drafted=drafted, accepted=None if drafted is None else len(tokens) - 1, logprob=logprob, top=top))
            session.seams = []
            self._traced("send_reply", step.sid, pos, n, t0_ns)

    def _traced(self, name: str, sid: int, pos: int, n: int, t0_ns: int) -> None:
        if self.timeline is not None:
            self.timeline.span(name, sid, pos, n, t0_ns, time.monotonic_ns())

    def _send(self, session: StageSession, endpoint: str, frames: list) -> None:
        try:
            self.pushes.to(endpoint).send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self._session_failed(session, MeshnetError(
                E.HOP_UNREACHABLE, f"stage [{self.info.layer_start},{self.info.layer_end}) could not pass session "
                f"{session.sid} on to {endpoint}: nothing takes from it"))
        except MeshnetError as e:
            self._session_failed(session, e)
