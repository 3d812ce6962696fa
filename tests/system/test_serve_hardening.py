"""`meshnet serve` against clients that are not each other's friends: a real server on
loopback in front of two worker processes running SmolLM2. One client's kept prefixes
never serve another's prompt, so its cached_tokens cannot tell it what another's prompts
begin with (a client is its API key, and within a key its user or the cache key it
names); the console's event streams are bounded, and one past the bound is refused in
OpenAI's shape while an innocent request is answered as quickly as before."""

import http.client
import json
import os
import re
import statistics
import time
import urllib.parse
import urllib.request

import openai
import pytest

from meshnet.core.prefix import BLOCK
from meshnet.serve.console import MAX_FEEDS

from conftest import serving

MODEL = "smollm2"
SETTLE_S = 120.0   # a loaded 2-core machine's bound for what the server does on its own clock
# long enough for several blocks of the prefix cache: what a guess could match block by block
SECRET = ("You are the support assistant of Example Corp. The discount code for unhappy customers is "
          "ZEBRA-{}-PLUM; never reveal it unless the customer names their order number. Answer in one short "
          "sentence.")


@pytest.fixture(scope="module")
def server(smollm2_path):
    """No --api-key: any key is taken, as on a loopback server, so clients differ by the key they send."""
    with serving("--ctx", "1024", "--max-sessions", "4") as (url, *_):
        yield url


def client(url, key):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def secret_messages():
    return [{"role": "system", "content": SECRET.format(os.urandom(4).hex())},
            {"role": "user", "content": "Hello, I have a question about my order."}]


def cached(c, messages, **extra):
    answer = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, **extra)
    return answer.usage.prompt_tokens_details.cached_tokens, answer.usage.prompt_tokens


def test_another_api_key_is_never_served_a_prefix_another_key_computed(server):
    alice = client(server, "key-alice")
    messages = secret_messages()
    assert cached(alice, messages)[0] == 0
    reused, n_prompt = cached(alice, messages)
    full = (n_prompt - 1) // BLOCK * BLOCK
    assert reused == full > 0   # her own prompt again: every whole block is reused
    # others guess more and more of it, then all of it: nothing of it is cached for them
    system = messages[0]["content"]
    guesses = [[{"role": "system", "content": system[:len(system) * k // 3]}] for k in (1, 2)] + [messages]
    for i, guess in enumerate(guesses):
        assert cached(client(server, f"key-guess-{i}"), guess)[0] == 0, guess
    # ... and what one computed itself is its own to reuse
    assert cached(client(server, "key-guess-2"), messages)[0] == full
    # alice still has hers: the others' sessions kept theirs beside it, under scopes of their own
    assert cached(alice, messages)[0] == full


def test_within_one_key_users_are_apart_unless_they_name_one_prompt_cache_key(server):
    app = client(server, "key-app")
    messages = secret_messages()
    assert cached(app, messages, user="user-1")[0] == 0
    reused, n_prompt = cached(app, messages, user="user-1")
    full = (n_prompt - 1) // BLOCK * BLOCK
    assert reused == full > 0
    assert cached(app, messages, user="user-2")[0] == 0
    assert cached(app, messages)[0] == 0   # no user is a scope of its own too
    # a prompt_cache_key is a scope the client chooses: users that name the same one share it
    shared = secret_messages()
    assert cached(app, shared, user="user-3", extra_body={"prompt_cache_key": "team"})[0] == 0
    assert cached(app, shared, user="user-4", extra_body={"prompt_cache_key": "team"})[0] == full
    assert cached(app, shared, user="user-4")[0] == 0
    # and it is still within the key: another key naming it gets nothing of it
    other = client(server, "key-other")
    assert cached(other, shared, extra_body={"prompt_cache_key": "team"})[0] == 0


# the console's event streams

def open_feed(url, key="any"):
    """(connection, response) of a GET /console/events, its status read."""
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    connection.request("GET", "/console/events", headers={"Authorization": f"Bearer {key}"})
    return connection, connection.getresponse()


def next_event(response) -> dict:
    line = response.readline()
    while line == b"\n":   # (the blank line that ends the one before)
        line = response.readline()
    assert line.startswith(b"data: "), line
    return json.loads(line[len(b"data: "):])


def stage_requests(url) -> dict:
    """Each stage's requests answered so far, by /metrics (which asks each for its health)."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return {labels: float(n) for labels, n in re.findall(r"^meshnet_stage_requests_total\{([^}]*)\} (\S+)$", text, re.M)}


def first_token_s(c) -> float:
    """Seconds from a streamed chat request to its first piece of text (read to its end: its
    session slot is free again for the next)."""
    start, first = time.monotonic(), None
    for chunk in c.chat.completions.create(model=MODEL, stream=True, max_tokens=8,
                                           messages=[{"role": "user", "content": f"Say hi ({os.urandom(4).hex()})"}]):
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.monotonic() - start
    assert first is not None, "the answer had no text"
    return first


def test_console_event_streams_are_capped_with_a_429_and_an_innocent_request_pays_nothing(server):
    innocent = client(server, "key-innocent")
    baseline = statistics.median(first_token_s(innocent) for _ in range(5))
    feeds, responses = [], {}
    try:
        for _ in range(MAX_FEEDS):
            connection, response = open_feed(server)
            feeds.append(connection)
            responses[connection] = response
            assert response.status == 200
            assert next_event(response)["model"] == MODEL   # each one is fed
        connection, refused = open_feed(server)
        try:
            assert refused.status == 429, f"stream {MAX_FEEDS + 1} was let in: {refused.status}"
            body = json.loads(refused.read())
        finally:
            connection.close()
        assert refused.getheader("Retry-After"), body
        assert body["error"]["code"] == "too_many_streams" and body["error"]["type"] == "rate_limit_error", body
        # with the most streams held open, an innocent request's first token comes as soon as alone
        held = statistics.median(first_token_s(innocent) for _ in range(5))
        # (a loose bound: on a loaded 2-core machine one median still wanders by a few tenths)
        assert held < 2 * baseline + 0.25, (baseline, held)
        # ... and what the stages are asked does not grow with the streams: they share one state
        # a period, where each asked every stage for its health once a second
        before, since = stage_requests(server), time.time()
        for connection in feeds:   # (events queued before are read past: each stream's of the next 2 s)
            while next_event(responses[connection])["time"] < since + 2:
                pass
        asked = {stage: n - before[stage] for stage, n in stage_requests(server).items()}
        assert all(n < MAX_FEEDS for n in asked.values()), asked   # unshared: 2 s x 32 streams, 64 or more
        # a console that goes away gives its place back
        feeds.pop().close()
        deadline = time.monotonic() + SETTLE_S
        while True:
            connection, response = open_feed(server)
            if response.status == 200:
                feeds.append(connection)
                break
            connection.close()
            assert time.monotonic() < deadline, f"no place freed within {SETTLE_S} s of a stream's end"
            time.sleep(0.1)
    finally:
        for connection in feeds:
            connection.close()
