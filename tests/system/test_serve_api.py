"""What clients build on, through `meshnet serve` and the real `openai` client (SmolLM2,
two worker processes): structured output (a JSON schema's grammar, llama.cpp's
json-schema-to-grammar, at the tail; json_object; a raw GBNF grammar) and logprobs. A
schema, format or count the engine cannot take is a 400 in OpenAI's shape."""

import json
import os
from concurrent.futures import ThreadPoolExecutor

import agents
import jsonschema
import numpy as np
import openai
import pytest

from meshnet.engine.binding import Entry, Stage

from conftest import serving

MODEL = "smollm2"
KEY = "test-key-" + os.urandom(4).hex()
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "Lyon", "Nice"]},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person who lives in France, as JSON."}]
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


@pytest.fixture(scope="module")
def client(smollm2_path):
    with serving("--ctx", "1024", "--max-sessions", "4", env=dict(os.environ, MESHNET_API_KEY=KEY)) as (url, *_):
        yield openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def test_a_json_schema_answer_validates_in_20_of_20_seeded_runs(client):
    def answer(seed):
        reply = client.chat.completions.create(model=MODEL, messages=ASK, response_format=FORMAT, temperature=0.9,
                                               seed=seed, max_tokens=200)
        return reply.choices[0]
    with ThreadPoolExecutor(4) as pool:
        choices = list(pool.map(answer, range(1, 21)))
    for choice in choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    assert len({c.message.content for c in choices}) > 1   # seeded draws, not one answer forced


def test_a_streamed_structured_answer_is_the_unstreamed_one_with_the_same_seed(client):
    kwargs = dict(model=MODEL, messages=ASK, response_format=FORMAT, temperature=0.9, seed=7, max_tokens=200)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
                       if c.choices)
    assert streamed == whole
    jsonschema.validate(json.loads(whole), PERSON)


def test_json_object_gives_an_object_and_a_raw_grammar_is_followed(client):
    cat = [{"role": "user", "content": "Describe a cat in JSON with the keys name and colour."}]
    reply = client.chat.completions.create(model=MODEL, messages=cat, response_format={"type": "json_object"},
                                           max_tokens=100)
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    answers = set()
    for seed in range(6):
        reply = client.completions.create(model=MODEL, prompt="Is the sky green? Answer:", max_tokens=8,
                                          temperature=1.0, seed=seed, extra_body={"grammar": 'root ::= " yes" | " no"'})
        answers.add(reply.choices[0].text)
        assert reply.choices[0].finish_reason == "stop"
    assert answers <= {" yes", " no"}


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
      "properties": {"a": {"$ref": "#/nowhere"}}}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_object"}, "grammar": 'root ::= "a"'}, "grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "colour": 1}}},
     "response_format.json_schema.colour"),
])
def test_a_format_the_engine_cannot_take_is_a_400_naming_its_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as bad:
        client.post("/chat/completions", body={"model": MODEL, "messages": ASK, "max_tokens": 4, **extra}, cast_to=object)
    assert bad.value.status_code == 400 and bad.value.body["param"] == param, bad.value.body
    assert bad.value.body["type"] == "invalid_request_error" and bad.value.body["message"]
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=2).usage.completion_tokens == 2


def test_a_grammar_that_is_not_gbnf_is_a_400_and_the_server_goes_on(client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, extra_body={"grammar": "root ::= ("})
    assert bad.value.status_code == 400 and "grammar" in bad.value.body["message"], bad.value.body
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=2).usage.completion_tokens == 2


# ---- logprobs: the tail's log-softmax of the logits it has

def greedy_log_softmax(path, messages, n):
    """The whole model's greedy tokens for MESSAGES, and its log-softmax before each."""
    with Stage(path, None, n_ctx=1024, max_sessions=1) as whole:
        prompt = whole.tokenize(whole.chat_template(messages), parse_special=True)
        whole.open_session(1)
        out = whole.forward([Entry(1, 0, tokens=np.array(prompt))])
        tokens, rows = [int(out.token[0])], [out.logits[0]]
        while len(tokens) < n:
            out = whole.forward([Entry(1, len(prompt) + len(tokens) - 1, tokens=np.array(tokens[-1:]))])
            tokens.append(int(out.token[0]))
            rows.append(out.logits[0])
        pieces = {t: whole.detokenize_bytes([t]) for t in range(whole.n_vocab)}
    rows = np.array(rows, dtype=np.float64)
    peak = rows.max(axis=1, keepdims=True)
    return tokens, rows - (peak + np.log(np.exp(rows - peak).sum(axis=1, keepdims=True))), pieces


def test_top_logprobs_lead_with_the_greedy_token_and_agree_with_the_whole_models_log_softmax(client, smollm2_path):
    reply = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, logprobs=True, top_logprobs=5)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == 12
    assert "".join(c.token for c in content) == reply.choices[0].message.content
    tokens, want, pieces = greedy_log_softmax(smollm2_path, ASK, 12)
    for i, c in enumerate(content):
        assert bytes(c.bytes) == pieces[tokens[i]] and abs(c.logprob - want[i, tokens[i]]) < 1e-4
        assert len(c.top_logprobs) == 5 and c.top_logprobs[0].token == c.token   # greedy: the top-1 is the token
        best = np.argsort(-want[i], kind="stable")[:5]
        assert [bytes(a.bytes) for a in c.top_logprobs] == [pieces[t] for t in best]
        assert max(abs(a.logprob - want[i, t]) for a, t in zip(c.top_logprobs, best)) < 1e-4


def test_streamed_logprobs_are_the_unstreamed_ones_and_completions_give_theirs(client):
    kwargs = dict(model=MODEL, messages=ASK, max_tokens=10, logprobs=True, top_logprobs=2, temperature=0.8, seed=4)
    whole = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    streamed = [entry for chunk in client.chat.completions.create(stream=True, **kwargs)
                if chunk.choices and chunk.choices[0].logprobs for entry in chunk.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in whole]
    reply = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, logprobs=3)
    lp = reply.choices[0].logprobs
    assert "".join(lp.tokens) == reply.choices[0].text and len(lp.token_logprobs) == 6
    assert all(len(top) == 3 and max(top.values()) >= chosen - 1e-9 for top, chosen in zip(lp.top_logprobs,
                                                                                          lp.token_logprobs))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]


@pytest.mark.parametrize("path, extra, param", [
    ("/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/chat/completions", {"top_logprobs": 3}, "top_logprobs"),
    ("/chat/completions", {"logprobs": 1}, "logprobs"),
    ("/completions", {"logprobs": 21}, "logprobs"),
    ("/completions", {"logprobs": True}, "logprobs"),
])
def test_logprobs_beyond_20_or_of_the_wrong_kind_are_a_400(client, path, extra, param):
    body = {"model": MODEL, "max_tokens": 2, **({"messages": ASK} if "chat" in path else {"prompt": "Hello"}), **extra}
    with pytest.raises(openai.BadRequestError) as bad:
        client.post(path, body=body, cast_to=object)
    assert bad.value.status_code == 400 and bad.value.body["param"] == param, bad.value.body


# ---- tool calls, in the generic format: SmolLM2's template has no tool-call format of its own

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
PARIS = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def called(message):
    assert message.tool_calls and message.content is None, message
    call = message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    return call.function.name, json.loads(call.function.arguments)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_named_tool_choice_gives_a_valid_call_to_that_function(client, stream):
    kwargs = dict(model=MODEL, messages=PARIS, tools=[TIME, WEATHER], tool_choice=NAMED, max_tokens=80)
    if stream:
        chunks = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
        calls = [call for c in chunks for call in (c.choices[0].delta.tool_calls or [])]
        assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]
        assert len(calls) == 1 and calls[0].index == 0
        name, arguments = calls[0].function.name, json.loads(calls[0].function.arguments)
    else:
        reply = client.chat.completions.create(**kwargs)
        assert reply.choices[0].finish_reason == "tool_calls"
        name, arguments = called(reply.choices[0].message)
    assert name == "get_weather"
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_tool_call_round_trip_call_result_and_final_answer(client, stream):
    first = client.chat.completions.create(model=MODEL, messages=PARIS, tools=[WEATHER], tool_choice="required",
                                           max_tokens=80)
    name, arguments = called(first.choices[0].message)
    call = first.choices[0].message.tool_calls[0]
    history = PARIS + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"city": arguments["city"], "sky": "sunny",
                                                                         "temperature": 21})}]
    kwargs = dict(model=MODEL, messages=history, tools=[WEATHER], tool_choice="none", max_tokens=60)
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
                       if c.choices)
    else:
        reply = client.chat.completions.create(**kwargs)
        assert reply.choices[0].finish_reason in ("stop", "length") and not reply.choices[0].message.tool_calls
        text = reply.choices[0].message.content
    assert text.strip()


def test_tool_choice_auto_answers_with_a_call_or_a_text_never_both(client):
    for messages in (PARIS, [{"role": "user", "content": "Say hello."}]):
        reply = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=80)
        message = reply.choices[0].message
        if message.tool_calls:
            assert reply.choices[0].finish_reason == "tool_calls" and message.content is None
            jsonschema.validate(json.loads(message.tool_calls[0].function.arguments), WEATHER["function"]["parameters"])
        else:
            assert isinstance(message.content, str) and reply.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "two words"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "x", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "x", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}]}, "tools[0].function.parameters"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "grammar": "root ::= \"x\""}, "grammar"),   # (a response_format is taken: the final answer's)
])
def test_a_bad_tool_schema_or_choice_is_a_400_naming_its_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as bad:
        client.post("/chat/completions", body={"model": MODEL, "messages": PARIS, "max_tokens": 4, **extra},
                    cast_to=object)
    assert bad.value.status_code == 400 and bad.value.body["param"] == param, bad.value.body
    assert bad.value.body["type"] == "invalid_request_error"


# ---- a second client: the OpenAI Agents SDK, over chat completions

def test_an_agent_of_the_openai_agents_sdk_calls_a_tool_and_answers_with_its_result(client):
    agents.set_tracing_disabled(True)   # (its traces would go to OpenAI's servers)
    asked = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather now in a city."""
        asked.append(city)
        return f"It is sunny and 21 degrees in {city}."

    model = agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=openai.AsyncOpenAI(
        base_url=str(client.base_url), api_key=KEY, max_retries=0, timeout=120))
    # the task ends with the tool's answer: SmolLM2-135M, given a tool's result and tool_choice auto,
    # calls the tool again rather than answer in words
    agent = agents.Agent(name="weather", instructions="Answer questions about the weather.", tools=[get_weather],
                         model=model, model_settings=agents.ModelSettings(tool_choice="required", max_tokens=80),
                         tool_use_behavior="stop_on_first_tool")
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=2)
    assert len(asked) == 1 and asked[0].strip()   # the tool ran once, with a city the model chose
    assert result.final_output == f"It is sunny and 21 degrees in {asked[0]}."
