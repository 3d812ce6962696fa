"""A holder: serves one model's bytes to the mesh's workers, on a socket of its own
and a thread of its own, so that a fetch never waits behind a session's tokens, nor they
behind it. With keys the socket is a CURVE server behind the same rule as the
coordinator's (its allow-list and the join key): only the mesh's members fetch.

A holder serves bytes, never trust: its MANIFEST is a hint the coordinator checks by
hashing the whole file (weights/vouch.py); a fetcher checks every span against the
manifest the coordinator vouches for. A member may still be hostile (a token is a bearer
credential), so what one peer can make the holder hold is bounded (PEER_QUEUE answers),
no request can end the thread, and a HEARTBEAT is answered so that the coordinator can
stop listing a holder that no longer answers. A model of several files (gguf-split) is
served as their concatenation, in order (weights/manifest.py).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from pathlib import Path
from typing import Callable

import zmq

from meshnet.core import errors as E
from meshnet.core.errors import MeshnetError
from meshnet.net import protocol as P
from meshnet.net import security, sockets
from meshnet.net.security import Gatekeeper, KeyPair
from meshnet.weights import manifest as manifests
from meshnet.weights.fetch import WINDOW

log = logging.getLogger("meshnet.weights.holder")

POLL_MS = 100   # how often the thread looks whether it is asked to stop
# answers queued for one peer at most: a peer that asks and never reads holds PEER_QUEUE x
# 4 MiB here (the socket's default, 10,000 answers, let it hold 40 GiB), and an answer past
# it is dropped. A fetcher has WINDOW requests in flight; libzmq learns that queued answers
# were taken only every (PEER_QUEUE + 1) / 2 of them, so twice WINDOW and a margin keep a
# fetcher from ever meeting the bound
PEER_QUEUE = 2 * WINDOW + 4


class Holder:
    def __init__(self, path: str | Path, sha256: str, bind: str, keys: KeyPair | None = None,
                 allowed: set[bytes] = frozenset(), join_key: Callable[[], bytes | None] | None = None):
        self.path = Path(path)
        self.manifest = manifests.of_file(self.path, sha256)
        self._manifest_wire = self.manifest.to_wire()
        self.keys = keys
        self.counters: collections.Counter = collections.Counter()
        self.ctx = zmq.Context()
        self.gatekeeper = Gatekeeper(self.ctx, allowed, join_key) if keys is not None else None
        self.sock = sockets.control_router(self.ctx, max_frame=2 * P.MAX_HEADER_BYTES)
        self.sock.setsockopt(zmq.SNDHWM, PEER_QUEUE)   # before bind: each peer's pipe takes it
        if keys is not None:
            security.serve(self.sock, keys)
        self.fds = [(os.open(self.path.with_name(name), os.O_RDONLY), start, size)
                     for name, start, size in self.manifest.files()]
        try:
            self.sock.bind(bind)
        except zmq.ZMQError as e:
            self.close()
            raise MeshnetError(E.BAD_ADDRESS, f"cannot serve the model's bytes on {bind!r}: {e.strerror}") from None
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="meshnet-holder", daemon=True)
        self._thread.start()

    @property
    def public_key(self) -> str | None:
        return self.keys.public.decode() if self.keys is not None else None

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                self._serve_one()
            except Exception:   # a bug or an exhausted machine must not silence the holder for good
                self.counters["failed"] += 1
                log.exception("holder: a request failed")
                self._stop.wait(POLL_MS / 1000)   # a failure that repeats does not spin

    def _serve_one(self) -> None:
        if not self.sock.poll(POLL_MS):
            return
        frames, why = P.recv_frames(self.sock, 3, 2 * P.MAX_HEADER_BYTES)
        identity, body = frames[0], frames[1:]
        rid = None
        try:
            if why is not None:
                raise P.ProtocolError(E.OVERSIZED, why)
            msg = P.decode(body, 0)
            rid = msg.rid
            reply = self._answer(msg)
        except P.ProtocolError as e:
            self.counters["refused"] += 1
            reply = P.error_frames(e.rid, e.code, e.message)
        except Exception as e:   # MemoryError included: this request fails, the next is served
            self.counters["failed"] += 1
            log.warning("holder: a request failed: %r", e)
            reply = P.error_frames(rid, E.INTERNAL, f"the holder could not serve the request: {type(e).__name__}")
        try:
            self.sock.send_multipart([identity, *reply], flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError:
            self.counters["unsent"] += 1   # a fetcher gone, or not reading: it asks again elsewhere

    def _answer(self, msg: P.Message) -> list:
        if msg.type == P.HEARTBEAT:
            return P.encode(P.OK, msg.rid)
        if msg.type == P.MANIFEST:
            self.counters["manifests"] += 1
            return P.encode(P.OK, msg.rid, self._manifest_wire)
        if msg.type != P.FETCH:
            raise P.ProtocolError(E.UNKNOWN_TYPE, f"a holder serves heartbeat, manifest and fetch, not "
                                  f"'{msg.type}'", msg.rid)
        offset, length = msg["offset"], msg["length"]
        if offset + length > self.manifest.file_bytes:
            raise P.ProtocolError(E.BAD_FIELD, f"bytes [{offset}, {offset + length}) are past the end of the "
                                  f"{self.manifest.file_bytes}-byte file", msg.rid)
        data = self._read(offset, length)
        self.counters["fetches"] += 1
        self.counters["bytes"] += len(data)
        return P.encode(P.OK, msg.rid, data, offset=offset)

    def _read(self, offset: int, length: int) -> bytes:
        """LENGTH bytes at OFFSET of the model's files, read across a split's end as one run."""
        pieces = []
        for fd, start, size in self.fds:
            lo, hi = max(offset, start), min(offset + length, start + size)
            if hi > lo:
                pieces.append(os.pread(fd, hi - lo, lo - start))
        return b"".join(pieces) if len(pieces) != 1 else pieces[0]

    def close(self) -> None:
        if hasattr(self, "_thread"):
            self._stop.set()
            self._thread.join(timeout=5)
        self.sock.close(linger=0)
        if self.gatekeeper is not None:
            self.gatekeeper.stop()
        self.ctx.term()
        for fd, _, _ in getattr(self, "fds", ()):
            os.close(fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
