"""Tool calls for `meshnet serve`. A chat request's tools are checked once (request_of),
then answered in one of two ways:

- NativePlan, for a chat template that knows tools (Qwen2.5's Hermes format, Llama 3's,
  Mistral's...): llama.cpp's common chat code on the head (the CHAT message) puts the
  tools, the calls and their results into the model's own template, and gives the grammar
  the tail holds the answer to and the format it is parsed back by (here, by the same
  code), as llama-server does.
- GenericPlan, for one that does not (SmolLM2's): the generic format (llama.cpp's, before
  its chat code learnt each family's own): the tools are described in a system message,
  and the answer is held by a JSON schema's grammar to `{"tool_calls": [{"name",
  "arguments"}]}` (a call, or several with parallel_tool_calls) or, with tool_choice auto,
  `{"response": text}`. The calls and results of the conversation go back as that JSON.

Either way a named or required tool_choice gets a valid call to the tools asked for. With
tool_choice auto a model often writes its call in a form of its own rather than its
template's (Qwen2.5 a fenced JSON object, where its Hermes template waits for <tool_call>):
a JSON object naming an offered tool with arguments that hold its schema's required keys,
bare or fenced, alone or in a list, is a call too (loose_calls); while the answer streams,
such a block is held back until the whole answer says which it is."""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from meshnet.core import errors
from meshnet.core.conversation import prompt_tokens
from meshnet.core.errors import MeshnetError
from meshnet.engine.binding import chat_parse, json_schema_grammar

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
INSTRUCTION = ("You can call these tools (JSON schemas of their arguments):\n{tools}\n\n"
               "Respond in JSON: {form}.")
CALL_FORM = '{"tool_calls": [{"name": <a tool\'s name>, "arguments": <its arguments>}]} to call tools'
RESPONSE_FORM = ' or {"response": <your answer>} to answer the user'


def _refused(message: str, field: str) -> MeshnetError:
    return MeshnetError(errors.INVALID_ARGUMENT, message, field=field)


def _call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolRequest:
    """A chat request's tools as checked: the functions the answer may call, and how."""
    tools: list[dict]        # OpenAI's tool objects of those functions (a named tool_choice: it alone)
    parameters: dict         # each one's name -> the JSON schema of its arguments
    descriptions: dict       # ... -> its description
    choice: str              # "auto", "none" or "required" (a named function is required, alone)
    parallel: bool
    answer_schema: dict | None = None   # a response_format's: the schema the final answer (no call) holds


def request_of(tools, tool_choice, parallel: bool | None) -> ToolRequest | None:
    """The checked tools of a chat request (None: no tools); a bad tool or tool_choice is
    an INVALID_ARGUMENT naming its field."""
    if tool_choice is not None and tools is None:
        raise _refused("tool_choice needs tools", "tool_choice")
    if not tools:
        return None
    parameters, descriptions, offered = {}, {}, {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if tool.type != "function":
            raise _refused(f"{where}.type must be function, not {tool.type!r}", where + ".type")
        function = tool.function
        if not NAME.match(function.name):
            raise _refused(f"{where}.function.name must be 1 to 64 letters, digits, _ or -, not {function.name!r}",
                           where + ".function.name")
        if function.name in parameters:
            raise _refused(f"{where}.function.name {function.name!r} names two tools", where + ".function.name")
        schema = function.parameters if function.parameters is not None else {"type": "object", "properties": {}}
        if schema.get("type", "object") != "object":
            raise _refused(f"{where}.function.parameters must be a JSON schema of an object",
                           where + ".function.parameters")
        try:
            json_schema_grammar(json.dumps(schema))   # a schema the grammar builder cannot take is the tool's fault
        except MeshnetError as e:
            raise _refused(f"{where}.function.parameters: {e.message}", where + ".function.parameters") from None
        parameters[function.name], descriptions[function.name] = schema, function.description or ""
        offered[function.name] = {"type": "function", "function": {
            "name": function.name, "description": function.description or "", "parameters": schema}}
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise _refused(f"tool_choice must be auto, none, required or a function, not {choice!r}", "tool_choice")
        names = list(parameters)
    else:
        if choice.type != "function" or choice.function.name not in parameters:
            raise _refused(f"tool_choice names the function {choice.function.name!r}, which is not among the tools",
                           "tool_choice.function.name")
        names, choice = [choice.function.name], "required"
    return ToolRequest([offered[n] for n in names], {n: parameters[n] for n in names},
                       {n: descriptions[n] for n in names}, choice, bool(parallel))


def knows_tools(caps: dict) -> bool:
    """A template (its capabilities, as llama.cpp's common chat code reads them) that
    describes tools and writes calls in a format of its own."""
    return bool(caps.get("supports_tools") and caps.get("supports_tool_calls"))


class GenericPlan:
    """The generic format: see the module's doc."""

    streams_content = False   # the answer is JSON until it is whole
    stops: list[str] = []

    def __init__(self, request: ToolRequest):
        self.answer_schema = request.answer_schema
        call = {"anyOf": [{"type": "object",
                           "properties": {"name": {"const": name}, "arguments": request.parameters[name]},
                           "required": ["name", "arguments"], "additionalProperties": False}
                          for name in request.parameters]}
        calls = {"type": "array", "items": call, "minItems": 1, **({} if request.parallel else {"maxItems": 1})}
        schema = {"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"],
                  "additionalProperties": False}
        if request.choice == "auto":
            answer = request.answer_schema if request.answer_schema is not None else {"type": "string"}
            schema = {"anyOf": [schema, {"type": "object", "properties": {"response": answer},
                                         "required": ["response"], "additionalProperties": False}]}
        described = "\n".join(json.dumps({"name": name, "description": request.descriptions[name],
                                          "parameters": request.parameters[name]}) for name in request.parameters)
        form = CALL_FORM + (RESPONSE_FORM if request.choice == "auto" else "")
        self.grammar = json_schema_grammar(json.dumps(schema))
        self.instruction = INSTRUCTION.format(tools=described, form=form)

    def grammar_fields(self) -> dict:
        return {"grammar": self.grammar}

    def tokens(self, coordinator, messages: list[dict], limit: int | None) -> list[int]:
        """The prompt: the template over the chat as text, the tools' instruction at the
        head of its system message."""
        chat = [generic_message(m) for m in messages]
        if chat[0]["role"] == "system":
            chat[0] = {"role": "system", "content": chat[0]["content"] + "\n\n" + self.instruction}
        else:
            chat.insert(0, {"role": "system", "content": self.instruction})
        return prompt_tokens(coordinator, chat, limit)

    def parse(self, text: str, partial: bool = False) -> tuple[str | None, list[dict] | None]:
        """The answer's (content, OpenAI tool_calls): one or the other; an answer held to a
        response_format is its JSON. A text the grammar held yet cut short (max_tokens) is
        content as it came."""
        try:
            answer = json.loads(text)
        except ValueError:
            return text, None
        if isinstance(answer, dict) and isinstance(answer.get("tool_calls"), list):
            return None, [{"id": _call_id(), "type": "function",
                           "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}}
                          for call in answer["tool_calls"]]
        if isinstance(answer, dict) and "response" in answer:
            if self.answer_schema is not None:
                return json.dumps(answer["response"], ensure_ascii=False), None
            if isinstance(answer["response"], str):
                return answer["response"], None
        return text, None


class NativePlan:
    """The template's own tool format, by llama.cpp's common chat code: see the module's doc."""

    streams_content = True   # text before a call is the model's, and is shown as it comes

    def __init__(self, request: ToolRequest, coordinator, messages: list[dict], limit: int | None):
        self.choice, self.parameters = request.choice, request.parameters
        self.chat = coordinator.chat_apply({"messages": messages, "tools": request.tools,
                                            "tool_choice": request.choice,
                                            "parallel_tool_calls": request.parallel}, limit=limit)
        self.stops = list(self.chat.get("additional_stops") or [])
        # a strict grammar begins with the generation prompt (the assistant's header) that
        # ends the prompt: those tokens are the grammar's too, as common/sampling.cpp feeds
        # them to it; a lazy one starts at its trigger
        header = self.chat.get("generation_prompt") or ""
        self.header = (coordinator.tokenize(header, add_special=False, parse_special=True)
                       if header and self.chat.get("grammar") and not self.chat.get("grammar_lazy") else [])
        self.prefill = len(self.header)

    def grammar_fields(self) -> dict:
        chat = self.chat
        if not chat.get("grammar"):
            return {}
        return {"grammar": chat["grammar"], "grammar_lazy": bool(chat["grammar_lazy"]),
                "trigger_patterns": tuple(chat["trigger_patterns"]), "trigger_tokens": tuple(chat["trigger_tokens"]),
                "grammar_prefill": self.prefill}

    def tokens(self, coordinator, messages: list[dict], limit: int | None) -> list[int]:
        """The template's prompt, which ends in the tokens of the grammar's header."""
        tokens = coordinator.tokenize(self.chat["prompt"], add_special=True, parse_special=True, limit=limit)
        if tokens[len(tokens) - len(self.header):] != self.header:
            raise MeshnetError(errors.INTERNAL, "the template's prompt does not end in the tokens of its generation "
                               f"prompt {self.chat['generation_prompt']!r}, which its tool-call grammar begins with")
        return tokens

    def parse(self, text: str, partial: bool = False) -> tuple[str | None, list[dict] | None]:
        """The answer's (content, OpenAI tool_calls), by the template's format; PARTIAL: the
        text may go on (a stream), so a call not yet closed is not given. With tool_choice
        none a call the model writes anyway is text: it asked for none."""
        if self.choice == "none":
            return text, None
        message = chat_parse(self.chat, text, partial)
        calls = [{"id": call.get("id") or _call_id(), "type": "function",
                  "function": {"name": call["function"]["name"], "arguments": call["function"]["arguments"]}}
                 for call in message.get("tool_calls") or []]
        content = message.get("content")
        if not calls and self.choice == "auto" and content:
            if partial:   # a call in a form of the model's own may be under way: it is not shown as text
                return content[:held_from(content)], None
            content, calls = loose_calls(content, self.parameters)
        return (content if content or not calls else None), (calls or None)


# the first key of a call in a form of the model's own
_CALL_KEYS = ("name", "tool_calls", "function")
_FENCED = re.compile(r"```[a-z]*\s*\n?(.*?)```", re.S)


def held_from(text: str) -> int:
    """Where the part of a streaming TEXT begins that may be the start of a call in a form
    of the model's own (a fence, a list, an object whose first key names a call), and is
    held back until more text says; len(TEXT): none."""
    for at, c in enumerate(text):
        if c in "`[{" and _may_begin_call(text[at:]):
            return at
    return len(text)


def _may_begin_call(s: str) -> bool:
    """Whether S is, or may go on to be, the opening of a call: ```lang, [, {"name": (as
    _CALL_KEYS), with any white space between."""
    i, n = 0, len(s)

    def space(i: int) -> int:
        while i < n and s[i].isspace():
            i += 1
        return i
    if s.startswith("```"):
        i = 3
        while i < n and s[i].isalpha():
            i += 1
    elif "```".startswith(s):
        return True
    i = space(i)
    if i < n and s[i] == "[":
        i = space(i + 1)
    if i >= n:
        return True
    if s[i] != "{":
        return False
    i = space(i + 1)
    if i >= n:
        return True
    if s[i] != '"':
        return False
    rest = s[i + 1:]
    for key in _CALL_KEYS:
        if (key + '"').startswith(rest):
            return True
        if rest.startswith(key + '"'):
            j = i + 1 + len(key) + 1
            while j < n and s[j].isspace():
                j += 1
            return j >= n or s[j] == ":"
    return False


def loose_calls(text: str, parameters: dict) -> tuple[str | None, list[dict] | None]:
    """TEXT's (content, calls) where it holds calls in a form of the model's own: a JSON
    object {"name", "arguments" (or "parameters")}, {"function": {...}} or {"tool_calls":
    [...]}, or a list of them, bare or in a code fence, each naming a tool of PARAMETERS
    with arguments that are an object holding its schema's required keys. Anything else
    is content, as it came."""
    blocks = [(m.start(), m.end(), m.group(1)) for m in _FENCED.finditer(text)]
    stripped = text.strip()
    if stripped[:1] in "{[":
        blocks.append((text.index(stripped[0]), len(text), stripped))
    for start, end, block in blocks:
        calls = _calls_in(block, parameters)
        if calls:
            rest = (text[:start] + text[end:]).strip()
            return rest or None, calls
    return text, None


def _calls_in(block: str, parameters: dict) -> list[dict] | None:
    try:
        found = json.loads(block)
    except ValueError:
        return None
    if isinstance(found, dict) and isinstance(found.get("tool_calls"), list):
        found = found["tool_calls"]
    calls = []
    for call in found if isinstance(found, list) else [found]:
        if isinstance(call, dict) and isinstance(call.get("function"), dict):
            call = call["function"]
        if not isinstance(call, dict) or call.get("name") not in parameters:
            return None
        arguments = call.get("arguments", call.get("parameters", {}))
        if isinstance(arguments, str):
            arguments = _arguments(arguments)
        required = parameters[call["name"]].get("required") or []
        if not isinstance(arguments, dict) or not all(key in arguments for key in required):
            return None
        calls.append({"id": _call_id(), "type": "function",
                      "function": {"name": call["name"], "arguments": json.dumps(arguments)}})
    return calls or None


def plan_of(request: ToolRequest, caps: dict, coordinator, messages: list[dict], limit: int | None):
    """How REQUEST's tools are answered, for a template of CAPS: the plan (blocks on the
    head, for a template that knows tools), or None: a plain chat (tool_choice none, on a
    template that does not know tools). A template that knows them is given them even
    with tool_choice none, as llama-server does: the calls and results of the
    conversation are written in its format, and the model knows what it has called.
    With a response_format the generic format is taken whatever the template: its one
    grammar holds the answer to a call or to the format, which a template's own tool
    grammar (lazy, waiting for its call's opening tag) cannot."""
    if knows_tools(caps) and request.answer_schema is None:
        return NativePlan(request, coordinator, messages, limit)
    return GenericPlan(request) if request.choice != "none" else None


def generic_message(message: dict) -> dict:
    """A message of a conversation with tools (OpenAI's) as a template without tools takes
    it: role and text."""
    role, content = message["role"], message.get("content")
    if role == "tool":
        return {"role": "user", "content": json.dumps({"tool_response": {
            "tool_call_id": message.get("tool_call_id"), "name": message.get("name"), "content": content or ""}})}
    if message.get("tool_calls"):
        calls = [{"name": c["function"]["name"], "arguments": _arguments(c["function"]["arguments"])}
                 for c in message["tool_calls"]]
        return {"role": role, "content": json.dumps({"tool_calls": calls})}
    return {"role": role, "content": content or ""}


def _arguments(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text
