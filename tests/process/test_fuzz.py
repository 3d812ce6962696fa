"""Seeded, bounded fuzz of the two programs that read the wire: the coordinator (with a
real two-worker route) and one real stage worker process, each on both of its planes:
its control socket and its data endpoint (a PULL that activations, tokens and "chunk
taken" come to). Each program is sent FRAMES frames from a seeded generator: random
bytes, truncated and garbled headers, valid headers with wrong-typed, boolean,
negative, huge or out-of-range fields, unknown types, wrong versions, extra frames,
oversized and non-finite payloads, mutations of every real message (READY with
unusable capabilities included), messages on the wrong plane, and data messages for
real-looking sessions with the session's key or without it.

What must hold all along:
- nothing crashes: the processes live and the coordinator's I/O thread runs without an
  internal error;
- nothing hangs: after every small batch the peer answers a probe within a bound, and
  the coordinator has counted every data message of the batch (the rate is bounded so
  that this measures robustness, not high-water-mark drops);
- every message that comes back, on either plane, is itself protocol-valid (decodes
  without error), and a worker's data message carries the key its session was opened
  with;
- nothing a bad message does reaches anyone else: a reference session through the same
  peer gives the whole model's greedy tokens before, during and after the flood; the
  data plane answers nothing, so a data message without the session's key shows only
  as a count (the coordinator's dropped_* counters, a worker's HEALTH "dropped");
- a worker never computes on a non-finite residual (each one is refused with an
  error, and no output ever comes of it), and a CANCEL of a session that was never
  opened does not stop that id from being opened and used later.

The seed is fixed so that a failure replays: MESHNET_FUZZ_SEED and MESHNET_FUZZ_FRAMES
change it and the size.
"""

import collections
import logging
import os
import random
import subprocess
import sys
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq

from meshnet.core import errors as E
from meshnet.engine.binding import Entry, Stage
from meshnet.engine.pipeline import LocalPipeline
from meshnet.launch.local_cluster import LocalCluster
from meshnet.net import protocol as P
from meshnet.net.heartbeat import HEARTBEAT_INTERVAL

from conftest import THREADS
from peers import KEY, bind_loopback, rss_kib

SEED = int(os.environ.get("MESHNET_FUZZ_SEED", "16"))
FRAMES = int(os.environ.get("MESHNET_FUZZ_FRAMES", "10000"))   # per program under test, both planes together
DATA_SHARE = 0.4           # the share of the frames sent to the data endpoint
BATCH = 25                 # frames sent before the peer must answer a probe: far below any HWM or queue bound
RATE = 1000                # frames per second at most: a flood that lasts while reference sessions run through it
CHECKPOINTS = 5            # coordinator: the flood waits at each fifth for one more reference session to have ended
PROBE_BOUND_S = 15.0       # a probe answered later than this is a hang (a loaded 2-core machine stalls a process for seconds)
SESSION_BOUND_S = 60.0     # a reference session longer than this is a hang
REJOIN_BOUND_S = 12.0      # a worker cut off by ZeroMQ: its liveness window (2 s) plus libzmq's reconnect back-off
REFERENCE_ROUNDS = 10      # worker: reference sessions spread over the flood
CUT_BATCH = 7              # the batch after which a frame past the socket's own limit cuts a connection
BIG = 1 << 30              # what we accept back: the point is validity, not size
RESERVED_RID = 1 << 62     # probes and reference requests: a range the fuzz never draws from
PROMPT = "The old lighthouse keeper climbed the stairs every night, and"
N_REFERENCE = 16
HALVES = [(0, 15), (15, 30)]
N_EMBD = 576
N_VOCAB = 49152
WORKER_MAX_PAYLOAD = 512 * N_EMBD * 4              # a worker's n_batch rows of f32
COORDINATOR_MAX_PAYLOAD = 4 << 20
NAN, INF = float("nan"), float("inf")


# ---- the generator ------------------------------------------------------------------

NASTY = [True, False, None, -1, -2**63, 2**63, 2**64 - 1, 0, 1 << 31, -(1 << 31) - 1, 1 << 20, 1.5, NAN, INF, -INF,
         "", "x" * 300, "é\x00", b"\xff\xfe", [], [True], [1, 2, 3], [[1]], {}, {"k": 1}, msgpack.ExtType(7, b"ext")]

# endpoints no stage can pass anything on to: malformed, unbindable, or with nothing behind them
BAD_ENDPOINTS = ["", "nowhere", "tcp://", "x://", "tcp://127.0.0.1:9", "tcp://256.0.0.1:1", "tcp://*:0",
                 "tcp://127.0.0.1:0", "ipc:///nonexistent/meshnet-fuzz", "inproc://meshnet-fuzz", "tcp://[::1]:9",
                 "tcp://" + "y" * 260 + ":1", "tcp://127.0.0.1:99999", "udp://127.0.0.1:9"]

# values that are wrong for one field in particular
SPECIAL = {
    "v": [0, 2, -1, "1", None, 1.5, 2**64 - 1, [1]],
    "type": ["", "ACT", "act\x00", 1, None, True, "make_coffee", "x" * 1000, b"act", ["act"],
             "forward", "result"],   # the types this protocol no longer has included
    "rid": [True, False, -1, -2**63, 2**64 - 1, 0, 1.5, "1", None, [1]],
    "sid": [True, False, -1, -2**63, 2**64 - 1, 2**63, 0, 1.0, "7", None, [7]],
    "key": [True, False, -1, -2**63, 0, 1, KEY + 1, 2**64 - 1, 1.0, "key", None, [KEY], b"\x00" * 8],
    "pos": [-1, 1 << 31, True, 1.5, None, 2**64 - 1, 10_000, 255, 256],
    "n": [0, -1, True, 1 << 31, 513, 100_000, 1.0, 2, 512],
    "tokens": [[True], [-1], [1 << 31], [-(1 << 31) - 1], [N_VOCAB], [1.0], [None], ["a"], list(range(1000)), [],
               "abc", {}, [1]],
    "stage": [-1, True, 0, 1, 2, (1 << 20) + 1, (1 << 31) - 1, 1 << 31, 1.0, None],
    "next": BAD_ENDPOINTS + [None, 1, ["tcp://127.0.0.1:9"]],
    "reply": BAD_ENDPOINTS + [None, 1, ["tcp://127.0.0.1:9"]],
    "prompt_len": [0, -1, True, 1 << 31, 1, (1 << 31) - 1, 1.5, None],
    "max_tokens": [0, -1, True, 1 << 31, 1, (1 << 31) - 1, 1.5, None],
    "stop_at_eog": [1, 0, None, "yes", []],
    "hop_clock": [1, 0, None, "yes"],
    "ack": [1, 0, None, "yes"],
    "ts": [-1, 0, 1, 2**63, 2**64 - 1, -2**63, True, 1.5, None],
    "seams": [[[0, 0, 0]] * 4096, [[0, 0, 0]] * 4097, [[-1, 0, 0]], [[0, -2, 0]], [[1 << 20, 0, 0]], [[0, 0, 1 << 40]],
              [[0, 1 << 40, 0]], [[0, 0]], [[0, 0, 0, 0]], [[True, 0, 0]], [[0.0, 0, 0]], [1, 2, 3], "seams", [[]],
              [[(1 << 20) - 1, (1 << 40) - 1, (1 << 40) - 1]] * 64, {}],
    "eog": [1, 0, None, "no"],
    "logits_n": [0, -1, True, N_VOCAB, 1, 1 << 31],
    "logits": [1, 0, "yes", None, []],
    "text": [None, 1, b"bytes", "", "\x00" * 10, "<|im_start|>system", "é" * 2000, ["a"]],
    "add_special": [1, "true", None],
    "parse_special": [1, "yes", None],
    "token": [-1, True, 1 << 31, N_VOCAB, None],
    "code": [None, 1, "", "stage_lost", "hop_unreachable", "cancelled"],
    "message": [None, 1, ""],
    "context": [None, [], "x", {"stage": [1]}],
    "info": [None, [], "x", {"tokens": [True]}],
    "piece": ["str", None, 1, b"\xff" * 1000],
    "capability": [None, [], "x", {}, {"layers": "all of them"}],
    "sampling": [None, [], "x", {}, {"temperature": -1}, {"temperature": NAN}, {"top_p": 2}, {"seed": -1},
                 {"seed": 2**63}, {"top_k": True}, {"repeat_penalty": 0}, {"penalty_last_n": -2}, {"frobnicate": 1},
                 {"temperature": 0.8, "seed": 42}, {"temperature": 1e6}],
    "history": [None, [], [-1], [N_VOCAB], [True], list(range(1000)), "abc", [1.0]],
    "messages": [None, [], "hi", [{}], [{"role": "user"}], [{"role": 1, "content": "x"}],
                 [{"role": "user", "content": "x", "name": "y"}], [{"role": "user", "content": "é" * 3000}] * 20,
                 [{"role": "user", "content": "\x00"}], [{"role": "user", "content": "x"}] * 5000],
    "add_generation_prompt": [1, "yes", None],
}

# READY capability fields the coordinator builds a route from, and values no worker can mean
UNUSABLE = {
    "model_sha256": [None, 1, True, [], {}, b"\xb1" * 32, ["b179"], "", "B179" * 16, "b179"],
    "layers": [None, 15, "0:15", [0], [0, 15, 30], [-1, 15], [15, 0], [0, 31], [0.0, 15.0], [True, 15], [0, True],
               [None, 15], [[0], [15]], {"0": 15}, [0, 2**64 - 1], [2**63, 2**64 - 1], [15, 15]],
    "n_layer": [None, "30", 30.0, True, -1, 0, [30], 2**64 - 1, NAN],
    "n_embd": [None, "576", 576.0, True, -1, 0, [576], NAN],
    "engine_pin": [None, 1, True, [], ["llama.cpp"], {}, "", "x" * 300],
    "backend": [None, 1, True, ["CPU"], {}, ""],
    "wire_dtype": [None, 32, True, ["f32"], {}, "f16", "F32"],
    "numerics": [None, 0, True, ["invariant"], {}, "", "exact", "Invariant"],
    "n_ctx": [None, "1024", 1024.5, True, -1, 0, [1024], NAN],
    "n_batch": [None, "512", 512.5, True, -1, 0, [512]],
    "data_endpoint": [None, 1, True, "", "nowhere", "tcp:/127.0.0.1:1", "x://" + "y" * 300, ["tcp://127.0.0.1:9"]],
    "worker_id": [None, 1, True, "", "w" * 300],
    "clock_id": [None, 1, "", "c" * 300],
    "max_sessions": [None, 0, -1, True, "8", 8.0],
    "admitted_bytes": [None, -1, True, -2**63, "1"],
    "arch": [None, 1, ""],
    "n_vocab": [None, 0, -1, True, "49152"],
}


class Fuzzer:
    """Frames from a seeded generator. templates: name -> rng -> (header, payload) of a
    valid message (a header may name its own type); the kinds below break them in every
    way we could think of. weights: how often each template is drawn (1 unless given);
    residual: the template a non-finite or oversized payload goes into, and what a
    non-finite one is sent as (a template of its own, so that what comes of it shows)."""

    KINDS = {  # kind: weight
        "random_bytes": 8, "truncated": 8, "garbled": 8, "valid": 14, "fields": 28, "version": 3,
        "unknown_type": 4, "extra_frames": 4, "payload": 10, "non_finite": 5, "non_map": 2,
        "big_header": 1, "oversized": 0.5, "bad_capability": 0,
    }

    def __init__(self, rng: random.Random, templates: dict, max_payload: int, weights: dict | None = None,
                 residual=None, **kinds):
        self.rng = rng
        self.templates = templates
        self.names = sorted(templates)
        self.template_weights = [(weights or {}).get(name, 1) for name in self.names]
        self.max_payload = max_payload
        self.residual = residual
        kinds = dict(self.KINDS, **kinds)
        if residual is None:
            kinds["non_finite"] = 0
        self.kinds, self.weights = zip(*[(k, w) for k, w in kinds.items() if w > 0])

    def rid(self) -> int:
        return self.rng.randrange(1, 1 << 40)

    def _header(self, name, header):
        return dict({"v": P.VERSION, "type": name, "rid": self.rid()}, **header)

    def template(self, names=None):
        name = self.rng.choice(names) if names else self.rng.choices(self.names, self.template_weights)[0]
        header, payload = self.templates[name](self.rng)
        return self._header(name, header), payload

    def next(self) -> tuple[str, list[bytes]]:
        kind = self.rng.choices(self.kinds, self.weights)[0]
        return kind, getattr(self, "_" + kind)()

    @staticmethod
    def pack(header) -> bytes:
        return msgpack.packb(header, use_bin_type=True)

    def frames(self, header, payload) -> list[bytes]:
        return [self.pack(header)] if payload is None else [self.pack(header), payload]

    def _random_bytes(self):
        return [self.rng.randbytes(self.rng.randrange(0, 200))]

    def _truncated(self):
        raw = self.pack(self.template()[0])
        return [raw[: self.rng.randrange(0, len(raw))]]

    def _garbled(self):
        header, payload = self.template()
        raw = bytearray(self.pack(header))
        for _ in range(self.rng.randint(1, 4)):
            raw[self.rng.randrange(len(raw))] = self.rng.randrange(256)
        return [bytes(raw)] + ([] if payload is None else [payload])

    def _valid(self):
        return self.frames(*self.template())

    def _fields(self):
        header, payload = self.template()
        for _ in range(self.rng.randint(1, 3)):
            op = self.rng.random()
            key = self.rng.choice([*header, "sid", "key", "tokens", "seams", "zzz", "shape"])
            if op < 0.15 and key in header:
                del header[key]
            elif op < 0.75 and key in SPECIAL:
                header[key] = self.rng.choice(SPECIAL[key])
            else:
                header[key] = self.rng.choice(NASTY)
        return self.frames(header, payload)

    def _version(self):
        header, payload = self.template()
        header["v"] = self.rng.choice(SPECIAL["v"])
        return self.frames(header, payload)

    def _unknown_type(self):
        header, payload = self.template()
        header["type"] = self.rng.choice(SPECIAL["type"])
        return self.frames(header, payload)

    def _extra_frames(self):
        frames = self._valid()
        return frames + [self.rng.randbytes(self.rng.randrange(0, 64)) for _ in range(self.rng.randint(1, 3))]

    def _payload(self):
        header, payload = self.template()
        payload = payload or b""
        op = self.rng.randrange(6)
        if op == 0:
            return self.frames(header, None)
        if op == 1 and payload:
            return self.frames(header, payload[: self.rng.randrange(len(payload))])
        if op == 2:
            return self.frames(header, payload + self.rng.randbytes(self.rng.randint(1, 8)))
        if op == 3:
            return self.frames(header, self.rng.randbytes(len(payload)))
        if op == 4:
            return self.frames(header, b"")
        return self.frames(header, self.rng.randbytes(self.rng.randrange(0, 4096)))

    def _non_finite(self):
        header, payload = self.residual(self.rng)
        values = np.frombuffer(payload, dtype="<f4").copy()
        for i in self.rng.sample(range(values.size), self.rng.randint(1, 4)):
            values[i] = self.rng.choice([NAN, INF, -INF])
        return self.frames(self._header("act", header), values.tobytes())

    def _non_map(self):
        return [self.pack(self.rng.choice([[1, 2], 5, "hello", None, True, {1: 2}, {b"v": 1, b"type": b"health"},
                                           msgpack.ExtType(1, b"x")]))]

    def _big_header(self):
        header, payload = self.template()
        header[self.rng.choice(["text", "zzz", "message"])] = "x" * (P.MAX_HEADER_BYTES + self.rng.randrange(1, 4096))
        return self.frames(header, payload)

    def _oversized(self):
        header, _ = self.template(["act"] if "act" in self.templates else None)
        return self.frames(header, bytes(self.max_payload + self.rng.randrange(1, 1 << 20)))

    def _bad_capability(self):
        return self.frames(*self.template(["ready"]))


def unusable_capability(rng: random.Random, real: dict):
    """A capability no coordinator can build a route from: one field it uses made
    unusable or missing, or no capability at all."""
    capability = dict(real)
    roll = rng.random()
    if roll < 0.1:
        return rng.choice(SPECIAL["capability"])
    if roll < 0.25:
        del capability[rng.choice(sorted(UNUSABLE))]
    else:
        key = rng.choice(sorted(UNUSABLE))
        capability[key] = rng.choice(UNUSABLE[key])
    return capability


def usable(capability: dict) -> bool:
    """What a capability must be for a route to be built on it (the inverse of UNUSABLE)."""
    def count(v, top=1 << 40):
        return isinstance(v, int) and not isinstance(v, bool) and 0 < v < top

    def text(v, top=256):
        return isinstance(v, str) and 0 < len(v) <= top

    layers, n_layer, sha = capability.get("layers"), capability.get("n_layer"), capability.get("model_sha256")
    endpoint = capability.get("data_endpoint")
    admitted = capability.get("admitted_bytes")
    return (isinstance(sha, str) and len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)
            and count(n_layer, 1 << 20) and isinstance(layers, list) and len(layers) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in layers)
            and 0 <= layers[0] < layers[1] <= n_layer
            and all(count(capability.get(k)) for k in ("n_embd", "n_ctx", "n_batch", "max_sessions", "n_vocab"))
            and all(text(capability.get(k)) for k in ("engine_pin", "backend", "worker_id", "clock_id", "arch"))
            and capability.get("wire_dtype") == "f32"
            and capability.get("numerics") in ("invariant", "stock", "baseline")
            and isinstance(admitted, int) and not isinstance(admitted, bool) and 0 <= admitted < 1 << 64
            and text(endpoint) and "://" in endpoint)


def residual_payload(rng: random.Random, n: int, width: int = N_EMBD) -> bytes:
    return np.random.default_rng(rng.randrange(1 << 32)).standard_normal((n, width), dtype=np.float32).tobytes()


def random_seams(rng: random.Random) -> list:
    """What stages report of the seams a step crossed: a few ordinary ones, or as many
    (or as large) as a message may carry."""
    roll = rng.random()
    if roll < 0.5:
        return [[rng.randrange(4), rng.randrange(-1, 1 << 20), rng.randrange(1 << 22)] for _ in range(rng.randint(0, 4))]
    if roll < 0.7:
        return [[0, -1, 0]] * 4096
    if roll < 0.85:
        return [[(1 << 20) - 1, (1 << 40) - 1, (1 << 40) - 1]] * rng.randint(1, 64)
    return [[1, 5, N_EMBD * 4]] * rng.randint(1, 300)


def data_key(rng: random.Random, real: int | None = None) -> int:
    """A session key: the real one when given (mostly), else anything a forger might try."""
    if real is not None and rng.random() < 0.7:
        return real
    return rng.choice([0, 1, KEY, KEY + 1, 2**63, 2**64 - 1, rng.randrange(1 << 63), rng.randrange(1 << 64)])


# ---- what comes back ------------------------------------------------------------------


def _show(frames) -> str:
    try:
        header = msgpack.unpackb(frames[0], raw=False, strict_map_key=False)
    except Exception:
        header = bytes(frames[0][:80])
    return f"{header!r:.300} (+{len(frames) - 1} frame(s))"


class Replies:
    """Every message that comes back is decoded (so checked) and counted; a bad one is
    reported with the message it answered, where its rid says which."""

    def __init__(self):
        self.violations: list[tuple[str, str]] = []   # (kind, what happened)
        self.counts: collections.Counter = collections.Counter()
        self.sent: dict[int, str] = {}          # rid -> what we sent with it, to explain a bad answer

    def violate(self, kind: str, text: str) -> None:
        self.violations.append((kind, text))

    def take(self, frames, plane: str = "control") -> P.Message | None:
        try:
            msg = P.decode(frames, BIG)
        except P.ProtocolError as e:
            self.counts[f"INVALID {plane}"] += 1
            rid = None
            try:
                rid = msgpack.unpackb(frames[0], raw=False, strict_map_key=False).get("rid")
            except Exception:
                pass
            answered = self.sent.get(rid) if isinstance(rid, int) and plane == "control" else None
            self.violate(f"invalid {plane} message", f"[{e.code}] {e.message}: {_show(frames)}"
                         + (f" -- answering {answered}" if answered else ""))
            return None
        what = f"error:{msg['code']}" if msg.type == P.ERROR else msg.type
        self.counts[what if plane == "control" else f"data:{what}"] += 1
        return msg

    def note(self, header, frames) -> None:
        rid = header.get("rid") if isinstance(header, dict) else None
        if isinstance(rid, int) and not isinstance(rid, bool):
            # a rid sent twice cannot say which message an answer was for
            self.sent[rid] = None if rid in self.sent else _show(frames)


def header_of(frames) -> dict | None:
    try:
        header = msgpack.unpackb(frames[0], raw=False, strict_map_key=False)
    except Exception:
        return None
    return header if isinstance(header, dict) else None


def decoded(frames, max_payload: int) -> P.Message | None:
    try:
        return P.decode(frames, max_payload)
    except P.ProtocolError:
        return None


def summary(name: str, replies: Replies, sent: collections.Counter, seconds: float, probes: list[float]) -> str:
    return (f"{name}: {sum(sent.values())} frames ({dict(sent)}) in {seconds:.1f} s, probe p50 "
            f"{np.median(probes) * 1000:.1f} ms max {max(probes) * 1000:.1f} ms; answers {dict(replies.counts.most_common())}")


def failure_report(replies: Replies, per_kind: int = 3) -> str:
    kinds = collections.Counter(kind for kind, _ in replies.violations)
    lines = []
    for kind in kinds:
        lines += [f"{kind}: {text}" for k, text in replies.violations if k == kind][:per_kind]
    return f"{len(replies.violations)} violation(s) {dict(kinds)}; the first of each:\n  " + "\n  ".join(lines)


def push_socket(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def send_bounded(sock: zmq.Socket, frames) -> bool:
    """Send on a PUSH without waiting for ever: False when it took nothing within the bound."""
    if not sock.poll(int(PROBE_BOUND_S * 1000), zmq.POLLOUT):
        return False
    sock.send_multipart(frames, copy=False)
    return True


@pytest.fixture(scope="module")
def expected(smollm2_path):
    """The whole model in one process: the prompt and its greedy continuation, the truth."""
    with LocalPipeline(smollm2_path, [(0, 30)], n_ctx=1024, max_sessions=1, n_threads=THREADS) as whole:
        tokens = whole.head.tokenize(PROMPT)
        return tokens, whole.generate(tokens, N_REFERENCE, stop_at_eog=False).tokens


# ---- the coordinator ------------------------------------------------------------------


def coordinator_templates(real_capability: dict, live_sids: list) -> tuple[dict, dict]:
    """(control, data): what a coordinator's peers send it on each plane, and what they
    must not (requests only a worker serves, data messages on the control socket and
    control messages on the data endpoint)."""

    def sid(rng):
        # as many draws whatever the sessions are, so that the seed replays the same frames
        roll, offset, other = rng.random(), rng.choice([-1, 0, 0, 0, 1, 1]), rng.choice([0, 1, 7, 2**64 - 1,
                                                                                          rng.randrange(1 << 40)])
        if roll < 0.5 and live_sids:
            # the session running now, the one just before, and the next one: ids are handed out in order
            return live_sids[-1] + offset
        return other

    def took(rng):
        return {"sid": sid(rng), "key": data_key(rng), "pos": rng.choice([0, 64, rng.randrange(1024)]),
                "n": rng.choice([1, 13, 64])}, None

    def token(rng):
        header = {"sid": sid(rng), "key": data_key(rng), "pos": rng.choice([0, 12, rng.randrange(1024)]),
                  "n": rng.choice([1, 1, 13]), "token": rng.randrange(N_VOCAB), "eog": rng.random() < 0.2}
        if rng.random() < 0.5:
            header["piece"] = rng.choice([b"x", b"\xff\xfe", b"", "é".encode() * 10])
        if rng.random() < 0.2:
            header["seams"] = random_seams(rng)
        if rng.random() < 0.15:
            header["logits_n"] = N_VOCAB
            return header, residual_payload(rng, N_VOCAB // N_EMBD + 1)[: N_VOCAB * 4]
        return header, None

    def act(rng):
        n = rng.randint(1, 4)
        header = {"sid": sid(rng), "key": data_key(rng), "pos": rng.choice([0, rng.randrange(64)]), "n": n}
        if rng.random() < 0.5:
            return dict(header, tokens=[rng.randrange(N_VOCAB) for _ in range(n)]), None
        return header, residual_payload(rng, n)

    def opened(rng):
        return {"sid": sid(rng), "key": data_key(rng), "stage": rng.choice([0, 1]), "next": "tcp://127.0.0.1:9",
                "reply": "tcp://127.0.0.1:9", "prompt_len": 12, "max_tokens": 16, "stop_at_eog": False}, None

    def error(rng):
        header = {"code": rng.choice(["busy", "hop_unreachable", "stage_lost", "bad_payload"]), "message": "fuzz",
                  "sid": sid(rng)}
        if rng.random() < 0.5:
            header["rid"] = 0   # as a stage reports a session that failed on its data plane
        return header, None

    control = {
        "ready": lambda rng: ({"capability": unusable_capability(rng, real_capability)}, None),
        "heartbeat": lambda rng: ({}, None),
        "goodbye": lambda rng: ({}, None),
        "ok": lambda rng: ({"sid": sid(rng), "info": {"tokens": [1, 2]}}, None),
        "error": error,
        "open": opened,
        "cancel": lambda rng: ({"sid": sid(rng)}, None),
        "release": lambda rng: ({"sid": sid(rng)}, None),
        "health": lambda rng: ({}, None),
        "capability": lambda rng: ({}, None),
        "tokenize": lambda rng: ({}, b"hello"),
        "detokenize": lambda rng: ({}, bytes(P.tokens_frame([1, 2, 3]))),
        "template": lambda rng: ({}, msgpack.packb([{"role": "user", "content": "hi"}])),
        "chat": lambda rng: ({}, b'{"messages": [{"role": "user", "content": "hi"}]}'),
        "shutdown": lambda rng: ({}, None),
        "disconnect": lambda rng: ({}, None),
        # the data plane's messages on the control socket
        "act": act,
        "took": took,
        "token": token,
    }
    data = {
        "took": took,
        "token": token,
        "act": act,
        # the control plane's messages on the data endpoint
        "ok": lambda rng: ({"sid": sid(rng)}, None),
        "error": error,
        "heartbeat": lambda rng: ({}, None),
        "ready": lambda rng: ({"capability": dict(real_capability)}, None),
    }
    return control, data


def bounded(fn, bound=SESSION_BOUND_S):
    """fn's value, or a note that it hung: a hung call must fail the test, not stall it."""
    box = []

    def call():
        try:
            box.append(fn())
        except Exception as e:  # an error is an answer too: the caller compares it with what it expected
            box.append(e)
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(bound)
    return box[0] if box else f"<no answer within {bound} s>"


class Dealer:
    def __init__(self, ctx, endpoint):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def drain(self, replies: Replies, until_rid=None, bound=PROBE_BOUND_S) -> bool:
        """Take every answer waiting; with until_rid, wait (bounded) for that one."""
        deadline = time.monotonic() + bound
        while True:
            timeout = 0 if until_rid is None else max(0.0, deadline - time.monotonic())
            if not self.sock.poll(int(timeout * 1000)):
                return until_rid is None
            msg = replies.take(self.sock.recv_multipart())
            if until_rid is not None and msg is not None and msg.rid == until_rid:
                return True


def dropped_total(counters: dict) -> int:
    return sum(v for k, v in counters.items() if k.startswith("dropped_"))


def test_fuzzing_the_coordinator_never_crashes_hangs_answers_invalidly_or_disturbs_a_session(smollm2_path, expected,
                                                                                             caplog):
    caplog.set_level(logging.ERROR, logger="meshnet.route.coordinator")  # a warning per refused READY: thousands, all expected
    prompt_tokens, expected_tokens = expected
    rng = random.Random(SEED)
    # keyless, as meshnet coordinator is on loopback: the fuzz is to reach the coordinator's own checks
    cluster = LocalCluster(smollm2_path, HALVES, threads=THREADS, n_ctx=1024, max_payload=COORDINATOR_MAX_PAYLOAD,
                           secure=False).start()
    coordinator = cluster.coordinator
    ctx = zmq.Context()
    replies = Replies()
    sessions: list[tuple[float, object]] = []   # (seconds, tokens or the error)
    live_sids: list[int] = []                   # the reference sessions' ids: what real-looking data messages name
    stop = threading.Event()
    peers: list[Dealer] = []
    pushes: list[zmq.Socket] = []
    retired: list[zmq.Socket] = []              # PUSHes whose connection a frame past the limit cut

    def reference_sessions():
        # one session after another for as long as the flood lasts: each must be the whole model's
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                handle = coordinator.generate(prompt_tokens, N_REFERENCE, stop_at_eog=False)
                live_sids.append(handle.sid)
                got = handle.result(SESSION_BOUND_S).tokens
            except Exception as e:
                got = e
            sessions.append((time.monotonic() - t0, got))

    def counters() -> dict:
        # read on the coordinator's own thread: an answer also proves its command queue is served
        return coordinator.counters()

    try:
        real = {w["name"]: w for w in coordinator.workers_snapshot()}
        real_capability = {k: v for k, v in next(iter(real.values())).items() if k not in ("name", "sessions")}
        control_templates, data_templates = coordinator_templates(real_capability, live_sids)
        fuzz = Fuzzer(rng, control_templates, COORDINATOR_MAX_PAYLOAD, bad_capability=10)

        def non_finite_logits(rng):
            header, _ = data_templates["token"](rng)
            return dict(header, type=P.TOKEN, logits_n=N_EMBD), residual_payload(rng, 1)

        data_fuzz = Fuzzer(rng, data_templates, COORDINATOR_MAX_PAYLOAD, weights={"took": 3, "token": 6, "act": 2},
                           residual=non_finite_logits, non_finite=3)
        peers += [Dealer(ctx, coordinator.endpoint) for _ in range(3)]
        pushes += [push_socket(ctx, coordinator.data_endpoint) for _ in range(2)]
        counted_before = dropped_total(counters())
        referee = threading.Thread(target=reference_sessions, daemon=True)
        referee.start()

        probes = []
        t_start = time.monotonic()
        sent = collections.Counter()   # frames sent, by plane
        batch_no = 0
        per_checkpoint = max(1, FRAMES // CHECKPOINTS)
        next_checkpoint = per_checkpoint
        while sum(sent.values()) < FRAMES:
            peer = peers[batch_no % len(peers)]
            push = pushes[batch_no % len(pushes)]
            batch_no += 1
            stuck = False
            for _ in range(min(BATCH, FRAMES - sum(sent.values()))):
                if rng.random() < DATA_SHARE:
                    kind, frames = data_fuzz.next()
                    if not send_bounded(push, frames):
                        stuck = True
                        break
                    sent["data"] += 1
                else:
                    kind, frames = fuzz.next()
                    replies.note(header_of(frames), frames)
                    peer.sock.send_multipart(frames, copy=False)
                    sent["control"] += 1
            if stuck:
                replies.violate("hang", f"the data endpoint took nothing for {PROBE_BOUND_S} s in batch {batch_no}")
                break
            if batch_no == CUT_BATCH:
                # past each socket's own limit (twice max_payload): zmq drops the connection; the
                # control peer reconnects, the data PUSH is replaced (and nothing it sent is counted)
                peer.sock.send_multipart([fuzz.pack({"v": P.VERSION, "type": "heartbeat", "rid": 1}),
                                          bytes(2 * COORDINATOR_MAX_PAYLOAD + 1)])
                push.send_multipart([fuzz.pack({"v": P.VERSION, "type": "token", "rid": 0}),
                                     bytes(2 * COORDINATOR_MAX_PAYLOAD + 1)])
                retired.append(push)
                pushes[pushes.index(push)] = push_socket(ctx, coordinator.data_endpoint)
            for other in peers:
                other.drain(replies)
            # the coordinator answers a request it does not serve; the answer proves it is alive and in order
            probe_rid = RESERVED_RID + batch_no
            t0 = time.monotonic()
            peer.sock.send_multipart(P.encode(P.HEALTH, probe_rid))
            answered = peer.drain(replies, until_rid=probe_rid)
            # and every data message sent so far has been read and counted as dropped: none had a session's key
            counted, waited = None, time.monotonic()
            while time.monotonic() - waited < PROBE_BOUND_S:
                try:
                    counted = dropped_total(counters()) - counted_before
                except Exception as e:
                    replies.violate("hang", f"the coordinator's counters: {type(e).__name__} {e} after batch {batch_no}")
                    break
                if counted >= sent["data"]:
                    break
                time.sleep(0.002)
            probes.append(time.monotonic() - t0)
            if not answered:
                replies.violate("hang", f"no answer to a probe within {PROBE_BOUND_S} s after batch {batch_no}")
                break
            if counted is None or counted < sent["data"]:
                replies.violate("hang", f"after batch {batch_no}, {counted} of the {sent['data']} data messages sent "
                                f"were counted within {PROBE_BOUND_S} s")
                break
            if not coordinator.alive():
                replies.violate("crash", f"the coordinator's I/O thread died during batch {batch_no}")
                break
            dead = [r for r, p in cluster.processes.items() if p.poll() is not None]
            if dead:
                replies.violate("crash", f"worker(s) {dead} exited during batch {batch_no}")
                break
            try:
                snapshot = {w["name"]: w for w in coordinator.workers_snapshot()}
                route = [o.worker for o in coordinator.route()]
            except Exception as e:
                replies.violate("route", f"asking for it raised {type(e).__name__}: {e} after batch {batch_no}")
                snapshot, route = {}, []
            intruders = {name: w for name, w in snapshot.items() if name not in real}
            for name, w in intruders.items():
                capability = {k: v for k, v in w.items() if k not in ("name", "sessions")}
                if not usable(capability):
                    odd = {k: capability.get(k, "<missing>") for k in UNUSABLE
                           if capability.get(k, ...) != real_capability.get(k)}
                    replies.violate("unusable READY accepted", f"batch {batch_no}: a capability with {odd!r:.300}")
            if snapshot and sorted(route) != sorted(real):
                replies.violate("route", f"{route} is not the real workers {sorted(real)} after batch {batch_no}")
            if intruders or sorted(route) != sorted(real):
                for p in peers:  # unregister whatever got in, so that later batches are judged on their own
                    p.sock.send_multipart(P.encode(P.GOODBYE, 0))
                time.sleep(0.1)
            time.sleep(max(0.0, t_start + sum(sent.values()) / RATE - time.monotonic()))
            if sum(sent.values()) >= next_checkpoint:
                # the flood waits for the sessions, not the other way round: on a slow or busy
                # machine they still run through all of it
                need, waited = next_checkpoint // per_checkpoint, time.monotonic()
                while len(sessions) < need and time.monotonic() - waited < SESSION_BOUND_S:
                    time.sleep(0.01)
                if len(sessions) < need:
                    replies.violate("hang", f"no reference session ended within {SESSION_BOUND_S} s (batch {batch_no})")
                    break
                next_checkpoint += per_checkpoint
        seconds = time.monotonic() - t_start
        stop.set()
        referee.join(SESSION_BOUND_S)
        if referee.is_alive():
            replies.violate("hang", f"a reference session did not end within {SESSION_BOUND_S} s")
        wrong = [(round(s, 2), got) for s, got in sessions if got != expected_tokens]
        slow = [round(s, 2) for s, _ in sessions if s > SESSION_BOUND_S]
        if wrong:
            replies.violate("reference", f"{len(wrong)} of {len(sessions)} sessions differ from the whole model: {wrong[:3]}")
        if slow:
            replies.violate("hang", f"reference sessions took {slow} s")
        final = {}
        if coordinator.alive():
            # after the flood the route still gives the whole model's tokens
            after = bounded(lambda: coordinator.generate(prompt_tokens, N_REFERENCE, stop_at_eog=False).result().tokens)
            if after != expected_tokens:
                replies.violate("reference", f"the session after the flood gave {after}")
            final = bounded(counters, PROBE_BOUND_S)
            if not isinstance(final, dict):
                replies.violate("hang", f"the coordinator's counters after the flood: {final}")
                final = {}
            if final.get("internal_errors"):
                replies.violate("crash", f"{final['internal_errors']} internal error(s) in the coordinator's loop "
                                f"(logged with their tracebacks): {caplog.text[-2000:]}")
            kinds = {k for k, v in final.items() if k.startswith("dropped_") and v}
            if sent["data"] >= 500 and len(kinds) < 3:
                replies.violate("data plane", f"the data fuzz was dropped as only {kinds}: {final}")
        dropped = {k: v for k, v in final.items() if k.startswith("dropped_")}
        print(summary("coordinator", replies, sent, seconds, probes), f"; {len(sessions)} reference sessions; "
              f"data messages counted as dropped {dropped}")
        assert not replies.violations, failure_report(replies)
        assert len(sessions) >= min(CHECKPOINTS, batch_no), \
            f"only {len(sessions)} reference sessions ran during the flood"
    finally:
        stop.set()
        for sock in [p.sock for p in peers] + pushes + retired:
            sock.close()
        ctx.term()
        cluster.close()


# ---- one worker -----------------------------------------------------------------------

# sessions the fuzz opens and uses on the worker: edge ids that are valid u64s included
FUZZ_SIDS = [0, 1, 7, 12345, 2**63, 2**64 - 1]
NF_SID = 4242              # the session every non-finite residual of the fuzz goes to, with its key: nothing may come of it
REFERENCE_SID = 1_000_000  # + the round
WARM_SID = 999_999         # one session of a full n_batch before the memory baseline
WORKER_N_CTX = 512         # a single session can then fill the worker's n_batch


class Router:
    """A raw ROUTER playing the coordinator of one worker, with its own data PULL (every
    session it opens sends its outputs there) and a PUSH to the worker's data endpoint.
    It follows the worker's identity, which changes when ZeroMQ drops and re-makes the
    connection, and checks everything that comes back on either socket. Like a real
    coordinator it keeps heartbeating while it waits: a worker that hears nothing for its
    liveness window (2 s: one long batch on a loaded machine) rightly drops every session."""

    def __init__(self, replies: Replies):
        self.ctx = zmq.Context()
        self.sock, self.endpoint = bind_loopback(self.ctx, zmq.ROUTER)
        self.data, self.data_endpoint = bind_loopback(self.ctx, zmq.PULL)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.data, zmq.POLLIN)
        self.push: zmq.Socket | None = None
        self.retired: list[zmq.Socket] = []
        self.identity = None
        self.replies = replies
        self.readies = 0
        self.capability = None
        self.keys: dict[int, set[int]] = collections.defaultdict(set)   # sid -> every key it was opened with
        self.nf_errors: collections.Counter = collections.Counter()     # the non-finite session's errors, by code
        self.last_sent = time.monotonic()

    def send(self, frames) -> None:
        self.sock.send_multipart([self.identity, *frames], copy=False)
        self.last_sent = time.monotonic()

    def _heartbeat_if_due(self) -> None:
        if self.identity is not None and time.monotonic() - self.last_sent >= HEARTBEAT_INTERVAL:
            self.send(P.encode(P.HEARTBEAT, 0))

    def connect_data(self) -> None:
        if self.push is not None:
            self.retired.append(self.push)   # kept open: what it was given still leaves
        self.push = push_socket(self.ctx, self.capability.data_endpoint)

    def send_data(self, frames) -> bool:
        return send_bounded(self.push, frames)

    def _check_control(self, msg: P.Message) -> None:
        if msg.type == P.ERROR and msg.rid == 0 and msg.get("sid") is not None and "stage" in msg.get("context", {}):
            # a session failed on the worker's data plane (not a refusal of a message of rid 0):
            # only a session it holds, under its key
            sid = msg["sid"]
            if sid == NF_SID:
                self.nf_errors[msg["code"]] += 1
            if sid not in self.keys:
                self.replies.violate("leak", f"an error for session {sid}, which was never opened: {msg.fields}")

    def _check_data(self, msg: P.Message) -> None:
        sid, key = msg.get("sid"), msg.get("key")
        if msg.type not in (P.ACT, P.TOKEN, P.TOOK):
            self.replies.violate("invalid data message", f"a {msg.type} on the data plane: {msg.fields!r:.300}")
        elif key not in self.keys.get(sid, ()):
            self.replies.violate("leak", f"a {msg.type} for session {sid} under key {key}, which that session was "
                                 f"never opened with ({sorted(self.keys.get(sid, ()))})")
        if sid == NF_SID:
            self.replies.violate("non-finite computed", f"a {msg.type} came of a non-finite residual: "
                                 f"{msg.fields!r:.300}")

    def drain(self, until=None, bound=PROBE_BOUND_S, until_new_identity=False) -> P.Message | bool | None:
        """Take everything waiting on both sockets; with until(plane, msg) or
        until_new_identity, wait (bounded) for that and return it (None if it did not come)."""
        deadline = time.monotonic() + bound
        old_identity = self.identity
        waiting = until is not None or until_new_identity
        while True:
            self._heartbeat_if_due()
            timeout = max(0.0, deadline - time.monotonic()) if waiting else 0
            events = dict(self.poller.poll(int(min(timeout, HEARTBEAT_INTERVAL) * 1000)))
            if not events:
                if waiting and time.monotonic() < deadline:
                    continue
                return None if waiting else True
            if self.data in events:
                msg = self.replies.take(self.data.recv_multipart(), plane="data")
                if msg is not None:
                    self._check_data(msg)
                    if until is not None and until("data", msg):
                        return msg
            if self.sock in events:
                identity, *frames = self.sock.recv_multipart()
                self.identity = identity
                msg = self.replies.take(frames)
                if msg is not None:
                    self._check_control(msg)
                    if msg.type == P.READY and msg["capability"].loading is None:   # (its offer, once loaded)
                        self.readies += 1
                        self.capability = msg["capability"]
                if until_new_identity and identity != old_identity:
                    return True
                if until is not None and msg is not None and until("control", msg):
                    return msg

    def close(self):
        for sock in [self.push, *self.retired]:
            if sock is not None:
                sock.close()
        self.data.close()
        self.sock.close()
        self.ctx.term()


def worker_templates(router: Router) -> tuple[dict, dict, object]:
    """(control, data, non-finite): what a coordinator and the stage before send a tail
    worker on each plane, what they must not, and the non-finite residual's template."""
    opened_with: dict[int, int] = {}      # sid -> the key of the last OPEN of it the fuzz sent
    next_pos: dict[int, int] = collections.defaultdict(int)

    def endpoint(rng):
        roll = rng.random()
        if roll < 0.8:
            return router.data_endpoint
        if roll < 0.9:
            return router.capability.data_endpoint   # the worker's own input
        return rng.choice(BAD_ENDPOINTS[4:])          # well-formed, with nothing (that takes) behind them

    def open_(rng):
        sid = rng.choice(FUZZ_SIDS)
        key = data_key(rng, KEY)
        header = {"sid": sid, "key": key, "stage": rng.choice([1, 1, 1, 1, 1, 2, 7, 0, (1 << 20) + 1]), "next": endpoint(rng),
                  "reply": endpoint(rng), "prompt_len": rng.choice([1, 1, rng.randint(1, 64), 1000]),
                  "max_tokens": rng.choice([1, 2, 64, (1 << 31) - 1]), "stop_at_eog": rng.random() < 0.5}
        if rng.random() < 0.3:
            header["logits"] = rng.random() < 0.5
        if rng.random() < 0.3:
            header["hop_clock"] = rng.random() < 0.5
        if rng.random() < 0.2:   # the tail's sampler, with the prompt as its history (or not quite)
            header["sampling"] = rng.choice([{"temperature": 0.8, "top_p": 0.95, "seed": rng.randrange(2**64)},
                                             {"temperature": 1.0, "repeat_penalty": 1.3, "penalty_last_n": -1}, {}])
            if rng.random() < 0.8:
                n = header["prompt_len"] + rng.choice([0, 0, 0, 1, -1])
                header["history"] = [rng.randrange(N_VOCAB) for _ in range(max(n, 0))]
        if rng.random() < 0.1:   # the neighbours' CURVE keys, as a keyed route gives them, to a keyless stage
            header["next_key"] = rng.choice(["0" * 40, "x" * 39, "é" * 40, ";" * 40])
            header["prev_key"] = rng.choice(["0" * 40, ""])
        opened_with[sid] = key
        next_pos[sid] = 0
        return header, None

    def act(rng):
        sid = rng.choice(FUZZ_SIDS)
        n = rng.choice([1, 1, 2, 4, rng.randint(1, 16)])
        pos = rng.choice([next_pos[sid], next_pos[sid], 0, rng.randrange(256)])
        header = {"sid": sid, "key": data_key(rng, opened_with.get(sid, KEY)), "pos": pos, "n": n}
        next_pos[sid] = pos + n
        if rng.random() < 0.2:
            header["seams"] = random_seams(rng)
        if rng.random() < 0.2:
            header["ts"] = rng.choice([2**63, 2**64 - 1, rng.randrange(2**62, 2**64)])   # never a past instant
        if rng.random() < 0.1:
            header["ack"] = rng.random() < 0.5
        roll = rng.random()
        if roll < 0.1:    # token ids, which only a head takes
            return dict(header, tokens=[rng.randrange(N_VOCAB) for _ in range(n)]), rng.choice([None, None, b""])
        if roll < 0.2:    # rows of another width
            return header, residual_payload(rng, n, rng.choice([N_EMBD - 8, N_EMBD + 1, 2 * N_EMBD, 1]))
        if roll < 0.25:   # the rows of another n
            return header, residual_payload(rng, rng.choice([n + 1, max(n - 1, 1), 2 * n]))
        return header, residual_payload(rng, n)

    def non_finite(rng):
        n = rng.randint(1, 4)
        return {"sid": NF_SID, "key": KEY, "pos": 0, "n": n}, residual_payload(rng, n)

    def took(rng):
        return {"sid": rng.choice(FUZZ_SIDS), "key": data_key(rng, KEY), "pos": 0, "n": 1}, None

    def token(rng):
        return {"sid": rng.choice(FUZZ_SIDS), "key": data_key(rng, KEY), "pos": 0, "n": 1,
                "token": rng.randrange(N_VOCAB), "eog": False}, None

    def sid(rng):
        return {"sid": rng.choice(FUZZ_SIDS)}

    control = {
        "open": open_,
        "cancel": lambda rng: (sid(rng), None),
        "release": lambda rng: (sid(rng), None),
        "health": lambda rng: ({}, None),
        "capability": lambda rng: ({}, None),
        "heartbeat": lambda rng: ({}, None),
        # (no DISCONNECT: a coordinator says it only to a worker it forgot, and the worker
        # then drops every session it held, this fuzz's reference sessions with them)
        "tokenize": lambda rng: ({"add_special": rng.random() < 0.5, "parse_special": rng.random() < 0.5,
                                  **({"limit": rng.choice([1, 5, 2048])} if rng.random() < 0.3 else {})},
                                 rng.choice([b"hello", "<|im_start|>hi".encode(), "é".encode() * 50, b"", b"\xff\xfe",
                                             None])),
        "detokenize": lambda rng: ({}, rng.choice([bytes(P.tokens_frame(t)) for t in ([1, 2, 3], [49151], [N_VOCAB], [-1],
                                                                                [0] * 100)] + [b"\x01\x02\x03", None])),
        "template": lambda rng: ({"add_generation_prompt": rng.random() < 0.5},
                                 rng.choice([msgpack.packb([{"role": "user", "content": "hi"}]),
                                             msgpack.packb([{"role": "system", "content": "é" * 100},
                                                            {"role": "nobody", "content": ""}]),
                                             msgpack.packb({"role": "user"}), b"\xc1", None])),
        "chat": lambda rng: ({}, rng.choice([b'{"messages": [{"role": "user", "content": "hi"}]}',
                                             b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "x"}]}',
                                             b'{"messages": [{"role": "tool"}], "tool_choice": "sometimes"}',
                                             b'{"messages": []}', b'{"messages": [1]}', b"[]", b"{", b"\xff", None])),
        # a range for a worker that holds one already (only --layers auto workers take one)
        "assign": lambda rng: ({"layers": rng.choice([[0, 15], [15, 30], [0, 1 << 19], [29, 30], [5, 4]])}, None),
        # the wrong direction: what a worker sends, sent to a worker
        "ready": lambda rng: ({"capability": {"layers": [0, 15]}}, None),
        "goodbye": lambda rng: ({}, None),
        "ok": lambda rng: ({"sid": 1}, None),
        "error": lambda rng: ({"code": "busy", "message": "fuzz"}, None),
        # the wrong plane: data messages on the control socket
        "act": act,
        "took": took,
        "token": token,
    }
    data = {
        "act": act,
        # what a worker sends, and what only the control socket takes, on its data endpoint
        "took": took,
        "token": token,
        "open": open_,
        "health": lambda rng: ({}, None),
    }
    return control, data, non_finite


def test_fuzzing_a_worker_never_crashes_hangs_answers_invalidly_or_disturbs_a_session(smollm2_path, expected):
    prompt_tokens, expected_tokens = expected
    rng = random.Random(SEED + 1)
    replies = Replies()
    router = Router(replies)
    worker = subprocess.Popen([sys.executable, "-m", "meshnet.cli.main", "worker", "--coordinator", router.endpoint,
                               "--model", smollm2_path, "--layers", "15:30", "--threads", str(THREADS), "--ctx", str(WORKER_N_CTX)])
    try:
        # what a real head gives for the prompt and for the first generated token: the worker's real input
        with Stage(smollm2_path, (0, 15), n_ctx=256, max_sessions=1, n_threads=THREADS) as head:
            head.open_session(1)
            prefill = head.forward([Entry(1, 0, tokens=np.array(prompt_tokens))]).residual.copy()
            step = head.forward([Entry(1, len(prompt_tokens), tokens=np.array(expected_tokens[:1]))]).residual.copy()
        deadline = time.monotonic() + 60
        while router.capability is None and time.monotonic() < deadline:
            router.drain(bound=1, until_new_identity=True)
        assert router.capability is not None, "the worker never announced itself"
        assert router.capability.n_embd == N_EMBD
        router.connect_data()

        rids = iter(range(RESERVED_RID, RESERVED_RID + 1_000_000))
        maybe_open = set(FUZZ_SIDS)   # grows with every OPEN the fuzz sent that decodes as valid
        sent = collections.Counter()  # frames sent, by plane
        nf_sent = 0                   # non-finite residuals sent to NF_SID

        hung = []  # once the worker has failed to answer, waiting on it again only adds time

        def note_hang(what: str) -> None:
            if not hung:
                hung.append(what)
                replies.violate("hang", f"{what} within {PROBE_BOUND_S} s (after {sum(sent.values())} fuzz frames)")

        def request(msg_type, payload=None, **fields):
            rid = next(rids)
            frames = P.encode(msg_type, rid, payload=payload, **fields)
            replies.note({"rid": rid}, frames)
            router.send(frames)
            answer = None if hung else router.drain(lambda plane, m: plane == "control" and m.rid == rid)
            if answer is None:
                note_hang(f"no answer to {msg_type} {fields.get('sid', '')}")
            return answer

        def open_session(sid: int):
            router.keys[sid].add(KEY)
            return request(P.OPEN, sid=sid, key=KEY, stage=1, next=router.data_endpoint, reply=router.data_endpoint,
                           prompt_len=len(prefill), max_tokens=1 << 20, stop_at_eog=False)

        def outcome(sid: int, frames: list, what: str) -> P.Message | None:
            """Send a step of session sid; what came of it: its TOKEN, or the error that
            ended it (the decode step the tail sends on to the head, which is us, is skipped)."""
            if not router.send_data(frames):
                note_hang(f"the worker's data endpoint took nothing ({what})")
                return None
            if hung:
                return None
            got = router.drain(lambda plane, m: m.get("sid") == sid and (
                m.type == P.TOKEN if plane == "data" else m.type == P.ERROR and m.rid == 0))
            if got is None:
                note_hang(f"nothing came of {what}")
            return got

        rounds = []

        def reference_round(index: int) -> list[tuple[str, str]]:
            """One session as a coordinator runs it, after whatever the flood did: the
            odd rounds first CANCEL the id before it is opened, every third round sends a
            non-finite residual first, which must be refused without touching the KV."""
            rounds.append(index)
            failures = []
            for sid in sorted(maybe_open):  # the fuzz's sessions would crowd out ours
                request(P.RELEASE, sid=sid)
            sid = REFERENCE_SID + index
            if index % 2:
                request(P.CANCEL, sid=sid)
            opened = open_session(sid)
            if opened is None or opened.type != P.OK:
                return [("reference", f"round {index}: OPEN {sid} got {opened and opened.fields}")]
            if index % 3 == 0:
                poisoned = prefill.copy()
                poisoned[rng.randrange(len(poisoned)), rng.randrange(N_EMBD)] = rng.choice([NAN, INF, -INF])
                got = outcome(sid, P.encode(P.ACT, 0, payload=P.f32_payload(poisoned), sid=sid, key=KEY, pos=0,
                                            n=len(poisoned)), f"a non-finite residual of round {index}")
                if got is None or got.type != P.ERROR or got["code"] != E.BAD_PAYLOAD:
                    failures.append(("non-finite computed", f"round {index}: a non-finite residual came to "
                                     f"{got and (got.type, got.fields)}, not a bad_payload error"))
            got = []
            for pos, rows in ((0, prefill), (len(prefill), step)):
                m = outcome(sid, P.encode(P.ACT, 0, payload=P.f32_payload(rows), sid=sid, key=KEY, pos=pos,
                                          n=len(rows)), f"the step at {pos} of round {index}")
                got.append(m["token"] if m is not None and m.type == P.TOKEN else (m and m.fields))
            if got != expected_tokens[:2]:
                failures.append(("reference", f"round {index}{' (CANCEL before OPEN)' if index % 2 else ''}"
                                 f"{' (after a non-finite residual)' if index % 3 == 0 else ''}: "
                                 f"got {got}, the whole model gives {expected_tokens[:2]}"))
            request(P.RELEASE, sid=sid)
            return failures

        control_templates, data_templates, non_finite = worker_templates(router)
        fuzz = Fuzzer(rng, control_templates, WORKER_MAX_PAYLOAD, weights={"open": 5})
        data_fuzz = Fuzzer(rng, data_templates, WORKER_MAX_PAYLOAD, weights={"act": 12}, residual=non_finite)
        probes, round_failures = [], []
        opened = open_session(NF_SID)
        assert opened is not None and opened.type == P.OK, opened
        round_failures += reference_round(0)
        rss_loaded = rss_kib(worker.pid)
        # The baseline is a worker that has served its largest batch: the engine's compute
        # buffers are allocated at load, but their pages only count in RSS once a batch that
        # large has touched them (+12 MiB from 12 rows to 255 on this tail), and the fuzz's
        # random batch sizes would otherwise read as growth. A leak is what grows past that.
        router.keys[WARM_SID].add(KEY)
        opened = request(P.OPEN, sid=WARM_SID, key=KEY, stage=1, next=router.data_endpoint, reply=router.data_endpoint,
                         prompt_len=WORKER_MAX_PAYLOAD // (4 * N_EMBD), max_tokens=1, stop_at_eog=False)
        assert opened is not None and opened.type == P.OK, opened and opened.fields
        full = residual_payload(rng, WORKER_MAX_PAYLOAD // (4 * N_EMBD))
        warm = outcome(WARM_SID, P.encode(P.ACT, 0, payload=full, sid=WARM_SID, key=KEY, pos=0,
                                          n=WORKER_MAX_PAYLOAD // (4 * N_EMBD)), "a full batch")
        assert warm is not None and warm.type == P.TOKEN, warm and warm.fields
        request(P.RELEASE, sid=WARM_SID)
        rss_before = rss_kib(worker.pid)
        rss_quarter = None
        t_start = time.monotonic()
        batch_no = 0
        every = max(1, FRAMES // REFERENCE_ROUNDS)
        next_round = every
        while sum(sent.values()) < FRAMES:
            batch_no += 1
            for _ in range(min(BATCH, FRAMES - sum(sent.values()))):
                if rng.random() < DATA_SHARE:
                    kind, frames = data_fuzz.next()
                    if not router.send_data(frames):
                        note_hang("the worker's data endpoint took nothing")
                        break
                    nf_sent += kind == "non_finite"
                    sent["data"] += 1
                    continue
                kind, frames = fuzz.next()
                valid = decoded(frames, WORKER_MAX_PAYLOAD)
                if valid is not None and valid.type == P.SHUTDOWN:
                    continue  # a valid shutdown stops the worker by design: nothing to learn from it
                if valid is not None and valid.type == P.OPEN:
                    maybe_open.add(valid["sid"])
                    router.keys[valid["sid"]].add(valid["key"])
                header = header_of(frames)
                replies.note(header, frames)
                router.send(frames)
                sent["control"] += 1
            if batch_no == CUT_BATCH and not hung:
                # past the data socket's own limit: ZeroMQ drops that connection; a new one is made
                router.send_data([fuzz.pack({"v": P.VERSION, "type": "act", "rid": 0}), bytes(3 * WORKER_MAX_PAYLOAD)])
                router.connect_data()
            router.drain()
            t0 = time.monotonic()
            request(P.HEALTH)
            if batch_no % 4 == 0:   # the stage loop too: a text request is its job, queued with the sessions'
                request(P.DETOKENIZE, bytes(P.tokens_frame([1, 2, 3])))
            probes.append(time.monotonic() - t0)
            if hung:
                break
            if worker.poll() is not None:
                replies.violate("crash", f"the worker exited with {worker.returncode} during batch {batch_no}")
                break
            if sum(sent.values()) >= next_round:
                round_failures += reference_round(next_round // every)
                next_round += every
            if rss_quarter is None and sum(sent.values()) >= FRAMES // 4:
                rss_quarter = rss_kib(worker.pid)
            time.sleep(max(0.0, t_start + sum(sent.values()) / RATE - time.monotonic()))
        seconds = time.monotonic() - t_start
        replies.violations += round_failures

        health = None
        if worker.poll() is None and not hung:
            # every non-finite residual was refused, each with its own error; nothing else came of any
            if sum(router.nf_errors.values()) < nf_sent:
                router.drain(lambda *_: sum(router.nf_errors.values()) >= nf_sent, bound=PROBE_BOUND_S)
            refused = sum(router.nf_errors.values())
            if refused != nf_sent or set(router.nf_errors) - {E.BAD_PAYLOAD, E.BUSY}:
                replies.violate("non-finite computed", f"{nf_sent} non-finite residuals sent, refused with "
                                f"{dict(router.nf_errors)}")
            for sid in sorted(maybe_open | {NF_SID}):
                request(P.RELEASE, sid=sid)
            health = request(P.HEALTH)
            info = health.get("info") if health is not None and health.type == P.OK else None
            if info is None or info["n_sessions"] != 0 or info["kv_bytes_used"] != 0:
                replies.violate("leak", f"after releasing every session the fuzz opened: {health and health.fields}")
            elif sent["data"] and (sum(info["dropped"].values()) == 0 or set(info["dropped"]) - set(E.CODES)):
                replies.violate("data plane", f"the worker's data fuzz was dropped as {info['dropped']}")
            rss_after = rss_kib(worker.pid)
            print(f"worker RSS {rss_loaded} KiB after a short session, {rss_before} KiB after a full batch (the baseline), "
                  f"{rss_quarter} KiB a quarter into the fuzz, {rss_after} KiB after it "
                  f"({100 * (rss_after - rss_before) / rss_before:+.1f}%)")
            if rss_after > rss_before * 1.05:
                replies.violate("memory", f"the worker's RSS grew from {rss_before} to {rss_after} KiB (> 5%)")
        if worker.poll() is None and not hung:
            # last, a frame past the worker socket's own limit: ZeroMQ drops that connection
            # (a protocol error, which libzmq never reconnects by itself); the worker must
            # find its coordinator again, within its liveness window plus a reconnect
            router.send([fuzz.pack({"v": P.VERSION, "type": "heartbeat", "rid": 1}),
                         bytes(3 * (max(WORKER_MAX_PAYLOAD, P.MAX_TEXT_BYTES) + P.MAX_HEADER_BYTES))])
            if not router.drain(bound=REJOIN_BOUND_S, until_new_identity=True):
                replies.violate("cut off", f"the worker did not reconnect within {REJOIN_BOUND_S} s after ZeroMQ "
                                "dropped its connection over a message past its size limit")
            else:
                failures = reference_round(REFERENCE_ROUNDS + 1)
                replies.violations += [(kind, "after the reconnection: " + text) for kind, text in failures]
        dropped = health["info"]["dropped"] if health is not None and health.type == P.OK else None
        print(summary("worker", replies, sent, seconds, probes),
              f"; {len(rounds)} reference rounds, {router.readies} READY(s), {nf_sent} non-finite residuals refused "
              f"with {dict(router.nf_errors)}; data messages dropped {dropped}")
        assert not replies.violations, failure_report(replies)
        worker.terminate()
        assert worker.wait(timeout=20) == 0  # and it still stops gracefully
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        router.close()
