"""What a coordinator is started with, in one value (the CLI, serve, the local cluster
and the tests build it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from meshnet.core.planner import OVERHEAD
from meshnet.net import addresses
from meshnet.net.heartbeat import HEARTBEAT_INTERVAL, HEARTBEAT_LIVENESS
from meshnet.net.security import KeyPair

PREFILL_CHUNK = 64             # prompt tokens per forward request
REQUEST_TIMEOUT = 60.0         # seconds a stage may take to answer one request
MIN_FETCH_RATE = 1 << 20       # bytes/s: a worker that fetches its range is given this long for each byte
MAX_PAYLOAD = 32 << 20         # largest payload accepted from a worker: 512 rows of an 16k-wide model fit


@dataclass(frozen=True)
class CoordinatorConfig:
    bind: str = "tcp://127.0.0.1:0"
    data_bind: str | None = None            # where stages send tokens; by default beside bind, on a free port
    heartbeat_interval: float = HEARTBEAT_INTERVAL
    heartbeat_liveness: int = HEARTBEAT_LIVENESS
    prefill_chunk: int = PREFILL_CHUNK
    request_timeout: float = REQUEST_TIMEOUT
    max_payload: int = MAX_PAYLOAD
    allow_mixed: bool = False               # let workers of other classes into a route; runs then report drift
    overhead: int = OVERHEAD                # per worker process, for the planner
    keys: KeyPair | None = None             # CURVE: this coordinator's keys; None runs without
    allowed_workers: frozenset[bytes] | None = None   # the workers' public keys admitted (with keys)
    # the join key's public half as it is now (net/join.py JoinKey.public), asked at each
    # handshake: a worker with a join token is admitted, and a rotated key no longer is
    join_key: Callable[[], bytes | None] | None = None
    # makes what answers HOLDERS, the manifest the coordinator vouches for and the holders
    # that answer (weights/vouch.py's Voucher, given by the launch layer: what a model file
    # holds is not the route's to know); None: it lists no holder and vouches for nothing
    holders: Callable[[], Any] | None = None
    # a session that loses a stage is replayed on a new route when one exists, or
    # appears within resume_wait seconds; at most max_resumes times (None: 0)
    resume_wait: float | None = 0.0
    max_resumes: int = 2
    trace: bool = False                     # record a span per token received (core/trace.py), for meshnet bench --trace
    # the CPU of the per-token handling (the loop thread and ZeroMQ's I/O thread), None for
    # any: a local route gives it the tail's, which is idle while the head computes
    cpu: int | None = None
    # speculative decoding: the head drafts up to this many tokens a round from the session's
    # own tokens (core/drafts.py) and the route keeps those it would have drawn; 0: off
    speculate: int = 0

    def __post_init__(self):
        if self.resume_wait is None:
            object.__setattr__(self, "resume_wait", 0.0)
        addresses.checked(self.bind, "--bind")
        if self.data_bind is not None:
            addresses.checked(self.data_bind, "--data-bind")
