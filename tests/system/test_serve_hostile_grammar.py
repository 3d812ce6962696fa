"""A grammar is bounded work (issue 46: G1, G2, H2), through `meshnet serve` with two
worker processes and the real `openai` client: a grammar or schema that would take the
tail down or keep its stage busy for minutes is refused for its own request alone; a
stream that started before it ends with exactly the tokens it gives alone, and the next
request is answered."""

import json
import os
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from conftest import serving

MODEL = "smollm2"
KEY = "test-key-" + os.urandom(4).hex()
INNOCENT = dict(model=MODEL, prompt="Once upon a time, in a small village by the sea,", max_tokens=160,
                temperature=0.8, seed=11)

# G1: 30,000 nested groups (a 60 KB body): llama.cpp's recursive parser overflowed the stack
NESTED_GROUPS = "root ::= " + "(" * 30_000 + '"a"' + ")" * 30_000
# G2: a 239-byte schema whose pattern expands into millions of grammar stacks
EXPANDING = {"type": "json_schema", "json_schema": {"name": "s", "schema": {
    "type": "string", "pattern": "^(a{0,2000}){0,2000}$"}}}


def deep_schema(depth: int) -> dict:
    schema = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"], "additionalProperties": False}
    return schema


@pytest.fixture(scope="module")
def server(smollm2_path):
    with serving("--ctx", "1024", "--max-sessions", "4", env=dict(os.environ, MESHNET_API_KEY=KEY)) as (url, *_):
        yield url, openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def health(url) -> dict:
    try:
        with urllib.request.urlopen(url + "/health", timeout=10) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as e:
        return json.loads(e.read())


def streamed(client, **kwargs) -> str:
    return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)


def under_attack(client, attack) -> tuple[str, object]:
    """The innocent stream's text when ATTACK is made while it is under way, and what the
    attack gave (its exception, or its reply)."""
    stream = client.completions.create(stream=True, **INNOCENT)
    chunks = iter(stream)
    text = next(chunks).choices[0].text    # the stream is under way at the tail
    try:
        outcome = attack()
    except openai.APIError as e:
        outcome = e
    return text + "".join(c.choices[0].text for c in chunks if c.choices), outcome


@pytest.mark.parametrize("name,attack", [
    ("nested groups", lambda client: client.completions.create(model=MODEL, prompt="Hi", max_tokens=4,
                                                               extra_body={"grammar": NESTED_GROUPS})),
    ("expanding schema", lambda client: client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say a"}], max_tokens=8, response_format=EXPANDING)),
])
def test_a_grammar_past_its_bounds_fails_alone_and_the_route_goes_on(server, name, attack):
    url, client = server
    alone = streamed(client, **INNOCENT)
    started = time.monotonic()
    text, outcome = under_attack(client, lambda: attack(client))
    took = time.monotonic() - started
    assert isinstance(outcome, openai.BadRequestError), f"{name}: {outcome!r}"
    assert "grammar" in outcome.body["message"], outcome.body
    assert text == alone, name                       # exactly its tokens, untouched by the attack
    assert took < 60, f"{name}: the innocent stream took {took:.1f} s"
    assert health(url)["status"] == "ready"
    after = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3)
    assert after.usage.completion_tokens == 3


def test_many_attacks_at_once_leave_the_stage_answering(server):
    """A handful of expanding schemas at once each end in a 400; none holds the stage."""
    url, client = server

    def attack(_):
        try:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}], max_tokens=4,
                                           response_format=EXPANDING)
        except openai.BadRequestError as e:
            return e.status_code
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(attack, range(4))) == [400] * 4
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=3).usage.completion_tokens == 3


def test_a_valid_grammar_past_the_header_limit_is_served(server):
    """H2: a JSON schema 200 objects deep (12 KB of JSON, over 64 KiB of GBNF) travels in
    OPEN's grammar frame: answered, not a 500."""
    _, client = server
    schema = deep_schema(200)
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "JSON please"}], max_tokens=8,
        response_format={"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}})
    assert reply.choices[0].finish_reason == "length"
    assert reply.choices[0].message.content.startswith("{")


def test_a_grammar_over_the_one_limit_is_a_400_naming_it(server):
    _, client = server
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2,
                                  extra_body={"grammar": 'root ::= "a"' + " | \"a\"" * 60_000})
    assert bad.value.body["param"] == "grammar" and "262144" in bad.value.body["message"], bad.value.body
    with pytest.raises(openai.BadRequestError) as bad:   # a schema 300 objects deep: 370 KB of GBNF
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}], max_tokens=2,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "deep", "schema": deep_schema(300)}})
    assert bad.value.body["param"] == "response_format.json_schema.schema", bad.value.body
    assert "262144" in bad.value.body["message"], bad.value.body
