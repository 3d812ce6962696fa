"""`meshnet serve`: the real `openai` client against a real server (a subprocess on
loopback, in front of two worker processes running SmolLM2)."""

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from meshnet.core.prefix import BLOCK
from meshnet.engine.binding import Stage
from meshnet.serve.completions import StopScanner

from conftest import serving
from peers import wait_for

MODEL = "smollm2"
KEY = "test-key-" + os.urandom(4).hex()
SLOTS = 8
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# the stages' numbers in /health and /metrics are each worker's answer to a HEALTH query,
# which can trail what the server has already streamed: a test waits for the state it
# means, up to a bound for a loaded 2-core machine, and never asserts one snapshot
SETTLE_S = 120.0


@pytest.fixture(scope="module")
def server(smollm2_path):
    """One server for the module: 8 session slots, an API key given in the environment."""
    with serving("--ctx", "1024", "--max-sessions", str(SLOTS), env=dict(os.environ, MESHNET_API_KEY=KEY)) as (url, *_):
        yield url


def health(url, ok=(200,)):
    try:
        with urllib.request.urlopen(url + "/health", timeout=10) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as e:
        assert e.code in ok, e.read()
        return json.loads(e.read())
    except urllib.error.URLError:
        return {"status": "starting"}


def wait_until_idle(url, timeout=SETTLE_S):
    """Every stage holds no session and no KV, and the server counts none open."""
    return wait_for(lambda: health(url), lambda state: state["sessions"] == 0 and all(
        s["n_sessions"] == 0 and s["kv_bytes_used"] == 0 for s in state["stages"]), "every stage idle", timeout)


def metrics_text(url):
    return urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()


def sessions_completed(url):
    return int(re.search(r'^meshnet_sessions_total\{outcome="completed"\} (\d+)$', metrics_text(url), re.M).group(1))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def whole(smollm2_path):
    """The whole model in this process, for its tokenizer and chat template only."""
    with Stage(smollm2_path, (0, 30), n_ctx=64, max_sessions=1) as stage:
        yield stage


def chat_stream(client, **kwargs):
    chunks = list(client.chat.completions.create(model=MODEL, stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return chunks, text, finish


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).owned_by == "meshnet"


def test_a_streamed_chat_joins_to_the_unstreamed_text_with_the_same_seed(client, whole):
    sampling = dict(messages=QUESTION, max_tokens=24, temperature=0.8, top_p=0.95, seed=1234)
    answer = client.chat.completions.create(model=MODEL, **sampling)
    assert answer.object == "chat.completion" and answer.model == MODEL
    text = answer.choices[0].message.content
    assert text and answer.choices[0].message.role == "assistant"
    chunks, streamed, finish = chat_stream(client, stream_options={"include_usage": True}, **sampling)
    assert streamed == text and finish == [answer.choices[0].finish_reason]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[-1].choices == []   # the usage chunk comes last
    # (the second of two equal prompts restores the first's whole blocks: only the counts agree)
    assert [getattr(chunks[-1].usage, k) for k in ("prompt_tokens", "completion_tokens", "total_tokens")] == \
        [getattr(answer.usage, k) for k in ("prompt_tokens", "completion_tokens", "total_tokens")]
    # usage: the prompt as the model's template makes it, tokenized with its special tokens
    prompt = whole.tokenize(whole.chat_template(QUESTION), add_special=True, parse_special=True)
    assert answer.usage.prompt_tokens == len(prompt)
    assert answer.usage.total_tokens == len(prompt) + answer.usage.completion_tokens
    # another seed, another answer (not a greedy one in disguise)
    other = {client.chat.completions.create(model=MODEL, **dict(sampling, seed=s)).choices[0].message.content
             for s in (1, 2, 3)}
    assert other - {text}


def test_completions_count_the_prompt_as_the_tokenizer_does_and_stop_at_max_tokens(client, whole):
    prompt = "The capital of France is a city where"
    answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8)
    assert answer.object == "text_completion" and answer.choices[0].finish_reason == "length"
    assert answer.usage.prompt_tokens == len(whole.tokenize(prompt))   # add_special, not parse_special
    assert answer.usage.completion_tokens == 8
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == answer.choices[0].text   # greedy: the same
    assert streamed[-1].choices[0].finish_reason == "length"
    # special tokens written in a completion's prompt are text, not markers
    marked = client.completions.create(model=MODEL, prompt="<|im_start|>", max_tokens=1)
    assert marked.usage.prompt_tokens == len(whole.tokenize("<|im_start|>")) > 1


def test_a_conversation_reuses_its_history_and_reports_the_cached_tokens_with_the_same_answer(client, server):
    system = {"role": "system", "content": f"You are assistant {os.urandom(4).hex()}. Answer in one short sentence, "
                                           "plainly, and never ask a question back."}
    first = [system, {"role": "user", "content": "Name a large city in Italy."}]
    answer = client.chat.completions.create(model=MODEL, messages=first, max_tokens=16)
    assert answer.usage.prompt_tokens_details.cached_tokens == 0   # a system prompt never seen
    again = client.chat.completions.create(model=MODEL, messages=first, max_tokens=16)
    # computed from the restored prefix, the same greedy answer as from a full prefill
    assert again.choices[0].message.content == answer.choices[0].message.content
    n_prompt = answer.usage.prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens == (n_prompt - 1) // BLOCK * BLOCK > 0
    turn = first + [{"role": "assistant", "content": answer.choices[0].message.content},
                    {"role": "user", "content": "And one in Spain?"}]
    later = client.chat.completions.create(model=MODEL, messages=turn, max_tokens=8)
    assert later.usage.prompt_tokens_details.cached_tokens >= (n_prompt - 1) // BLOCK * BLOCK
    hits = re.search(r"^meshnet_prefix_cache_hits_total\{\} (\d+)$", metrics_text(server), re.M)
    assert hits and int(hits.group(1)) >= 2


def test_chat_max_tokens_ends_with_length(client):
    answer = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=3)
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 3
    _, _, finish = chat_stream(client, messages=QUESTION, max_completion_tokens=3)
    assert finish == ["length"]


def test_stop_strings_cut_the_text_before_them_and_free_the_session(client, server):
    prompt = "Here is a list of fruits: apples, bananas,"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24).choices[0].text
    words = full.split()
    assert len(words) > 4, full
    stop = " " + words[3]   # a stop string in the middle of what greedy gives
    expected = full[:full.index(stop)]
    for stops in (stop, ["never-seen-xyz", stop]):
        answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, stop=stops)
        assert answer.choices[0].text == expected and answer.choices[0].finish_reason == "stop"
        assert answer.usage.completion_tokens < 24
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, stop=stops, stream=True))
        pieces = [c.choices[0].text for c in chunks]
        assert "".join(pieces) == expected and chunks[-1].choices[0].finish_reason == "stop"
    # in a chat too, and the session cut short is gone from every stage
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24).choices[0].message.content
    assert " Paris" in reply, reply
    chunks, text, finish = chat_stream(client, messages=QUESTION, max_tokens=24, stop=" Paris")
    assert text == reply[:reply.index(" Paris")] and finish == ["stop"]
    wait_until_idle(server)


def test_a_stop_string_split_across_pieces_is_held_back_and_never_shown():
    scanner = StopScanner(["o W", "xyz"])
    assert scanner.feed("Hell") == ("Hell", False)
    assert scanner.feed("o") == ("", False)      # it could be the start of "o W"
    assert scanner.feed(" ") == ("", False)
    assert scanner.feed("Wor") == ("", True)     # it was: cut before it
    scanner = StopScanner(["o W"])
    assert scanner.feed("Hello") == ("Hell", False)
    assert scanner.feed(" there") == ("o there", False)   # it was not: shown with the next piece
    assert scanner.feed("o") == ("", False) and scanner.flush() == "o"


def test_eight_concurrent_streams_each_get_what_they_get_alone(client):
    topics = ["the sea", "a cat", "winter", "bread", "trains", "the moon", "music", "a garden"]
    requests = [dict(messages=[{"role": "user", "content": f"Write one sentence about {t}."}], max_tokens=16,
                     **({"temperature": 0.8, "top_p": 0.95, "seed": 100 + i} if i % 2 else {}))
                for i, t in enumerate(topics)]
    alone = [chat_stream(client, **r)[1] for r in requests]
    together, spans = [None] * len(requests), [None] * len(requests)

    def one(i):
        start = time.monotonic()
        together[i] = chat_stream(client, **requests[i])[1]
        spans[i] = (start, time.monotonic())
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert together == alone
    assert len(set(alone)) == len(alone)
    assert max(start for start, _ in spans) < min(end for _, end in spans)   # all eight were open at once


def test_a_client_that_goes_away_mid_stream_frees_its_session_on_every_stage(client, server):
    wait_until_idle(server)   # the sessions of the tests before are released on every stage
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell me a long story."}],
                                            max_tokens=400, stream=True)
    completed = sessions_completed(server)
    try:
        for _, chunk in zip(range(3), stream):
            pass
        # the server counts the session at once; each stage shows it once it answers HEALTH after
        # the session's first step (up to 400 tokens take minutes: it is still open meanwhile)
        wait_for(lambda: health(server), lambda busy: busy["sessions"] == 1 and busy["stages"] and all(
            s["n_sessions"] == 1 and s["kv_bytes_used"] > 0 for s in busy["stages"]), "the session on every stage")
    finally:
        stream.close()   # the openai client drops the connection
    wait_until_idle(server)
    # not streaming: a client that stops waiting for the answer frees its session too
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}],
                       "max_tokens": 400}).encode()
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as raw:
        raw.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: meshnet\r\nContent-Type: application/json\r\n"
                    b"Authorization: Bearer %s\r\nContent-Length: %d\r\n\r\n%s" % (KEY.encode(), len(body), body))
        wait_for(lambda: health(server), lambda busy: busy["stages"] and all(
            s["kv_bytes_used"] > 0 for s in busy["stages"]), "the unstreamed session on every stage")
    wait_until_idle(server)
    # cut short: neither session made its 400 tokens (the count is the coordinator's own, never behind)
    assert sessions_completed(server) == completed
    assert client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4).choices[0].message.content


def test_64_concurrent_streams_beyond_the_session_slots_wait_their_turn_and_all_complete(client, server):
    """8 slots, 64 streams at once: the rest wait in the queue (tests/system/test_serve_queue.py
    holds its bounds), none is refused, and each gets the answer the question gets alone."""
    wait_until_idle(server)
    alone = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8).choices[0].message.content
    waits_before = int(re.search(r"^meshnet_http_queue_wait_seconds_count\{\} (\d+)$", metrics_text(server), re.M)[1])
    answers, failures = [], []

    def ask():
        try:
            stream = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, stream=True)
            answers.append("".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices))
        except Exception as e:   # (the test's own failure, named below)
            failures.append(repr(e))
    threads = [threading.Thread(target=ask, daemon=True) for _ in range(64)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(SETTLE_S * 4)
    assert not failures and answers == [alone] * 64, (failures, answers)
    metrics = metrics_text(server)
    assert int(re.search(r"^meshnet_http_queue_wait_seconds_count\{\} (\d+)$", metrics, re.M)[1]) == waits_before + 64
    assert 'meshnet_http_queue_refused_total{reason="queue_full"} 0' in metrics
    wait_until_idle(server)


@pytest.mark.parametrize("body, param", [
    ({"model": MODEL}, "messages"),                                               # no messages
    ({"model": MODEL, "messages": "hello"}, "messages"),                          # the wrong type
    ({"model": MODEL, "messages": [{"role": "user"}], "max_tokens": "4"}, "max_tokens"),
    ({"model": MODEL, "messages": [], "max_tokens": 4}, "messages"),
    ({"model": MODEL, "messages": QUESTION, "n": 9}, "n"),                        # over MAX_CHOICES
    ({"model": MODEL, "messages": QUESTION, "temperature": -1}, "temperature"),
    ({"model": MODEL, "messages": QUESTION, "top_p": 1.5}, "top_p"),
    ({"model": MODEL, "messages": QUESTION, "seed": -3, "temperature": 0.5}, "seed"),
    ({"model": MODEL, "messages": QUESTION, "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "messages": QUESTION, "stop": 7}, "stop"),
])
def test_a_bad_body_is_a_400_in_openais_shape_and_the_server_goes_on(client, body, param):
    with pytest.raises(openai.BadRequestError) as bad:
        client.post("/chat/completions", body=body, cast_to=object)
    assert bad.value.status_code == 400
    assert bad.value.response.json() == {"error": bad.value.body}
    assert bad.value.body["param"] == param and bad.value.body["type"] == "invalid_request_error"
    assert bad.value.body["message"]
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=2).usage.completion_tokens == 2


def test_a_prompt_beyond_the_context_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as full:
        client.completions.create(model=MODEL, prompt="word " * 900, max_tokens=200)
    assert full.value.body["code"] == "context_full"


def test_unknown_model_is_404_and_a_wrong_or_missing_key_is_401(client, server):
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(model="gpt-4", messages=QUESTION, max_tokens=4)
    assert unknown.value.status_code == 404 and unknown.value.body["code"] == "model_not_found"
    assert unknown.value.body["param"] == "model"
    wrong = openai.OpenAI(base_url=server + "/v1", api_key="not-the-key", max_retries=0)
    for call in (lambda: wrong.models.list(), lambda: wrong.chat.completions.create(model=MODEL, messages=QUESTION)):
        with pytest.raises(openai.AuthenticationError) as denied:
            call()
        assert denied.value.status_code == 401 and denied.value.body["type"] == "authentication_error"
    request = urllib.request.Request(server + "/v1/models")   # no Authorization header at all
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(request, timeout=10)
    assert missing.value.code == 401 and set(json.loads(missing.value.read())["error"]) == {"message", "type", "param",
                                                                                           "code"}
    # an unparsable body is a 400 too (FastAPI would say 422)
    request = urllib.request.Request(server + "/v1/completions", data=b"{not json", method="POST",
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with pytest.raises(urllib.error.HTTPError) as unparsable:
        urllib.request.urlopen(request, timeout=10)
    assert unparsable.value.code == 400
    assert client.models.list().data[0].id == MODEL


def test_the_command_line_refuses_an_open_server_without_a_key_and_local_options_with_a_coordinator():
    def serve(*args):
        return subprocess.run([sys.executable, "-m", "meshnet.cli.main", "serve", *args], capture_output=True, text=True,
                              timeout=60, env={k: v for k, v in os.environ.items() if k != "MESHNET_API_KEY"})
    open_http = serve("--host", "0.0.0.0", "--port", "0")
    assert open_http.returncode == 2 and "--api-key" in open_http.stderr
    mixed = serve("--coordinator", "tcp://127.0.0.1:0", "--stages", "3")
    assert mixed.returncode == 2 and "--stages is for local workers" in mixed.stderr
