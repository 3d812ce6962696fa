"""A stage worker: one layer range of one model, served to a coordinator over ZeroMQ.

This module is the control plane: one DEALER to the coordinator, heartbeats both ways,
health, and open/release/cancel handed to the stage loop (stage_loop.py), which owns
the engine and the data plane. A worker started with `--layers auto` loads nothing at
first: it announces the memory it admits and the model's per-layer bytes, and loads the
range the coordinator's planner assigns it (in a thread, so heartbeats go on). The socket loop here never computes and never touches
an activation. The worker holds no routing knowledge beyond what the coordinator told
it at open (each session's next hop): it runs its fixed layer range on what it is
given, and nothing else (no generic tensor or graph execution).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
import uuid
from concurrent.futures import Future

import zmq

from meshnet.core import errors as E
from meshnet.core import kv_cache
from meshnet.core.errors import MeshnetError
from meshnet.core.layers import LayerRange
from meshnet.core.metrics import clock_id, rss_bytes
from meshnet.core.planner import ModelCost, Settings, fitted_pool, format_size, stage_need
from meshnet.core.trace import Timeline
from meshnet.engine.binding import Stage, default_threads, engine_pin, layer_memory
from meshnet.net import addresses
from meshnet.net import protocol as P
from meshnet.net import security
from meshnet.net.addresses import advertised, reachable
from meshnet.net.heartbeat import Pacer, Wakefulness
from meshnet.net.security import DataCurve, Gatekeeper
from meshnet.stage.config import WorkerConfig
from meshnet.stage.link import CoordinatorLink
from meshnet.stage.jobs import SESSION_FAILED, Job, JobKind
from meshnet.stage.loop import StageLoop
from meshnet.stage.prefix_store import PrefixStore, store_capacity, store_refusal
from meshnet.stage.tp_member import LeaderGroup
from meshnet.stage.tp_mirror import GroupStage

log = logging.getLogger("meshnet.stage.worker")

MAX_TEXT_JOBS = 8         # tokenize/detokenize requests waiting before "busy", beyond one per session
RECENT_RIDS = 4096        # request ids remembered to refuse duplicates
LOADING_POLL_MS = 20      # how often the socket loop looks at a range being loaded
# test-only fault switch: "wrong_logits" makes a tail worker corrupt the logits it returns,
# so that tests can prove `meshnet accept` notices; never set outside tests
TEST_FAULT = os.environ.get("MESHNET_TEST_FAULT")
# a test's hook: each step of a load's progress waits this long, so that a real load is slow
# enough to be watched
TEST_SLOW_LOAD_S = float(os.environ.get("MESHNET_TEST_SLOW_LOAD_MS", "0")) / 1000
PROGRESS_SAID_EVERY = 0.1   # a load says on stderr how far it got at each tenth
# a test's hook: each step of a fetch's progress waits this long, so that a test can stop it halfway
TEST_SLOW_FETCH_S = float(os.environ.get("MESHNET_TEST_SLOW_FETCH_MS", "0")) / 1000


class Tenths:
    """When a load or a fetch says on stderr how far it got: at each tenth, and at its end."""

    def __init__(self):
        self.said = -1.0

    def due(self, fraction: float) -> bool:
        if fraction >= self.said + PROGRESS_SAID_EVERY or fraction >= 1.0 > self.said:
            self.said = fraction
            return True
        return False


class StageWorker:
    def __init__(self, config: WorkerConfig):
        addresses.checked(config.coordinator, "--coordinator")   # before the model loads: a typo fails at once
        addresses.checked(config.data_bind, "--data-bind")
        # the threads resolved once: the stage, the polling choice and the capability agree
        self.config = config = dataclasses.replace(config, n_threads=config.n_threads or default_threads(config.gpu))
        self.ctx = zmq.Context()
        if config.cpu is not None:
            # the I/O thread that receives an activation wakes the stage loop on its own CPU:
            # a wake-up on a CPU already running costs far less than one on an idle CPU
            self.ctx.set(zmq.THREAD_AFFINITY_CPU_ADD, config.cpu)
        self.results = self.ctx.socket(zmq.PAIR)
        self.results_endpoint = f"inproc://meshnet-stage-{uuid.uuid4().hex}"
        self.results.bind(self.results_endpoint)
        self.stage: Stage | None = None
        self.loop: StageLoop | None = None
        self.loading: tuple[int, Future] | None = None      # an ASSIGN's request id and the load under way
        self.load_progress: float | None = None   # the weights read of the range loading (0 to 1), as llama.cpp says
        self.cost: ModelCost | None = None        # the model's costs, for the planner (--layers auto) and the pool
        self.load_seconds: float | None = None    # ... and how long the last load took
        self.worker_id = uuid.uuid4().hex
        self.gatekeeper: Gatekeeper | None = None
        self.group: LeaderGroup | None = None          # a tensor-parallel leader's follower (--tp 0/2)
        self.group_error: MeshnetError | None = None   # why its group broke: the worker leaves the route
        self.load_error: MeshnetError | None = None   # why the range of --layers did not load: the worker exits
        self.fetch_progress: float | None = None   # the bytes fetched of the range's (0 to 1), while fetching
        if config.layers is not None:
            self._load_given_range(config.layers)
        else:
            self._wait_for_a_range()
        self.link = CoordinatorLink(self.ctx, config.coordinator, config.keys, config.coordinator_key,
                                    config.heartbeat_interval, config.heartbeat_liveness)
        self.epoch = 0
        self.holds_sessions = False   # an OPEN came since the sessions were last all dropped
        # jobs waiting for the stage loop, by kind, each with its own bound
        self.queued: collections.Counter = collections.Counter()
        # (serve asks for a prompt's tokens only once a request has a session slot: a burst
        # waits in its queue, not in this one)
        self.queue_limits = {"text": MAX_TEXT_JOBS + config.max_sessions, "control": 4 * config.max_sessions + 16}
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
            P.SHUTDOWN: self._shutdown,
            P.TOKENIZE: self._tokenize,
            P.DETOKENIZE: self._detokenize,
            P.TEMPLATE: self._template,
            P.CHAT: self._chat,
            P.ASSIGN: self._assign,
        }

    def _pool_for(self, layers) -> int:
        """The KV pool the stage of LAYERS takes: the one asked, or (a default pool and
        --mem) the largest its memory leaves room for (core/planner.py fitted_pool)."""
        config = self.config
        if not config.kv_pool_floor or config.mem is None:
            return config.kv_pool
        cost = self.cost or ModelCost.from_layout(self._layout(), layer_memory(config.model_path, config.kv_type))
        return fitted_pool(cost, layers[0], layers[1], self._settings(), config.mem)

    def _settings(self) -> Settings:
        config = self.config
        return Settings(config.n_ctx, config.max_sessions, config.n_batch, config.kv_pool, config.kv_pool_floor)

    def _load(self, layers) -> Stage:
        """The engine stage for these layers, as this worker's options say; its progress in
        load_progress (health shows it) and, at each tenth, on stderr."""
        config = self.config
        label = LayerRange(*layers).label
        tenths = Tenths()

        def progress(fraction: float) -> None:
            self.load_progress = fraction
            if tenths.due(fraction):
                print(f"meshnet worker: loading layers {label}: {int(fraction * 100)}%", file=sys.stderr, flush=True)
            if TEST_SLOW_LOAD_S:
                time.sleep(TEST_SLOW_LOAD_S)
        began = time.monotonic()
        self.load_progress = 0.0
        options = dict(n_ctx=config.n_ctx, max_sessions=config.max_sessions, n_batch=config.n_batch,
                       numerics=config.numerics_class, flash_attn=config.flash_attn,
                       pool_cells=self._pool_for(layers), kv_type=config.kv_type)
        group = {}
        if config.group is not None:
            # a tensor-parallel leader: its follower joined and linked first (stage/tp_member.py)
            self.group = LeaderGroup(config.group, config.keys, config.model_sha256, tuple(layers), options,
                                     2 * self.max_payload)
            group = dict(tp=(0, 2), tp_link=self.group.link.engine_link())
        try:
            stage = Stage(config.model_path, layers, n_threads=config.n_threads, gpu=config.gpu, progress=progress,
                          thread_poll=config.thread_poll_on(len(os.sched_getaffinity(0))), **options, **group)
            if self.group is not None:
                self.group.wait_loaded(2 * self.max_payload)
        except BaseException:
            if self.group is not None:
                self.group.close()
                self.group = None
            raise
        self.load_seconds = round(time.monotonic() - began, 3)
        info = stage.info()
        print(f"meshnet worker: loaded layers {label}: {format_size(info.model_bytes)} of weights, "
              f"{format_size(info.kv_bytes)} of KV, in {self.load_seconds:.1f} s", file=sys.stderr, flush=True)
        return stage

    def _fetch(self, layers) -> None:
        """The bytes of LAYERS this worker lacks, from the mesh's holders (weights/fetch.py),
        each tensor checked; its progress in fetch_progress (health shows it) and, at each
        tenth, on stderr."""
        fetch = self.config.fetch
        label = LayerRange(*layers).label
        spans = fetch.manifest.spans_for(LayerRange(*layers))
        if not fetch.missing(spans):
            return
        tenths = Tenths()
        began = time.monotonic()

        def progress(done: int, total: int) -> None:
            fraction = done / total if total else 1.0
            self.fetch_progress = fraction
            if tenths.due(fraction):
                rate = done / max(time.monotonic() - began, 1e-6)
                print(f"meshnet worker: fetching layers {label}: {int(fraction * 100)}% ({format_size(done)} of "
                      f"{format_size(total)}, {format_size(rate)}/s)", file=sys.stderr, flush=True)
            if TEST_SLOW_FETCH_S:
                time.sleep(TEST_SLOW_FETCH_S)
        self.fetch_progress = 0.0
        try:
            fetch.run(spans, progress)
        finally:
            self.fetch_progress = None
        print(f"meshnet worker: fetched layers {label}: {fetch.fetched_bytes} bytes ({format_size(fetch.fetched_bytes)}) "
              f"in {fetch.seconds:.3f} s; "
              f"{format_size(fetch.disk_bytes())} of the {format_size(fetch.manifest.file_bytes)} file on disk at "
              f"{fetch.path}", file=sys.stderr, flush=True)

    @property
    def max_control_payload(self) -> int:
        """The largest payload the control socket takes: a residual's, or a text request's."""
        return max(self.max_payload, P.MAX_TEXT_BYTES)

    def _common_capability(self, n_layer: int, arch: str, n_embd: int, n_vocab: int) -> dict:
        return {
            "model_sha256": self.config.model_sha256,
            "arch": arch,
            "n_layer": n_layer,
            "n_embd": n_embd,
            "n_vocab": n_vocab,
            "engine_pin": engine_pin(self.config.gpu),
            # until a range is loaded the engine has not named its backend; the GPU engine is CUDA's
            "backend": "CUDA" if self.config.gpu else "CPU",
            "wire_dtype": "f32",
            "numerics": self.config.numerics_class,
            **({"flash_attn": True} if self.config.flash_attn else {}),
            **({"kv_type": self.config.kv_type} if self.config.kv_type != kv_cache.DEFAULT else {}),
            "max_sessions": self.config.max_sessions,
            "n_ctx": self.config.n_ctx,
            **({"kv_pool": self.config.kv_pool} if self.config.kv_pool else {}),
            **({"kv_pool_floor": self.config.kv_pool_floor} if self.config.kv_pool_floor else {}),
            "n_batch": self.config.n_batch,
            "clock_id": clock_id(),
            "n_threads": self.config.n_threads,
            "n_cpus": len(os.sched_getaffinity(0)),
            "pid": os.getpid(),
            # one id for every connection this process makes: a coordinator that gets a
            # READY from a new connection drops the old one, whatever it still delivers
            "worker_id": self.worker_id,
            **({"mem_bytes": self.config.mem} if self.config.mem is not None else {}),
            **({"fetches": True} if self.config.fetch is not None else {}),
            **({"weights": advertised(self.config.weights, self.config.coordinator)} if self.config.weights else {}),
        }

    def _wait_for_a_range(self) -> None:
        """--layers auto: announce the budget and the model's costs, hold nothing yet."""
        layout = self._layout()
        self.cost = ModelCost.from_layout(layout, layer_memory(self.config.model_path, self.config.kv_type))
        self.capability = dict(self._common_capability(layout.n_layer, layout.arch, layout.n_embd, layout.n_vocab),
                               admitted_bytes=self.config.mem, cost=self.cost.to_dict())

    def _load_given_range(self, layers) -> None:
        """--layers START:END: load them in a thread, announced as loading meanwhile, so
        the coordinator (and `meshnet status`, the console) show the load's progress; the
        range is offered when it is loaded."""
        layout = self._layout()
        start, end = layers
        if end > layout.n_layer:
            raise MeshnetError(E.BAD_RANGE, f"layers [{start},{end}) are outside the model's {layout.n_layer}")
        self.capability = dict(self._common_capability(layout.n_layer, layout.arch, layout.n_embd, layout.n_vocab),
                               loading=[start, end], admitted_bytes=self.config.mem or 0)
        self._start_loading(None, (start, end))

    def _layout(self):
        """The model's shape from its GGUF header; the largest payload as it will be (it
        bounds the control socket until the range is loaded)."""
        from meshnet.engine.gguf_layout import read_layout

        layout = read_layout(self.config.model_path)
        self.max_payload = self.config.n_batch * layout.n_embd * 4
        return layout

    def _serve(self, stage: Stage) -> None:
        """Hold STAGE: its stage loop and data endpoint, and a capability that offers it."""
        self.stage = stage
        info = stage.info()
        self.info = info
        self.capability = dict(self._common_capability(info.n_layer, info.arch, info.n_embd, info.n_vocab),
                               layers=[info.layer_start, info.layer_end], backend=info.backend, device=info.device,
                               admitted_bytes=info.model_bytes + info.kv_bytes + info.compute_bytes,
                               # what the stage holds: a pool a model cannot share holds fewer sessions
                               n_ctx=info.n_ctx, max_sessions=info.max_sessions)
        self.capability.pop("kv_pool_floor", None)   # (the pool it took)
        self.capability.pop("kv_pool", None)
        if info.pool_cells:
            self.capability["kv_pool"] = info.pool_cells
        if info.is_head:   # the coordinator refuses a text too long for any context before sending it here
            self.capability["max_token_bytes"] = max(len(stage.detokenize_bytes([t])) for t in range(info.n_vocab))
        self.max_payload = max(info.n_batch * info.seam_width, 1) * 4
        curve = None
        if self.config.keys is not None:
            # the data endpoint lets in the coordinator, and each session's previous stage
            # once the coordinator has named it at open
            self.gatekeeper = self.gatekeeper or Gatekeeper(self.ctx, {self.config.coordinator_key})
            curve = DataCurve(self.config.keys, self.config.coordinator_key, self.gatekeeper)
        timeline = Timeline(LayerRange(info.layer_start, info.layer_end).label) if self.config.trace else None
        # a group's leader: every call that changes its stage goes to its follower too
        self.loop = StageLoop(GroupStage(stage, [self.group.control]) if self.group else stage,
                              self.ctx, self.results_endpoint, self.config.data_bind,
                              self.config.max_queue_for(info.max_sessions),
                              self.max_payload, test_fault=TEST_FAULT, cpu=self.config.cpu, curve=curve,
                              timeline=timeline, spin_ms=self.config.spin_ms_on(len(os.sched_getaffinity(0))),
                              prefix_store=None if self.group else self._prefix_store(info),
                              # drafts need every stage of the model to drop the rows it refuses
                              rolls_back=not any(m.state_bytes for m in layer_memory(self.config.model_path)))
        self.capability["data_endpoint"] = advertised(self.loop.data_endpoint, self.config.coordinator)

    def _prefix_store(self, info) -> PrefixStore | None:
        """The store of ended sessions' memory, where reusing it gives the same tokens."""
        why_not = store_refusal(self.config.prefix_cache_mib, self.config.numerics_class,
                                       layer_memory(self.config.model_path, self.config.kv_type)[info.layer_start:info.layer_end])
        capacity = store_capacity(self.config.prefix_cache_mib, self.config.mem,
                                  info.model_bytes + info.kv_bytes + info.compute_bytes)
        if why_not is None and capacity == 0:
            why_not = "the stage leaves none of --mem to it"
        if why_not is not None:
            log.info("no prefix cache on layers [%d,%d): %s", info.layer_start, info.layer_end, why_not)
            return None
        return PrefixStore(capacity)

    # connection

    def _connect(self) -> None:
        self.link.connect(max_frame=2 * (self.max_control_payload + P.MAX_HEADER_BYTES))
        self._announce()

    def _announce(self) -> None:
        """READY with our epoch: a coordinator that had sessions here under an older one
        knows they are gone."""
        self._send(P.encode(P.READY, 0, capability=self.capability, epoch=self.epoch))

    def _forgive_own_stop(self, stopped_for: float) -> bool:
        """The coordinator's silence while this process was stopped (SIGSTOP, a laptop's
        suspend, a swap storm) was ours; what it sent meanwhile is still to be read."""
        if stopped_for:
            self.link.coordinator_alive.heard()
        return bool(stopped_for)

    def _coordinator_lost(self) -> None:
        """Its sessions are over: free them and drop the replies still owed to it."""
        self._submit(Job(JobKind.RELEASE_ALL, 0, self.epoch))
        self.holds_sessions = False
        self.epoch += 1
        if self.loop is not None:
            self.loop.epoch = self.epoch
        self.recent_rids.clear()

    def _send(self, frames: list) -> None:
        self.link.send(frames)

    # requests

    def _refuse(self, rid, code: str, message: str, sid=None) -> None:
        self.errors[code] += 1
        self._send(P.error_frames(rid, code, message, sid=sid))

    def _handle(self, frames: list) -> None:
        try:
            msg = P.decode(frames, self.max_control_payload)
        except P.ProtocolError as e:
            self._refuse(e.rid, e.code, e.message, e.sid)
            return
        self.link.coordinator_alive.heard()
        if msg.type == P.HEARTBEAT:
            return
        if msg.type == P.DISCONNECT:
            # the coordinator has forgotten us, and with us the sessions it had here: they
            # are over (it replays them, on us again once we are back). It says so once per
            # message of ours it did not know: only the first finds sessions to drop
            if self.holds_sessions:
                self._coordinator_lost()
            self._announce()
            return
        self.requests[msg.type] += 1
        if msg.rid in self.recent_rids:
            self._refuse(msg.rid, E.DUPLICATE_REQUEST, f"request id {msg.rid} was already used", msg.get("sid"))
            return
        self.recent_rids[msg.rid] = None
        if len(self.recent_rids) > RECENT_RIDS:
            self.recent_rids.popitem(last=False)

        handler = self.handlers.get(msg.type)
        if handler is None:
            self._refuse(msg.rid, E.UNKNOWN_TYPE, f"a worker does not serve '{msg.type}' messages")
            return
        try:
            handler(msg)
        except MeshnetError as e:
            self._refuse(msg.rid, e.code, e.message, msg.get("sid"))

    def _submit(self, job: Job | None) -> None:
        if self.loop is None:
            return   # holds nothing: no session to release, no loop to stop
        self.loop.submit(job)
        self.results.send(b"", flags=zmq.NOBLOCK)   # wake the stage loop

    def _queue(self, job: Job) -> None:
        """Hand a job to the stage loop, or refuse it with `busy` when its kind's bound
        is reached: no kind of request can grow the worker's memory without end."""
        queue_kind = job.kind.queue
        if self.queued[queue_kind] >= self.queue_limits[queue_kind]:
            raise MeshnetError(E.BUSY, f"{self.queued[queue_kind]} {queue_kind} requests are already waiting; "
                               "try again later")
        self.queued[queue_kind] += 1
        self._submit(job)

    def _stage_loop(self) -> StageLoop:
        if self.loop is None:
            if self.loading is not None:
                raise MeshnetError(E.UNASSIGNED, "this worker holds no layers yet: it is loading its range")
            raise MeshnetError(E.UNASSIGNED, "this worker holds no layers yet: it waits for the coordinator to "
                               "assign it a range")
        return self.loop

    def _assign(self, msg: P.Message) -> None:
        """Load the range the coordinator planned for this worker, in a thread: the socket
        loop goes on with heartbeats meanwhile. The reply comes when the stage is loaded,
        then a READY that offers it."""
        if self.loop is not None or self.loading is not None or self.config.layers is not None:
            raise MeshnetError(E.INVALID_ARGUMENT, "this worker already holds or is loading a range; a range is "
                               "assigned once, to a worker started with --layers auto")
        start, end = msg["layers"]
        if end > self.cost.n_layer:
            raise MeshnetError(E.BAD_RANGE, f"layers [{start},{end}) are outside the model's {self.cost.n_layer}")
        need = stage_need(self.cost, start, end, self._settings())
        if need > self.config.mem:
            raise MeshnetError(E.MODEL_DOES_NOT_FIT, f"layers [{start},{end}) need {format_size(need)}; this worker "
                               f"admits {format_size(self.config.mem)} (--mem)")
        self._start_loading(msg.rid, (start, end))

    def _start_loading(self, rid: int | None, layers: tuple[int, int]) -> None:
        """Load LAYERS in a thread: the socket loop goes on with heartbeats and health
        meanwhile. RID: the ASSIGN to answer when it is done (None: the range of --layers)."""
        future: Future = Future()

        def load():
            try:
                if self.config.fetch is not None:
                    self._fetch(layers)
                future.set_result(self._load(layers))
            except BaseException as e:  # handed to the socket loop, which answers with it
                future.set_exception(e)
        threading.Thread(target=load, name="meshnet-load", daemon=True).start()
        self.loading = (rid, future)

    def _finish_loading(self) -> None:
        rid, future = self.loading
        self.loading = None
        try:
            stage = future.result()
        except Exception as e:
            error = e if isinstance(e, MeshnetError) else MeshnetError(E.MODEL_LOAD, f"loading the range failed: {e}")
            if rid is None:   # the range it was started for: nothing else to serve
                self.load_error, self.stopping = error, True
            else:
                # the coordinator keeps it out of the route with this reason; its operator reads it here
                print(f"meshnet worker: could not take the range assigned: {error}; this worker stays out of the "
                      "route", file=sys.stderr, flush=True)
                self._refuse(rid, error.code, error.message)
            return
        self._serve(stage)
        self.loop.start()
        self.poller.register(self.results, zmq.POLLIN)
        if rid is not None:
            self._send(P.encode(P.OK, rid))
        self._announce()

    def _health(self, msg: P.Message) -> None:
        # answered here, never queued behind work: the stage loop's last snapshot of the
        # stage plus the socket loop's own counters
        if self.loop is None:
            self._send(P.encode(P.OK, msg.rid, info=dict(
                requests=dict(self.requests), errors=dict(self.errors), stopping=self.stopping, rss_bytes=rss_bytes(),
                state=("fetching" if self.fetch_progress is not None else "loading") if self.loading
                else "waiting for a range",
                **({"fetch_progress": round(self.fetch_progress, 4)} if self.fetch_progress is not None else {}),
                **({"load_progress": round(self.load_progress, 4)} if self.loading and self.load_progress is not None
                   else {}))))
            return
        stats = dict(self.loop.stats)
        stats["mechanisms"] = dict(stats.get("mechanisms", {}), control=security.mechanism(self.link.dealer))
        stats["step_s"] = round(self.loop.step_seconds(), 3)
        errors = collections.Counter(stats.pop("errors", {}))
        errors.update(self.errors)
        self._send(P.encode(P.OK, msg.rid, info=dict(
            stats, requests=dict(self.requests), errors=dict(errors), stopping=self.stopping,
            queue_depth=stats.get("waiting", 0), queued=dict(self.queued), rss_bytes=rss_bytes(),
            load_progress=1.0, load_seconds=self.load_seconds)))

    def _capability(self, msg: P.Message) -> None:
        self._send(P.encode(P.OK, msg.rid, info=self.capability))

    def _control(self, msg: P.Message) -> None:
        if msg.type == P.OPEN and self.stopping:
            raise MeshnetError(E.SHUTTING_DOWN, "this worker is shutting down and takes no new sessions")
        self._stage_loop()
        if msg.type == P.OPEN:
            msg.fields["reply"] = reachable(msg["reply"], self.config.coordinator)
            self.holds_sessions = True
        self._queue(Job(JobKind(msg.type), msg.rid, self.epoch, sid=msg["sid"], msg=msg))

    def _cancel(self, msg: P.Message) -> None:
        self._stage_loop()
        sid = msg["sid"]
        self._queue(Job(JobKind.CANCEL, msg.rid, self.epoch, sid=sid))
        self.loop.cancel(sid)  # after the job is queued: its job is what forgets the cancel again

    def _tokenize(self, msg: P.Message) -> None:
        self._stage_loop()
        self._queue(Job(JobKind.TOKENIZE, msg.rid, self.epoch, msg=msg))

    def _detokenize(self, msg: P.Message) -> None:
        self._stage_loop()
        self._queue(Job(JobKind.DETOKENIZE, msg.rid, self.epoch, msg=msg))

    def _template(self, msg: P.Message) -> None:
        self._stage_loop()
        self._queue(Job(JobKind.TEMPLATE, msg.rid, self.epoch, msg=msg))

    def _chat(self, msg: P.Message) -> None:
        self._stage_loop()
        self._queue(Job(JobKind.CHAT, msg.rid, self.epoch, msg=msg))

    def _shutdown(self, msg: P.Message) -> None:
        self._send(P.encode(P.OK, msg.rid))
        self.stopping = True

    def _relay_result(self) -> None:
        epoch_frame, kind_frame, *frames = self.results.recv_multipart()
        # a session's failure and the worker's own jobs were in no bounded queue
        queue_kind = None if kind_frame == SESSION_FAILED else JobKind(kind_frame.decode()).queue
        if queue_kind is not None:
            self.queued[queue_kind] -= 1
        if int.from_bytes(epoch_frame, "little") == self.epoch:
            self._send(frames)

    # the loop

    def run(self) -> int:
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        self._connect()
        pacer = Pacer(self.config.heartbeat_interval)
        poller = self.poller = zmq.Poller()
        if self.loop is not None:
            self.loop.start()
            poller.register(self.results, zmq.POLLIN)
        self._watch_link()
        interval_ms = int(self.config.heartbeat_interval * 1000)
        awake = Wakefulness(self.config.heartbeat_interval)
        while True:
            events = dict(poller.poll(LOADING_POLL_MS if self.loading else interval_ms))
            self._forgive_own_stop(awake.stopped_for())
            if self.loading is not None and self.loading[1].done():
                self._finish_loading()
            if self.results in events:
                while self.results.poll(0):
                    self._relay_result()
            if self.link.dealer in events:
                frames, why = P.recv_frames(self.link.dealer, 2, self.max_control_payload + P.MAX_HEADER_BYTES)
                if why is not None:
                    self._refuse(None, E.OVERSIZED, why)
                else:
                    self._handle(frames)
            # (a load under way is not waited for: it holds no session, and may take minutes)
            if self.stopping and (self.loading is not None
                                  or (sum(self.queued.values()) == 0 and not (self.loop and self.loop.jobs))):
                break
            if self.link.monitor in events:
                self.link.on_event()
            if self.link.given_up():
                self._coordinator_lost()
                for sock in (self.link.dealer, self.link.monitor):
                    poller.unregister(sock)
                self._connect()  # announces us on the new socket
                self._watch_link()
            elif self.link.coordinator_alive.dead() and not self._forgive_own_stop(awake.stopped_for()):
                # nothing here blocks: the socket stays (libzmq reconnects it), heartbeats go on
                self._coordinator_lost()
                self.link.renew_liveness()
                self._announce()  # dropped unless connected
            if pacer.due():
                self._send(P.encode(P.HEARTBEAT, 0))
                if self._group_broken():
                    break
        self._stop()
        for error in (self.load_error, self.group_error):
            if error is not None:
                raise error
        return 0

    def _group_broken(self) -> bool:
        """A leader whose follower is gone, or whose group's passes failed, leaves the route
        (GOODBYE): the coordinator then fails its sessions over as for any lost stage."""
        if self.group is None or self.loop is None:
            return False
        why = self.group.lost() or self.loop.stage.broken
        if why:
            self.group_error = MeshnetError(E.TP_EXCHANGE, f"this worker's tensor-parallel group broke: {why}")
            print(f"meshnet worker: {self.group_error.message}; leaving the route", file=sys.stderr, flush=True)
        return bool(why)

    def _watch_link(self) -> None:
        self.poller.register(self.link.dealer, zmq.POLLIN)
        self.poller.register(self.link.monitor, zmq.POLLIN)

    def _stop(self) -> int:
        self._submit(Job(JobKind.RELEASE_ALL, 0, self.epoch))
        self._submit(None)
        if self.loop is not None:
            self.loop.join(timeout=30)
            if self.loop.timeline is not None:
                self.loop.timeline.write(self.config.trace)
        self._send(P.encode(P.GOODBYE, 0))
        time.sleep(0.05)  # let the goodbye leave before the socket closes
        self.link.close(linger=100)
        self.results.close(linger=0)
        if self.gatekeeper is not None:
            self.gatekeeper.stop()
        self.ctx.term()
        if self.stage is not None:
            self.stage.close()
        if self.group is not None:
            self.group.close()
        return 0
