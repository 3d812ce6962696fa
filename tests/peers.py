"""Raw ZeroMQ peers for tests: a fake coordinator to send a real worker whatever a test
wants, and a fake worker to send a real coordinator whatever a test wants. They are the
input of the thing under test (an attacker, a silent peer), never a stand-in for our code."""

import socket
import subprocess
import sys
import threading
import time

import zmq

from meshnet import protocol as P

from conftest import THREADS

SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def start_worker(path, endpoint, layers, *extra, **popen):
    return subprocess.Popen([sys.executable, "-m", "meshnet.cli", "worker", "--coordinator", endpoint, "--model", path,
                             "--layers", f"{layers[0]}:{layers[1]}", "--threads", str(THREADS), "--ctx", "256", *extra],
                            **popen)


def rss_kib(pid) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


class FakeCoordinator:
    """A raw ROUTER playing coordinator."""

    def __init__(self):
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind("tcp://127.0.0.1:0")
        self.endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.identity = None
        self.rid = 1000

    def wait_ready(self, timeout=60):
        while True:
            frames = self.recv(timeout)
            msg = P.decode(frames, 1 << 30)
            if msg.type == P.READY:
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
        while True:
            msg = P.decode(self.recv(timeout), 1 << 30)  # every answer must be protocol-valid
            if msg.type == P.HEARTBEAT:
                self.send(P.encode(P.HEARTBEAT, 0))
                continue
            return msg

    def request(self, msg_type, payload=None, **fields):
        self.rid += 1
        return self.reply_to(P.encode(msg_type, self.rid, payload=payload, **fields))

    def close(self):
        self.router.close()
        self.ctx.term()


def capability(**overrides) -> dict:
    """A READY capability as a real SmolLM2 worker sends it."""
    cap = {"worker_id": "fake-" + str(time.monotonic_ns()), "model_sha256": SMOLLM2_SHA256, "arch": "llama",
           "layers": [0, 30], "n_layer": 30, "n_embd": 576, "n_vocab": 49152, "engine_pin": "llama.cpp@fake",
           "backend": "CPU", "wire_dtype": "f32", "max_sessions": 4, "n_ctx": 256, "n_batch": 512,
           "admitted_bytes": 1 << 20, "pid": 1}
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
                self.send(P.encode(P.HEARTBEAT, 0))
                time.sleep(interval)
        threading.Thread(target=beat, daemon=True).start()

    def close(self):
        self._beating = False
        time.sleep(0.15)
        self.sock.close()
        self.ctx.term()
