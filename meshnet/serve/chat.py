"""A chat completion as one call: what OpenAI's /v1/chat/completions runs, and what the
other APIs' routes run once they have said their request in OpenAI's terms (Ollama's
/api/chat and /api/generate, Anthropic's /v1/messages, OpenAI's /v1/responses): the
request checked, its tools planned, its prompt built by the model's chat template, and
the answer as OpenAI's chat.completion (a dict) or its stream of chunks (a response)."""

from __future__ import annotations

import json

from fastapi import Request
from pydantic import ValidationError

from meshnet.core import errors
from meshnet.core.conversation import prompt_tokens as chat_prompt_tokens
from meshnet.serve.completions import Completions
from meshnet.serve.openai import UNSUPPORTED_FIELD, ApiError, ChatRequest, chat_messages, check_request, field_path, tool_request
from meshnet.serve.tools import generic_message


def refused_field(field: str, why: str) -> ApiError:
    """A 400 for a field meshnet serve does not honour (or a value of it), named by FIELD as
    the request's API names it."""
    return ApiError(400, f"{field} {why}", code=UNSUPPORTED_FIELD, param=field)


def bad_field(field: str, why: str) -> ApiError:
    """A 400 for a field whose value is not what the API takes."""
    return ApiError(400, f"{field} {why}", code=errors.INVALID_ARGUMENT, param=field)


async def read_json(request: Request):
    """The request's JSON body (an empty one: {}); a body that is not JSON, or is nested past
    what the parser takes (json's recursion: a hostile "[[[[...") is a 400, not a 500."""
    try:
        return json.loads(await request.body() or b"{}")
    except (ValueError, RecursionError):
        raise bad_field("body", "is not JSON (or is nested deeper than a request can be)") from None


async def chat_answer(completions: Completions, request: Request, body: ChatRequest, report: dict | None = None):
    check_request(body)
    tools = tool_request(body)
    messages = chat_messages(body.messages)
    coordinator = completions.coordinator

    def prepare(limit: int):   # once the request has a slot: the head's text work waits in the queue too
        plan = completions.tool_plan(tools, messages, limit) if tools is not None else None
        if plan is None:   # (no tools, or tool_choice none on a template that knows none)
            return None, chat_prompt_tokens(coordinator, [generic_message(m) for m in messages], limit)
        return plan, plan.tokens(coordinator, messages, limit)
    return await completions.answer(request, body, True, prepare, body.token_limit(),
                                    tools=tools is not None, report=report)


def openai_chat_request(fields: dict, names: dict[str, str] | None = None) -> ChatRequest:
    """FIELDS, another API's request said in OpenAI's terms, as a checked ChatRequest; a
    field that does not hold is a 400 named as the other API names it (NAMES: OpenAI's
    name -> that API's, where they differ)."""
    try:
        return ChatRequest.model_validate(fields)
    except ValidationError as e:
        first = e.errors()[0]
        path = field_path(first["loc"]) or "body"
        for ours, theirs in (names or {}).items():
            if path == ours or path.startswith(ours + ".") or path.startswith(ours + "["):
                path = theirs + path[len(ours):]
                break
        raise ApiError(400, f"{path}: {first['msg']}", code=errors.INVALID_ARGUMENT, param=path) from None


async def openai_chunks(response):
    """The chunks of OpenAI's stream RESPONSE (chat.completion.chunk dicts, an error body
    as {"error": ...}), and None for each keep-alive: what another API's stream says."""
    async for event in response.body_iterator:
        text = event.decode() if isinstance(event, bytes) else event
        for line in text.split("\n"):
            if line.startswith(": "):
                yield None
            elif line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[len("data: "):])


async def answer_events(response):
    """OpenAI's stream RESPONSE as what every API's stream says, in order: ("text", piece),
    ("calls", [OpenAI tool calls]), ("keepalive", None), and at the end ("error", OpenAI's
    error body) or ("done", (finish_reason, usage))."""
    finish = usage = None
    async for chunk in openai_chunks(response):
        if chunk is None:
            yield "keepalive", None
            continue
        if "error" in chunk:
            yield "error", chunk["error"]
            return
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices") or []:
            finish = choice.get("finish_reason") or finish
            delta = choice.get("delta") or {}
            if delta.get("content"):
                yield "text", delta["content"]
            if delta.get("tool_calls"):
                yield "calls", [{k: v for k, v in call.items() if k != "index"} for call in delta["tool_calls"]]
    yield "done", (finish, usage)
