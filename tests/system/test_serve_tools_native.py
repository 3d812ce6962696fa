"""Tool calls in a template's own format, through `meshnet serve` (two worker processes)
and the real `openai` client, on Qwen2.5-Coder-1.5B-Instruct, whose template writes Hermes
calls (`<tool_call>{"name", "arguments"}</tool_call>`): llama.cpp's common chat code on the
head puts the tools, the calls and their results into the template, the tail holds the
answer to its grammar, and the server parses it back by the same code."""

import json
import os

import jsonschema
import openai
import pytest

from conftest import serving

MODEL = "qwen2.5-coder-1.5b"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
# (without the system message's last sentence this small model, given the result, calls
# the tool again)
PARIS = [{"role": "system", "content": "You are a helpful assistant. Once a tool has given its result, "
                                       "answer the user's question in one sentence."},
         {"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(qwen_path):
    with serving("--model", MODEL, "--ctx", "1024", "--max-sessions", "2", env=dict(os.environ)) as (url, *_):
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)


def streamed(client, **kwargs):
    """A streamed answer's (content, tool calls as the deltas gave them, finish reasons)."""
    chunks = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = [call for c in chunks for call in (c.choices[0].delta.tool_calls or [])]
    return content, calls, [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_tool_call_round_trip_in_the_templates_own_format(client, stream):
    kwargs = dict(model=MODEL, messages=PARIS, tools=[WEATHER, TIME], tool_choice="required", max_tokens=60)
    if stream:
        content, calls, finishes = streamed(client, **kwargs)
        assert finishes == ["tool_calls"] and not content and len(calls) == 1 and calls[0].index == 0
        call = calls[0]
    else:
        reply = client.chat.completions.create(**kwargs)
        assert reply.choices[0].finish_reason == "tool_calls" and reply.choices[0].message.content is None
        (call,) = reply.choices[0].message.tool_calls   # parallel_tool_calls unset: one call
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    assert "paris" in arguments["city"].lower()
    # the call and its result go back into the template (Qwen's <tool_response>), and the
    # model answers in words from the result (tool_choice auto, or none: the tools are
    # still in the template, as llama-server puts them, but no call is made)
    history = PARIS + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                             "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"sky": "sunny", "temperature_c": 21})}]
    kwargs = dict(model=MODEL, messages=history, tools=[WEATHER, TIME], max_tokens=40,
                  tool_choice="none" if stream else "auto")
    if stream:
        text, calls, finishes = streamed(client, **kwargs)
        assert not calls and finishes and finishes[0] in ("stop", "length")
    else:
        reply = client.chat.completions.create(**kwargs)
        assert not reply.choices[0].message.tool_calls and reply.choices[0].finish_reason in ("stop", "length")
        text = reply.choices[0].message.content
    assert "21" in text or "sunny" in text.lower(), text


def test_a_named_tool_choice_calls_that_function_in_the_templates_format(client):
    reply = client.chat.completions.create(model=MODEL, messages=PARIS, tools=[WEATHER, TIME], max_tokens=60,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), TIME["function"]["parameters"])


def test_parallel_tool_calls_give_several_calls_when_the_model_makes_them(client):
    ask = [{"role": "user", "content": "What is the weather in Paris, and in Rome?"}]
    reply = client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER], tool_choice="required",
                                           parallel_tool_calls=True, max_tokens=120)
    calls = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and calls
    for call in calls:
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    assert len({c.id for c in calls}) == len(calls)


def test_tool_choice_auto_streams_a_text_answer_as_it_comes(client):
    ask = [{"role": "user", "content": "Say hello in French, in one word."}]
    kwargs = dict(model=MODEL, messages=ask, tools=[WEATHER], max_tokens=12)
    content, calls, finishes = streamed(client, **kwargs)
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert not calls and not whole.message.tool_calls
    assert content == whole.message.content and content.strip()
    assert finishes == [whole.finish_reason]
