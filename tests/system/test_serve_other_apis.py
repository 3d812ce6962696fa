"""The APIs tools speak beside OpenAI's chat completions, through `meshnet serve` (SmolLM2,
two worker processes) and each API's real client: Ollama's (the `ollama` package), OpenAI's
Responses (the `openai` client) and Anthropic's Messages (the `anthropic` client) each
complete a chat, a streamed chat (the same text, greedy) and a tool call; a field none of
them takes is a 400 naming it; llama-server's /tokenize and /detokenize."""

import json
import os

import anthropic
import jsonschema
import ollama
import openai
import pytest

from conftest import post_json, serving

MODEL = "smollm2"
KEY = "test-key-" + os.urandom(4).hex()
ASK = "What is the capital of France? Answer in one sentence."
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
           "additionalProperties": False}
WEATHER_ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def url(smollm2_path):
    with serving("--ctx", "1024", "--max-sessions", "4", env=dict(os.environ, MESHNET_API_KEY=KEY)) as (base, *_):
        yield base


@pytest.fixture(scope="module")
def chat_text(url):
    """The OpenAI route's greedy answer to ASK in 24 tokens: what every API must say."""
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}],
                                          max_tokens=24).choices[0].message.content


# ---- Ollama's API, through the ollama package

@pytest.fixture(scope="module")
def ollama_client(url):
    return ollama.Client(host=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


def test_ollama_lists_shows_and_chats_whole_and_streamed(ollama_client, chat_text):
    listed = ollama_client.list().models
    assert [m.model for m in listed] == [MODEL] and listed[0].details.format == "gguf"
    assert listed[0].digest == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert ollama_client.show(MODEL).modelinfo["general.architecture"] == "llama"
    messages = [{"role": "user", "content": ASK}]
    whole = ollama_client.chat(model=MODEL, messages=messages, options={"num_predict": 24})
    assert whole.message.content == chat_text and whole.done and whole.done_reason in ("stop", "length")
    assert whole.eval_count > 0 and whole.prompt_eval_count > 0
    parts = list(ollama_client.chat(model=f"{MODEL}:latest", messages=messages, stream=True,
                                    options={"num_predict": 24}))
    assert "".join(p.message.content for p in parts) == chat_text
    assert parts[-1].done and not any(p.done for p in parts[:-1])
    generated = ollama_client.generate(model=MODEL, prompt="The capital of France is", raw=True,
                                       options={"num_predict": 4})
    assert generated.response and generated.done


def test_ollama_calls_a_tool_with_its_arguments_as_an_object(ollama_client):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                               "parameters": WEATHER}}]
    reply = ollama_client.chat(model=MODEL, messages=[{"role": "user", "content": WEATHER_ASK}], tools=tools,
                               options={"num_predict": 96})
    calls = reply.message.tool_calls
    assert calls and calls[0].function.name == "get_weather"
    jsonschema.validate(dict(calls[0].function.arguments), WEATHER)


def test_ollama_refuses_what_it_cannot_honour_naming_the_field(ollama_client):
    for kwargs, field in (({"options": {"num_gpu": 1}}, "options.num_gpu"), ({"think": True}, "think")):
        with pytest.raises(ollama.ResponseError) as refused:
            ollama_client.chat(model=MODEL, messages=[{"role": "user", "content": "hi"}], **kwargs)
        assert refused.value.status_code == 400 and field in refused.value.error
    with pytest.raises(ollama.ResponseError) as unknown:
        ollama_client.chat(model="llama3", messages=[{"role": "user", "content": "hi"}])
    assert unknown.value.status_code == 404


# ---- OpenAI's Responses API, through the openai client

@pytest.fixture(scope="module")
def openai_client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def test_responses_answers_whole_and_streamed(openai_client, chat_text):
    whole = openai_client.responses.create(model=MODEL, input=ASK, max_output_tokens=24)
    assert whole.output_text == chat_text and whole.usage.output_tokens > 0
    events = list(openai_client.responses.create(model=MODEL, input=[{"role": "user", "content": ASK}],
                                                 max_output_tokens=24, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == chat_text
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output_text == chat_text


def test_responses_calls_a_tool_and_takes_its_output_back(openai_client):
    tools = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
              "parameters": WEATHER}]
    reply = openai_client.responses.create(model=MODEL, input=WEATHER_ASK, tools=tools, tool_choice="required",
                                           parallel_tool_calls=False, max_output_tokens=96)
    call = reply.output[-1]
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    streamed = list(openai_client.responses.create(model=MODEL, input=WEATHER_ASK, tools=tools, tool_choice="required",
                                                   parallel_tool_calls=False, max_output_tokens=96, stream=True))
    done = [e.item for e in streamed if e.type == "response.output_item.done"]
    assert done[-1].type == "function_call" and done[-1].arguments == call.arguments
    after = openai_client.responses.create(
        model=MODEL, tools=tools, max_output_tokens=48,
        input=[{"role": "user", "content": WEATHER_ASK}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}])
    assert after.status in ("completed", "incomplete") and after.output


def test_responses_structured_output_and_refusals(openai_client):
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}}, "required": ["name"],
              "additionalProperties": False}
    reply = openai_client.responses.create(model=MODEL, input="A person who lives in France, as JSON.",
                                           text={"format": {"type": "json_schema", "name": "person", "schema": person}},
                                           max_output_tokens=48)
    jsonschema.validate(json.loads(reply.output_text), person)
    for kwargs, field in (({"previous_response_id": "resp_x"}, "previous_response_id"), ({"store": True}, "store"),
                          ({"tools": [{"type": "web_search"}]}, "tools[0].type")):
        with pytest.raises(openai.BadRequestError) as refused:
            openai_client.responses.create(model=MODEL, input="hi", **kwargs)
        assert field in refused.value.message


# ---- Anthropic's Messages API, through the anthropic client

@pytest.fixture(scope="module")
def anthropic_client(url):
    return anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=120)


def test_messages_answer_whole_and_streamed_with_the_stop_sequence_named(anthropic_client, chat_text):
    whole = anthropic_client.messages.create(model=MODEL, max_tokens=24, messages=[{"role": "user", "content": ASK}])
    assert whole.content[0].text == chat_text and whole.stop_reason in ("end_turn", "max_tokens")
    with anthropic_client.messages.stream(model=MODEL, max_tokens=24, messages=[{"role": "user", "content": ASK}]) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == chat_text and final.usage.output_tokens == whole.usage.output_tokens
    word = chat_text.split()[2]
    stopped = anthropic_client.messages.create(model=MODEL, max_tokens=24, stop_sequences=[word],
                                               messages=[{"role": "user", "content": ASK}])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert word not in stopped.content[0].text


def test_messages_call_a_tool_whole_and_streamed(anthropic_client):
    tools = [{"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER}]
    kwargs = dict(model=MODEL, max_tokens=96, tools=tools,
                  tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
                  messages=[{"role": "user", "content": WEATHER_ASK}])
    reply = anthropic_client.messages.create(**kwargs)
    use = reply.content[-1]
    assert reply.stop_reason == "tool_use" and use.type == "tool_use" and use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER)
    with anthropic_client.messages.stream(**kwargs) as s:
        final = s.get_final_message()
    assert final.content[-1].input == use.input and final.stop_reason == "tool_use"
    after = anthropic_client.messages.create(
        model=MODEL, max_tokens=48, tools=tools,
        messages=[{"role": "user", "content": WEATHER_ASK}, {"role": "assistant", "content": reply.content},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny"}]}])
    assert after.content


def test_messages_refuse_what_they_cannot_honour_in_anthropic_s_error_shape(anthropic_client):
    for kwargs, field in (
            ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0]"),
            ({"messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "enabled", "budget_tokens": 1024}},
             "thinking")):
        with pytest.raises(anthropic.BadRequestError) as refused:
            anthropic_client.messages.create(model=MODEL, max_tokens=8, **kwargs)
        assert refused.value.body["type"] == "error" and field in refused.value.body["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=anthropic_client.base_url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}])


# ---- llama-server's /tokenize and /detokenize

def post(url, path, body):
    return post_json(url, path, body, KEY)


def test_tokenize_and_detokenize_round_trip_and_refuse_a_token_outside_the_vocabulary(url):
    status, tokens = post(url, "/tokenize", {"content": ASK})
    assert status == 200 and len(tokens["tokens"]) > 5
    assert post(url, "/detokenize", tokens) == (200, {"content": ASK})
    status, refused = post(url, "/detokenize", {"tokens": [1 << 30]})
    assert status == 400 and refused["error"]["code"] == "bad_token"


# ---- n choices of one request (OpenAI's n), each a session of its own

def test_n_choices_are_n_seeded_answers_whole_and_streamed(openai_client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": ASK}], max_tokens=12, temperature=0.9, seed=11)
    whole = openai_client.chat.completions.create(n=3, **kwargs)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    # choice i is the answer drawn with seed + i
    alone = [openai_client.chat.completions.create(**dict(kwargs, seed=11 + i)) for i in range(3)]
    singles = [a.choices[0].message.content for a in alone]
    assert [c.message.content for c in whole.choices] == singles
    assert whole.usage.prompt_tokens == alone[0].usage.prompt_tokens   # the prompt counted once
    assert whole.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    chunks = list(openai_client.chat.completions.create(n=3, stream=True, stream_options={"include_usage": True},
                                                        **kwargs))
    texts = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
             for i in range(3)]
    assert texts == singles and len({c.id for c in chunks}) == 1
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    text = openai_client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, n=2,
                                            temperature=0.9, seed=5)
    assert [c.index for c in text.choices] == [0, 1]


# ---- hostile bodies: a 400 in each API's shape, never a 500, and the server goes on

DEEP = b'{"model": "smollm2", "messages": ' + b"[" * 50000 + b"]" * 50000 + b"}"


@pytest.mark.parametrize("path", ["/api/chat", "/api/generate", "/api/show", "/v1/messages", "/v1/responses"])
@pytest.mark.parametrize("body", [DEEP, b"[1, 2]", b"{not json", json.dumps({"model": MODEL, "messages": "hi",
                                                                            "input": 7, "prompt": [], "max_tokens": 4}).encode()],
                         ids=["nested-50000-deep", "a-list", "not-json", "wrong-types"])
def test_a_hostile_body_is_a_400_in_the_api_s_own_shape(url, path, body):
    status, answer = post(url, path, body)
    assert status == 400, answer
    message = (answer["error"] if isinstance(answer["error"], str) else answer["error"]["message"])
    assert message and ("type" not in answer or answer["type"] == "error")
    assert post(url, "/tokenize", {"content": "still here"})[0] == 200
