"""`meshnet serve`'s admission queue (meshnet/serve/admission.py), against a real server in
front of two worker processes running SmolLM2: a request beyond the session slots waits
its turn, first come first served, and is refused only when the queue is full or its wait
runs out; a client gone while it waits leaves the queue; a stream that waits gets
keep-alive comments."""

import http.client
import json
import re
import socket
import threading
import time

import pytest

from conftest import serving
from peers import wait_for

MODEL = "smollm2"
SLOTS, QUEUE, WAIT_S = 2, 2, 30
PROMPT = "The capital of France is"
SETTLE_S = 120.0


@pytest.fixture(scope="module")
def server(smollm2_path):
    """Two slots whose sessions share one KV pool per stage (the held streams grow through it)."""
    with serving("--ctx", "4096", "--kv-pool", "8192", "--max-sessions", str(SLOTS), "--max-queue", str(QUEUE),
                 "--queue-wait", str(WAIT_S)) as (url, *_):
        yield url


@pytest.fixture(scope="module")
def reference(server):
    """PROMPT's greedy continuation, asked of the idle server."""
    return complete(server)


def request(url, body: dict, timeout=300) -> http.client.HTTPConnection:
    connection = http.client.HTTPConnection(url.removeprefix("http://"), timeout=timeout)
    connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    return connection


def complete(url, max_tokens=6) -> str:
    """A greedy completion of PROMPT: its text, or an AssertionError naming the status."""
    response = request(url, {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens}).getresponse()
    body = json.loads(response.read())
    assert response.status == 200, (response.status, body)
    return body["choices"][0]["text"]


def stream_lines(response):
    """The SSE lines of a streamed response, without their line ends, as they come."""
    while True:
        line = response.readline()
        if not line:
            return
        line = line.rstrip(b"\r\n")
        if line:
            yield line.decode()


class Held:
    """A session slot held by a sampled stream of thousands of tokens (seeded, at a high
    temperature: it runs long and the same each time) until release()."""

    def __init__(self, url):
        self.connection = request(url, {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4000,
                                        "temperature": 2.0, "seed": 11, "stream": True})
        response = self.connection.getresponse()
        assert response.status == 200, response.read()
        for line in stream_lines(response):   # (its first token: the session is open on every stage)
            if line.startswith("data: {") and '"text":"' in line:
                break

    def release(self):
        self.connection.close()


def metric(url, name: str) -> float:
    text = urllib_get(url, "/metrics")
    found = re.search(rf"^meshnet_{re.escape(name)} (\S+)$", text, re.M)
    assert found, f"/metrics has no meshnet_{name}"
    return float(found.group(1))


def urllib_get(url, path: str) -> str:
    connection = http.client.HTTPConnection(url.removeprefix("http://"), timeout=30)
    connection.request("GET", path)
    return connection.getresponse().read().decode()


def queued(url) -> int:
    return int(metric(url, "http_queue_depth{}"))


def active(url) -> int:
    return int(metric(url, "http_sessions_active{}"))


@pytest.fixture
def holding(server):
    """Every slot held, until the test's end."""
    wait_for(lambda: (active(server), queued(server)), lambda v: v == (0, 0), "an idle server")
    held = [Held(server) for _ in range(SLOTS)]
    yield held
    for h in held:
        h.release()
    wait_for(lambda: active(server), lambda n: n == 0, "every slot given back")


def test_a_request_beyond_the_slots_waits_its_turn_first_come_and_a_full_queue_refuses_at_once(server, reference,
                                                                                               holding):
    finished, answers = [], {}

    def ask(name):
        answers[name] = complete(server)
        finished.append(name)
    first = threading.Thread(target=ask, args=("first",), daemon=True)
    first.start()
    wait_for(lambda: queued(server), lambda n: n == 1, "the first request waiting")
    second = threading.Thread(target=ask, args=("second",), daemon=True)
    second.start()
    wait_for(lambda: queued(server), lambda n: n == 2, "both requests waiting")

    refused_before = metric(server, 'http_queue_refused_total{reason="queue_full"}')
    started = time.monotonic()
    response = request(server, {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}).getresponse()
    body = json.loads(response.read())
    assert response.status == 429 and response.getheader("Retry-After") == "1", (response.status, body)
    assert time.monotonic() - started < WAIT_S / 2, "a full queue refuses at once, without waiting"
    assert body["error"]["code"] == "too_many_sessions" and "--max-queue" in body["error"]["message"], body
    assert metric(server, 'http_queue_refused_total{reason="queue_full"}') == refused_before + 1
    assert active(server) == SLOTS and not finished, "the held streams still hold every slot"

    holding[0].release()   # one slot comes free: the first to come is the first served
    first.join(SETTLE_S)
    second.join(SETTLE_S)
    assert finished == ["first", "second"]
    assert answers == {"first": reference, "second": reference}
    assert metric(server, "http_queue_wait_seconds_count{}") >= 2


def test_a_client_gone_while_it_waits_leaves_the_queue(server, reference, holding):
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 4}).encode()
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as raw:
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: meshnet\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_for(lambda: queued(server), lambda n: n == 1, "the request waiting")
    wait_for(lambda: queued(server), lambda n: n == 0, "the request gone from the queue")
    assert active(server) == SLOTS   # (no slot was given to it, or lost)
    holding[0].release()
    assert complete(server) == reference


def test_a_waiting_stream_gets_keep_alives_then_its_answer(server, reference, holding):
    connection = request(server, {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "stream": True})
    response = connection.getresponse()   # 200 before its turn comes: a wait's error would go in the stream
    assert response.status == 200
    lines = stream_lines(response)
    assert next(lines) == ": keep-alive"
    assert queued(server) == 1
    holding[0].release()
    events = [json.loads(line.removeprefix("data: ")) for line in lines
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert "".join(e["choices"][0]["text"] for e in events) == reference
    connection.close()


def test_a_wait_that_runs_out_is_a_429_or_an_error_in_a_stream_that_was_kept_alive(server, holding):
    waited = {}

    def plain():
        started = time.monotonic()
        response = request(server, {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}).getresponse()
        waited["plain"] = (time.monotonic() - started, response.status, json.loads(response.read()))
    thread = threading.Thread(target=plain, daemon=True)
    thread.start()
    started = time.monotonic()
    connection = request(server, {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": True})
    response = connection.getresponse()
    assert response.status == 200
    lines = list(stream_lines(response))
    elapsed = time.monotonic() - started
    assert lines[0] == ": keep-alive" and lines[-1] == "data: [DONE]", lines
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert error["code"] == "too_many_sessions" and "--queue-wait" in error["message"], error
    assert elapsed >= WAIT_S, f"refused after {elapsed:.1f} s of a {WAIT_S} s wait"
    thread.join(SETTLE_S)
    seconds, status, body = waited["plain"]
    assert status == 429 and seconds >= WAIT_S and "--queue-wait" in body["error"]["message"], waited
    assert metric(server, 'http_queue_refused_total{reason="wait_over"}') >= 2
    assert active(server) == SLOTS
