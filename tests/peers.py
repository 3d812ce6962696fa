"""Raw ZeroMQ peers for tests: a fake coordinator to send a real worker whatever a test
wants, and a fake worker to send a real coordinator whatever a test wants. They are the
input of the thing under test (an attacker, a silent peer), never a stand-in for our code."""

import random
import socket
import subprocess
import sys
import threading
import time

import zmq

from meshnet.net import protocol as P

from conftest import THREADS, track

SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
KEY = 0x5EC2E7           # the session key a fake coordinator gives its sessions


def ephemeral_ports() -> range:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


def free_port(width: int = 1) -> int:
    """A port P with P .. P+WIDTH-1 free now, for a server a test starts with its address
    on the command line. Never one the kernel hands out (bind to port 0 does): between this
    check and the server's bind, any outgoing connection (a worker's fetch, a heartbeat)
    may be given an ephemeral port as its own end, and a server then fails with 'Address
    already in use' (a clean-clone CI run lost two-host.sh's second worker that way)."""
    ephemeral = ephemeral_ports()
    # the ports below the range, or where it starts low (a container's 1024-65535) above it,
    # or where it spans them all any (the race then stays, rare)
    if ephemeral.start - width > 2048:
        candidates = range(ephemeral.start // 2, ephemeral.start - width + 1)
    elif ephemeral.stop < 65536 - width - 256:
        candidates = range(ephemeral.stop, 65536 - width + 1)
    else:
        candidates = range(1025, 65536 - width + 1)
    rng = random.Random()
    for _ in range(1000):
        port = rng.choice(candidates)
        sockets = [socket.socket() for _ in range(width)]
        try:
            for offset, s in enumerate(sockets):
                s.bind(("127.0.0.1", port + offset))
            return port
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError(f"no {width} free port(s) among {candidates.start}-{candidates.stop - 1}")


def wait_until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def wait_for(read, condition, what, timeout=120.0):
    """READ() until CONDITION holds of what it gave: that, or the test fails naming WHAT and
    the last thing read (a state a server reaches on its own clock, bounded for a loaded
    2-core machine, never one snapshot)."""
    deadline = time.monotonic() + timeout
    while True:
        state = read()
        if condition(state):
            return state
        assert time.monotonic() < deadline, f"{what}: not within {timeout:g} s; last seen: {state}"
        time.sleep(0.05)


def start_worker(path, endpoint, layers, *extra, ctx=256, **popen):
    """A worker process for LAYERS, (A, B) or "auto" (then give --mem in EXTRA); killed at
    the end of the test that started it, however that ends, if it is still running then."""
    layers = layers if isinstance(layers, str) else f"{layers[0]}:{layers[1]}"
    return track(subprocess.Popen([sys.executable, "-m", "meshnet.cli.main", "worker", "--coordinator", endpoint, "--model",
                                   path, "--layers", layers, "--threads", str(THREADS), "--ctx", str(ctx), *extra],
                                  **popen))


def alive(pid) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def rss_kib(pid) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


def bind_loopback(ctx: zmq.Context, kind: int) -> tuple[zmq.Socket, str]:
    """A socket bound to a free loopback port, and its address."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:0")
    return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)


class FakeCoordinator:
    """A raw ROUTER playing coordinator, with its own data PULL: a session it opens sends
    every output (the next stage's input, tokens, "chunk taken") back to it."""

    def __init__(self):
        self.ctx = zmq.Context()
        self.router, self.endpoint = bind_loopback(self.ctx, zmq.ROUTER)
        self.data, self.data_endpoint = bind_loopback(self.ctx, zmq.PULL)
        self.pushes = {}
        self.identity = None
        self.capability = None
        self.rid = 1000

    def wait_ready(self, timeout=60):
        while True:
            frames = self.recv(timeout)
            msg = P.decode(frames, 1 << 30)
            if msg.type == P.READY and msg["capability"].loading is None:   # its offer, once its range is loaded
                self.capability = msg["capability"]
                return msg["capability"]

    def recv(self, timeout=10):
        if not self.router.poll(timeout * 1000):
            raise TimeoutError("no message from the worker")
        identity, *frames = self.router.recv_multipart()
        self.identity = identity
        return frames

    def send(self, frames):
        self.router.send_multipart([self.identity, *frames])

    def reply_to(self, frames, timeout=10):
        """Send frames, return the first non-heartbeat answer (answering its heartbeats)."""
        self.send(frames)
        return self.next_reply(timeout)

    def next_reply(self, timeout=10):
        """The next answer within TIMEOUT s; the worker's heartbeats do not extend it."""
        deadline = time.monotonic() + timeout
        while True:
            msg = P.decode(self.recv(max(0.0, deadline - time.monotonic())), 1 << 30)  # every answer must be protocol-valid
            if msg.type == P.HEARTBEAT:
                self.send(P.encode(P.HEARTBEAT, 0))
                continue
            return msg

    def request(self, msg_type, payload=None, **fields):
        self.rid += 1
        return self.reply_to(P.encode(msg_type, self.rid, payload=payload, **fields))

    # the data plane

    def open(self, sid, prompt_len=1, max_tokens=64, key=KEY, stage=None, **fields):
        """OPEN a session whose every output comes back to this fake."""
        if stage is None:
            stage = 0 if self.capability.layers[0] == 0 else 1
        return self.request(P.OPEN, sid=sid, key=key, stage=stage, next=self.data_endpoint, reply=self.data_endpoint,
                            prompt_len=prompt_len, max_tokens=max_tokens, stop_at_eog=False, **fields)

    def send_data(self, frames, endpoint=None):
        endpoint = endpoint or self.capability.data_endpoint
        if endpoint not in self.pushes:
            sock = self.pushes[endpoint] = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
        self.pushes[endpoint].send_multipart(frames)

    def act(self, sid, pos, tokens=None, residual=None, key=KEY, **fields):
        """Send the worker one step of a session on its data endpoint."""
        n = len(tokens) if tokens is not None else len(residual)
        payload = None if residual is None else P.f32_payload(residual)
        self.send_data(P.encode(P.ACT, 0, payload=payload, sid=sid, key=key, pos=pos, n=n,
                                tokens=None if tokens is None else list(tokens), **fields))

    def outcome(self, timeout=10, skip=(P.TOOK,)):
        """The next thing the worker does about a step: an ACT or TOKEN on our data
        socket, or an ERROR on the control socket (heartbeats answered meanwhile)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.data.poll(10):
                msg = P.decode(self.data.recv_multipart(), 1 << 30)
                if msg.type not in skip:
                    return msg
            if self.router.poll(0):
                identity, *frames = self.router.recv_multipart()
                msg = P.decode(frames, 1 << 30)
                if msg.type == P.HEARTBEAT:
                    self.router.send_multipart([identity, *P.encode(P.HEARTBEAT, 0)])
                    continue
                return msg
        raise TimeoutError("the worker did nothing about the step")

    def forward(self, sid, pos, tokens=None, residual=None, **fields):
        """One step through the worker: what came of it (ACT rows, a TOKEN, or an ERROR)."""
        self.act(sid, pos, tokens=tokens, residual=residual, **fields)
        return self.outcome(skip=(P.TOOK,) if self.capability.layers[1] < self.capability.n_layer
                            else (P.TOOK, P.ACT))

    def close(self):
        for sock in self.pushes.values():
            sock.close()
        self.data.close()
        self.router.close()
        self.ctx.destroy(linger=0)   # (what is still queued for a stopped worker goes nowhere)


def capability(**overrides) -> dict:
    """A READY capability as a real SmolLM2 worker sends it."""
    cap = {"worker_id": "fake-" + str(time.monotonic_ns()), "model_sha256": SMOLLM2_SHA256, "arch": "llama",
           "layers": [0, 30], "n_layer": 30, "n_embd": 576, "n_vocab": 49152, "engine_pin": "llama.cpp@fake",
           "backend": "CPU", "wire_dtype": "f32", "numerics": "invariant", "max_sessions": 4, "n_ctx": 256, "n_batch": 512,
           "admitted_bytes": 1 << 20, "data_endpoint": "tcp://127.0.0.1:9", "clock_id": "fake", "pid": 1}
    cap.update(overrides)
    return cap


class FakeWorker:
    """A raw DEALER playing worker: it can register, heartbeat on a thread, and answer nothing."""

    def __init__(self, endpoint: str):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self._beating = False
        self._lock = threading.Lock()

    def send(self, frames):
        with self._lock:
            self.sock.send_multipart(frames)

    def recv(self, timeout=5.0):
        """The next message that is not a heartbeat, decoded (so: protocol-valid)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                ready = self.sock.poll(10)
                frames = self.sock.recv_multipart() if ready else None
            if frames is not None:
                msg = P.decode(frames, 1 << 30)
                if msg.type != P.HEARTBEAT:
                    return msg
            elif time.monotonic() > deadline:
                raise TimeoutError("no answer from the coordinator")

    def heartbeat_forever(self, interval=0.1):
        """Look alive and never answer a request: a silent peer."""
        self._beating = True

        def beat():
            while self._beating:
                try:   # a coordinator that refused our handshake leaves no link to queue on
                    with self._lock:
                        self.sock.send_multipart(P.encode(P.HEARTBEAT, 0), flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass
                time.sleep(interval)
        self._beat = threading.Thread(target=beat, daemon=True)
        self._beat.start()

    def close(self):
        self._beating = False
        if getattr(self, "_beat", None) is not None:
            self._beat.join(timeout=10)   # its last send before the socket closes
        self.sock.close()
        self.ctx.term()
