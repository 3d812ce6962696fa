"""The coordinator: the registry of stage workers and every session's route through
them, behind a thread-safe API.

This file is the facade callers use (the CLI, serve, the local cluster, tests). The
work is done in one I/O thread (io_loop.py) over plain tables: the registry
(registry.py), the requests in flight (requests.py), standby planning (standby.py)
and the sessions (sessions.py, with no I/O). At open the coordinator gives each stage of
a session its next hop and the session's key; from then on activations go head -> ...
-> tail directly, and the tail sends each token here and, in decode, the next step
straight back to the head (a ring): the coordinator is off the per-token path. It feeds
the prompt to the head in bounded chunks and follows each session with the generation
state machine (core/generation.py), whose stop rule the tail applies too.
"""

from __future__ import annotations

import collections
import itertools
import json
import queue
import secrets
import threading
import time
from concurrent.futures import Future
from typing import Callable, Iterator

import msgpack
import numpy as np

from meshnet.core import errors as E
from meshnet.core.errors import MeshnetError
from meshnet.core.generation import Generation, StopRule
from meshnet.core.logprobs import MAX_TOP
from meshnet.core.metrics import percentiles
from meshnet.core.sampling import Sampling
from meshnet.core.text import utf8_or_error
from meshnet.net import protocol as P
from meshnet.route.config import CoordinatorConfig
from meshnet.route.io_loop import IOLoop
from meshnet.route.registry import WorkerRecord
from meshnet.route.events import CallerEvent, Done, Failed, TokenEvent
from meshnet.route.tracker import StageOffer

# a text request (tokenize, template, detokenize) is sent this many times at most while
# the workers it goes to are lost under it
TEXT_TRIES = 3


class SessionEvents(queue.Queue):
    """A session's events for its caller; `ended` is set with the last one, so that a
    caller waiting for the whole result sleeps until then instead of waking per token."""

    def __init__(self):
        super().__init__()
        self.ended = threading.Event()

    def put(self, item: CallerEvent, block=True, timeout=None):
        super().put(item, block, timeout)
        if not isinstance(item, TokenEvent):
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
        self.logprobs: list[tuple[float, list]] = []   # with logprobs: each token's (see TokenEvent)
        self.text = b""
        self.metrics: dict = {}
        self.stop_reason: str | None = None
        self.cached_tokens = 0               # prompt tokens the route restored from stored prefixes, not computed
        self._done = False

    def __iter__(self) -> Iterator[TokenEvent]:
        return self._events_until(None)

    def _events_until(self, deadline: float | None) -> Iterator[TokenEvent]:
        while not self._done:
            try:
                event = self._events.get(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise MeshnetError(E.TIMEOUT, f"session {self.sid} gave no result in time", session=self.sid) from None
            if isinstance(event, TokenEvent):
                self.cached_tokens = event.cached
                self.tokens.append(event.token)
                self.text += event.piece
                if event.logits is not None:
                    self.logits.append(event.logits)
                if event.logprob is not None:
                    self.logprobs.append(event.logprob)
                yield event
            elif isinstance(event, Done):
                self._done = True
                self.stop_reason, self.metrics, self.token_times = event.reason, event.metrics, event.token_times
                if self.metrics.get("mixed_route"):
                    self.metrics["drift"] = self.coordinator.drift(self.prompt_tokens, self.tokens, self.logits,
                                                                   self.metrics.get("numerics"))
            else:
                assert isinstance(event, Failed)
                self._done = True
                raise event.error

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
    def __init__(self, config: CoordinatorConfig | None = None, *, drift_meter=None):
        self.config = config or CoordinatorConfig()
        # the whole model a mixed route is measured against (evidence.drift.DriftMeter, or
        # anything with its measure and close), handed in: the route loads no model itself
        self.drift_meter = drift_meter
        self._sids = itertools.count(secrets.randbits(40))
        self._io = IOLoop(self.config)
        self.endpoint = self._io.sockets.endpoint
        self.data_endpoint = self._io.sockets.data_endpoint

    # the sockets, for a check of their security mechanism
    router = property(lambda self: self._io.sockets.router)
    data = property(lambda self: self._io.sockets.data)
    pushes = property(lambda self: self._io.sockets.pushes.sockets)

    def close(self) -> None:
        self._io.close()
        if self.drift_meter is not None:
            self.drift_meter.close()
            self.drift_meter = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def alive(self) -> bool:
        """Whether the I/O thread runs (a bug in it must not stop it)."""
        return self._io.alive()

    def set_resume_wait(self, seconds: float) -> None:
        """How long a session that lost a stage waits for a new route, from now on."""
        self._io.submit(lambda f: f.set_result(setattr(self._io.table, "resume_wait", seconds))).result(5)

    def counters(self) -> collections.Counter:
        """The coordinator's counters, as the I/O thread has them now (0 for a count never made)."""
        return self._io.submit(lambda f: f.set_result(collections.Counter(self._io.counters))).result(5)

    def timeline(self) -> dict | None:
        """The spans of the tokens received so far (core/trace.py), when started with trace."""
        timeline = self._io.timeline
        return None if timeline is None else self._io.submit(lambda f: f.set_result(timeline.to_dict())).result(5)

    def route(self) -> list[StageOffer]:
        """The current route, or MeshnetError(route_incomplete) saying why there is none."""
        return self._io.submit(lambda f: f.set_result([w.offer for w in self._io.registry.route()])).result(5)

    def drift(self, prompt_tokens: list[int], tokens: list[int], logits: list, numerics_class: str | None) -> dict:
        """A mixed route's run against the whole model (the reference model given), per
        step; the whole model computes in the numerics class the session ran in."""
        if self.drift_meter is None:
            return {"measured": False, "why": "no whole model to compare with: give the coordinator a reference "
                                               "model (meshnet coordinator --reference MODEL)"}
        return dict(self.drift_meter.measure(prompt_tokens, tokens, logits, numerics=numerics_class), measured=True)

    def route_report(self) -> dict:
        """The route (or why there is none) and why each registered worker is not in it."""
        return self._io.submit(lambda f: f.set_result(self._io.registry.report())).result(5)

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
            f.set_result([dict(w.capability.to_wire(), name=w.name, sessions=self._io.table.sessions_on(w.identity))
                          for w in self._io.registry.all()])
        return self._io.submit(snap).result(5)

    def generate(self, prompt_tokens: list[int], max_tokens: int, *, want_logits: bool = False,
                 stop_at_eog: bool = True, prefill_chunk: int | None = None,
                 sampling: Sampling | None = None, speculate: int | None = None,
                 logprobs: int | None = None, cache_scope: str = "") -> SessionHandle:
        """A new session: its tokens come from the tail, the most likely ones or, with
        sampling, llama.cpp's sampler chain's (seeded: the same on any route). SPECULATE:
        drafts per round at most for this session (None: the coordinator's --speculate).
        LOGPROBS: each token's log-probability and those of this many most likely tokens,
        in the handle's logprobs (0 to 20; None: none). CACHE_SCOPE: the session starts from
        the prefixes kept by sessions of the same scope only, and keeps its own for them."""
        if logprobs is not None and not (isinstance(logprobs, int) and 0 <= logprobs <= MAX_TOP):
            raise MeshnetError(E.INVALID_ARGUMENT, f"logprobs must be None or a count of 0 to {MAX_TOP}, "
                               f"not {logprobs!r}")
        gen = Generation(list(prompt_tokens), StopRule(max_tokens, stop_at_eog), prefill_chunk or self.config.prefill_chunk,
                         tail_feeds_head=True)   # checks the request before anything starts
        sampling = None if sampling is None or sampling.greedy else sampling
        sid = next(self._sids)
        events = SessionEvents()
        self._io.submit(lambda f: self._io.start_session(sid, events, gen, want_logits, sampling, speculate, logprobs,
                                                         cache_scope))
        return SessionHandle(self, sid, events, list(prompt_tokens))

    def cancel(self, sid: int) -> None:
        self._io.submit(lambda f: self._io.cancel_session(sid))

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

    def chat_apply(self, request: dict, timeout: float = 30.0, limit: int | None = None) -> dict:
        """The model's own template over an OpenAI chat request with its tools, by llama.cpp's
        common chat code on the head (Stage.chat_apply): the prompt, the grammar its answer
        is held to and the format it is parsed back by. With a limit (in tokens), a request
        whose text alone is longer than that many tokens could be is refused with
        context_full before it is sent."""
        data = json.dumps(request, ensure_ascii=False).encode("utf-8", errors="surrogatepass")
        answer = self._query_stage(0, P.CHAT, {}, payload=data,
                                   check=_fits(len(data), limit, "the messages' text", "messages")).result(timeout)
        return json.loads(answer)

    def detokenize(self, tokens: list[int], timeout: float = 30.0) -> str:
        answer = self._query_stage(-1, P.DETOKENIZE, {}, payload=P.tokens_frame(list(tokens))).result(timeout)
        return answer.decode("utf-8", errors="replace")

    def stage_stats(self, timeout: float = 10.0) -> list[dict]:
        """HEALTH of every registered worker (KV in use, sessions, queue depth), in layer order."""
        def ask(f):
            futures = [self._io.query(w, P.HEALTH, {}) for w in self._io.registry.in_layer_order()]
            f.set_result(futures)
        futures = self._io.submit(ask).result(timeout)
        return [dict(fut.result(timeout)) for fut in futures]

    def metrics(self, timeout: float = 2.0) -> dict:
        """Every stage's numbers (the worker's own, from HEALTH, and the hops measured
        here) and the coordinator's counters: what `meshnet status` and /metrics show.
        Answers within `timeout` from what is known: a worker that does not answer its
        HEALTH in time is shown as silent, with how long since it was last heard."""
        deadline = time.monotonic() + timeout

        def ask(f):
            workers = self._io.registry.in_layer_order()
            in_route, kept_out, route_error = self._io.registry.membership()   # and why each is not in it
            mine = [{
                "stage": w.label, "worker": w.name, "seam_bytes": w.seam_bytes, "replies": w.replies,
                "reply_errors": dict(w.errors), "last_heard_s": round(w.liveness.silent_for(), 3),
                "in_route": w.name in in_route, "backend": w.capability.backend, "device": w.capability.device,
                # the host it serves its stage from, as it told the coordinator
                "host": (w.capability.data_endpoint or "").split("://")[-1].rsplit(":", 1)[0] or None,
                "kept_out": kept_out.get(w.name) or (None if w.name in in_route else route_error or w.standby_state),
                **{f"hop_us_{k}": v for k, v in percentiles(w.hops_us).items()},
            } for w in workers]
            f.set_result((mine, [self._io.query(w, P.HEALTH, {}) for w in workers], dict(self._io.counters), route_error))
        mine, futures, counters, route_error = self._io.submit(ask).result(timeout)
        if self._io.sockets.gatekeeper is not None:
            counters["refused_peers"] = self._io.sockets.gatekeeper.refusals
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
        resume_ms = percentiles(list(self._io.table.resume_ms))
        resumes = {"count": counters.get("resumes", 0), "replayed_tokens": counters.get("replayed_tokens", 0),
                   "ms_p50": resume_ms["p50"], "ms_p99": resume_ms["p99"]}
        failovers = self._io.submit(lambda f: f.set_result(list(self._io.table.failovers))).result(timeout)
        return {"stages": stages, "sessions": sessions, "counters": counters, "resumes": resumes,
                "route_error": route_error, "failovers": failovers}

    def shutdown_workers(self) -> None:
        def ask(f):
            for w in self._io.registry.all():
                self._io.query(w, P.SHUTDOWN, {})
            f.set_result(None)
        self._io.submit(ask).result(5)

    def _query_stage(self, index: int, msg_type: str, fields: dict, payload=None,
                     check: Callable[[list[WorkerRecord]], None] | None = None) -> Future:
        """A request to the route's stage INDEX; CHECK, given the route, may refuse it
        first (with a MeshnetError) from what the stages' capabilities say. A text request
        holds no state on the stage, so one whose worker is lost before it answers goes
        to the route's stage again (a spare may hold it now), TEXT_TRIES times at most:
        a request must not fail for a worker that dies while a spare stands by."""
        outer: Future = Future()

        def ask(f, tries_left: int):
            try:
                route = self._io.registry.route()
                if check is not None:
                    check(route)
            except MeshnetError as e:
                outer.set_exception(e)
                return
            inner = self._io.query(route[index], msg_type, fields, payload)

            def answered(i: Future) -> None:
                error = i.exception()
                if isinstance(error, MeshnetError) and error.code == E.STAGE_LOST and tries_left > 1:
                    self._io.counters["text_retries"] += 1
                    send(tries_left - 1)
                elif error is not None:
                    outer.set_exception(error)
                else:
                    outer.set_result(i.result())
            inner.add_done_callback(answered)

        def send(tries_left: int) -> None:
            submitted = self._io.submit(lambda f: ask(f, tries_left))
            # a failure inside ask itself must reach the caller, not leave it waiting
            submitted.add_done_callback(lambda f: f.exception() and not outer.done() and outer.set_exception(f.exception()))
        send(TEXT_TRIES)
        return outer


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
        per_token = route[0].capability.max_token_bytes
        if limit and per_token and size > limit * 2 * max(per_token, 32):
            raise MeshnetError(E.CONTEXT_FULL, f"{what} is {size} bytes, so at least {size // (2 * max(per_token, 32))} "
                               f"tokens: more than {limit}", field=field)
    return check
