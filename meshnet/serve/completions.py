"""One completion of `meshnet serve`, from a checked request to its answer: a session
slot counted against the stages' --max-sessions (waited for in admission.py's queue),
the prompt's tokens within the context, a session iterated by a thread of its own (the
coordinator's API blocks) that hands its events to the request's asyncio queue, stop
strings, and the answer whole or as server-sent events; a stream that waits long for
its first token gets keep-alive comments meanwhile."""

from __future__ import annotations

import asyncio
import codecs
import hashlib
import json
import secrets
import threading
import time

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from meshnet.core import errors
from meshnet.core.errors import MeshnetError
from meshnet.core.sampling import Sampling
from meshnet.serve.admission import Admission, ClientGone
from meshnet.serve.openai import ApiError, choice, logprobs_of, sampling_of, sse
from meshnet.serve.tools import ToolRequest, plan_of

SETTLE_S = 2.0
DISCONNECT_POLL_S = 0.5  # how soon a client gone (not streaming, or during a long prompt) frees its session
# A stream whose first token has not come this soon (it waits for a slot, or its prompt is
# long) is answered 200 at once, and an SSE comment goes every KEEPALIVE_S until it comes:
# clients and proxies (nginx's 60 s read timeout) see a live connection. An error after
# that goes in the stream, as one after the first token does.
KEEPALIVE_AFTER_S = 2.0
KEEPALIVE_S = 5.0


class StopScanner:
    """Cuts the text before the first stop string. Text that could be the start of one is
    held back until the next piece says whether it is, so a stop string is never shown."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.hit: str | None = None   # the stop string the text ended at

    def feed(self, text: str) -> tuple[str, bool]:
        self.held += text
        hits = [(i, s) for i, s in ((self.held.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            at, self.hit = min(hits, key=lambda h: h[0])
            out, self.held = self.held[:at], ""
            return out, True
        keep = max((k for s in self.stops for k in range(1, len(s)) if self.held.endswith(s[:k])), default=0)
        out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return out, False

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


class Session:
    """One generation, iterated by a thread of its own; its events (token, done, error)
    reach the request through an asyncio queue. The slot is given back once the
    coordinator has ended the session."""

    def __init__(self, coordinator, tokens: list[int], max_tokens: int, sampling: Sampling | None, slots: Admission,
                 logprobs: int | None = None, scope: str = ""):
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.lock = threading.Lock()
        self.handle = None
        self.cancelled = False
        self.reason: MeshnetError | None = None   # why this server cancelled it, if it did
        self._get: asyncio.Future | None = None
        self._check_at = time.monotonic() + DISCONNECT_POLL_S
        slots.hold(self)
        threading.Thread(target=self._run, args=(coordinator, tokens, max_tokens, sampling, logprobs, scope, slots),
                         name="meshnet-serve-session", daemon=True).start()

    def _put(self, kind: str, value) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:
            pass   # the server has stopped: nobody listens

    def _run(self, coordinator, tokens, max_tokens, sampling, logprobs, scope, slots) -> None:
        final = ("error", MeshnetError(errors.CANCELLED, "the request was cancelled"))
        try:
            with self.lock:
                if not self.cancelled:
                    self.handle = coordinator.generate(tokens, max_tokens, sampling=sampling, logprobs=logprobs,
                                                       cache_scope=scope)
            if self.handle is not None:
                for event in self.handle:
                    self._put("token", event)
                final = ("done", self.handle.stop_reason)
        except Exception as e:   # the session's error, generate's own checks of the request, and what nobody foresaw
            final = ("error", e if isinstance(e, MeshnetError) else MeshnetError(errors.INTERNAL, repr(e)))
        finally:
            slots.give(self)   # before the last event: whoever has seen it finds the slot free
            self._put(*final)

    def cancel(self, reason: MeshnetError | None = None) -> None:
        """Ends the session on every stage (its KV is freed); a CANCELLED error follows."""
        with self.lock:
            self.cancelled = True
            self.reason = self.reason or reason
            handle = self.handle
        if handle is not None:
            handle.cancel()

    def close(self) -> None:
        """Drops a wait for the next event that nobody will read."""
        if self._get is not None:
            self._get.cancel()
            self._get = None

    async def settle(self) -> None:
        """Wait (a little at most) until the coordinator has ended the session."""
        deadline = time.monotonic() + SETTLE_S
        try:   # (asyncio.timeout would do, from Python 3.11; meshnet runs on 3.10)
            while (await asyncio.wait_for(self.events.get(), max(0.0, deadline - time.monotonic())))[0] == "token":
                pass
        except asyncio.TimeoutError:
            pass

    async def next(self, request: Request) -> tuple[str, object]:
        """The next event; ClientGone if the client went away while waiting for it."""
        if self._get is None:
            self._get = asyncio.ensure_future(self.events.get())
        while True:
            if time.monotonic() >= self._check_at:   # tokens may come quicker than this: not only on a wait
                self._check_at = time.monotonic() + DISCONNECT_POLL_S
                if await request.is_disconnected():
                    raise ClientGone()
            done, _ = await asyncio.wait({self._get}, timeout=DISCONNECT_POLL_S)
            if done:
                event, self._get = self._get.result(), None
                return event


class Answer:
    """The text of one answer, piece by piece as it may be shown, and how it ended; with
    logprobs, each token's (take_logprobs: those of the tokens since the last call)."""

    def __init__(self, session: Session, first, stops: list[str], logprobs: bool = False, report: dict | None = None):
        self.session, self.first = session, first
        self.report = report   # what OpenAI's shape has no place for, for another API's: the stop string hit
        self.scanner = StopScanner(stops)
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.n_tokens = 0
        self.finish_reason: str | None = None
        self.logprobs: list | None = [] if logprobs else None   # (piece, logprob, top) of tokens not yet taken
        self.text_offset = 0   # the text given before the entries not yet taken

    def take_logprobs(self, text: str = "") -> tuple[list | None, int]:
        """The entries of the tokens since the last call and where their text starts; TEXT:
        what the caller gives with them."""
        if self.logprobs is None:
            return None, 0
        entries, offset = self.logprobs, self.text_offset
        self.logprobs, self.text_offset = [], offset + len(text)
        return entries, offset

    async def texts(self, request: Request):
        event, ended = self.first, False
        try:
            while True:
                kind, value = event
                if kind == "error":
                    raise self.session.reason or value
                if kind == "token":
                    self.n_tokens += 1
                    if self.logprobs is not None and value.logprob is not None:
                        self.logprobs.append((value.piece, value.logprob[0], value.logprob[1]))
                    text, stopped = self.scanner.feed(self.decoder.decode(value.piece))
                else:
                    text, stopped = self.scanner.feed(self.decoder.decode(b"", final=True))
                    text += "" if stopped else self.scanner.flush()
                if text:
                    yield text
                if stopped and kind == "token":   # the rest is not wanted: free the session now
                    self.session.cancel()
                    await self.session.settle()
                if stopped or kind == "done":
                    self.finish_reason = "length" if not stopped and value == "length" else "stop"
                    if self.report is not None:
                        self.report["stop_sequence"] = self.scanner.hit
                    ended = True
                    return
                event = await self.session.next(request)
        finally:
            if not ended:   # a client gone, an error: the stages free the session now
                self.session.cancel()
            self.session.close()


def route_limits(coordinator) -> tuple[int, int]:
    """(context, session slots) of the route's stages: the smallest of each."""
    report = coordinator.route_report()
    names = {stage.split("@", 1)[1] for stage in report["route"] or []}
    workers = [w for w in coordinator.workers_snapshot() if w["name"] in names]
    if not workers:
        raise MeshnetError(errors.ROUTE_INCOMPLETE, f"no route over the whole model: {report.get('error') or 'none yet'}")
    return min(w["n_ctx"] for w in workers), min(w["max_sessions"] for w in workers)


class Started:
    """A request admitted and under way: its session and first event, the prompt's tokens,
    the tools its answer may call (PLAN) and what it asked of the answer."""

    def __init__(self, session: Session, first, tokens: list[int], plan, stops: list[str], logprobs: bool,
                 report: dict | None = None):
        self.session, self.first, self.tokens, self.plan = session, first, tokens, plan
        self.stops, self.logprobs, self.report = stops, logprobs, report

    def answer(self) -> Answer:
        return Answer(self.session, self.first, self.stops, logprobs=self.logprobs, report=self.report)


class Completions:
    """The completions of one server: its coordinator, the model it serves, its slots and
    the queue of requests waiting for one."""

    def __init__(self, coordinator, model: str, admission: Admission | None = None):
        self.coordinator, self.model = coordinator, model
        self.slots = admission or Admission()
        self.caps: dict | None = None   # the chat template's capabilities, asked of the head once

    def tool_plan(self, tools: ToolRequest, messages: list[dict], limit: int):
        """How the answer calls TOOLS (serve/tools.py): in the template's own format where
        it has one, else in the generic one. Blocks: run in a thread."""
        if self.caps is None:
            self.caps = self.coordinator.chat_apply({"messages": [{"role": "user", "content": "hi"}]})["caps"]
        return plan_of(tools, self.caps, self.coordinator, messages, limit)

    async def answer(self, request: Request, body, chat: bool, prepare, max_tokens: int | None,
                     tools: bool = False, report: dict | None = None):
        """The response to a checked request. Once it has a slot, PREPARE(limit) (in a
        thread) gives (plan, tokens): the tools the answer may call (serve/tools.py; None:
        none) and the prompt's tokens, at most LIMIT of them. TOOLS: the request has tools,
        whose plan its sampling needs; without them a bad sampling field is refused before
        the request waits for a slot. REPORT, when given, gets the stop string the answer
        ended at (stop_sequence) before its last chunk."""
        if body.model != self.model:
            raise ApiError(404, f"the model '{body.model}' does not exist here: this server serves '{self.model}'",
                           code="model_not_found", param="model")
        if body.n not in (None, 1):   # (n choices are n answers: serve/choices.py)
            raise ApiError(400, f"n must be 1 here, not {body.n}", code=errors.INVALID_ARGUMENT, param="n")
        sampling = None if tools else sampling_of(body)
        start = asyncio.ensure_future(self._start(request, body, chat, prepare, max_tokens, tools, sampling, report))
        handed_on = False   # to a stream that goes on waiting for it
        try:
            if body.stream:
                await asyncio.wait({start}, timeout=KEEPALIVE_AFTER_S)
                if not start.done():   # an error now goes in the stream
                    handed_on = True
                    return _event_stream(_kept_alive(self._stream(request, body, chat, start), KEEPALIVE_S))
            started = await start
        except ClientGone:
            return Response(status_code=499)
        finally:
            if not handed_on and not start.done():   # (this handler was cancelled)
                start.cancel()
        if body.stream:
            return _event_stream(self._stream(request, body, chat, start))
        answer = started.answer()
        try:
            text = "".join([t async for t in answer.texts(request)])
        except ClientGone:
            return Response(status_code=499)
        entries, _ = answer.take_logprobs()
        content, calls = _parsed(started.plan, text) if started.plan is not None else (text, None)
        return dict(self._head(chat, False), usage=_usage(started.tokens, answer),
                    choices=[choice(chat, content, "tool_calls" if calls else answer.finish_reason, False,
                                    logprobs_of(chat, entries), calls)])

    def _head(self, chat: bool, stream: bool) -> dict:
        kind = ("chat.completion.chunk" if stream else "chat.completion") if chat else "text_completion"
        return {"id": ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12), "object": kind,
                "created": int(time.time()), "model": self.model}

    async def _stream(self, request: Request, body, chat: bool, start: asyncio.Future):
        """A streamed answer's events, from a request that may still wait for its start."""
        answer = None
        try:
            try:
                started = await start
            except (ApiError, MeshnetError) as e:
                yield _stream_ended_by(e)
                return
            except ClientGone:
                return
            answer = started.answer()
            head, plan = self._head(chat, True), started.plan
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            if plan is not None and not plan.streams_content:   # (one in JSON is whole first)
                try:
                    text = "".join([t async for t in answer.texts(request)])
                except MeshnetError as e:
                    yield _stream_ended_by(e)
                    return
                except ClientGone:
                    return
                entries, _ = answer.take_logprobs()
                content, calls = _parsed(plan, text)
                events = _whole_events(head, content, calls, "tool_calls" if calls else answer.finish_reason,
                                       logprobs_of(chat, entries),
                                       _usage(started.tokens, answer) if include_usage else None)
            elif plan is not None:
                events = _tool_events(request, answer, head, plan, started.tokens, include_usage)
            else:
                events = _events(request, answer, head, chat, started.tokens, include_usage)
            async for event in events:
                yield event
        finally:
            if not start.done():
                start.cancel()
            elif answer is None and not start.cancelled() and start.exception() is None:
                start.result().session.cancel()   # (never read: its client went away first)
                start.result().session.close()

    async def _start(self, request: Request, body, chat: bool, prepare, max_tokens: int | None, tools: bool,
                     sampling: Sampling | None, report: dict | None) -> Started:
        """A slot (waiting in the queue for one), the prompt, the session and its first
        event: an error before that one is the request's status."""
        n_ctx, n_slots = await run_in_threadpool(route_limits, self.coordinator)
        await self.slots.take(n_slots, request.is_disconnected)
        session = None
        try:
            plan, tokens = await run_in_threadpool(self._prompt, prepare, n_ctx, chat)
            sampling = sampling_of(body, plan) if tools else sampling
            logprobs = body.logprobs_asked()
            stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
            stops += plan.stops if plan is not None else []
            session = Session(self.coordinator, tokens, max_tokens or n_ctx - len(tokens), sampling, self.slots,
                              logprobs, cache_scope(request, body))
        except BaseException:
            if session is None:
                self.slots.give()
            raise
        try:
            first = await session.next(request)
        except BaseException:
            session.cancel()
            session.close()
            raise
        if first[0] == "error":
            raise ApiError.of(session.reason or first[1])
        return Started(session, first, tokens, plan, stops, logprobs is not None, report)

    @staticmethod
    def _prompt(prepare, n_ctx: int, chat: bool):
        """PREPARE's (plan, tokens) within the context: a prompt that cannot leave room for
        one new token is refused by the head's tokenizer, or before it by its length alone,
        so a client's megabytes never hold a stage."""
        try:
            plan, tokens = prepare(n_ctx - 1)
        except MeshnetError as e:
            if e.code != errors.CONTEXT_FULL:
                raise
            raise ApiError(400, f"{e.message}: the context is {n_ctx}", code=errors.CONTEXT_FULL,
                           param="messages" if chat else "prompt") from None
        if len(tokens) >= n_ctx:
            raise ApiError(400, f"the prompt is {len(tokens)} tokens: the context is {n_ctx}",
                           code=errors.CONTEXT_FULL, param="messages" if chat else "prompt")
        return plan, tokens


def _event_stream(events) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _kept_alive(events, every: float):
    """EVENTS, with an SSE comment (which clients skip) whenever none came for EVERY seconds."""
    pending = asyncio.ensure_future(events.__anext__())
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=every)
            if not done:
                yield ": keep-alive\n\n"
                continue
            try:
                event = pending.result()
            except StopAsyncIteration:
                return
            yield event
            pending = asyncio.ensure_future(events.__anext__())
    finally:
        if not pending.done():
            pending.cancel()
            try:
                await pending
            except BaseException:
                pass
        await events.aclose()


def cache_scope(request: Request, body) -> str:
    """Whose kept prefixes a request may start from: those of requests with the same API
    key (the one sent, whether or not the server checks keys) and the same prompt_cache_key,
    or without one the same user. A prefix reused shows in cached_tokens, so a scope any
    client could share would let it learn, block by block, what another's prompts begin with.
    cache_prompt false (llama-server's): a scope of its own, so it starts from no kept prefix."""
    if getattr(body, "cache_prompt", None) is False:
        return secrets.token_hex(16)
    _, _, key = request.headers.get("authorization", "").partition(" ")
    key = key or request.headers.get("x-api-key", "")   # (Anthropic's clients send it so)
    named = ["prompt_cache_key", body.prompt_cache_key] if body.prompt_cache_key is not None else ["user", body.user]
    # a digest: the key itself goes no further than this server's HTTP layer
    return hashlib.blake2b(json.dumps([key.strip(), *named]).encode(), digest_size=16).hexdigest()


def _usage(tokens: list[int], answer: Answer) -> dict:
    handle = answer.session.handle
    return {"prompt_tokens": len(tokens), "completion_tokens": answer.n_tokens,
            "total_tokens": len(tokens) + answer.n_tokens,
            # as OpenAI reports its prompt caching: of prompt_tokens, those not computed again
            "prompt_tokens_details": {"cached_tokens": handle.cached_tokens if handle is not None else 0}}


async def _whole_events(head: dict, content: str | None, calls: list | None, finish: str, logprobs: dict | None,
                       usage: dict | None):
    """A chat answer known whole (one that may call tools) as OpenAI's chunks: the role, the
    content or the calls, the finish, [DONE]."""
    extra = {"usage": None} if usage is not None else {}
    yield sse(dict(head, choices=[dict(choice(True, None, None, True), delta={"role": "assistant", "content": ""})],
                   **extra))
    yield sse(dict(head, choices=[choice(True, content, None, True, logprobs, calls)], **extra))
    yield sse(dict(head, choices=[choice(True, None, finish, True)], **extra))
    if usage is not None:
        yield sse(dict(head, choices=[], usage=usage))
    yield "data: [DONE]\n\n"


def _stream_ended_by(error: MeshnetError) -> str:
    """The events that end a stream on ERROR: after the first token the status is sent,
    so the error goes in the stream, OpenAI-shaped, then [DONE]."""
    return sse(ApiError.of(error).body()) + "data: [DONE]\n\n"


def _parsed(plan, text: str) -> tuple[str | None, list | None]:
    """The whole answer's (content, tool_calls) by PLAN; a text its format cannot take (cut
    short by max_tokens inside a call) is content as it came."""
    try:
        return plan.parse(text)
    except MeshnetError:
        return text, None


async def _tool_events(request: Request, answer: Answer, head: dict, plan, tokens: list[int], include_usage: bool):
    """A chat answer that may call tools, in the template's own format, as OpenAI's chunks:
    the text before any call as it comes (each piece parsed with what came before, so a
    call's start is never shown as text), then the calls, each whole, and the finish."""
    extra = {"usage": None} if include_usage else {}

    def chunk(delta: dict, finish: str | None = None, logprobs: dict | None = None) -> str:
        return sse(dict(head, choices=[{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
                        **extra))

    yield chunk({"role": "assistant", "content": ""})
    text, shown = "", ""
    try:
        async for piece in answer.texts(request):
            text += piece
            try:
                content = plan.parse(text, partial=True)[0] or ""
            except MeshnetError:
                continue   # (a text the parser cannot take yet: the whole one decides)
            if len(content) > len(shown) and content.startswith(shown):
                yield chunk({"content": content[len(shown):]})
                shown = content
    except MeshnetError as e:   # after the first token the status is sent: the error goes in the stream
        yield _stream_ended_by(e)
        return
    except ClientGone:
        return
    content, calls = _parsed(plan, text)
    delta = {}
    if content and content.startswith(shown) and len(content) > len(shown):
        delta["content"] = content[len(shown):]
    if calls:
        delta["tool_calls"] = [dict(call, index=i) for i, call in enumerate(calls)]
    entries, _ = answer.take_logprobs()
    if delta or entries:
        yield chunk(delta, logprobs=logprobs_of(True, entries))
    yield chunk({}, "tool_calls" if calls else answer.finish_reason)
    if include_usage:
        yield sse(dict(head, choices=[], usage=_usage(tokens, answer)))
    yield "data: [DONE]\n\n"


async def _events(request: Request, answer: Answer, head: dict, chat: bool, tokens: list[int], include_usage: bool):
    """The answer as server-sent events, OpenAI's chunks, ending with [DONE]."""
    def chunk(text, finish=None, role=False):
        entries, offset = answer.take_logprobs(text or "") if text else (None, 0)
        piece = choice(chat, text, finish, True, logprobs_of(chat, entries, offset))
        if role:
            piece["delta"] = {"role": "assistant", "content": ""}
        return sse(dict(head, choices=[piece], **({"usage": None} if include_usage else {})))

    if chat:
        yield chunk(None, role=True)
    try:
        async for text in answer.texts(request):
            yield chunk(text)
    except MeshnetError as e:   # after the first token the status is sent: the error goes in the stream
        yield _stream_ended_by(e)
        return
    except ClientGone:
        return
    yield chunk(None, answer.finish_reason)
    if include_usage:
        yield sse(dict(head, choices=[], usage=_usage(tokens, answer)))
    yield "data: [DONE]\n\n"
