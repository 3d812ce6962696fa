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

from . import errors, models
from .chat import answer_sampling
from .chat import prompt_tokens as chat_prompt_tokens
from .errors import MeshnetError
from .metrics import prometheus_text
from .sampling import Sampling

RETRY_AFTER_S = 1
SETTLE_S = 2.0
DISCONNECT_POLL_S = 0.5  # how soon a client gone (not streaming, or during a long prompt) frees its session

STATUS = {errors.TOO_MANY_SESSIONS: 429, errors.BUSY: 429, errors.ROUTE_INCOMPLETE: 503, errors.STAGE_LOST: 503,
          errors.SHUTTING_DOWN: 503, errors.HOP_UNREACHABLE: 503, errors.DEADLINE_EXCEEDED: 503, errors.TIMEOUT: 503,
          errors.UNREACHABLE: 503, errors.CONTEXT_FULL: 400, errors.INVALID_ARGUMENT: 400,
          errors.NO_CHAT_TEMPLATE: 400, errors.BAD_TOKEN: 400}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
               405: "invalid_request_error", 429: "rate_limit_error"}
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                   "repeat_penalty", "seed")
UNSUPPORTED = ("echo", "logprobs", "top_logprobs", "suffix", "logit_bias", "tools", "functions")


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    @classmethod
    def of(cls, error: MeshnetError) -> "ApiError":
        return cls(STATUS.get(error.code, 500), error.message, code=error.code, param=error.context.get("field"))

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        retry = {"Retry-After": str(RETRY_AFTER_S)} if self.status in (429, 503) else None
        return JSONResponse(self.body(), status_code=self.status, headers=retry)


# ---- request bodies: strict types (a string is not a number); fields OpenAI clients send
# and meshnet does not use (user, metadata, ...) are let through

class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Body):
    include_usage: bool = False


class ContentPart(_Body):
    type: str
    text: str | None = None


class Message(_Body):
    role: str
    content: str | list[ContentPart] | None = None


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


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)   # the newer name of max_tokens


class CompletionRequest(_Request):
    prompt: str | list[str]


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
    """OpenAI's messages as the chat template takes them: role and content text."""
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            if any(part.type != "text" or part.text is None for part in content):
                raise ApiError(400, f"messages[{i}]: only text content parts are supported", param="messages")
            content = "".join(part.text for part in content)
        out.append({"role": "system" if m.role == "developer" else m.role, "content": content or ""})
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
        loc = [str(part) for part in first["loc"] if part != "body"]
        return ApiError(400, f"{'.'.join(loc) or 'body'}: {first['msg']}", code=errors.INVALID_ARGUMENT,
                        param=loc[0] if loc else None).response()

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
            raise ApiError(400, f"n must be 1 (one choice per request), not {body.n}", param="n")
        for name in UNSUPPORTED:
            if (body.model_extra or {}).get(name):
                raise ApiError(400, f"{name} is not supported by meshnet serve", param=name)
        sampling = sampling_of(body)
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        n_ctx, n_slots = await run_in_threadpool(route_limits, coordinator)
        if not slots.take(n_slots):
            raise ApiError(429, f"all {n_slots} session slots are in use: retry in a moment",
                           code=errors.TOO_MANY_SESSIONS)
        try:
            tokens = await run_in_threadpool(tokens_of)
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
        messages = chat_messages(body.messages)
        return await generate(request, body, True, lambda: chat_prompt_tokens(coordinator, messages),
                              body.max_completion_tokens or body.max_tokens)

    @v1.post("/completions")
    async def completions(request: Request, body: CompletionRequest):
        if isinstance(body.prompt, list) and len(body.prompt) != 1:
            raise ApiError(400, "prompt must be one text (one choice per request)", param="prompt")
        prompt = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
        return await generate(request, body, False, lambda: coordinator.tokenize(prompt), body.max_tokens)

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
          coordinator_options: dict | None = None, stages: int = 2, threads: int = 0, n_ctx: int = 2048,
          max_sessions: int = 8, echo=print) -> None:
    """Serve until SIGINT or SIGTERM: in front of local workers, or (bind) of a coordinator
    that workers elsewhere connect to."""
    import uvicorn

    from .cluster import LocalCluster
    from .coordinator import Coordinator
    from .gguf_layout import read_layout

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
            with LocalCluster(path, ranges, threads=threads, n_ctx=n_ctx, max_sessions=max_sessions, **resume) as cluster:
                run(cluster.coordinator, f"{len(ranges)} local workers {' '.join(r.label for r in ranges)}")
        else:
            with Coordinator(bind, **(coordinator_options or {})) as coordinator:
                run(coordinator, f"workers connect to {coordinator.endpoint}")
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        sock.close()
