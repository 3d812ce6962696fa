"""A tensor-parallel member's links to its group: a keyed TCP stream to each other member
(net/member_link.py), on which the engine exchanges the rows (engine/tp_link.py)."""

from __future__ import annotations

import socket

from meshnet.core import errors
from meshnet.core.errors import MeshnetError
from meshnet.engine.tp_link import engine_link, measure
from meshnet.net import member_link
from meshnet.net.security import KeyPair

GATHER_TIMEOUT_MS = 30_000   # a gather not done in this long loses the member its group
LINK_TIMEOUT_S = 60.0        # members start apart: the time a binder waits for its peer
# how long a member spins on its sockets at a gather before it sleeps (yielding its CPU to
# anything else that wants it): a peer's rows are usually microseconds away, and a sleep and
# wake-up costs more than a gather; a peer still computing its half, a few milliseconds
# (tools/tp_bench.py: 2 ms of spin gave 45.7 ms a token, 20 ms 37.4-39.8, Qwen 1.5B)
SPIN_US = 20_000


class GroupLink:
    """Member RANK of SIZE: a stream to each other member. The lower rank of each pair
    listens (bind_for) and the higher connects (connect_to); with KEYS (this member's CURVE
    pair) each stream is keyed from both members' CURVE keys, so each must be told the
    other's public key."""

    def __init__(self, rank: int, size: int, keys: KeyPair | None = None, timeout_ms: int = GATHER_TIMEOUT_MS,
                 spin_us: int = SPIN_US, link_timeout_s: float = LINK_TIMEOUT_S, group: bytes = b""):
        if size < 2 or not 0 <= rank < size:
            raise MeshnetError(errors.INVALID_ARGUMENT, f"member {rank} of a group of {size}")
        # GROUP names the group (its model and layers, say): a member's keys in two groups
        # cannot link one group's member to the other's
        self.rank, self.size, self.keys, self.group = rank, size, keys, group
        self.timeout_ms, self.spin_us, self.link_timeout_s = timeout_ms, spin_us, link_timeout_s
        self.sockets: list[socket.socket | None] = [None] * size
        self.link_keys: list[bytes | None] = [None] * size
        self.figures = None   # the group's exchange as measured when linked (engine/tp_link.py LinkFigures)
        self._listening: dict[int, tuple[socket.socket, member_link.Keys | None]] = {}
        self._engine_link = None

    def _peer_keys(self, peer: int, peer_public: bytes | None) -> member_link.Keys | None:
        if peer == self.rank or not 0 <= peer < self.size or self.sockets[peer] is not None or peer in self._listening:
            raise MeshnetError(errors.INVALID_ARGUMENT, f"member {self.rank} has no second link to member {peer}")
        if self.keys is None:
            return None
        if peer_public is None:
            raise MeshnetError(errors.BAD_KEY, f"member {peer}'s public key is needed to key the link to it")
        return member_link.Keys(self.keys.public, self.keys.secret, peer_public)

    def bind_for(self, peer: int, address: str = "tcp://127.0.0.1:0", peer_public: bytes | None = None) -> str:
        """Listen for member PEER (a higher rank): the endpoint it is to connect to. The
        connection is taken, and checked, in engine_link."""
        if peer < self.rank:
            raise MeshnetError(errors.INVALID_ARGUMENT, f"member {self.rank} connects to member {peer}; it does not bind")
        keys = self._peer_keys(peer, peer_public)
        listener, endpoint = member_link.listen(address)
        self._listening[peer] = (listener, keys)
        return endpoint

    def connect_to(self, peer: int, endpoint: str, peer_public: bytes | None = None) -> None:
        """Connect to the listener member PEER (a lower rank) made for this member, and key
        the link (it waits for PEER to take the connection)."""
        if peer > self.rank:
            raise MeshnetError(errors.INVALID_ARGUMENT, f"member {self.rank} binds for member {peer}; it does not connect")
        keys = self._peer_keys(peer, peer_public)
        self.sockets[peer], self.link_keys[peer] = member_link.connect(endpoint, self.rank, peer, keys, self.group,
                                                                       self.link_timeout_s)

    def accept_all(self) -> None:
        """Take each listened-for member's connection, checked (its key, its rank)."""
        for peer, (listener, keys) in sorted(self._listening.items()):
            try:
                self.sockets[peer], self.link_keys[peer] = member_link.accept(listener, self.rank, peer, keys,
                                                                              self.group, self.link_timeout_s)
            finally:
                listener.close()
                del self._listening[peer]

    def engine_link(self):
        """The engine's meshnet_tp_link over these streams (Stage's tp_link), once every
        other member is linked."""
        if self._engine_link is None:
            self.accept_all()
            missing = [peer for peer, sock in enumerate(self.sockets) if sock is None and peer != self.rank]
            if missing:
                raise MeshnetError(errors.INVALID_ARGUMENT, f"member {self.rank} has no link to members {missing}")
            cipher = member_link.cipher_addresses() if self.keys is not None else None
            self._engine_link = engine_link(self.rank, self.size, self.sockets, self.link_keys, cipher,
                                            self.timeout_ms, self.spin_us)
        return self._engine_link

    def measure(self):
        """The group's exchange as measured through the engine's gather (the cost model's
        inputs): every member calls it at about the same time, before its stage's first
        pass, and each waits for the others."""
        self.figures = measure(self.engine_link(), self.rank, self.size)
        return self.figures

    def lost(self) -> str | None:
        """Why a member's stream is gone (its end closed it: the process ended), or None.
        It only peeks: rows that came early stay for the engine's gather."""
        for peer, sock in enumerate(self.sockets):
            if sock is None:
                continue
            try:
                if sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                    return f"member {peer} closed its stream"
            except BlockingIOError:
                continue
            except OSError as e:
                return f"member {peer}'s stream failed ({e.strerror})"
        return None

    def close(self) -> None:
        """This side's sockets closed (the engine's link holds its own copies of them, closed
        when the link is freed: a stage still using it keeps the streams open)."""
        self._engine_link = None
        for listener, _ in self._listening.values():
            listener.close()
        self._listening.clear()
        for sock in self.sockets:
            if sock is not None:
                sock.close()
        self.sockets = [None] * self.size
