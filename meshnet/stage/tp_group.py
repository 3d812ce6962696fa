"""A tensor-parallel member's links to its group: one ZeroMQ PAIR socket per other member,
secured like every meshnet link, on which the engine exchanges the rows (engine/tp_link.py)."""

from __future__ import annotations

import zmq

from meshnet.core import errors
from meshnet.core.errors import MeshnetError
from meshnet.engine.tp_link import engine_link
from meshnet.net import security

GATHER_TIMEOUT_MS = 30_000   # a member silent this long at a gather is lost to its group
# the largest gather a peer may send: a batch of 512 rows of a 262,144-token vocabulary's
# logits (the engine checks each message against the gather it is in; this bounds the
# memory a peer can make ZeroMQ hold before that)
MAX_GATHER_BYTES = 512 * 262_144 * 4 + 64
QUEUED_MESSAGES = 16         # a gather is two parts; a peer cannot queue more than a few


class GroupLink:
    """Member RANK of SIZE: a PAIR socket to each other member. The lower rank of each pair
    binds (bind_for) and the higher connects (connect_to); with KEYS the binder is a CURVE
    server and the connector its client, as on every meshnet link."""

    def __init__(self, ctx: zmq.Context, rank: int, size: int, keys: security.KeyPair | None = None,
                 timeout_ms: int = GATHER_TIMEOUT_MS):
        if size < 2 or not 0 <= rank < size:
            raise MeshnetError(errors.INVALID_ARGUMENT, f"member {rank} of a group of {size}")
        self.ctx, self.rank, self.size, self.keys, self.timeout_ms = ctx, rank, size, keys, timeout_ms
        self.sockets: list[zmq.Socket | None] = [None] * size
        self._engine_link = None

    def _socket(self, peer: int) -> zmq.Socket:
        if peer == self.rank or not 0 <= peer < self.size or self.sockets[peer] is not None:
            raise MeshnetError(errors.INVALID_ARGUMENT, f"member {self.rank} has no second link to member {peer}")
        sock = self.ctx.socket(zmq.PAIR)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, self.timeout_ms)
        sock.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_GATHER_BYTES)
        sock.setsockopt(zmq.RCVHWM, QUEUED_MESSAGES)
        sock.setsockopt(zmq.SNDHWM, QUEUED_MESSAGES)
        self.sockets[peer] = sock
        return sock

    def bind_for(self, peer: int, address: str = "tcp://127.0.0.1:0") -> str:
        """A socket that member PEER (a higher rank) connects to: its endpoint."""
        if peer < self.rank:
            raise MeshnetError(errors.INVALID_ARGUMENT, f"member {self.rank} connects to member {peer}; it does not bind")
        sock = self._socket(peer)
        if self.keys is not None:
            security.serve(sock, self.keys)
        sock.bind(address)
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def connect_to(self, peer: int, endpoint: str, server_public: bytes | None = None) -> None:
        """Connect to the socket member PEER (a lower rank) bound for this member."""
        if peer > self.rank:
            raise MeshnetError(errors.INVALID_ARGUMENT, f"member {self.rank} binds for member {peer}; it does not connect")
        sock = self._socket(peer)
        if self.keys is not None:
            if server_public is None:
                raise MeshnetError(errors.BAD_KEY, f"member {peer}'s public key is needed to connect to it over CURVE")
            security.client(sock, self.keys, server_public)
        sock.connect(endpoint)

    def engine_link(self):
        """The engine's meshnet_tp_link over these sockets (Stage's tp_link), once every
        other member is linked."""
        if self._engine_link is None:
            missing = [peer for peer, sock in enumerate(self.sockets) if sock is None and peer != self.rank]
            if missing:
                raise MeshnetError(errors.INVALID_ARGUMENT, f"member {self.rank} has no link to members {missing}")
            self._engine_link = engine_link(self.rank, self.size, self.sockets)
        return self._engine_link

    def close(self) -> None:
        """The sockets closed; the engine's link must not be used after (its stage closed first)."""
        self._engine_link = None
        for sock in self.sockets:
            if sock is not None:
                sock.close(linger=0)
        self.sockets = [None] * self.size
