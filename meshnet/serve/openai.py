"""OpenAI's API shapes for `meshnet serve`: the request bodies (strict pydantic types),
the checks of what the types leave open (check_request: text UTF-8 cannot encode, a
field meshnet does not honour, a chat message without a role it knows), the error
bodies and status codes, and the response pieces (choices, server-sent events)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from meshnet.core import errors
from meshnet.core.conversation import answer_sampling
from meshnet.core.errors import MeshnetError
from meshnet.core.logprobs import MAX_TOP
from meshnet.core.sampling import Sampling
from meshnet.engine import models
from meshnet.serve.structured import answer_schema, grammar_of
from meshnet.serve.tools import ToolRequest, request_of

RETRY_AFTER_S = 1
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
               405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error"}
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                   "repeat_penalty", "seed")
UNSUPPORTED_FIELD = "unsupported_field"   # the code of a field (or value) meshnet does not honour
TOO_LARGE = "request_too_large"           # the code of a body over MAX_BODY_BYTES
ROLES = ("system", "developer", "user", "assistant", "tool")
# OpenAI's request fields that meshnet does not honour, each with the values that mean
# "off" (null, and the default where a client sends it for "off"): a request with one of
# them is answered as it would be without the field; any other value is refused
# (unsupported_field), never ignored, since the answer would not be what was asked. A
# field neither here nor in the request models below is refused whatever its value.
OFF_VALUES = {
    "logit_bias": (None, {}), "echo": (None, False),
    "best_of": (None, 1), "suffix": (None,),
    "functions": (None, []), "function_call": (None, "none"), "store": (None, False), "metadata": (None, {}),
    "service_tier": (None, "auto"), "modalities": (None, ["text"]), "audio": (None,), "prediction": (None,),
    "reasoning_effort": (None,), "verbosity": (None,), "web_search_options": (None,),
    "safety_identifier": (None,),
    "chat_template_kwargs": (None, {}),   # (llama-server's: the head's template takes no arguments)
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


class FunctionCall(_Body):
    name: str
    arguments: str


class ToolCall(_Body):
    id: str
    type: str
    function: FunctionCall


class Message(_Body):
    role: str
    content: str | list[ContentPart] | None = None   # (None: check_request says which message lacks it)
    name: str | None = None   # a participant's name: taken, without effect (the chat template has no place for it)
    tool_calls: list[ToolCall] | None = None   # an assistant's calls (serve/tools.py)
    tool_call_id: str | None = None            # a tool message: the call it answers


class FunctionDef(_Body):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None   # the grammar holds the arguments to the schema whatever it says


class Tool(_Body):
    type: str
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class ToolChoice(_Body):
    type: str
    function: NamedFunction


class JsonSchemaFormat(_Body):
    name: str
    description: str | None = None
    # (the field's own name is pydantic's BaseModel.schema's)
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None   # the grammar holds the answer to the schema whatever it says


class ResponseFormat(_Body):
    type: str
    json_schema: JsonSchemaFormat | None = None


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
    user: str | None = None   # an end user's id: the prefix cache's scope (completions.cache_scope)
    prompt_cache_key: str | None = None   # a prefix cache scope named by the client, in place of user's
    response_format: ResponseFormat | None = None   # structured output (serve/structured.py)
    grammar: str | None = None   # llama-server's field: the answer follows this GBNF
    # llama-server's: n_predict is max_tokens (-1: no limit); cache_prompt false starts
    # from no kept prefix (true is meshnet's way already)
    n_predict: int | None = Field(None, ge=-1)
    cache_prompt: bool | None = None

    def token_limit(self) -> int | None:
        """The most tokens the answer may have (None: the rest of the context)."""
        given = getattr(self, "max_completion_tokens", None) or self.max_tokens
        return given or (self.n_predict if self.n_predict and self.n_predict > 0 else None)


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)   # the newer name of max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP)   # with logprobs: this many most likely tokens too
    tools: list[Tool] | None = None
    tool_choice: str | ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def logprobs_asked(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", code=errors.INVALID_ARGUMENT, param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Request):
    prompt: str | list[str]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP)   # each token's, and this many most likely tokens'

    def logprobs_asked(self) -> int | None:
        return self.logprobs


FIELD_NAMES = frozenset().union(*(model.model_fields for model in (
    ChatRequest, CompletionRequest, Message, ContentPart, StreamOptions, ResponseFormat, Tool, FunctionDef, ToolChoice,
    NamedFunction, ToolCall, FunctionCall)), {"schema"})


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
    if body.response_format is not None:
        _refuse_others(body.response_format, "response_format.")
        if body.response_format.json_schema is not None:
            _refuse_others(body.response_format.json_schema, "response_format.json_schema.")
    for i, m in enumerate(body.messages if isinstance(body, ChatRequest) else []):
        where = f"messages[{i}]"
        _refuse_others(m, where + ".")
        if m.role not in ROLES:
            raise ApiError(400, f"{where}.role must be one of {', '.join(ROLES)}", code=errors.INVALID_ARGUMENT,
                           param=where + ".role")
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            raise ApiError(400, f"{where}.content is required: the message's text (or text parts)",
                           code=errors.INVALID_ARGUMENT, param=where + ".content")
        if m.tool_calls is not None and m.role != "assistant":
            raise ApiError(400, f"{where}.tool_calls: only an assistant's message calls tools",
                           code=errors.INVALID_ARGUMENT, param=where + ".tool_calls")
        if (m.role == "tool") != (m.tool_call_id is not None):
            raise ApiError(400, f"{where}.tool_call_id: a tool message, and it alone, names the call it answers",
                           code=errors.INVALID_ARGUMENT, param=where + ".tool_call_id")
        for j, part in enumerate(m.content if isinstance(m.content, list) else []):
            at = f"{where}.content[{j}]"
            if part.type != "text":   # (before its other fields: an image_url part is refused for being one)
                raise ApiError(400, f"{at}.type: only text content parts are supported", code=UNSUPPORTED_FIELD,
                               param=at + ".type")
            _refuse_others(part, at + ".")
            if part.text is None:
                raise ApiError(400, f"{at}.text is required: the part's text", code=errors.INVALID_ARGUMENT,
                               param=at + ".text")


def tool_request(body: _Request) -> ToolRequest | None:
    """The tools of a chat request, checked (serve/tools.py); None: none to call."""
    if not isinstance(body, ChatRequest):
        return None
    try:
        request = request_of(body.tools, body.tool_choice, body.parallel_tool_calls)
        if request is not None:
            # as OpenAI: the calls are the tools', the final answer the format's
            request.answer_schema = answer_schema(body.response_format)
    except MeshnetError as e:
        raise ApiError(400, e.message, code=e.code, param=e.context.get("field")) from None
    if request is not None and body.grammar is not None:
        raise ApiError(400, "tools and a grammar cannot both be given: a raw grammar has no place for the calls; "
                       "give a response_format instead", code=errors.INVALID_ARGUMENT, param="grammar")
    return request


def sampling_of(body: _Request, plan=None) -> Sampling | None:
    """No temperature: greedy (meshnet's default). A temperature without a seed: a fresh
    seed per request. A response_format, grammar or tools to call (PLAN, serve/tools.py):
    the tail's grammar."""
    given = {name: getattr(body, name) for name in SAMPLING_FIELDS if getattr(body, name) is not None}
    try:
        if plan is not None:
            given.update(plan.grammar_fields())
        else:
            grammar = grammar_of(body.response_format, body.grammar)
            if grammar:
                given["grammar"] = grammar
        if not given:
            return None
        return answer_sampling(Sampling(**given), "seed" in given)
    except MeshnetError as e:
        raise ApiError(400, e.message, code=e.code, param=e.context.get("field")) from None


def chat_messages(messages: list[Message]) -> list[dict]:
    """OpenAI's messages as checked (check_request), as plain data: role, content text
    (parts joined), and an assistant's tool calls or a tool result's call id and name."""
    out = []
    for m in messages:
        content = m.content if isinstance(m.content, str) or m.content is None else "".join(p.text for p in m.content)
        message = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": c.type,
                                      "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                     for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            message["name"] = m.name
        out.append(message)
    return out


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _token_text(piece: bytes) -> str:
    return piece.decode("utf-8", errors="replace")


def logprobs_of(chat: bool, entries: list | None, text_offset: int = 0) -> dict | None:
    """OpenAI's logprobs of a choice (or a chunk's) from the tail's entries: each token's
    (piece, logprob, [(token, logprob, piece)] of the most likely). None: none asked."""
    if entries is None:
        return None
    if chat:
        def one(piece, logprob):
            return {"token": _token_text(piece), "logprob": logprob, "bytes": list(piece)}
        return {"content": [dict(one(piece, logprob), top_logprobs=[one(p, lp) for _, lp, p in top])
                            for piece, logprob, top in entries], "refusal": None}
    offsets, at = [], text_offset
    for piece, _, _ in entries:
        offsets.append(at)
        at += len(_token_text(piece))
    return {"tokens": [_token_text(piece) for piece, _, _ in entries],
            "token_logprobs": [logprob for _, logprob, _ in entries],
            "top_logprobs": [{_token_text(p): lp for _, lp, p in top} for _, _, top in entries],
            "text_offset": offsets}


def choice(chat: bool, text: str | None, finish: str | None, stream: bool, logprobs: dict | None = None,
           tool_calls: list | None = None) -> dict:
    if not chat:
        return {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
    if stream:
        delta = {} if text is None else {"content": text}
        if tool_calls:
            delta["tool_calls"] = [dict(call, index=i) for i, call in enumerate(tool_calls)]
        return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    message = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}


def model_id(model: str | None) -> str:
    """The name clients ask for: a known model's name, a GGUF file's stem (a split model's
    without its split number), a hub name's ORG/REPO[:QUANT], an Ollama name's NAME:TAG."""
    model = model or models.DEFAULT_MODEL
    if model in models.MODELS:
        return model
    if model.startswith("hf:"):
        return model[len("hf:"):]
    if model.startswith("ollama:"):
        name = model[len("ollama:"):]
        return name if ":" in name.rsplit("/", 1)[-1] else name + ":latest"
    stem = Path(model).stem
    return re.sub(r"-\d{5}-of-\d{5}$", "", stem)
