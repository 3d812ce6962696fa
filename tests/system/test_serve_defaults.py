"""`meshnet serve` with its defaults, against a real server in front of two worker processes
running SmolLM2: 64 session slots whose sessions share one KV pool per stage (sized from
the model's trained context), and a queue beyond them. 64 concurrent streams all complete,
each exactly the answer the prompt gets alone; with --max-queue 8 (its only option), the
73rd concurrent request is refused at once."""

import http.client
import json
import socket
import threading
import time
import urllib.request

import pytest

from conftest import serving
from peers import wait_for

MODEL = "smollm2"
PROMPT = "The capital of France is"
SLOTS, QUEUE = 64, 8
SETTLE_S = 300.0


@pytest.fixture(scope="module")
def server(smollm2_path):
    with serving("--max-queue", str(QUEUE)) as (url, *_):
        yield url


def request(url, body: dict, timeout=600) -> http.client.HTTPConnection:
    connection = http.client.HTTPConnection(url.removeprefix("http://"), timeout=timeout)
    connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    return connection


def streamed_text(response) -> str:
    """The text of a streamed completion, read to its [DONE]; an error event raises."""
    text = []
    for raw in response:
        line = raw.decode().strip()
        if line == "data: [DONE]":
            return "".join(text)
        if line.startswith("data: "):
            event = json.loads(line.removeprefix("data: "))
            assert "error" not in event, event
            text += [choice["text"] for choice in event["choices"]]
    raise AssertionError(f"the stream ended without [DONE] after {''.join(text)!r}")


def health(url) -> dict:
    with urllib.request.urlopen(url + "/health", timeout=30) as response:
        return json.loads(response.read())


def test_64_concurrent_streams_with_the_defaults_all_complete_each_with_the_answer_it_gets_alone(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16}
    response = request(server, body).getresponse()
    assert response.status == 200
    alone = json.loads(response.read())["choices"][0]["text"]
    answers, failures = [], []

    def ask():
        try:
            answer = request(server, dict(body, stream=True)).getresponse()
            assert answer.status == 200, answer.read()
            answers.append(streamed_text(answer))
        except Exception as e:   # (the test's own failure, named below)
            failures.append(repr(e))
    threads = [threading.Thread(target=ask, daemon=True) for _ in range(SLOTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(SETTLE_S)
    assert not failures and answers == [alone] * SLOTS, (failures, answers)


def test_with_every_slot_taken_and_the_queue_full_the_73rd_request_is_refused_at_once(server):
    held, stop = [], threading.Event()

    def hold(seed: int):
        """A long sampled stream (it runs until released), read as it comes."""
        connection = request(server, {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4000,
                                      "temperature": 2.0, "seed": seed, "stream": True})
        held.append(connection)
        try:
            response = connection.getresponse()
            while not stop.is_set() and response.readline():
                pass
        # (released: the test shut it down mid-read; a response closed under readline has no
        # file left, an AttributeError)
        except (OSError, ValueError, AttributeError, http.client.HTTPException):
            pass
    threads = [threading.Thread(target=hold, args=(seed,), daemon=True) for seed in range(SLOTS + QUEUE)]
    try:
        for thread in threads:
            thread.start()
        wait_for(lambda: health(server), lambda state: state["sessions"] == SLOTS and state["queued"] == QUEUE,
                 f"{SLOTS} sessions and {QUEUE} waiting", SETTLE_S)
        began = time.monotonic()
        refused = request(server, {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}).getresponse()
        body = json.loads(refused.read())
        assert refused.status == 429 and time.monotonic() - began < 10, (refused.status, body)
        assert body["error"]["code"] == "too_many_sessions" and "--max-queue" in body["error"]["message"], body
        assert refused.getheader("Retry-After")
    finally:
        stop.set()
        for connection in held:   # (a shutdown ends a read blocked in another thread: a close would not)
            if connection.sock is not None:
                connection.sock.shutdown(socket.SHUT_RDWR)
            connection.close()
        for thread in threads:
            thread.join(60)
    wait_for(lambda: health(server), lambda state: state["sessions"] == 0 and state["queued"] == 0,
             "every slot free again", SETTLE_S)
