"""`meshnet serve` against clients that are not each other's friends: a real server on
loopback in front of two worker processes running SmolLM2. One client's kept prefixes
never serve another's prompt, so its cached_tokens cannot tell it what another's prompts
begin with (a client is its API key, and within a key its user or the cache key it
names)."""

import json
import os

import openai
import pytest

from meshnet.core.prefix import BLOCK

from conftest import serving

MODEL = "smollm2"
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
