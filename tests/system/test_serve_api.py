"""What clients build on, through `meshnet serve` and the real `openai` client (SmolLM2,
two worker processes): structured output (a JSON schema's grammar, llama.cpp's
json-schema-to-grammar, at the tail; json_object; a raw GBNF grammar) and logprobs. A
schema, format or count the engine cannot take is a 400 in OpenAI's shape."""

import json
import os
from concurrent.futures import ThreadPoolExecutor

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
