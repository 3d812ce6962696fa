"""Ollama's, Anthropic's and the Responses API's requests said in OpenAI's Chat Completions
terms, and the fields none of them takes refused by name (pure logic: plain data)."""

import pytest

from meshnet.serve.anthropic_api import message_of, messages_request
from meshnet.serve.ollama_api import ollama_chat_request, ollama_reply
from meshnet.serve.openai import ApiError
from meshnet.serve.responses_api import responses_request

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}


def refused(make, body) -> ApiError:
    with pytest.raises(ApiError) as e:
        make(body)
    assert e.value.status == 400
    return e.value


def test_ollama_options_format_and_tool_results_in_openai_s_terms():
    fields = ollama_chat_request({
        "model": "m:latest", "format": "json", "keep_alive": "5m",
        "options": {"temperature": 0.5, "num_predict": 32, "stop": ["\n"], "seed": 3},
        "messages": [{"role": "user", "content": "weather?"},
                     {"role": "assistant", "content": "", "tool_calls": [
                         {"function": {"name": "a", "arguments": {"x": 1}}},
                         {"function": {"name": "b", "arguments": {}}}]},
                     {"role": "tool", "content": "B", "tool_name": "b"},
                     {"role": "tool", "content": "A"}]}, "m")
    assert fields["model"] == "m" and fields["stream"] is True and fields["stream_options"] == {"include_usage": True}
    assert (fields["temperature"], fields["max_tokens"], fields["stop"], fields["seed"]) == (0.5, 32, ["\n"], 3)
    assert fields["response_format"] == {"type": "json_object"}
    calls = fields["messages"][1]["tool_calls"]
    assert calls[0]["function"] == {"name": "a", "arguments": '{"x": 1}'}
    # a result names its call by tool name, or answers the earliest one still open
    assert [m["tool_call_id"] for m in fields["messages"][2:]] == [calls[1]["id"], calls[0]["id"]]
    schema = ollama_chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}], "format": SCHEMA,
                                  "stream": False, "options": {"num_predict": -1}}, "m")
    assert schema["response_format"]["json_schema"]["schema"] == SCHEMA and "max_tokens" not in schema


@pytest.mark.parametrize("body, field", [
    ({"options": {"mirostat": 1}}, "options.mirostat"),
    ({"think": True}, "think"),
    ({"raw": True}, "raw"),
    ({"messages": [{"role": "user", "content": "x", "images": ["AAAA"]}]}, "messages[0].images"),
])
def test_ollama_fields_meshnet_cannot_honour_are_refused_by_name(body, field):
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], **body}
    assert refused(lambda b: ollama_chat_request(b, "m"), body).param == field


def test_an_ollama_answer_gives_a_call_s_arguments_as_an_object():
    reply = {"model": "m", "choices": [{"finish_reason": "tool_calls", "message": {"content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "a", "arguments": '{"x": 1}'}}]}}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 7}}
    out = ollama_reply(reply, False, 0.0)
    assert out["message"]["tool_calls"] == [{"function": {"index": 0, "name": "a", "arguments": {"x": 1}}}]
    assert (out["done"], out["done_reason"], out["prompt_eval_count"], out["eval_count"]) == (True, "stop", 5, 7)


def test_anthropic_blocks_in_openai_s_terms():
    fields = messages_request({
        "model": "m", "max_tokens": 10, "system": [{"type": "text", "text": "Be brief.", "cache_control": {}}],
        "stop_sequences": ["END"], "metadata": {"user_id": "u1"},
        "tools": [{"name": "a", "input_schema": SCHEMA}], "tool_choice": {"type": "any"},
        "messages": [{"role": "user", "content": "weather?"},
                     {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                                       {"type": "tool_use", "id": "t1", "name": "a", "input": {"city": "P"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                                                  {"type": "text", "text": "and tomorrow?"}]}]}, "m")
    assert fields["messages"][0] == {"role": "system", "content": "Be brief."}
    assert fields["messages"][2]["tool_calls"][0]["function"] == {"name": "a", "arguments": '{"city": "P"}'}
    assert fields["messages"][2]["content"] == "Let me look."
    assert fields["messages"][3] == {"role": "tool", "tool_call_id": "t1", "content": "sunny"}
    assert fields["messages"][4] == {"role": "user", "content": "and tomorrow?"}
    assert (fields["stop"], fields["user"], fields["tool_choice"], fields["parallel_tool_calls"]) == \
        (["END"], "u1", "required", True)
    assert fields["tools"] == [{"type": "function", "function": {"name": "a", "description": None, "parameters": SCHEMA}}]


@pytest.mark.parametrize("body, field", [
    ({"thinking": {"type": "enabled", "budget_tokens": 1000}}, "thinking"),
    ({"max_tokens": None}, "max_tokens"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "x", "name": "a", "input": {}}]}]},
     "messages[0].content[0].type"),
    ({"container": "c"}, "container"),
])
def test_anthropic_fields_meshnet_cannot_honour_are_refused_by_name(body, field):
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}], **body}
    assert refused(lambda b: messages_request(b, "m"), body).param == field


def test_an_anthropic_answer_names_its_stop():
    reply = {"model": "m", "choices": [{"finish_reason": "stop", "message": {"content": "hi"}}], "usage": {}}
    assert message_of(reply, {"stop_sequence": "END"})["stop_reason"] == "stop_sequence"
    assert message_of(reply, {"stop_sequence": None})["stop_reason"] == "end_turn"
    reply["choices"][0]["finish_reason"] = "length"
    assert message_of(reply, {})["stop_reason"] == "max_tokens"


def test_responses_input_items_in_openai_s_terms():
    fields = responses_request({
        "model": "m", "instructions": "Be brief.", "max_output_tokens": 20, "store": False,
        "text": {"format": {"type": "json_schema", "name": "p", "schema": SCHEMA, "strict": True}},
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
                  {"type": "function_call", "call_id": "c1", "name": "a", "arguments": "{}"},
                  {"type": "function_call", "call_id": "c2", "name": "a", "arguments": "{}"},
                  {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]})
    assert [m["role"] for m in fields["messages"]] == ["system", "user", "assistant", "tool"]
    assert [c["id"] for c in fields["messages"][2]["tool_calls"]] == ["c1", "c2"]
    assert fields["max_tokens"] == 20
    assert fields["response_format"] == {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA,
                                                                                "strict": True}}


@pytest.mark.parametrize("body, field", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"store": True}, "store"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
    ({"tools": [{"type": "file_search"}]}, "tools[0].type"),
    ({"conversation": "c"}, "conversation"),
])
def test_responses_fields_meshnet_cannot_honour_are_refused_by_name(body, field):
    assert refused(responses_request, {"model": "m", "input": "x", **body}).param == field


def test_a_bad_value_is_named_as_the_api_names_it():
    from meshnet.serve.chat import openai_chat_request
    from meshnet.serve.ollama_api import NAMES

    fields = ollama_chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                  "options": {"temperature": "hot"}}, "m")
    assert refused(lambda f: openai_chat_request(f, NAMES), fields).param == "options.temperature"
