"""Seeded, bounded fuzz of the two programs that read the wire: the coordinator (with a
real two-worker route) and one real stage worker process. Each is sent FRAMES frames
from a seeded generator: random bytes, truncated and garbled headers, valid headers
with wrong-typed, boolean, negative, huge or out-of-range fields, unknown types, wrong
versions, extra frames, oversized and non-finite payloads, and mutations of every real
message, READY with unusable capabilities included.

What must hold all along:
- nothing crashes: the processes live and the coordinator's I/O thread runs;
- nothing hangs: after every small batch the peer answers a probe within a bound (the
  rate is bounded so that this measures robustness, not high-water-mark drops);
- every message that comes back is itself protocol-valid (decodes without error);
- nothing a bad message does reaches anyone else: a reference session through the same
  peer gives the whole model's greedy tokens before, during and after the flood;
- a worker never computes on a non-finite residual, and a CANCEL of a session that was
  never opened does not stop that id from being opened and used later.

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

from meshnet import protocol as P
from meshnet.cluster import LocalCluster
from meshnet.engine import Entry, Stage
from meshnet.pipeline import LocalPipeline

from conftest import THREADS

SEED = int(os.environ.get("MESHNET_FUZZ_SEED", "16"))
FRAMES = int(os.environ.get("MESHNET_FUZZ_FRAMES", "10000"))   # per program under test
BATCH = 25                 # frames sent before the peer must answer a probe: far below any HWM or queue bound
RATE = 1000                # frames per second at most: a flood that lasts while reference sessions run through it
CHECKPOINTS = 5            # coordinator: the flood waits at each fifth for one more reference session to have ended
PROBE_BOUND_S = 5.0        # a probe answered later than this is a hang
SESSION_BOUND_S = 30.0     # a reference session longer than this is a hang
REJOIN_BOUND_S = 12.0      # a worker cut off by ZeroMQ: its liveness window (2 s) plus libzmq's reconnect back-off
REFERENCE_ROUNDS = 10      # worker: reference sessions spread over the flood
BIG = 1 << 30              # what we accept back: the point is validity, not size
RESERVED_RID = 1 << 62     # probes and reference requests: a range the fuzz never draws from
PROMPT = "The old lighthouse keeper climbed the stairs every night, and"
N_REFERENCE = 16
HALVES = [(0, 15), (15, 30)]
N_EMBD = 576
WORKER_MAX_PAYLOAD = 512 * N_EMBD * 4              # a worker's n_batch rows of f32
COORDINATOR_MAX_PAYLOAD = 4 << 20
NAN, INF = float("nan"), float("inf")


# ---- the generator ------------------------------------------------------------------

NASTY = [True, False, None, -1, -2**63, 2**63, 2**64 - 1, 0, 1 << 31, -(1 << 31) - 1, 1 << 20, 1.5, NAN, INF, -INF,
         "", "x" * 300, "é\x00", b"\xff\xfe", [], [True], [1, 2, 3], [[1]], {}, {"k": 1}, msgpack.ExtType(7, b"ext")]

# values that are wrong for one field in particular
SPECIAL = {
    "v": [0, 2, -1, "1", None, 1.5, 2**64 - 1, [1]],
    "type": ["", "FORWARD", "forward\x00", 1, None, True, "make_coffee", "x" * 1000, b"forward", ["forward"]],
    "rid": [True, False, -1, -2**63, 2**64 - 1, 0, 1.5, "1", None, [1]],
    "sid": [True, False, -1, -2**63, 2**64 - 1, 2**63, 0, 1.0, "7", None, [7]],
    "pos": [-1, 1 << 31, True, 1.5, None, 2**64 - 1, 10_000],
    "n": [0, -1, True, 1 << 31, 513, 100_000, 1.0],
    "tokens": [[True], [-1], [1 << 31], [-(1 << 31) - 1], [49152], [1.0], [None], ["a"], list(range(1000)), [], "abc", {}],
    "shape": [[True, N_EMBD], [0, N_EMBD], [1, -N_EMBD], [1], [1, N_EMBD, 1], [1 << 31, N_EMBD], [1, N_EMBD + 1],
              [1, N_EMBD - 1], "1x576", [1.0, 576.0], [], [2**64 - 1, N_EMBD]],
    "dtype": ["f16", "F32", "", None, 32, True, "f32\x00"],
    "logits": [1, 0, "yes", None, []],
    "deadline_ms": [0, -1, True, 1 << 62, 1.5, 1],
    "text": [None, 1, b"bytes", "", "\x00" * 10, "<|im_start|>system", "é" * 2000, ["a"]],
    "add_special": [1, "true", None],
    "parse_special": [1, "yes", None],
    "token": [-1, True, 1 << 31, 49152, None],
    "code": [None, 1, "", "stage_lost"],
    "message": [None, 1, ""],
    "info": [None, [], "x", {"tokens": [True]}],
    "piece": ["str", None, 1],
    "capability": [None, [], "x", {}, {"layers": "all of them"}],
}

# READY capability fields the coordinator builds a route from, and values no worker can mean
UNUSABLE = {
    "model_sha256": [None, 1, True, [], {}, b"\xb1" * 32, ["b179"]],
    "layers": [None, 15, "0:15", [0], [0, 15, 30], [-1, 15], [15, 0], [0, 31], [0.0, 15.0], [True, 15], [0, True],
               [None, 15], [[0], [15]], {"0": 15}, [0, 2**64 - 1], [2**63, 2**64 - 1]],
    "n_layer": [None, "30", 30.0, True, -1, 0, [30], 2**64 - 1, NAN],
    "n_embd": [None, "576", 576.0, True, -1, 0, [576], NAN],
    "engine_pin": [None, 1, True, [], ["llama.cpp"], {}],
    "backend": [None, 1, True, ["CPU"], {}],
    "wire_dtype": [None, 32, True, ["f32"], {}],
    "n_ctx": [None, "1024", 1024.5, True, -1, 0, [1024], NAN],
    "n_batch": [None, "512", 512.5, True, -1, 0, [512]],
}


class Fuzzer:
    """Frames from a seeded generator. templates: name -> rng -> (header, payload) of a
    valid message; the kinds below break them in every way we could think of."""

    KINDS = {  # kind: weight
        "random_bytes": 8, "truncated": 8, "garbled": 8, "valid": 14, "fields": 28, "version": 3,
        "unknown_type": 4, "extra_frames": 4, "payload": 10, "non_finite": 5, "non_map": 2,
        "big_header": 1, "oversized": 0.5, "bad_capability": 0,
    }

    def __init__(self, rng: random.Random, templates: dict, max_payload: int, **weights):
        self.rng = rng
        self.templates = templates
        self.max_payload = max_payload
        kinds = dict(self.KINDS, **weights)
        self.kinds, self.weights = zip(*[(k, w) for k, w in kinds.items() if w > 0])

    def rid(self) -> int:
        return self.rng.randrange(1, 1 << 40)

    def template(self, names=None):
        name = self.rng.choice(names or sorted(self.templates))
        header, payload = self.templates[name](self.rng)
        return dict({"v": P.VERSION, "type": name, "rid": self.rid()}, **header), payload

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
            key = self.rng.choice([*header, "sid", "tokens", "shape", "zzz"])
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
        header, payload = self.template(["forward"])
        values = np.frombuffer(payload, dtype="<f4").copy()
        for i in self.rng.sample(range(values.size), self.rng.randint(1, 4)):
            values[i] = self.rng.choice([NAN, INF, -INF])
        return self.frames(header, values.tobytes())

    def _non_map(self):
        return [self.pack(self.rng.choice([[1, 2], 5, "hello", None, True, {1: 2}, {b"v": 1, b"type": b"health"},
                                           msgpack.ExtType(1, b"x")]))]

    def _big_header(self):
        header, payload = self.template()
        header[self.rng.choice(["text", "zzz", "message"])] = "x" * (P.MAX_HEADER_BYTES + self.rng.randrange(1, 4096))
        return self.frames(header, payload)

    def _oversized(self):
        header, _ = self.template(["forward"])
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

    layers, n_layer = capability.get("layers"), capability.get("n_layer")
    return (isinstance(capability.get("model_sha256"), str) and count(n_layer, 1 << 20)
            and isinstance(layers, list) and len(layers) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in layers)
            and 0 <= layers[0] < layers[1] <= n_layer
            and all(count(capability.get(k)) for k in ("n_embd", "n_ctx", "n_batch"))
            and all(isinstance(capability.get(k), str) for k in ("engine_pin", "backend", "wire_dtype")))


def residual_payload(rng: random.Random, n: int) -> bytes:
    return np.random.default_rng(rng.randrange(1 << 32)).standard_normal((n, N_EMBD), dtype=np.float32).tobytes()


# ---- what comes back ------------------------------------------------------------------


def _show(frames) -> str:
    try:
        header = msgpack.unpackb(frames[0], raw=False, strict_map_key=False)
    except Exception:
        header = frames[0][:80]
    return f"{header!r:.300} (+{len(frames) - 1} frame(s))"


class Replies:
    """Every message that comes back is decoded (so checked) and counted; a bad one is
    reported with the message it answered, where its rid says which."""

    def __init__(self):
        self.violations: list[tuple[str, str]] = []   # (kind, what happened)
        self.counts: collections.Counter = collections.Counter()
        self.sent: dict[int, str] = {}          # rid -> what we sent with it, to explain a bad answer
        self.non_finite: set[int] = set()       # rids of forwards that carried NaN/Inf

    def violate(self, kind: str, text: str) -> None:
        self.violations.append((kind, text))

    def take(self, frames) -> P.Message | None:
        try:
            msg = P.decode(frames, BIG)
        except P.ProtocolError as e:
            self.counts["INVALID"] += 1
            rid = None
            try:
                rid = msgpack.unpackb(frames[0], raw=False, strict_map_key=False).get("rid")
            except Exception:
                pass
            answered = self.sent.get(rid) if isinstance(rid, int) else None
            self.violate("invalid reply", f"[{e.code}] {e.message}: {_show(frames)}"
                         + (f" -- answering {answered}" if answered else ""))
            return None
        self.counts[f"error:{msg['code']}" if msg.type == P.ERROR else msg.type] += 1
        if msg.rid in self.non_finite and msg.type == P.RESULT:
            self.violate("non-finite computed", f"{self.sent.get(msg.rid)} -> RESULT {msg.fields}")
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


def summary(name: str, replies: Replies, sent: int, seconds: float, probes: list[float]) -> str:
    return (f"{name}: {sent} frames in {seconds:.1f} s, probe p50 {np.median(probes) * 1000:.1f} ms "
            f"max {max(probes) * 1000:.1f} ms; answers {dict(replies.counts.most_common())}")


def failure_report(replies: Replies, per_kind: int = 3) -> str:
    kinds = collections.Counter(kind for kind, _ in replies.violations)
    lines = []
    for kind in kinds:
        lines += [f"{kind}: {text}" for k, text in replies.violations if k == kind][:per_kind]
    return f"{len(replies.violations)} violation(s) {dict(kinds)}; the first of each:\n  " + "\n  ".join(lines)


@pytest.fixture(scope="module")
def expected(smollm2_path):
    """The whole model in one process: the prompt and its greedy continuation, the truth."""
    with LocalPipeline(smollm2_path, [(0, 30)], n_ctx=1024, max_sessions=1, n_threads=THREADS) as whole:
        tokens = whole.head.tokenize(PROMPT)
        return tokens, whole.generate(tokens, N_REFERENCE, stop_at_eog=False).tokens


# ---- the coordinator ------------------------------------------------------------------


def coordinator_templates(real_capability: dict) -> dict:
    def sid(rng):
        return rng.choice([1, 7, rng.randrange(1 << 40)])

    def forward(rng):
        n = rng.randint(1, 4)
        return {"sid": sid(rng), "pos": 0, "n": n, "shape": [n, N_EMBD], "dtype": "f32"}, residual_payload(rng, n)

    return {
        "ready": lambda rng: ({"capability": unusable_capability(rng, real_capability)}, None),
        "heartbeat": lambda rng: ({}, None),
        "goodbye": lambda rng: ({}, None),
        "ok": lambda rng: ({"sid": sid(rng), "info": {"tokens": [1, 2]}}, None),
        "result": lambda rng: ({"sid": sid(rng), "n": 1, "token": rng.randrange(49152), "eog": False, "piece": b"x"},
                               None),
        "error": lambda rng: ({"code": "busy", "message": "fuzz", "sid": sid(rng)}, None),
        "forward": forward,
        "open": lambda rng: ({"sid": sid(rng)}, None),
        "cancel": lambda rng: ({"sid": sid(rng)}, None),
        "release": lambda rng: ({"sid": sid(rng)}, None),
        "health": lambda rng: ({}, None),
        "capability": lambda rng: ({}, None),
        "tokenize": lambda rng: ({"text": "hello"}, None),
        "detokenize": lambda rng: ({"tokens": [1, 2, 3]}, None),
        "shutdown": lambda rng: ({}, None),
    }


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


def test_fuzzing_the_coordinator_never_crashes_hangs_answers_invalidly_or_disturbs_a_session(smollm2_path, expected,
                                                                                             caplog):
    caplog.set_level(logging.ERROR, logger="meshnet.coordinator")  # a warning per refused READY: thousands, all expected
    prompt_tokens, expected_tokens = expected
    rng = random.Random(SEED)
    cluster = LocalCluster(smollm2_path, HALVES, threads=THREADS, n_ctx=1024, max_payload=COORDINATOR_MAX_PAYLOAD).start()
    coordinator = cluster.coordinator
    ctx = zmq.Context()
    replies = Replies()
    sessions: list[tuple[float, object]] = []   # (seconds, tokens or the error)
    stop = threading.Event()
    peers: list[Dealer] = []

    def reference_sessions():
        # one session after another for as long as the flood lasts: each must be the whole model's
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                got = coordinator.generate(prompt_tokens, N_REFERENCE, stop_at_eog=False).result().tokens
            except Exception as e:
                got = e
            sessions.append((time.monotonic() - t0, got))

    try:
        real = {w["name"]: w for w in coordinator.workers_snapshot()}
        real_capability = {k: v for k, v in next(iter(real.values())).items() if k not in ("name", "sessions")}
        fuzz = Fuzzer(rng, coordinator_templates(real_capability), COORDINATOR_MAX_PAYLOAD, bad_capability=10)
        peers += [Dealer(ctx, coordinator.endpoint) for _ in range(3)]
        referee = threading.Thread(target=reference_sessions, daemon=True)
        referee.start()

        probes = []
        t_start = time.monotonic()
        sent = 0
        batch_no = 0
        next_checkpoint = FRAMES // CHECKPOINTS
        while sent < FRAMES:
            peer = peers[batch_no % len(peers)]
            batch_no += 1
            for _ in range(min(BATCH, FRAMES - sent)):
                kind, frames = fuzz.next()
                replies.note(header_of(frames), frames)
                peer.sock.send_multipart(frames, copy=False)
                sent += 1
            if batch_no == 7:
                # past the socket's own limit (twice max_payload): zmq drops the connection, which reconnects
                peer.sock.send_multipart([fuzz.pack({"v": 1, "type": "heartbeat", "rid": 1}),
                                          bytes(2 * COORDINATOR_MAX_PAYLOAD + 1)])
            for other in peers:
                other.drain(replies)
            # the coordinator answers a request it does not serve; the answer proves it is alive and in order
            probe_rid = RESERVED_RID + batch_no
            t0 = time.monotonic()
            peer.sock.send_multipart(P.encode(P.HEALTH, probe_rid))
            answered = peer.drain(replies, until_rid=probe_rid)
            probes.append(time.monotonic() - t0)
            if not answered:
                replies.violate("hang", f"no answer to a probe within {PROBE_BOUND_S} s after batch {batch_no}")
                break
            if not coordinator._thread.is_alive():
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
            time.sleep(max(0.0, t_start + sent / RATE - time.monotonic()))
            if sent >= next_checkpoint:
                # the flood waits for the sessions, not the other way round: on a slow or busy
                # machine they still run through all of it
                need, waited = next_checkpoint // (FRAMES // CHECKPOINTS), time.monotonic()
                while len(sessions) < need and time.monotonic() - waited < SESSION_BOUND_S:
                    time.sleep(0.01)
                if len(sessions) < need:
                    replies.violate("hang", f"no reference session ended within {SESSION_BOUND_S} s (batch {batch_no})")
                    break
                next_checkpoint += FRAMES // CHECKPOINTS
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
        if coordinator._thread.is_alive():
            # after the flood the route still gives the whole model's tokens
            after = bounded(lambda: coordinator.generate(prompt_tokens, N_REFERENCE, stop_at_eog=False).result().tokens)
            if after != expected_tokens:
                replies.violate("reference", f"the session after the flood gave {after}")
        print(summary("coordinator", replies, sent, seconds, probes), f"; {len(sessions)} reference sessions")
        assert not replies.violations, failure_report(replies)
        assert len(sessions) >= CHECKPOINTS, f"only {len(sessions)} reference sessions ran during the flood"
    finally:
        stop.set()
        for p in peers:
            p.sock.close()
        ctx.term()
        cluster.close()


# ---- one worker -----------------------------------------------------------------------

# sessions the fuzz opens and uses on the worker: edge ids that are valid u64s included
FUZZ_SIDS = [0, 1, 7, 12345, 2**63, 2**64 - 1]


def worker_templates() -> dict:
    def forward(rng):
        n = rng.randint(1, 4)
        header = {"sid": rng.choice(FUZZ_SIDS), "pos": rng.choice([0, 0, rng.randrange(64)]), "n": n,
                  "shape": [n, N_EMBD], "dtype": "f32"}
        if rng.random() < 0.2:
            header["logits"] = True
        if rng.random() < 0.1:
            header["deadline_ms"] = rng.choice([1, 60_000])
        return header, residual_payload(rng, n)

    def sid(rng):
        return {"sid": rng.choice(FUZZ_SIDS)}

    return {
        "forward": forward,
        "open": lambda rng: (sid(rng), None),
        "cancel": lambda rng: (sid(rng), None),
        "release": lambda rng: (sid(rng), None),
        "health": lambda rng: ({}, None),
        "capability": lambda rng: ({}, None),
        "heartbeat": lambda rng: ({}, None),
        "disconnect": lambda rng: ({}, None),
        "tokenize": lambda rng: ({"text": rng.choice(["hello", "<|im_start|>hi", "é" * 50, ""]),
                                  "add_special": rng.random() < 0.5, "parse_special": rng.random() < 0.5}, None),
        "detokenize": lambda rng: ({"tokens": rng.choice([[1, 2, 3], [49151], [49152], [-1], [0] * 100])}, None),
        # the wrong direction: what a worker sends, sent to a worker
        "ready": lambda rng: ({"capability": {"layers": [0, 15]}}, None),
        "goodbye": lambda rng: ({}, None),
        "ok": lambda rng: ({"sid": 1}, None),
        "result": lambda rng: ({"sid": 1, "n": 1, "token": 5}, None),
        "error": lambda rng: ({"code": "busy", "message": "fuzz"}, None),
    }


class Router:
    """A raw ROUTER playing the coordinator of one worker; it follows the worker's
    identity, which changes when ZeroMQ drops and re-makes the connection."""

    def __init__(self, replies: Replies):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:0")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.identity = None
        self.replies = replies
        self.readies = 0
        self.capability = None

    def send(self, frames) -> None:
        self.sock.send_multipart([self.identity, *frames], copy=False)

    def drain(self, until_rid=None, bound=PROBE_BOUND_S, until_new_identity=False) -> P.Message | bool | None:
        deadline = time.monotonic() + bound
        old_identity = self.identity
        waiting = until_rid is not None or until_new_identity
        while True:
            timeout = max(0.0, deadline - time.monotonic()) if waiting else 0
            if not self.sock.poll(int(timeout * 1000)):
                return None if waiting else True
            identity, *frames = self.sock.recv_multipart()
            self.identity = identity
            msg = self.replies.take(frames)
            if msg is not None and msg.type == P.READY:
                self.readies += 1
                self.capability = msg["capability"]
            if until_new_identity and identity != old_identity:
                return True
            if until_rid is not None and msg is not None and msg.rid == until_rid:
                return msg

    def close(self):
        self.sock.close()
        self.ctx.term()


def test_fuzzing_a_worker_never_crashes_hangs_answers_invalidly_or_disturbs_a_session(smollm2_path, expected):
    prompt_tokens, expected_tokens = expected
    rng = random.Random(SEED + 1)
    replies = Replies()
    router = Router(replies)
    worker = subprocess.Popen([sys.executable, "-m", "meshnet.cli", "worker", "--coordinator", router.endpoint,
                               "--model", smollm2_path, "--layers", "15:30", "--threads", str(THREADS), "--ctx", "256"])
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
        assert router.capability["n_embd"] == N_EMBD

        rids = iter(range(RESERVED_RID, RESERVED_RID + 1_000_000))
        maybe_open = set(FUZZ_SIDS)   # grows with every OPEN the fuzz sent that decodes as valid

        hung = []  # once the worker has failed to answer, waiting on it again only adds time

        def request(msg_type, payload=None, **fields):
            rid = next(rids)
            frames = P.encode(msg_type, rid, payload=payload, **fields)
            replies.note({"rid": rid}, frames)
            router.send(frames)
            answer = None if hung else router.drain(until_rid=rid)
            if answer is None and not hung:
                hung.append(f"{msg_type} {fields.get('sid', '')}")
                replies.violate("hang", f"no answer to {msg_type} {fields.get('sid', '')} within {PROBE_BOUND_S} s "
                                f"(after {sent} fuzz frames)")
            return answer

        rounds = []

        def reference_round(index: int) -> list[tuple[str, str]]:
            """One session as a coordinator runs it, after whatever the flood did: the
            odd rounds first CANCEL the id before it is opened, every third round sends a
            non-finite residual first, which must be refused without touching the KV."""
            rounds.append(index)
            failures = []
            for sid in sorted(maybe_open):  # the fuzz's sessions would crowd out ours
                request(P.RELEASE, sid=sid)
            sid = 1_000_000 + index
            if index % 2:
                request(P.CANCEL, sid=sid)
            opened = request(P.OPEN, sid=sid)
            if opened is None or opened.type != P.OK:
                return [("reference", f"round {index}: OPEN {sid} got {opened and opened.fields}")]
            if index % 3 == 0:
                poisoned = prefill.copy()
                poisoned[rng.randrange(len(poisoned)), rng.randrange(N_EMBD)] = rng.choice([NAN, INF, -INF])
                got = request(P.FORWARD, payload=P.f32_payload(poisoned), sid=sid, pos=0, n=len(prefill),
                              shape=list(prefill.shape), dtype="f32")
                if got is None or got.type != P.ERROR:
                    failures.append(("non-finite computed", f"round {index}: a non-finite residual was answered "
                                     f"with {got and (got.type, got.fields.get('token'))}, not an error"))
            first = request(P.FORWARD, payload=P.f32_payload(prefill), sid=sid, pos=0, n=len(prefill),
                            shape=list(prefill.shape), dtype="f32")
            second = request(P.FORWARD, payload=P.f32_payload(step), sid=sid, pos=len(prefill), n=1,
                             shape=list(step.shape), dtype="f32")
            got = [m.get("token") if m is not None and m.type == P.RESULT else (m and m.fields) for m in (first, second)]
            if got != expected_tokens[:2]:
                failures.append(("reference", f"round {index}{' (CANCEL before OPEN)' if index % 2 else ''}"
                                 f"{' (after a non-finite residual)' if index % 3 == 0 else ''}: "
                                 f"got {got}, the whole model gives {expected_tokens[:2]}"))
            request(P.RELEASE, sid=sid)
            return failures

        fuzz = Fuzzer(rng, worker_templates(), WORKER_MAX_PAYLOAD)
        sent = 0
        probes, round_failures = [], []
        round_failures += reference_round(0)
        t_start = time.monotonic()
        batch_no = 0
        every = max(1, FRAMES // REFERENCE_ROUNDS)
        next_round = every
        while sent < FRAMES:
            batch_no += 1
            for _ in range(min(BATCH, FRAMES - sent)):
                kind, frames = fuzz.next()
                try:
                    valid = P.decode(frames, WORKER_MAX_PAYLOAD)
                except P.ProtocolError:
                    valid = None
                if valid is not None and valid.type == P.SHUTDOWN:
                    continue  # a valid shutdown stops the worker by design: nothing to learn from it
                if valid is not None and valid.type == P.OPEN:
                    maybe_open.add(valid["sid"])
                header = header_of(frames)
                replies.note(header, frames)
                if kind == "non_finite" and header and isinstance(header.get("rid"), int):
                    replies.non_finite.add(header["rid"])
                router.send(frames)
                sent += 1
            router.drain()
            t0 = time.monotonic()
            request(P.HEALTH)
            probes.append(time.monotonic() - t0)
            if hung:
                break
            if worker.poll() is not None:
                replies.violate("crash", f"the worker exited with {worker.returncode} during batch {batch_no}")
                break
            if sent >= next_round:
                round_failures += reference_round(next_round // every)
                next_round += every
            time.sleep(max(0.0, t_start + sent / RATE - time.monotonic()))
        seconds = time.monotonic() - t_start
        replies.violations += round_failures

        if worker.poll() is None and not hung:
            for sid in sorted(maybe_open):
                request(P.RELEASE, sid=sid)
            health = request(P.HEALTH)
            info = health.get("info") if health is not None and health.type == P.OK else None
            if info is None or info["n_sessions"] != 0 or info["kv_bytes_used"] != 0:
                replies.violate("leak", f"after releasing every session the fuzz opened: {health and health.fields}")
        if worker.poll() is None and not hung:
            # last, a frame past the worker socket's own limit: ZeroMQ drops that connection
            # (a protocol error, which libzmq never reconnects by itself); the worker must
            # find its coordinator again, within its liveness window plus a reconnect
            router.send([fuzz.pack({"v": 1, "type": "heartbeat", "rid": 1}), bytes(5 * WORKER_MAX_PAYLOAD)])
            if not router.drain(bound=REJOIN_BOUND_S, until_new_identity=True):
                replies.violate("cut off", f"the worker did not reconnect within {REJOIN_BOUND_S} s after ZeroMQ "
                                "dropped its connection over a message past its size limit")
            else:
                failures = reference_round(REFERENCE_ROUNDS + 1)
                replies.violations += [(kind, "after the reconnection: " + text) for kind, text in failures]
        print(summary("worker", replies, sent, seconds, probes),
              f"; {len(rounds)} reference rounds, {router.readies} READY(s)")
        assert not replies.violations, failure_report(replies)
        worker.terminate()
        assert worker.wait(timeout=20) == 0  # and it still stops gracefully
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        router.close()
