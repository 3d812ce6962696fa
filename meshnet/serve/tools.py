"""Tool calls for `meshnet serve` in the generic format (llama.cpp's, before its chat code
learnt each family's own): the tools are described to the model in a system message, and
the answer is held by a JSON schema's grammar to `{"tool_calls": [{"name", "arguments"}]}`
(a call, or several with parallel_tool_calls) or, with tool_choice auto, `{"response": text}`.
So any model answers a named or required tool_choice with a valid call to the tools asked
for, whatever its chat template knows. A conversation's tool calls and results go back to the
template as text in the same JSON."""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from meshnet.core import errors
from meshnet.core.errors import MeshnetError
from meshnet.engine.binding import json_schema_grammar

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
INSTRUCTION = ("You can call these tools (JSON schemas of their arguments):\n{tools}\n\n"
               "Respond in JSON: {form}.")
CALL_FORM = '{"tool_calls": [{"name": <a tool\'s name>, "arguments": <its arguments>}]} to call tools'
RESPONSE_FORM = ' or {"response": <your answer>} to answer the user'


def _refused(message: str, field: str) -> MeshnetError:
    return MeshnetError(errors.INVALID_ARGUMENT, message, field=field)


@dataclass
class ToolPlan:
    grammar: str
    instruction: str

    def messages(self, messages: list[dict]) -> list[dict]:
        """The chat with the tools' instruction at the head of its system message."""
        if messages and messages[0]["role"] == "system":
            return [{"role": "system", "content": messages[0]["content"] + "\n\n" + self.instruction}] + messages[1:]
        return [{"role": "system", "content": self.instruction}] + messages

    @staticmethod
    def parse(text: str) -> tuple[str | None, list[dict] | None]:
        """The answer's (content, OpenAI tool_calls): one or the other. A text the grammar
        held yet cut short (max_tokens) is content as it came."""
        try:
            answer = json.loads(text)
        except ValueError:
            return text, None
        if isinstance(answer, dict) and isinstance(answer.get("tool_calls"), list):
            return None, [{"id": "call_" + secrets.token_hex(12), "type": "function",
                           "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}}
                          for call in answer["tool_calls"]]
        if isinstance(answer, dict) and isinstance(answer.get("response"), str):
            return answer["response"], None
        return text, None


def plan_of(tools, tool_choice, parallel: bool | None) -> ToolPlan | None:
    """The plan of a chat request's tools (None: no tools, or tool_choice none)."""
    if tool_choice is not None and tools is None:
        raise _refused("tool_choice needs tools", "tool_choice")
    if not tools:
        return None
    schemas = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if tool.type != "function":
            raise _refused(f"{where}.type must be function, not {tool.type!r}", where + ".type")
        function = tool.function
        if not NAME.match(function.name):
            raise _refused(f"{where}.function.name must be 1 to 64 letters, digits, _ or -, not {function.name!r}",
                           where + ".function.name")
        if function.name in schemas:
            raise _refused(f"{where}.function.name {function.name!r} names two tools", where + ".function.name")
        parameters = function.parameters if function.parameters is not None else {"type": "object", "properties": {}}
        if parameters.get("type", "object") != "object":
            raise _refused(f"{where}.function.parameters must be a JSON schema of an object",
                           where + ".function.parameters")
        try:
            json_schema_grammar(json.dumps(parameters))   # a schema the grammar builder cannot take is the tool's fault
        except MeshnetError as e:
            raise _refused(f"{where}.function.parameters: {e.message}", where + ".function.parameters") from None
        schemas[function.name] = (function, parameters)
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise _refused(f"tool_choice must be auto, none, required or a function, not {choice!r}", "tool_choice")
        if choice == "none":
            return None
        names = list(schemas)
    else:
        if choice.type != "function" or choice.function.name not in schemas:
            raise _refused(f"tool_choice names the function {choice.function.name!r}, which is not among the tools",
                           "tool_choice.function.name")
        names, choice = [choice.function.name], "required"
    call = {"anyOf": [{"type": "object", "properties": {"name": {"const": name}, "arguments": schemas[name][1]},
                       "required": ["name", "arguments"], "additionalProperties": False} for name in names]}
    calls = {"type": "array", "items": call, "minItems": 1, **({} if parallel else {"maxItems": 1})}
    schema = {"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"],
              "additionalProperties": False}
    if choice == "auto":
        schema = {"anyOf": [schema, {"type": "object", "properties": {"response": {"type": "string"}},
                                     "required": ["response"], "additionalProperties": False}]}
    described = "\n".join(json.dumps({"name": name, "description": schemas[name][0].description or "",
                                      "parameters": schemas[name][1]}) for name in names)
    form = CALL_FORM + (RESPONSE_FORM if choice == "auto" else "")
    return ToolPlan(json_schema_grammar(json.dumps(schema)), INSTRUCTION.format(tools=described, form=form))


def generic_message(role: str, content: str | None, tool_calls, tool_call_id: str | None, name: str | None) -> dict:
    """A message of a conversation with tools as the template takes it: role and text."""
    if role == "tool":
        return {"role": "user", "content": json.dumps({"tool_response": {"tool_call_id": tool_call_id, "name": name,
                                                                          "content": content or ""}})}
    if tool_calls:
        calls = [{"name": c.function.name, "arguments": _arguments(c.function.arguments)} for c in tool_calls]
        return {"role": role, "content": json.dumps({"tool_calls": calls})}
    return {"role": role, "content": content or ""}


def _arguments(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text
