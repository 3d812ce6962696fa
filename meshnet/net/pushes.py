"""Outgoing data-plane links: one PUSH per peer's data endpoint, made at the first
message there and kept while a session still sends there. A stage pushes to the next
stage and to the coordinator; the coordinator pushes prompt chunks to each head."""

from __future__ import annotations

import collections

import zmq

from meshnet.core import errors as E
from meshnet.core.errors import MeshnetError
from meshnet.net import security, sockets
from meshnet.net.security import KeyPair


class Pushes:
    def __init__(self, ctx: zmq.Context, keys: KeyPair | None):
        self.ctx, self.own_keys = ctx, keys    # with keys, every link is CURVE
        self.sockets: dict[str, zmq.Socket] = {}
        self.keys: dict[str, bytes] = {}   # the CURVE key of the peer behind each endpoint, told at open
        self.opened: collections.Counter[str] = collections.Counter()   # by mechanism: the links that outlived their session

    def expect(self, endpoint: str, server_key: bytes) -> None:
        """The link to ENDPOINT is made at the session's first step, not now: with CURVE
        the next stage lets this one in only once its own OPEN has named it, and a
        handshake it refused is never tried again; the first step comes after every
        stage's OPEN."""
        self.keys[endpoint] = server_key

    def to(self, endpoint: str) -> zmq.Socket:
        """The PUSH to ENDPOINT (CURVE to the key expected behind it)."""
        sock = self.sockets.get(endpoint)
        if sock is None:
            sock = sockets.data_push(self.ctx)
            if self.own_keys is not None:
                security.client(sock, self.own_keys, self.keys.get(endpoint, b""))
            try:
                sock.connect(endpoint)
            except zmq.ZMQError as e:
                sock.close(linger=0)
                raise MeshnetError(E.BAD_ADDRESS, f"cannot connect to {endpoint!r}: {e.strerror}") from None
            self.sockets[endpoint] = sock
            self.opened[security.mechanism(sock)] += 1
        return sock

    def forget(self, endpoint: str) -> None:
        """No session sends to ENDPOINT any more."""
        self.keys.pop(endpoint, None)
        if endpoint in self.sockets:
            self.sockets.pop(endpoint).close(linger=0)

    def mechanisms(self) -> dict:
        return {endpoint: security.mechanism(sock) for endpoint, sock in self.sockets.items()}

    def close(self) -> None:
        for sock in self.sockets.values():
            sock.close(linger=0)
