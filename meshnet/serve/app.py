"""`meshnet serve`: OpenAI's HTTP API in front of a coordinator.

This file is the HTTP layer: the routes, the API key, the error handlers and the bound
on a request body. A request is checked before any of it reaches the coordinator: its
body's size (BodyLimit), its types (the pydantic models of openai.py), then what the
types leave open (check_request). A generation (chat template, tokenizer, sampling, end
of generation) is the coordinator's, over the stages; completions.py carries one from
the request to its answer, adding what OpenAI's API has and the coordinator has not:
stop strings, usage, and a count of session slots: a request beyond the stages'
--max-sessions waits its turn in admission.py's queue instead of opening a session that
a stage refuses. launch.py starts the server.
"""

from __future__ import annotations

import secrets
import time

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException

from meshnet.core.version import version
from meshnet.core import defaults, errors
from meshnet.core.errors import MeshnetError
from meshnet.core.metrics import prometheus_text
from meshnet.serve import anthropic_api, console, ollama_api, responses_api
from meshnet.serve.admission import Admission
from meshnet.serve.completions import Completions, route_limits
from meshnet.serve.chat import chat_answer
from meshnet.serve.choices import answer_choices
from meshnet.serve.openai import (TOO_LARGE, UNSUPPORTED_FIELD, ApiError, ChatRequest, CompletionRequest,
                                  check_request, field_path, not_utf8)

# The largest request body taken: a bigger one is refused (413) before it is read. It is
# well above any prompt a context holds (a 3,000,000-character prompt is let through, to
# be refused as context_full), and keeps what one request may make the server hold small.
MAX_BODY_BYTES = 4 * 1024 * 1024


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


def create_app(coordinator, model: str, *, api_key: str | None = None, stuck_after: float = defaults.STUCK_AFTER_S,
               max_queue: int = defaults.MAX_QUEUE, queue_wait: float = defaults.QUEUE_WAIT_S,
               facts: dict | None = None, cors_origins: list[str] = ()) -> FastAPI:
    """The server's app. FACTS: what the model's file says of it (model_facts), for the
    APIs that list a model's details (Ollama's). CORS_ORIGINS: the browser origins whose
    pages may call it (none: no CORS headers, as llama-server without --cors)."""
    app = FastAPI(title="meshnet", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit)
    if cors_origins:   # (outside the body limit: a preflight is answered before anything else)
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["*"], allow_headers=["*"],
                           allow_credentials="*" not in cors_origins, max_age=600)
    completions = Completions(coordinator, model, Admission(max_queue, queue_wait))
    _answer_errors_as_openai_does(app)
    authorize = _authorizer(api_key)
    app.include_router(_v1(coordinator, model, completions, authorize))
    app.include_router(ollama_api.routes(completions, model, facts or {}, authorize))
    app.include_router(_llama_server(coordinator, model, completions, authorize))
    feeds = console.Feeds()
    for router in console.routes(coordinator, model, completions.slots, authorize, feeds):
        app.include_router(router)
    _status_routes(app, coordinator, model, completions, stuck_after)

    def stop_sessions():   # the server is stopping: streams end now, and their connections close
        completions.slots.stop_all()
        feeds.stop()
    app.state.stop_sessions = stop_sessions
    return app


def _answer_errors_as_openai_does(app: FastAPI) -> None:
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


def _authorizer(api_key: str | None):
    """The dependency that holds a route behind the API key, when there is one."""
    async def authorize(request: Request):
        if api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":   # Anthropic's clients send the key as x-api-key
            scheme, given = "bearer", request.headers.get("x-api-key", "")
        if not secrets.compare_digest(given.strip().encode(), api_key.encode()):
            raise ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY' (or "
                           "'x-api-key: KEY')", code="invalid_api_key")
    return authorize


def _v1(coordinator, model: str, completions: Completions, authorize) -> APIRouter:
    """OpenAI's routes, behind the API key when there is one."""
    created = int(time.time())

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

    @v1.post("/chat/completions")
    async def chat_completions(request: Request, body: ChatRequest):
        return await answer_choices(body, lambda one: chat_answer(completions, request, one))

    @v1.post("/embeddings")
    async def embeddings():   # a clear no, where a 404 would read as a wrong address
        raise ApiError(400, "embeddings are not supported by meshnet serve: its route of stages generates text, its "
                       "tail has no pooled hidden state to give; serve an embedding model with llama-server "
                       "--embeddings", code=UNSUPPORTED_FIELD, param="model")

    @v1.post("/responses")
    async def responses(request: Request):   # OpenAI's Responses API
        return await responses_api.answer(completions, request, model)

    @v1.post("/messages")
    async def messages(request: Request):   # Anthropic's Messages API
        return await anthropic_api.answer(completions, request, model)

    @v1.post("/completions")
    async def text_completions(request: Request, body: CompletionRequest):
        check_request(body)
        if isinstance(body.prompt, list) and len(body.prompt) != 1:
            raise ApiError(400, "prompt must be one text (one choice per request)", param="prompt")
        prompt = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
        return await answer_choices(body, lambda one: completions.answer(
            request, one, False, lambda limit: (None, coordinator.tokenize(prompt, limit=limit)), one.token_limit()))

    return v1


def check_request_text(text: str, field: str) -> None:
    if not_utf8(text) is not None:
        raise ApiError(400, f"{field} is not valid UTF-8: it holds a lone surrogate", code=errors.INVALID_ARGUMENT,
                       param=field)


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    tokens: list[int]


def _llama_server(coordinator, model: str, completions: Completions, authorize) -> APIRouter:
    """llama-server's own routes: /tokenize and /detokenize (by the head's and the tail's
    tokenizer), /props and /slots."""
    router = APIRouter(dependencies=[Depends(authorize)])

    @router.post("/tokenize")
    def tokenize(body: TokenizeRequest):
        check_request_text(body.content, "content")
        if body.with_pieces:
            raise ApiError(400, "with_pieces is not supported by meshnet serve: leave it out or false",
                           code=UNSUPPORTED_FIELD, param="with_pieces")
        return {"tokens": coordinator.tokenize(body.content, add_special=body.add_special,
                                               parse_special=body.parse_special)}

    @router.get("/props")
    def props():   # llama-server's: what a web UI reads first
        n_ctx, n_slots = route_limits(coordinator)
        return {"model_alias": model, "total_slots": n_slots, "build_info": f"meshnet {version()}",
                "default_generation_settings": {"n_ctx": n_ctx, "params": {"temperature": 0.0}},
                "modalities": {"vision": False, "audio": False}}

    @router.get("/slots")
    def slots():   # llama-server's: each session slot, and whether a request holds it
        _, n_slots = route_limits(coordinator)
        busy = completions.slots.active
        return [{"id": i, "n_ctx": None, "is_processing": i < busy} for i in range(n_slots)]

    @router.post("/detokenize")
    def detokenize(body: DetokenizeRequest):
        return {"content": coordinator.detokenize(body.tokens)}

    return router


def _status_routes(app: FastAPI, coordinator, model: str, completions: Completions, stuck_after: float) -> None:
    slots = completions.slots

    @app.get("/health")
    def health():
        """Ready when a route covers the model and no stage is stuck in one step (its worker
        answers, but its compute thread has not come round for STUCK_AFTER seconds); each
        stage's sessions, KV in use and how long its step under way has run."""
        report = coordinator.route_report()
        try:
            stages = [{"layers": s.get("layers"), "n_sessions": s.get("n_sessions"),
                       "kv_bytes_used": s.get("kv_bytes_used"), "step_s": s.get("step_s")}
                      for s in coordinator.stage_stats(timeout=2)]
        except (MeshnetError, TimeoutError) as e:
            stages = [{"error": str(e)}]
        stuck = [s for s in stages if (s.get("step_s") or 0) > stuck_after]
        status, error = ("ready" if report["route"] else "no_route"), report.get("error")
        if report["route"] and stuck:
            status = "stage_stuck"
            error = "; ".join(f"stage {s['layers']} has run one step for {s['step_s']:.1f} s (over {stuck_after:g} s)"
                              for s in stuck)
        return JSONResponse({"status": status, "model": model, "route": report["route"] or [], "error": error,
                             "sessions": slots.active, "queued": slots.queued,
                             "stages": stages}, status_code=200 if status == "ready" else 503)

    @app.get("/metrics")
    def metrics():
        return PlainTextResponse(prometheus_text(coordinator.metrics()) + slots.prometheus(),
                                 media_type="text/plain; version=0.0.4")
