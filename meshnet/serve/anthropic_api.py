"""Anthropic's Messages API in `meshnet serve`, beside OpenAI's: POST /v1/messages, whole
or streamed as Anthropic's server-sent events, with tools: what coding agents and the
`anthropic` client speak (llama-server serves it too).

A request is said in OpenAI's terms (messages_request) and answered by the chat
completion every API shares (chat.py); the answer is said back as Anthropic's message and
events. Every field is honoured or refused with a 400 naming it: `cache_control` is taken
(meshnet keeps a conversation's prefix without being asked: prompt reuse), images,
documents, thinking and server tools are refused."""

from __future__ import annotations

import json
import secrets

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from meshnet.core import errors
from meshnet.core.errors import MeshnetError
from meshnet.serve.chat import answer_events, bad_field, chat_answer, openai_chat_request, read_json, refused_field
from meshnet.serve.completions import Completions
from meshnet.serve.openai import ApiError

FIELDS = {"model", "max_tokens", "messages", "system", "stop_sequences", "temperature", "top_p", "top_k", "stream",
          "tools", "tool_choice", "metadata", "thinking", "service_tier"}
OFF = {"thinking": (None, {"type": "disabled"}), "service_tier": (None, "auto", "standard_only")}
BLOCK_FIELDS = {"text": {"type", "text", "cache_control", "citations"},
                "tool_use": {"type", "id", "name", "input", "cache_control"},
                "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control"}}
TOOL_FIELDS = {"name", "description", "input_schema", "cache_control", "type"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
# names OpenAI's checks give a field -> Anthropic's
NAMES = {"max_tokens": "max_tokens", "stop": "stop_sequences", "user": "metadata.user_id"}


def _known(obj: dict, fields: set[str], where: str) -> None:
    for name in obj:
        if name not in fields:
            raise refused_field(where + name, "is not a field meshnet serve takes")


def _text_of(content, where: str) -> str:
    """A text or a list of text blocks, as one text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_field(where, "must be text or a list of text blocks")
    texts = []
    for i, block in enumerate(content):
        at = f"{where}[{i}]"
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else None
            raise refused_field(at + ".type", f"{kind!r} is not supported by meshnet serve: it takes text blocks here")
        _known(block, BLOCK_FIELDS["text"], at + ".")
        if not isinstance(block.get("text"), str):
            raise bad_field(at + ".text", "is required: the block's text")
        texts.append(block["text"])
    return "".join(texts)


def _messages(messages, system) -> list[dict]:
    """Anthropic's system and messages in OpenAI's terms: an assistant's tool_use blocks are
    its tool calls, a user's tool_result blocks are tool messages (before its text)."""
    out = [{"role": "system", "content": _text_of(system, "system")}] if system else []
    if not isinstance(messages, list) or not messages:
        raise bad_field("messages", "must be a list of at least one message")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_field(where, "must be an object")
        _known(m, {"role", "content"}, where + ".")
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            raise bad_field(where + ".role", "must be user or assistant")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise bad_field(where + ".content", "must be text or a list of content blocks")
        texts, calls, results = [], [], []
        for j, block in enumerate(blocks):
            at = f"{where}.content[{j}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind not in BLOCK_FIELDS or (kind == "tool_use" and role != "assistant") \
                    or (kind == "tool_result" and role != "user"):
                raise refused_field(at + ".type", f"{kind!r} is not supported by meshnet serve in a {role}'s message "
                               "(it takes text, an assistant's tool_use and a user's tool_result)")
            _known(block, BLOCK_FIELDS[kind], at + ".")
            if kind == "text":
                texts.append(_text_of([block], at[:at.rindex("[")]))
            elif kind == "tool_use":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                    raise bad_field(at, "needs an id and a name")
                calls.append({"id": block["id"], "type": "function",
                              "function": {"name": block["name"], "arguments": json.dumps(block.get("input") or {})}})
            else:
                if not isinstance(block.get("tool_use_id"), str):
                    raise bad_field(at + ".tool_use_id", "is required: the tool_use this result answers")
                text = _text_of(block.get("content") or "", at + ".content")
                results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                                "content": ("Error: " + text) if block.get("is_error") else text})
        out += results
        if calls:
            out.append({"role": "assistant", "content": "".join(texts) or None, "tool_calls": calls})
        elif texts or not results:
            out.append({"role": role, "content": "".join(texts)})
    return out


def _tools(tools, choice) -> dict:
    out: dict = {}
    if tools is not None:
        if not isinstance(tools, list):
            raise bad_field("tools", "must be a list")
        functions = []
        for i, tool in enumerate(tools):
            where = f"tools[{i}]"
            if not isinstance(tool, dict):
                raise bad_field(where, "must be an object")
            if tool.get("type") not in (None, "custom"):
                raise refused_field(where + ".type", f"{tool.get('type')!r}: server tools are not supported by meshnet "
                               "serve; give client tools (name, input_schema)")
            _known(tool, TOOL_FIELDS, where + ".")
            functions.append({"type": "function", "function": {
                "name": tool.get("name"), "description": tool.get("description"),
                "parameters": tool.get("input_schema")}})
        if functions:
            out["tools"] = functions
    if choice is not None:
        if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
            raise bad_field("tool_choice.type", "must be auto, any, tool or none")
        _known(choice, {"type", "name", "disable_parallel_tool_use"}, "tool_choice.")
        kind = choice["type"]
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(kind) or \
            {"type": "function", "function": {"name": choice.get("name")}}
        if "tools" in out:
            out["parallel_tool_calls"] = not choice.get("disable_parallel_tool_use", False)
    elif "tools" in out:
        out["parallel_tool_calls"] = True
    return out


def messages_request(body, model: str) -> dict:
    """Anthropic's /v1/messages body -> OpenAI's chat request fields; a field not taken is a 400."""
    if not isinstance(body, dict):
        raise bad_field("body", "must be a JSON object")
    _known(body, FIELDS, "")
    for name, offs in OFF.items():
        if name in body and not any(type(body[name]) is type(v) and body[name] == v for v in offs):
            raise refused_field(name, f"is not supported by meshnet serve: leave it out, or send "
                           f"{' or '.join(json.dumps(v) for v in offs if v is not None)}")
    if body.get("max_tokens") is None:
        raise bad_field("max_tokens", "is required: the most tokens the answer may have")
    fields = {"model": body.get("model"), "max_tokens": body["max_tokens"],
              "messages": _messages(body.get("messages"), body.get("system")),
              "stream": body.get("stream") is True}
    for name in ("temperature", "top_p", "top_k"):
        if body.get(name) is not None:
            fields[name] = body[name]
    if body.get("stop_sequences") is not None:
        fields["stop"] = body["stop_sequences"]
    metadata = body.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise bad_field("metadata", "must be an object")
    _known(metadata, {"user_id"}, "metadata.")
    if metadata.get("user_id") is not None:
        fields["user"] = metadata["user_id"]
    fields.update(_tools(body.get("tools"), body.get("tool_choice")))
    if fields["stream"]:
        fields["stream_options"] = {"include_usage": True}
    return fields


def _stop_reason(finish: str | None, calls, stop_sequence: str | None) -> str:
    if calls:
        return "tool_use"
    if finish == "length":
        return "max_tokens"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def _usage(usage: dict | None) -> dict:
    usage = usage or {}
    return {"input_tokens": usage.get("prompt_tokens", 0), "output_tokens": usage.get("completion_tokens", 0),
            "cache_read_input_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            "cache_creation_input_tokens": 0}


def _tool_use(call: dict) -> dict:
    try:
        arguments = json.loads(call["function"]["arguments"])
    except ValueError:
        arguments = {}
    return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": arguments}


def message_of(reply: dict, report: dict) -> dict:
    """OpenAI's chat.completion -> Anthropic's message."""
    message = reply["choices"][0]["message"]
    calls = message.get("tool_calls") or []
    content = ([{"type": "text", "text": message["content"]}] if message.get("content") else []) + \
        [_tool_use(c) for c in calls]
    stop = report.get("stop_sequence")
    return {"id": "msg_" + secrets.token_hex(12), "type": "message", "role": "assistant", "model": reply["model"],
            "content": content, "stop_reason": _stop_reason(reply["choices"][0]["finish_reason"], calls, stop),
            "stop_sequence": stop, "usage": _usage(reply.get("usage"))}


def _event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps(dict(type=kind, **data), ensure_ascii=False)}\n\n"


async def _events(response, model: str, report: dict):
    """OpenAI's stream -> Anthropic's events: message_start, a text block's deltas, each
    tool_use block whole, message_delta with the stop reason and usage, message_stop."""
    yield _event("message_start", {"message": {
        "id": "msg_" + secrets.token_hex(12), "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": _usage(None)}})
    index, text_open, calls = 0, False, []
    async for kind, value in answer_events(response):
        if kind == "keepalive":
            yield _event("ping", {})
        elif kind == "text":
            if not text_open:
                yield _event("content_block_start", {"index": index, "content_block": {"type": "text", "text": ""}})
                text_open = True
            yield _event("content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": value}})
        elif kind == "calls":
            if text_open:
                yield _event("content_block_stop", {"index": index})
                index, text_open = index + 1, False
            for call in value:
                block = _tool_use(call)
                yield _event("content_block_start", {"index": index, "content_block": dict(block, input={})})
                yield _event("content_block_delta", {"index": index, "delta": {
                    "type": "input_json_delta", "partial_json": json.dumps(block["input"])}})
                yield _event("content_block_stop", {"index": index})
                index += 1
            calls += value
        elif kind == "error":
            yield _event("error", {"error": {"type": ERROR_TYPES.get(errors.http_status(value.get("code") or ""),
                                                                      "api_error"),
                                             "message": value.get("message")}})
            return
        else:
            finish, usage = value
            if text_open:
                yield _event("content_block_stop", {"index": index})
            stop = report.get("stop_sequence")
            yield _event("message_delta", {"delta": {"stop_reason": _stop_reason(finish, calls, stop),
                                                     "stop_sequence": stop}, "usage": _usage(usage)})
            yield _event("message_stop", {})


def error_response(e: ApiError | MeshnetError) -> JSONResponse:
    """Anthropic's error shape, with the status OpenAI's routes give."""
    e = e if isinstance(e, ApiError) else ApiError.of(e)
    return JSONResponse({"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "api_error"),
                                                    "message": e.message}},
                        status_code=e.status, headers={"Retry-After": "1"} if e.status in (429, 503) else None)


async def answer(completions: Completions, request: Request, model: str):
    """POST /v1/messages."""
    report: dict = {}
    try:
        fields = messages_request(await read_json(request), model)
        result = await chat_answer(completions, request, openai_chat_request(fields, NAMES), report)
    except (ApiError, MeshnetError) as e:
        return error_response(e)
    if isinstance(result, StreamingResponse):
        return StreamingResponse(_events(result, model, report), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    if not isinstance(result, dict):
        return result   # (a client gone)
    return message_of(result, report)
