"""Ollama's API in `meshnet serve`, beside OpenAI's: /api/chat and /api/generate (streamed
by default, as Ollama streams: one JSON object a line), /api/tags, /api/show, /api/ps and
/api/version: what Open WebUI, editors and the `ollama` client speak to a local model.

A request is said in OpenAI's terms (ollama_request) and answered by the chat completion
every API shares (chat.py); its answer is said back in Ollama's (ollama_reply). Every field
is honoured or refused with a 400 naming it, as the OpenAI routes do: `options` maps to the
sampling fields llama.cpp's names share, `format` to a JSON schema's grammar, `tools` to
the tool calls; what meshnet cannot do (images, thinking, options it has no knob for) is
refused, never ignored."""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from meshnet.core.errors import MeshnetError
from meshnet.core.version import version
from meshnet.serve.chat import bad_field, chat_answer, openai_chat_request, openai_chunks, read_json, refused_field
from meshnet.serve.completions import Completions
from meshnet.serve.openai import ApiError, CompletionRequest, check_request

# Ollama's options -> OpenAI's (llama.cpp's) request fields: the ones meshnet honours
OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
           "repeat_penalty": "repeat_penalty", "presence_penalty": "presence_penalty",
           "frequency_penalty": "frequency_penalty", "stop": "stop", "num_predict": "max_tokens"}
# OpenAI's name of a field -> Ollama's, for the 400 that names it
NAMES = {**{ours: f"options.{theirs}" for theirs, ours in OPTIONS.items()}, "response_format": "format"}
CHAT_FIELDS = {"model", "messages", "tools", "format", "options", "stream", "keep_alive", "think"}
GENERATE_FIELDS = {"model", "prompt", "suffix", "system", "template", "raw", "format", "options", "stream",
                   "keep_alive", "think", "context", "images"}
MESSAGE_FIELDS = {"role", "content", "images", "tool_calls", "tool_name", "thinking"}


def _object(body, where: str = "body") -> dict:
    if not isinstance(body, dict):
        raise bad_field(where, "must be a JSON object")
    return body


def _known(body: dict, fields: set[str], where: str = "") -> None:
    for name in body:
        if name not in fields:
            raise refused_field(where + name, "is not a field of Ollama's API that meshnet serve takes")


def _sampling(body: dict) -> dict:
    """OpenAI's fields for Ollama's options, format and stream."""
    out: dict = {"stream": body.get("stream", True) is not False}
    options = _object(body.get("options") or {}, "options")
    for name, value in options.items():
        if name not in OPTIONS:
            raise refused_field(f"options.{name}", "is not an option meshnet serve honours (it takes "
                           f"{', '.join(sorted(OPTIONS))})")
        if name == "num_predict":
            if not isinstance(value, int) or isinstance(value, bool) or not (value >= 1 or value in (-1, -2)):
                raise bad_field("options.num_predict", "must be a number of tokens, or -1 (no limit)")
            if value >= 1:
                out["max_tokens"] = value
        elif value is not None:
            out[OPTIONS[name]] = value
    fmt = body.get("format")
    if fmt == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    elif fmt not in (None, ""):
        raise bad_field("format", 'must be "json" or a JSON schema')
    if body.get("think") not in (None, False):
        raise refused_field("think", "is not supported by meshnet serve: it has no thinking mode; leave it out or false")
    keep_alive = body.get("keep_alive")   # the model stays loaded while serve runs, whatever is asked
    if keep_alive is not None and not isinstance(keep_alive, (str, int, float)):
        raise bad_field("keep_alive", "must be a duration")
    return out


def _messages(messages) -> list[dict]:
    """Ollama's messages in OpenAI's terms: a call's arguments as JSON text, a tool result
    tied to the call it answers (the earliest unanswered one of its name, as Ollama's
    templates read them in order)."""
    if not isinstance(messages, list) or not messages:
        raise bad_field("messages", "must be a list of at least one message")
    out, open_calls = [], []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        m = _object(m, where)
        _known(m, MESSAGE_FIELDS, where + ".")
        if m.get("images"):
            raise refused_field(where + ".images", "are not supported by meshnet serve: it runs text models")
        if m.get("thinking"):
            raise refused_field(where + ".thinking", "is not supported by meshnet serve: it has no thinking mode")
        message = {"role": m.get("role"), "content": m.get("content", "")}
        if m.get("tool_calls"):
            if not isinstance(m["tool_calls"], list):
                raise bad_field(where + ".tool_calls", "must be a list of calls")
            calls = []
            for j, call in enumerate(m["tool_calls"]):
                function = _object(_object(call, f"{where}.tool_calls[{j}]").get("function"),
                                   f"{where}.tool_calls[{j}].function")
                arguments = function.get("arguments", {})
                calls.append({"id": f"call_{i}_{j}", "type": "function",
                              "function": {"name": function.get("name"),
                                           "arguments": arguments if isinstance(arguments, str) else
                                           json.dumps(arguments)}})
            message["tool_calls"] = calls
            open_calls = [(c["id"], c["function"]["name"]) for c in calls]
        if m.get("role") == "tool":
            name = m.get("tool_name")
            match = next((k for k, (_, n) in enumerate(open_calls) if name is None or n == name), None)
            message["tool_call_id"] = open_calls.pop(match)[0] if match is not None else f"call_{i}"
        elif m.get("tool_name") is not None:
            raise bad_field(where + ".tool_name", "belongs to a tool message alone")
        out.append(message)
    return out


def ollama_chat_request(body: dict, model: str) -> dict:
    """Ollama's /api/chat body -> OpenAI's chat request fields; a field not taken is a 400."""
    body = _object(body)
    _known(body, CHAT_FIELDS)
    fields = dict(_sampling(body), model=_model(body.get("model"), model), messages=_messages(body.get("messages")))
    if body.get("tools"):
        fields["tools"] = body["tools"]
    if fields["stream"]:
        fields["stream_options"] = {"include_usage": True}
    return fields


def _model(asked, model: str) -> str:
    """Ollama's name for the model asked for: NAME and NAME:latest are one model."""
    if not isinstance(asked, str) or not asked:
        raise bad_field("model", "is required: the model's name (GET /api/tags lists it)")
    strip = (lambda n: n[:-len(":latest")] if n.endswith(":latest") else n)
    return model if strip(asked) == strip(model) else asked


def _stamp() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _done_fields(finish: str | None, usage: dict | None, began: float, first: float | None) -> dict:
    now = time.monotonic()
    out = {"done": True, "done_reason": "length" if finish == "length" else "stop",
           "total_duration": int((now - began) * 1e9), "load_duration": 0}
    if usage is not None:
        out["prompt_eval_count"] = usage["prompt_tokens"]
        out["eval_count"] = usage["completion_tokens"]
    if first is not None:   # streamed: the prompt until the first piece, the rest after it
        out["prompt_eval_duration"] = int((first - began) * 1e9)
        out["eval_duration"] = int((now - first) * 1e9)
    return out


def _calls(calls: list | None) -> list | None:
    if not calls:
        return None
    return [{"function": {"index": i, "name": c["function"]["name"], "arguments": _arguments(c["function"]["arguments"])}}
            for i, c in enumerate(calls)]


def _arguments(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return {}


def ollama_reply(reply: dict, generate: bool, began: float) -> dict:
    """OpenAI's chat.completion (or text_completion) -> Ollama's answer, whole."""
    choice = reply["choices"][0]
    out = {"model": reply["model"], "created_at": _stamp()}
    if generate:
        out["response"] = choice.get("text") if "text" in choice else choice["message"].get("content") or ""
    else:
        message = {"role": "assistant", "content": choice["message"].get("content") or ""}
        if calls := _calls(choice["message"].get("tool_calls")):
            message["tool_calls"] = calls
        out["message"] = message
    return dict(out, **_done_fields(choice["finish_reason"], reply.get("usage"), began, None))


async def _ndjson(response, model: str, generate: bool, began: float):
    """OpenAI's stream of chunks -> Ollama's, one JSON object a line."""
    first = finish = usage = None

    def line(obj) -> str:
        return json.dumps(obj, ensure_ascii=False) + "\n"
    async for chunk in openai_chunks(response):
        if chunk is None:
            continue   # (NDJSON has no comment: a wait is a wait)
        if "error" in chunk:
            yield line({"error": chunk["error"].get("message")})
            return
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            finish = choice.get("finish_reason") or finish
            delta = choice.get("delta") or {}
            text = choice.get("text") if generate else delta.get("content")
            calls = _calls(delta.get("tool_calls"))
            if text or calls:
                first = first or time.monotonic()
                out = {"model": model, "created_at": _stamp()}
                if generate:
                    out["response"] = text or ""
                else:
                    out["message"] = dict({"role": "assistant", "content": text or ""},
                                          **({"tool_calls": calls} if calls else {}))
                yield line(dict(out, done=False))
    last = {"model": model, "created_at": _stamp()}
    last.update({"response": ""} if generate else {"message": {"role": "assistant", "content": ""}})
    yield line(dict(last, **_done_fields(finish, usage, began, first or time.monotonic())))


def _error(e: ApiError | MeshnetError) -> JSONResponse:
    """Ollama's error shape: {"error": message}, with the status OpenAI's routes give."""
    e = e if isinstance(e, ApiError) else ApiError.of(e)
    return JSONResponse({"error": e.message}, status_code=e.status)


def routes(completions: Completions, model: str, facts: dict, authorize) -> APIRouter:
    api = APIRouter(prefix="/api", dependencies=[Depends(authorize)])
    started = _stamp()

    async def answer(request: Request, generate: bool):
        began = time.monotonic()
        try:
            body = _object(await read_json(request))
            if generate:
                fields, raw = _generate_request(body, model)
                if fields is None:   # no prompt: Ollama loads the model and says so
                    return {"model": model, "created_at": _stamp(), "response": "", "done": True,
                            "done_reason": "load"}
            else:
                fields, raw = ollama_chat_request(body, model), False
            if raw:
                result = await _raw_completion(completions, request, fields)
            else:
                result = await chat_answer(completions, request, openai_chat_request(fields, NAMES))
        except (ApiError, MeshnetError) as e:
            return _error(e)
        if isinstance(result, StreamingResponse):
            return StreamingResponse(_ndjson(result, model, generate, began), media_type="application/x-ndjson")
        if not isinstance(result, dict):
            return result   # (a client gone: nobody reads it)
        return ollama_reply(result, generate, began)

    @api.post("/chat")
    async def chat(request: Request):
        return await answer(request, False)

    @api.post("/generate")
    async def generate(request: Request):
        return await answer(request, True)

    def card() -> dict:
        return {"name": model, "model": model, "modified_at": started, "size": facts.get("bytes", 0),
                "digest": facts.get("sha256", ""),
                "details": {"parent_model": "", "format": "gguf", "family": facts.get("arch", ""),
                            "families": [facts["arch"]] if facts.get("arch") else None,
                            "parameter_size": facts.get("parameter_size", ""),
                            "quantization_level": facts.get("quantization", "")}}

    @api.get("/tags")
    async def tags():
        return {"models": [card()]}

    @api.get("/ps")
    async def ps():
        return {"models": [dict(card(), expires_at="0001-01-01T00:00:00Z", size_vram=0)]}

    @api.post("/show")
    async def show(request: Request):
        try:
            body = _object(await read_json(request))
            _known(body, {"model", "name", "verbose"})
            asked = body.get("model", body.get("name"))
            if _model(asked, model) != model:
                raise ApiError(404, f"model '{asked}' not found: this server serves '{model}'", code="model_not_found")
        except ApiError as e:
            return _error(e)
        info = {"general.architecture": facts.get("arch", ""), "general.parameter_count": facts.get("parameters", 0)}
        if facts.get("context_length"):
            info[f"{facts['arch']}.context_length"] = facts["context_length"]
        return {"modelfile": "", "parameters": "", "template": "", "details": card()["details"], "model_info": info,
                "capabilities": ["completion", "tools"], "modified_at": started}

    @api.get("/version")
    async def api_version():
        return {"version": version()}

    return api


def _generate_request(body: dict, model: str) -> tuple[dict | None, bool]:
    """Ollama's /api/generate body -> (OpenAI's request fields, raw: a text completion of
    the prompt as it is rather than a chat turn); None fields: no prompt, a load."""
    _known(body, GENERATE_FIELDS)
    for name in ("suffix", "template", "context", "images"):
        if body.get(name):
            raise refused_field(name, {"suffix": "(fill in the middle) is not supported by meshnet serve",
                                  "template": "is not supported: the model's own chat template is used",
                                  "context": "(the deprecated token context) is not supported: send the conversation "
                                             "to /api/chat",
                                  "images": "are not supported by meshnet serve: it runs text models"}[name])
    prompt, system = body.get("prompt") or "", body.get("system")
    if not isinstance(prompt, str) or not (system is None or isinstance(system, str)):
        raise bad_field("prompt", "and system must be text")
    fields = dict(_sampling(body), model=_model(body.get("model"), model))
    if not prompt and not system:
        return None, False
    raw = body.get("raw") is True
    if raw:
        if system:
            raise bad_field("system", "has no place in a raw prompt: put it in the prompt")
        fields["prompt"] = prompt
    else:
        fields["messages"] = ([{"role": "system", "content": system}] if system else []) + \
            [{"role": "user", "content": prompt}]
    if fields["stream"]:
        fields["stream_options"] = {"include_usage": True}
    return fields, raw


async def _raw_completion(completions: Completions, request: Request, fields: dict):
    """A raw prompt, continued as it is (OpenAI's /v1/completions)."""
    from pydantic import ValidationError

    try:
        body = CompletionRequest.model_validate(fields)
    except ValidationError as e:
        raise bad_field("body", e.errors()[0]["msg"]) from None
    check_request(body)
    coordinator = completions.coordinator
    return await completions.answer(request, body, False,
                                    lambda limit: (None, coordinator.tokenize(body.prompt, limit=limit)),
                                    body.token_limit())
