"""OpenAI's Responses API in `meshnet serve`: POST /v1/responses, whole or streamed as its
typed events, with function tools and structured output (`text.format`): what the newer
OpenAI clients and agent SDKs call.

A request is said in the Chat Completions' terms (responses_request) and answered by the
chat completion every API shares (chat.py); the answer is said back as a response object
and its events. meshnet keeps no responses: `store` true and `previous_response_id` are
refused (send the conversation as input items); every other field is honoured or refused
with a 400 naming it."""

from __future__ import annotations

import json
import secrets
import time

from fastapi import Request
from fastapi.responses import StreamingResponse

from meshnet.core.errors import MeshnetError
from meshnet.serve.chat import answer_events, bad_field, chat_answer, openai_chat_request, read_json, refused_field
from meshnet.serve.completions import Completions
from meshnet.serve.openai import ApiError

TAKEN = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "tools",
         "tool_choice", "parallel_tool_calls", "text", "user", "prompt_cache_key", "metadata", "store",
         "reasoning", "truncation", "include", "background", "service_tier", "stream_options", "top_logprobs",
         "safety_identifier", "max_tool_calls"}
# fields taken only at the values that mean "off"
OFF = {"store": (None, False), "reasoning": (None, {}), "truncation": (None, "disabled"), "include": (None, []),
       "background": (None, False), "service_tier": (None, "auto", "default"), "top_logprobs": (None, 0),
       "max_tool_calls": (None,), "stream_options": (None, {}, {"include_obfuscation": False})}
NAMES = {"max_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input"}


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_field(where, "must be text or a list of content parts")
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise refused_field(f"{where}[{i}].type", f"{kind!r} is not supported by meshnet serve: it takes text parts")
        if not isinstance(part.get("text"), str):
            raise bad_field(f"{where}[{i}].text", "is required")
        texts.append(part["text"])
    return "".join(texts)


def _messages(input_, instructions) -> list[dict]:
    """The input items in Chat Completions' terms: messages, function calls (an
    assistant's, consecutive ones together) and their outputs (tool messages)."""
    out = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(input_, str):
        return out + [{"role": "user", "content": input_}]
    if not isinstance(input_, list) or not input_:
        raise bad_field("input", "must be text or a list of items")
    for i, item in enumerate(input_):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_field(where, "must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            if item.get("role") not in ("user", "system", "developer", "assistant"):
                raise bad_field(where + ".role", "must be user, system, developer or assistant")
            out.append({"role": item["role"], "content": _text(item.get("content"), where + ".content")})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise bad_field(where, "a function_call needs call_id, name and arguments")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad_field(where + ".call_id", "is required: the function_call this output answers")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text(item.get("output"),
                                                                                         where + ".output")})
        else:
            raise refused_field(where + ".type", f"{kind!r} is not supported by meshnet serve: it takes messages, "
                           "function_call and function_call_output items")
    return out


def responses_request(body) -> dict:
    """The Responses API's body -> Chat Completions' request fields; a field not taken is a 400."""
    if not isinstance(body, dict):
        raise bad_field("body", "must be a JSON object")
    for name, value in body.items():
        if name == "previous_response_id" and value is not None:
            raise refused_field(name, "is not supported: meshnet serve keeps no responses; send the conversation as "
                           "input items")
        if name not in TAKEN and name != "previous_response_id":
            raise refused_field(name, "is not a field of the Responses API that meshnet serve takes")
        if name in OFF and not any(type(value) is type(v) and value == v for v in OFF[name]):
            raise refused_field(name, "is not supported by meshnet serve: leave it out, or send "
                           + " or ".join(json.dumps(v) for v in OFF[name]))
    fields = {"model": body.get("model"), "messages": _messages(body.get("input"), body.get("instructions")),
              "stream": body.get("stream") is True}
    for ours, theirs in (("max_tokens", "max_output_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                         ("user", "user"), ("prompt_cache_key", "prompt_cache_key"),
                         ("parallel_tool_calls", "parallel_tool_calls")):
        if body.get(theirs) is not None:
            fields[ours] = body[theirs]
    if body.get("tools"):
        fields["tools"] = [_function(t, i) for i, t in enumerate(_list(body["tools"], "tools"))]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad_field("tool_choice", 'must be auto, none, required or {"type": "function", "name": ...}')
        fields["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None:
        fields["tool_choice"] = choice
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if body.get("text") is not None and not isinstance(body.get("text"), dict):
        raise bad_field("text", 'must be an object: {"format": {...}}')
    if fmt is not None and fmt.get("type") != "text":
        schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
        fields["response_format"] = {"type": fmt.get("type")} | ({"json_schema": schema}
                                                                 if fmt.get("type") == "json_schema" else {})
    if fields["stream"]:
        fields["stream_options"] = {"include_usage": True}
    return fields


def _list(value, where: str) -> list:
    if not isinstance(value, list):
        raise bad_field(where, "must be a list")
    return value


def _function(tool, i: int) -> dict:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise refused_field(where + ".type", f"{kind!r}: only function tools are supported by meshnet serve")
    for name in tool:
        if name not in ("type", "name", "description", "parameters", "strict"):
            raise refused_field(f"{where}.{name}", "is not a field meshnet serve takes")
    return {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters", "strict")
                                             if k in tool}}


def _usage(usage: dict | None) -> dict:
    usage = usage or {}
    prompt, completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


def _message_item(item_id: str, text: str, done: bool) -> dict:
    return {"type": "message", "id": item_id, "status": "completed" if done else "in_progress", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if done else []}


def _call_item(call: dict, done: bool = True) -> dict:
    return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"] if done else "",
            "status": "completed" if done else "in_progress"}


class _Response:
    """The response object, as it is when it starts and when it ends."""

    def __init__(self, body: dict, model: str):
        self.id, self.created = "resp_" + secrets.token_hex(12), int(time.time())
        self.body, self.model = body, model

    def object(self, status: str, output: list, usage: dict | None = None, finish: str | None = None) -> dict:
        incomplete = status == "completed" and finish == "length"
        fmt = (self.body.get("text") or {}).get("format") or {"type": "text"}
        return {"id": self.id, "object": "response", "created_at": self.created,
                "status": "incomplete" if incomplete else status, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "instructions": self.body.get("instructions"), "max_output_tokens": self.body.get("max_output_tokens"),
                "model": self.model, "output": output, "parallel_tool_calls": self.body.get("parallel_tool_calls", True),
                "previous_response_id": None, "reasoning": {"effort": None, "summary": None}, "store": False,
                "temperature": self.body.get("temperature"), "text": {"format": fmt},
                "tool_choice": self.body.get("tool_choice", "auto"), "tools": self.body.get("tools") or [],
                "top_p": self.body.get("top_p"), "truncation": "disabled",
                "usage": _usage(usage) if usage is not None else None, "user": self.body.get("user"),
                "metadata": self.body.get("metadata") or {}}


def response_of(reply: dict, shape: _Response) -> dict:
    """Chat Completions' answer -> the response object."""
    choice = reply["choices"][0]
    message = choice["message"]
    output = ([_message_item("msg_" + secrets.token_hex(12), message["content"], True)]
              if message.get("content") else []) + [_call_item(c) for c in message.get("tool_calls") or []]
    return shape.object("completed", output, reply.get("usage"), choice["finish_reason"])


async def _events(response, shape: _Response):
    """Chat Completions' stream -> the Responses API's events, numbered in order."""
    sequence = 0

    def event(kind: str, **data) -> str:
        nonlocal sequence
        sequence += 1
        return f"event: {kind}\ndata: {json.dumps(dict(type=kind, sequence_number=sequence - 1, **data))}\n\n"
    yield event("response.created", response=shape.object("in_progress", []))
    yield event("response.in_progress", response=shape.object("in_progress", []))
    output: list = []
    text, item_id = None, None

    def close_text():
        item = _message_item(item_id, text, True)
        output.append(item)
        index = len(output) - 1
        part = item["content"][0]
        return [event("response.output_text.done", item_id=item_id, output_index=index, content_index=0, text=text,
                      logprobs=[]),
                event("response.content_part.done", item_id=item_id, output_index=index, content_index=0, part=part),
                event("response.output_item.done", output_index=index, item=item)]
    async for kind, value in answer_events(response):
        if kind == "text":
            if text is None:
                text, item_id = "", "msg_" + secrets.token_hex(12)
                yield event("response.output_item.added", output_index=len(output),
                            item=_message_item(item_id, "", False))
                yield event("response.content_part.added", item_id=item_id, output_index=len(output),
                            content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                   "logprobs": []})
            text += value
            yield event("response.output_text.delta", item_id=item_id, output_index=len(output), content_index=0,
                        delta=value, logprobs=[])
        elif kind == "calls":
            if text is not None:
                for e in close_text():
                    yield e
                text = None
            for call in value:
                item = _call_item(call)
                index = len(output)
                yield event("response.output_item.added", output_index=index, item=_call_item(call, done=False))
                yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                            delta=item["arguments"])
                yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            name=item["name"], arguments=item["arguments"])
                yield event("response.output_item.done", output_index=index, item=item)
                output.append(item)
        elif kind == "error":
            failed = shape.object("failed", output)
            failed["error"] = {"code": value.get("code") or "server_error", "message": value.get("message")}
            yield event("response.failed", response=failed)
            return
        elif kind == "done":
            if text is not None:
                for e in close_text():
                    yield e
            finish, usage = value
            whole = shape.object("completed", output, usage, finish)
            yield event("response.incomplete" if whole["status"] == "incomplete" else "response.completed",
                        response=whole)


async def answer(completions: Completions, request: Request, model: str):
    """POST /v1/responses."""
    body = await read_json(request)
    fields = responses_request(body)
    shape = _Response(body, model)
    try:
        result = await chat_answer(completions, request, openai_chat_request(fields, NAMES))
    except MeshnetError as e:
        raise ApiError.of(e) from None
    if isinstance(result, StreamingResponse):
        return StreamingResponse(_events(result, shape), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    if not isinstance(result, dict):
        return result   # (a client gone)
    return response_of(result, shape)
