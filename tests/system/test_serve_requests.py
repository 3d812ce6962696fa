"""`meshnet serve`: what a request may hold, checked at the HTTP layer before any of it
reaches the coordinator. Raw bytes over plain connections (a lone surrogate is written
as JSON's own escape, a body as big or as chunked as wanted), against a real server (a
subprocess on loopback, in front of two worker processes running SmolLM2)."""

import http.client
import json
import os
import socket
import time
import urllib.error
import urllib.request

import pytest

from conftest import post_json, serving

MODEL = "smollm2"
KEY = "test-key-" + os.urandom(4).hex()
LIMIT = 4 * 1024 * 1024   # the README's bound on a request body (meshnet.serve.app.MAX_BODY_BYTES)
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def server(smollm2_path):
    """One server for the module, as tests/system/test_serve.py starts it."""
    with serving("--ctx", "1024", "--max-sessions", "2", env=dict(os.environ, MESHNET_API_KEY=KEY)) as (url, *_):
        yield url


def health(url):
    try:
        with urllib.request.urlopen(url + "/health", timeout=10) as response:
            return json.loads(response.read())["status"]
    except urllib.error.HTTPError as e:
        assert e.code == 503, e.read()
        return "no_route"
    except urllib.error.URLError:
        return "starting"


def post(url, path, body):
    return post_json(url, path, body, KEY)


def text_of(answer):
    choice = answer["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def assert_openai_error(answer, param, code):
    assert set(answer) == {"error"} and set(answer["error"]) == {"message", "type", "param", "code"}, answer
    assert answer["error"]["type"] == "invalid_request_error", answer
    assert (answer["error"]["param"], answer["error"]["code"]) == (param, code), answer
    assert answer["error"]["message"]


def chat(**fields):
    return CHAT, dict({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}, **fields)


def completion(**fields):
    return COMPLETIONS, dict({"model": MODEL, "prompt": "Hello", "max_tokens": 3}, **fields)


def message(**fields):
    return chat(messages=[dict({"role": "user", "content": "Hi"}, **fields)])


@pytest.fixture(scope="module")
def plain(server):
    """The greedy answer of chat() and of completion(), each without any other field."""
    answers = {}
    for path, body in (chat(), completion()):
        status, answer = post(server, path, body)
        assert status == 200, answer
        answers[path] = text_of(answer)
    return answers


# ---- 1: a lone surrogate, anywhere, is a 400 naming the field (never a 500)

def raw(path, fields: bytes):
    """A request's body as bytes: fields (JSON written out), and the model, messages or
    prompt and max_tokens of a short request where fields have none."""
    given = {b"model": b'"smollm2"', b"max_tokens": b"1",
             **({b"messages": b'[{"role":"user","content":"Hi"}]'} if path == CHAT else {b"prompt": b'"Hello"'})}
    for name, value in given.items():
        if b'"%s":' % name not in fields:
            fields += b',"%s":%s' % (name, value)
    return path, b"{%s}" % fields


SURROGATES = [   # (path, body, the param that names where its lone surrogate is)
    (*raw(COMPLETIONS, b'"prompt":"a\\ud800b"'), "prompt"),
    (*raw(COMPLETIONS, b'"prompt":["a\\udfffb"]'), "prompt[0]"),
    (*raw(COMPLETIONS, b'"prompt":"a\xed\xa0\x80b"'), "prompt"),   # the surrogate's own bytes (CESU-8), not an escape
    (*raw(CHAT, b'"messages":[{"role":"user","content":"Hi \\ud83d"}]'), "messages[0].content"),
    (*raw(CHAT, b'"messages":[{"role":"user","content":"Hi"},'
                b'{"role":"user","content":[{"type":"text","text":"\\udc00"}]}]'),
     "messages[1].content[0].text"),
    (*raw(CHAT, b'"messages":[{"role":"us\\ud800er","content":"Hi"}]'), "messages[0].role"),
    (*raw(CHAT, b'"model":"smollm2\\ud800","messages":[{"role":"user","content":"Hi"}]'), "model"),
    (*raw(COMPLETIONS, b'"model":"\\ud800","prompt":"Hello"'), "model"),
    (*raw(CHAT, b'"stop":["\\ud800"]'), "stop[0]"),
    (*raw(COMPLETIONS, b'"user":"\\udbff"'), "user"),
]


def case_id(path, param):
    return f"{'chat' if path == CHAT else 'completions'}-{param}"


@pytest.mark.parametrize("path, body, param", SURROGATES, ids=[case_id(case[0], case[-1]) for case in SURROGATES])
def test_a_lone_surrogate_in_any_text_is_a_400_naming_the_field(server, path, body, param):
    status, answer = post(server, path, body)
    assert status == 400, answer
    assert_openai_error(answer, param, "invalid_argument")
    assert "UTF-8" in answer["error"]["message"]
    assert post(server, *completion(max_tokens=1))[0] == 200   # and the server goes on


# ---- 2: a field meshnet does not honour is refused, unless at a value that changes nothing

TOOL = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}}}
NOT_HONOURED = [   # (param, a request refused for it, requests at its "off" values: answered as without it)
    ("logit_bias", chat(logit_bias={"42": 100}), [chat(logit_bias={}), chat(logit_bias=None)]),
    ("functions", chat(functions=[TOOL["function"]]), [chat(functions=None)]),
    ("store", chat(store=True), [chat(store=False)]),
    ("echo", completion(echo=True), [completion(echo=False)]),
    ("best_of", completion(best_of=2), [completion(best_of=1)]),
    ("suffix", completion(suffix=" The end."), [completion(suffix=None)]),
    ("max_token", chat(max_token=5), []),   # a misspelt field is not ignored either
    ("prompt", chat(prompt="Hi"), []),
    ("messages", completion(messages=[{"role": "user", "content": "Hi"}]), []),
    ("stream_options.include_obfuscation", chat(stream_options={"include_usage": False, "include_obfuscation": True}),
     [chat(stream_options={"include_usage": False})]),
    ("messages[0].content[0].type",
     message(content=[{"type": "image_url", "image_url": {"url": "https://a.example/c.png"}}]),
     [message(content=[{"type": "text", "text": "Hi"}])]),
    ("messages[0].content[0].cache_control",
     message(content=[{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}]), []),
]


@pytest.mark.parametrize("param, refused, taken", NOT_HONOURED,
                         ids=[case_id(case[1][0], case[0]) for case in NOT_HONOURED])
def test_a_field_meshnet_does_not_honour_is_a_400_naming_it_unless_it_is_off(server, plain, param, refused, taken):
    status, answer = post(server, *refused)
    assert status == 400, answer
    assert_openai_error(answer, param, "unsupported_field")
    assert param in answer["error"]["message"]
    for path, body in taken:
        status, answer = post(server, path, body)
        assert status == 200, (body, answer)
        assert text_of(answer) == plain[path], body


@pytest.mark.parametrize("param, refused, taken", [
    ("user", chat(user=42), [chat(user="user-1234"), completion(user="user-1234"), chat(user=None)]),
    ("messages[0].name", message(name=7), [message(name="alice"), message(name=None)]),
])
def test_user_and_a_messages_name_are_taken_as_text_without_effect(server, plain, param, refused, taken):
    status, answer = post(server, *refused)
    assert status == 400, answer
    assert_openai_error(answer, param, "invalid_argument")
    for path, body in taken:
        status, answer = post(server, path, body)
        assert status == 200, (body, answer)
        assert text_of(answer) == plain[path], body


# ---- 3: a chat message needs a role meshnet knows, and content (a tool's result, the call it answers)

@pytest.mark.parametrize("messages, param", [
    ([{"role": "user", "content": "Hi"}, {"role": "wizard", "content": "Abracadabra"}], "messages[1].role"),
    ([{"role": "tool", "content": "22 degrees"}], "messages[0].tool_call_id"),   # a result of no call
    ([{"role": "user", "content": "Hi", "tool_calls": []}], "messages[0].tool_calls"),
    ([{"content": "Hi"}], "messages[0].role"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": None}], "messages[1].content"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text"),
])
def test_a_chat_message_without_content_or_with_another_role_is_a_400_naming_it(server, messages, param):
    status, answer = post(server, *chat(messages=messages))
    assert status == 400, answer
    assert_openai_error(answer, param, "invalid_argument")
    assert param in answer["error"]["message"]
    every_role = [{"role": "system", "content": "Be brief."}, {"role": "developer", "content": "Answer in English."},
                  {"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""},
                  {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "?"}]}]
    assert post(server, *chat(messages=every_role))[0] == 200


# ---- 4: a body over the bound is a 413, and is not read

def raw_post(url, head, pieces, timeout=20):
    """A POST over a plain socket: the given headers, then each piece as it is. Its status
    and JSON answer."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        lines = [f"POST {COMPLETIONS} HTTP/1.1", "Host: meshnet", "Content-Type: application/json",
                 f"Authorization: Bearer {KEY}", *(f"{name}: {value}" for name, value in head.items())]
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        for piece in pieces:
            sock.sendall(piece)
        response = http.client.HTTPResponse(sock)
        response.begin()
        return response.status, json.loads(response.read())


def body_of(size, model="not-this-model"):
    """A completion's body of exactly size bytes: its prompt fills it. Another model: a 404 once read."""
    head = json.dumps({"model": model, "prompt": ""})
    return (head[:-2] + "x" * (size - len(head)) + '"}').encode()


def chunked(body, complete=True, size=2**20):
    pieces = [b"%x\r\n%s\r\n" % (len(body[i:i + size]), body[i:i + size]) for i in range(0, len(body), size)]
    return pieces + ([b"0\r\n\r\n"] if complete else [])


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_body_over_the_bound_is_a_413_and_one_up_to_it_is_read(server, framing):
    if framing == "content-length":
        # refused on its Content-Length alone: no byte of the body is ever sent
        status, answer = raw_post(server, {"Content-Length": LIMIT + 1}, [])
        whole = body_of(LIMIT)
        below = raw_post(server, {"Content-Length": len(whole)}, [whole])
    else:
        # refused once what came passes the bound: the body's end is never sent
        status, answer = raw_post(server, {"Transfer-Encoding": "chunked"}, chunked(body_of(LIMIT + 1), complete=False))
        below = raw_post(server, {"Transfer-Encoding": "chunked"}, chunked(body_of(LIMIT)))
    assert status == 413, answer
    assert_openai_error(answer, None, "request_too_large")
    assert "4 MiB" in answer["error"]["message"]
    status, answer = below   # at the bound: read, and answered
    assert status == 404 and answer["error"]["code"] == "model_not_found", answer
    # a 3,000,000-character prompt is under the bound: not a 413 (here the model is another: a 404)
    status, answer = post(server, COMPLETIONS, {"model": "not-this-model", "prompt": "word " * 600_000})
    assert status == 404, answer
    assert post(server, *completion(max_tokens=1))[0] == 200


@pytest.mark.parametrize("n_chars", [70_000, 3_000_000], ids=["70KB", "3MB"])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_prompt_far_past_the_context_is_refused_at_once_with_context_full(server, n_chars, chat):
    text = ("lorem ipsum dolor sit amet " * (n_chars // 27 + 1))[:n_chars]
    body = ({"model": MODEL, "messages": [{"role": "user", "content": text}]} if chat
            else {"model": MODEL, "prompt": text})
    t0 = time.monotonic()
    status, answer = post(server, "/v1/chat/completions" if chat else "/v1/completions", json.dumps(body).encode())
    elapsed = time.monotonic() - t0
    assert status == 400 and answer["error"]["code"] == "context_full", answer
    assert answer["error"]["param"] == ("messages" if chat else "prompt")
    print(f"{n_chars} characters refused in {elapsed:.3f} s")
    assert elapsed < 30   # the figure is in the note; a busy machine must not fail this
