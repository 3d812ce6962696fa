"""Contexts as long as the model allows, by default: `meshnet serve` with no option but the
model, over a generated model whose header says it was trained on 32768 tokens
(tests/long_model.py), gives each session up to that context from one KV pool per stage.
A prompt of 32,000 tokens beside 8 short ones, all at once, gets exactly what each gets
alone."""

import http.client
import json
import os
import threading

import pytest

from conftest import TEST_MODELS, serving
from long_model import write_long_context_model

LONG_TOKENS = 32000
SHORT = [f"question {i}: what comes after {i}?" for i in range(8)]
SETTLE_S = 900.0   # a 32k prefill through two stages beside the others, on a loaded 2-core machine


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    source = os.path.join(TEST_MODELS, "llama-dense.gguf")
    assert os.path.isfile(source), f"{source} is missing: run `make test-models` (make test does)"
    path = write_long_context_model(source, tmp_path_factory.mktemp("long") / "long.gguf")
    with serving("--model", str(path)) as (url, *_):
        yield url


def complete(url, prompt: str, max_tokens: int, user: str = "") -> dict:
    """USER: the kept prefixes it may start from are its user's (the runs together compute
    the long prompt again, none restores what the run alone kept)."""
    connection = http.client.HTTPConnection(url.removeprefix("http://"), timeout=SETTLE_S)
    connection.request("POST", "/v1/completions", json.dumps({"model": "long", "prompt": prompt, "user": user,
                                                              "max_tokens": max_tokens}),
                       {"Content-Type": "application/json"})
    response = connection.getresponse()
    body = json.loads(response.read())
    assert response.status == 200, body
    return {"text": body["choices"][0]["text"], "prompt_tokens": body["usage"]["prompt_tokens"],
            "computed": body["usage"]["prompt_tokens"] - body["usage"]["prompt_tokens_details"]["cached_tokens"]}


def long_prompt(url) -> str:
    """Text that the model's tokenizer makes about LONG_TOKENS tokens."""
    unit = "the quick brown fox jumps over the lazy dog, then rests. "
    per_unit = complete(url, unit * 10, 1)["prompt_tokens"] / 10
    return unit * int(LONG_TOKENS / per_unit)


def test_a_32k_token_prompt_beside_8_short_ones_in_the_default_pool_gets_what_each_gets_alone(server):
    prompt = long_prompt(server)
    alone = {p: complete(server, p, 8, user="alone") for p in [prompt, *SHORT]}
    assert 31000 <= alone[prompt]["prompt_tokens"] <= 32768 - 8, alone[prompt]
    assert alone[prompt]["computed"] == alone[prompt]["prompt_tokens"], alone[prompt]
    together, failures = {}, []

    def ask(p):
        try:
            together[p] = complete(server, p, 8, user="together")
        except Exception as e:   # (the test's own failure, named below)
            failures.append(repr(e))
    threads = [threading.Thread(target=ask, args=(p,), daemon=True) for p in [prompt, *SHORT]]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(SETTLE_S)
    assert not failures and together == alone, (failures, {p[:40]: (together.get(p), alone[p]) for p in alone})
