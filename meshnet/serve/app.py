"""`meshnet serve`: OpenAI's HTTP API in front of a coordinator.

This file is the HTTP layer only: OpenAI's request and response shapes, its error
bodies and status codes, server-sent events. A generation (chat template, tokenizer,
sampling, end of generation) is the coordinator's, over the stages. What OpenAI's API
has and the coordinator has not is added here: stop strings, usage, and a count of
session slots, so that a request beyond the stages' --max-sessions is refused at once
(429) instead of opening a session that a stage refuses.

The coordinator's API blocks, so each session is iterated by a thread of its own that
hands its events to the request's asyncio queue: concurrent requests are concurrent
sessions, which the stages batch.

A request is checked here before any of it reaches the coordinator: its body's size
(BodyLimit), its types (the pydantic models), then what the types leave open
(check_request): text that UTF-8 cannot encode, a field meshnet does not honour, a chat
message without a role it knows or without content.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import secrets
import signal
import socket
import threading
import time
from pathlib import Path

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from meshnet.core import defaults
from meshnet.core import errors
from meshnet.core.conversation import answer_sampling
from meshnet.core.conversation import prompt_tokens as chat_prompt_tokens
from meshnet.core.errors import MeshnetError
from meshnet.core.metrics import prometheus_text
from meshnet.core.sampling import Sampling
from meshnet.engine import models

RETRY_AFTER_S = 1
SETTLE_S = 2.0
DISCONNECT_POLL_S = 0.5  # how soon a client gone (not streaming, or during a long prompt) frees its session
# The largest request body taken: a bigger one is refused (413) before it is read. It is
# well above any prompt a context holds (a 3,000,000-character prompt is let through, to
# be refused as context_full), and keeps what one request may make the server hold small.
MAX_BODY_BYTES = 4 * 1024 * 1024

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
               405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error"}
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                   "repeat_penalty", "seed")
UNSUPPORTED_FIELD = "unsupported_field"   # the code of a field (or value) meshnet does not honour
TOO_LARGE = "request_too_large"           # the code of a body over MAX_BODY_BYTES
ROLES = ("system", "developer", "user", "assistant")
# OpenAI's request fields that meshnet does not honour, each with the values that mean
# "off" (null, and the default where a client sends it for "off"): a request with one of
# them is answered as it would be without the field; any other value is refused
# (unsupported_field), never ignored, since the answer would not be what was asked. A
# field neither here nor in the request models below is refused whatever its value.
OFF_VALUES = {
    "logprobs": (None, False), "top_logprobs": (None,), "logit_bias": (None, {}), "echo": (None, False),
    "best_of": (None, 1), "suffix": (None,), "response_format": (None, {"type": "text"}),
    "tools": (None, []), "tool_choice": (None, "none"), "parallel_tool_calls": (None, True),
    "functions": (None, []), "function_call": (None, "none"), "store": (None, False), "metadata": (None, {}),
    "service_tier": (None, "auto"), "modalities": (None, ["text"]), "audio": (None,), "prediction": (None,),
    "reasoning_effort": (None,), "verbosity": (None,), "web_search_options": (None,),
    "prompt_cache_key": (None,), "safety_identifier": (None,),
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    @classmethod
    def of(cls, error: MeshnetError) -> "ApiError":
        return cls(errors.http_status(error.code), error.message, code=error.code, param=error.context.get("field"))

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        retry = {"Retry-After": str(RETRY_AFTER_S)} if self.status in (429, 503) else None
        return JSONResponse(self.body(), status_code=self.status, headers=retry)


# ---- request bodies: strict types (a string is not a number). Other fields are kept
# (model_extra) for check_request to take at an off value or refuse, with the field's
# whole name (messages[0].tool_calls), before anything of the request is used.

class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Body):
    include_usage: bool = False


class ContentPart(_Body):
    type: str
    text: str | None = None


class Message(_Body):
    role: str
    content: str | list[ContentPart] | None = None   # (None: check_request says which message lacks it)
    name: str | None = None   # a participant's name: taken, without effect (the chat template has no place for it)


class _Request(_Body):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repeat_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = 1         # (null is what some clients send for "the default")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None   # an end user's id, for OpenAI's abuse monitoring: taken, without effect


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)   # the newer name of max_tokens


class CompletionRequest(_Request):
    prompt: str | list[str]


FIELD_NAMES = frozenset().union(*(model.model_fields for model in (ChatRequest, CompletionRequest, Message,
                                                                    ContentPart, StreamOptions)))


def field_path(loc) -> str:
    """OpenAI's name of the field a pydantic error is about (messages[0].content). The loc
    also names the member of a union that was tried (str, list[str]): the name ends before
    the first part that is neither a field nor an index into one."""
    path = ""
    for part in loc:
        if isinstance(part, int) and path:
            path += f"[{part}]"
        elif isinstance(part, str) and part in FIELD_NAMES:
            path += f".{part}" if path else part
        else:
            break
    return path


def _encodes(text: str) -> bool:
    try:
        text.encode()
        return True
    except UnicodeEncodeError:
        return False


def not_utf8(value) -> tuple[str, bool] | None:
    """Where the first text in a JSON value is that UTF-8 cannot encode: a lone surrogate,
    which JSON's escape "\\ud800" (or CESU's bytes) gives and Python's json takes. (path,
    whether it is the name of a field in the object at path), or None. A loop, not a
    recursion: the body may be nested as deep as json could parse it."""
    todo = [("", "", None, value)]   # (path, the object's path, the name there, value), the next one last
    while todo:
        path, where, name, value = todo.pop()
        if name is not None and not _encodes(name):
            return where, True
        if isinstance(value, str):
            if not value.isascii() and not _encodes(value):
                return path, False
        elif isinstance(value, dict):
            todo.extend(reversed([(f"{path}.{key}" if path else key, path, key, item) for key, item in value.items()]))
        elif isinstance(value, list):
            todo.extend(reversed([(f"{path}[{i}]", path, None, item) for i, item in enumerate(value)]))
    return None


def _is_off(name: str, value) -> bool:
    # of the value's own type: 0 == False and 1 == True, but logprobs 0 is not "off"
    return any(type(value) is type(off) and value == off for off in OFF_VALUES.get(name, ()))


def _refuse_others(part: _Body, where: str = "") -> None:
    """A field beyond the model's is refused, named by its path (where: the path of part);
    at the top, one of OFF_VALUES at an off value is taken."""
    for name, value in (part.model_extra or {}).items():
        if where == "" and _is_off(name, value):
            continue
        offs = OFF_VALUES.get(name) if where == "" else None
        why = (f"is not supported by meshnet serve: leave it out, or send {' or '.join(map(json.dumps, offs))}"
               if offs else "is not a field meshnet serve takes")
        raise ApiError(400, f"{where}{name} {why}", code=UNSUPPORTED_FIELD, param=where + name)


def check_request(body: _Request) -> None:
    """What the types leave open, checked before anything of the request is used (a text
    that UTF-8 cannot encode would fail in the coordinator, or in this error's own body):
    every text encodes; every field is one meshnet honours, or one of OFF_VALUES at an off
    value; every chat message has a role meshnet knows, and content, of text parts only."""
    bad = not_utf8(body.model_dump())
    if bad is not None:
        path, key = bad
        where = f"a field name in {path or 'the body'}" if key else path
        raise ApiError(400, f"{where} is not valid UTF-8: it holds a lone surrogate (\\ud800 to \\udfff), which "
                       "is no character; send text as UTF-8", code=errors.INVALID_ARGUMENT, param=path or None)
    _refuse_others(body)
    if body.stream_options is not None:
        _refuse_others(body.stream_options, "stream_options.")
    for i, m in enumerate(body.messages if isinstance(body, ChatRequest) else []):
        where = f"messages[{i}]"
        _refuse_others(m, where + ".")
        if m.role not in ROLES:
            raise ApiError(400, f"{where}.role must be one of {', '.join(ROLES)}", code=errors.INVALID_ARGUMENT,
                           param=where + ".role")
        if m.content is None:
            raise ApiError(400, f"{where}.content is required: the message's text (or text parts)",
                           code=errors.INVALID_ARGUMENT, param=where + ".content")
        for j, part in enumerate(m.content if isinstance(m.content, list) else []):
            at = f"{where}.content[{j}]"
            if part.type != "text":   # (before its other fields: an image_url part is refused for being one)
                raise ApiError(400, f"{at}.type: only text content parts are supported", code=UNSUPPORTED_FIELD,
                               param=at + ".type")
            _refuse_others(part, at + ".")
            if part.text is None:
                raise ApiError(400, f"{at}.text is required: the part's text", code=errors.INVALID_ARGUMENT,
                               param=at + ".text")


def sampling_of(body: _Request) -> Sampling | None:
    """No temperature: greedy (meshnet's default). A temperature without a seed: a fresh
    seed per request."""
    given = {name: getattr(body, name) for name in SAMPLING_FIELDS if getattr(body, name) is not None}
    if not given:
        return None
    try:
        return answer_sampling(Sampling(**given), "seed" in given)
    except MeshnetError as e:
        raise ApiError(400, e.message, code=e.code, param=e.context.get("field")) from None


def chat_messages(messages: list[Message]) -> list[dict]:
    """OpenAI's messages as the chat template takes them: role and content text (the
    messages as check_request has taken them)."""
    out = []
    for m in messages:
        content = m.content if isinstance(m.content, str) else "".join(part.text for part in m.content)
        out.append({"role": "system" if m.role == "developer" else m.role, "content": content})
    return out


class StopScanner:
    """Cuts the text before the first stop string. Text that could be the start of one is
    held back until the next piece says whether it is, so a stop string is never shown."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        self.held += text
        hits = [i for i in (self.held.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.held = self.held[:min(hits)], ""
            return out, True
        keep = max((k for s in self.stops for k in range(1, len(s)) if self.held.endswith(s[:k])), default=0)
        out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return out, False

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


class Slots:
    """Sessions this server has open, counted against the stages' --max-sessions, and
    the live ones among them, ended at once when the server stops."""

    def __init__(self):
        self.lock = threading.Lock()
        self.active = 0
        self.sessions: set[Session] = set()

    def take(self, limit: int) -> bool:
        with self.lock:
            if self.active >= limit:
                return False
            self.active += 1
            return True

    def hold(self, session: "Session") -> None:
        with self.lock:
            self.sessions.add(session)

    def give(self, session: "Session | None" = None) -> None:
        with self.lock:
            self.active -= 1
            self.sessions.discard(session)

    def stop_all(self) -> None:
        """Their clients get shutting_down now, not after uvicorn's graceful timeout."""
        with self.lock:
            sessions = list(self.sessions)
        for session in sessions:
            session.cancel(MeshnetError(errors.SHUTTING_DOWN, "the server is shutting down"))


class _ClientGone(Exception):
    pass


class Session:
    """One generation, iterated by a thread of its own; its events (token, done, error)
    reach the request through an asyncio queue. The slot is given back once the
    coordinator has ended the session."""

    def __init__(self, coordinator, tokens: list[int], max_tokens: int, sampling: Sampling | None, slots: Slots):
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.lock = threading.Lock()
        self.handle = None
        self.cancelled = False
        self.reason: MeshnetError | None = None   # why this server cancelled it, if it did
        self._get: asyncio.Future | None = None
        self._check_at = time.monotonic() + DISCONNECT_POLL_S
        slots.hold(self)
        threading.Thread(target=self._run, args=(coordinator, tokens, max_tokens, sampling, slots),
                         name="meshnet-serve-session", daemon=True).start()

    def _put(self, kind: str, value) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:
            pass   # the server has stopped: nobody listens

    def _run(self, coordinator, tokens, max_tokens, sampling, slots) -> None:
        final = ("error", MeshnetError(errors.CANCELLED, "the request was cancelled"))
        try:
            with self.lock:
                if not self.cancelled:
                    self.handle = coordinator.generate(tokens, max_tokens, sampling=sampling)
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
        """The next event; _ClientGone if the client went away while waiting for it."""
        if self._get is None:
            self._get = asyncio.ensure_future(self.events.get())
        while True:
            if time.monotonic() >= self._check_at:   # tokens may come quicker than this: not only on a wait
                self._check_at = time.monotonic() + DISCONNECT_POLL_S
                if await request.is_disconnected():
                    raise _ClientGone()
            done, _ = await asyncio.wait({self._get}, timeout=DISCONNECT_POLL_S)
            if done:
                event, self._get = self._get.result(), None
                return event


class Answer:
    """The text of one answer, piece by piece as it may be shown, and how it ended."""

    def __init__(self, session: Session, first, stops: list[str]):
        self.session, self.first = session, first
        self.scanner = StopScanner(stops)
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.n_tokens = 0
        self.finish_reason: str | None = None

    async def texts(self, request: Request):
        event, ended = self.first, False
        try:
            while True:
                kind, value = event
                if kind == "error":
                    raise self.session.reason or value
                if kind == "token":
                    self.n_tokens += 1
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
                    ended = True
                    return
                event = await self.session.next(request)
        finally:
            if not ended:   # a client gone, an error: the stages free the session now
                self.session.cancel()
            self.session.close()


class BodyLimit:
    """ASGI middleware: a request body over MAX_BODY_BYTES gets 413, and no more of it than
    that is read. A Content-Length over it is refused before any of the body is read
    (uvicorn holds a body to its Content-Length); a chunked body, which has none, is read
    here up to the bound, refused as soon as what came passes it, and handed on whole."""

    def __init__(self, app, limit: int = MAX_BODY_BYTES):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            return await self.refuse(scope, receive, send)
        if b"chunked" not in headers.get(b"transfer-encoding", b"").lower():
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return   # the client went away before the body's end: nobody to answer
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self.refuse(scope, receive, send)
            if not message.get("more_body", False):
                break
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        chunks.clear()   # (the pieces are not held beside the whole)

        async def replay():   # the body once, then what the client sends next (a disconnect)
            nonlocal whole
            if whole is None:
                return await receive()
            message, whole = whole, None
            return message
        return await self.app(scope, replay, send)

    async def refuse(self, scope, receive, send):
        e = ApiError(413, f"the request body is over {self.limit} bytes ({self.limit // 2**20} MiB), the most "
                     "meshnet serve takes", code=TOO_LARGE)
        response = e.response()
        response.headers["connection"] = "close"   # the rest of the body is not read: this connection is done
        await response(scope, receive, send)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _choice(chat: bool, text: str | None, finish: str | None, stream: bool) -> dict:
    if not chat:
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
    if stream:
        return {"index": 0, "delta": {} if text is None else {"content": text}, "logprobs": None, "finish_reason": finish}
    return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish}


def route_limits(coordinator) -> tuple[int, int]:
    """(context, session slots) of the route's stages: the smallest of each."""
    report = coordinator.route_report()
    names = {stage.split("@", 1)[1] for stage in report["route"] or []}
    workers = [w for w in coordinator.workers_snapshot() if w["name"] in names]
    if not workers:
        raise MeshnetError(errors.ROUTE_INCOMPLETE, f"no route over the whole model: {report.get('error') or 'none yet'}")
    return min(w["n_ctx"] for w in workers), min(w["max_sessions"] for w in workers)


def model_id(model: str | None) -> str:
    """The name clients ask for: a known model's name, or a GGUF file's stem."""
    model = model or models.DEFAULT_MODEL
    return model if model in models.MODELS else Path(model).stem


def create_app(coordinator, model: str, *, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="meshnet", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit)
    slots = Slots()
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return e.response()

    @app.exception_handler(MeshnetError)
    async def meshnet_error(request, e: MeshnetError):
        return ApiError.of(e).response()

    @app.exception_handler(RequestValidationError)
    async def bad_body(request, e: RequestValidationError):   # FastAPI's 422 is OpenAI's 400
        first = e.errors()[0] if e.errors() else {"loc": (), "msg": "a bad request body"}
        path = field_path(first["loc"][1:] if first["loc"][:1] == ("body",) else first["loc"])
        return ApiError(400, f"{path or 'body'}: {first['msg']}", code=errors.INVALID_ARGUMENT,
                        param=path or None).response()

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        return ApiError(e.status_code, str(e.detail), code=None).response()

    async def authorize(request: Request):
        if api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), api_key.encode()):
            raise ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                           code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])

    def model_card():
        return {"id": model, "object": "model", "created": created, "owned_by": "meshnet"}

    @v1.get("/models")
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @v1.get("/models/{name:path}")
    async def get_model(name: str):
        if name != model:
            raise ApiError(404, f"the model '{name}' does not exist here: this server serves '{model}'",
                           code="model_not_found", param="model")
        return model_card()

    async def generate(request: Request, body: _Request, chat: bool, tokens_of, max_tokens: int | None):
        if body.model != model:
            raise ApiError(404, f"the model '{body.model}' does not exist here: this server serves '{model}'",
                           code="model_not_found", param="model")
        if body.n not in (None, 1):
            raise ApiError(400, f"n must be 1 (one choice per request), not {body.n}", code=UNSUPPORTED_FIELD,
                           param="n")
        sampling = sampling_of(body)
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        n_ctx, n_slots = await run_in_threadpool(route_limits, coordinator)
        if not slots.take(n_slots):
            raise ApiError(429, f"all {n_slots} session slots are in use: retry in a moment",
                           code=errors.TOO_MANY_SESSIONS)
        try:
            # a prompt that cannot leave room for one new token is refused by the head's
            # tokenizer, or before it by its length alone: a client's megabytes never hold a stage
            try:
                tokens = await run_in_threadpool(tokens_of, n_ctx - 1)
            except MeshnetError as e:
                if e.code != errors.CONTEXT_FULL:
                    raise
                raise ApiError(400, f"{e.message}: the context is {n_ctx}", code=errors.CONTEXT_FULL,
                               param="messages" if chat else "prompt") from None
            if len(tokens) >= n_ctx:
                raise ApiError(400, f"the prompt is {len(tokens)} tokens: the context is {n_ctx}",
                               code=errors.CONTEXT_FULL, param="messages" if chat else "prompt")
            session = Session(coordinator, tokens, max_tokens or n_ctx - len(tokens), sampling, slots)
        except BaseException:
            slots.give()
            raise
        try:   # the session's first event: an error before it is the request's status
            first = await session.next(request)
        except _ClientGone:
            session.cancel()
            session.close()
            return Response(status_code=499)
        if first[0] == "error":
            raise ApiError.of(session.reason or first[1])

        answer = Answer(session, first, stops)
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        head = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": model}

        def usage():
            return {"prompt_tokens": len(tokens), "completion_tokens": answer.n_tokens,
                    "total_tokens": len(tokens) + answer.n_tokens}

        if not body.stream:
            try:
                text = "".join([t async for t in answer.texts(request)])
            except _ClientGone:
                return Response(status_code=499)
            return dict(head, choices=[_choice(chat, text, answer.finish_reason, False)], usage=usage())

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        head["object"] = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text, finish=None, role=False):
            choice = _choice(chat, text, finish, True)
            if role:
                choice["delta"] = {"role": "assistant", "content": ""}
            return _sse(dict(head, choices=[choice], **({"usage": None} if include_usage else {})))

        async def events():
            if chat:
                yield chunk(None, role=True)
            try:
                async for text in answer.texts(request):
                    yield chunk(text)
            except MeshnetError as e:   # after the first token the status is sent: the error goes in the stream
                yield _sse(ApiError.of(e).body())
                yield "data: [DONE]\n\n"
                return
            except _ClientGone:
                return
            yield chunk(None, answer.finish_reason)
            if include_usage:
                yield _sse(dict(head, choices=[], usage=usage()))
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @v1.post("/chat/completions")
    async def chat_completions(request: Request, body: ChatRequest):
        check_request(body)
        messages = chat_messages(body.messages)
        return await generate(request, body, True, lambda limit: chat_prompt_tokens(coordinator, messages, limit),
                              body.max_completion_tokens or body.max_tokens)

    @v1.post("/completions")
    async def completions(request: Request, body: CompletionRequest):
        check_request(body)
        if isinstance(body.prompt, list) and len(body.prompt) != 1:
            raise ApiError(400, "prompt must be one text (one choice per request)", param="prompt")
        prompt = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
        return await generate(request, body, False, lambda limit: coordinator.tokenize(prompt, limit=limit), body.max_tokens)

    app.include_router(v1)

    @app.get("/health")
    def health():
        """Ready when a route covers the model; each stage's sessions and KV in use."""
        report = coordinator.route_report()
        try:
            stages = [{"layers": s.get("layers"), "n_sessions": s.get("n_sessions"),
                       "kv_bytes_used": s.get("kv_bytes_used")} for s in coordinator.stage_stats(timeout=2)]
        except (MeshnetError, TimeoutError) as e:
            stages = [{"error": str(e)}]
        ready = bool(report["route"])
        return JSONResponse({"status": "ready" if ready else "no_route", "model": model,
                             "route": report["route"] or [], "error": report.get("error"),
                             "sessions": slots.active, "stages": stages}, status_code=200 if ready else 503)

    @app.get("/metrics")
    def metrics():
        own = ("# HELP meshnet_http_sessions_active sessions open for HTTP requests\n"
               "# TYPE meshnet_http_sessions_active gauge\n"
               f"meshnet_http_sessions_active{{}} {slots.active}\n")
        return PlainTextResponse(prometheus_text(coordinator.metrics()) + own, media_type="text/plain; version=0.0.4")

    app.state.stop_sessions = slots.stop_all
    return app


def listen(host: str, port: int) -> socket.socket:
    """The HTTP socket, bound and listening before any worker starts: a port in use fails at once."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        code = errors.ADDRESS_IN_USE if e.errno == 98 else errors.BAD_ADDRESS
        raise MeshnetError(code, f"cannot listen on {host}:{port}: {e.strerror}; choose another --host/--port") from None
    sock.listen(1024)
    return sock


def serve(model: str | None, sock: socket.socket, *, api_key: str | None = None, bind: str | None = None,
          coordinator_options: dict | None = None, stages: int = 2, threads: int = 0, n_ctx: int = defaults.N_CTX,
          max_sessions: int = defaults.MAX_SESSIONS, secure: bool = True, numerics: str | None = None, echo=print) -> None:
    """Serve until SIGINT or SIGTERM: in front of local workers (CURVE on their links
    unless not secure), or (bind) of a coordinator that workers elsewhere connect to."""
    import uvicorn

    from meshnet.engine.gguf_layout import read_layout
    from meshnet.launch.local_cluster import LocalCluster
    from meshnet.route.config import CoordinatorConfig
    from meshnet.route.coordinator import Coordinator

    def run(coordinator, where: str):
        host, port = sock.getsockname()[:2]
        app = create_app(coordinator, model_id(model), api_key=api_key)

        class Server(uvicorn.Server):
            async def shutdown(self, sockets=None):
                app.state.stop_sessions()   # streams end now, with an error, and their connections close
                await super().shutdown(sockets)
        server = Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
        echo(f"meshnet serve: {model_id(model)} on http://{host}:{port}/v1 ({where})")
        server.run(sockets=[sock])

    def stop(signum, frame):   # uvicorn passes SIGTERM on once it has stopped: the workers close too
        raise KeyboardInterrupt
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        if bind is None:
            path, _ = models.resolve(model)
            ranges = read_layout(path).balanced_ranges(stages)
            # the workers ignore the terminal's Ctrl-C: they are closed after the server
            resume = {k: v for k, v in (coordinator_options or {}).items() if k in ("resume_wait", "max_resumes")}
            if numerics == "stock" and max_sessions > 1:
                echo("meshnet serve: numerics stock: one request alone gets stock llama.cpp's tokens; requests "
                     "batched together may get others (--numerics invariant holds them under any batching)")
            with LocalCluster(path, ranges, threads=threads, n_ctx=n_ctx, max_sessions=max_sessions, secure=secure,
                              numerics=numerics, **resume) as cluster:
                run(cluster.coordinator, f"{len(ranges)} local workers {' '.join(r.label for r in ranges)}")
        else:
            with Coordinator(CoordinatorConfig(bind, **(coordinator_options or {}))) as coordinator:
                run(coordinator, f"workers connect to {coordinator.endpoint}")
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        sock.close()
