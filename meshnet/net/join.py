"""Joining a mesh with one token: the coordinator's keys and the join key, kept under
$MESHNET_HOME/keys, and the token that carries what a worker needs to be admitted.

The credential is a shared join key: a CURVE key pair whose public half is on the
coordinator's allow-list and whose secret half is in every token. A worker given a token
connects with that key pair, so the coordinator's ZAP handler (security.Gatekeeper)
admits it in the CURVE handshake, before any of its messages is read, and nobody without
the token gets that far. Rotating the join key (`meshnet keys rotate-join`) writes a new
pair; the coordinator reads the public half again at each handshake, so a token made
before the rotation is refused from then on. The trade-offs are in the README's security
section.

A token is `mnj1-` and the base64url of a msgpack map: the coordinator's addresses
(possibly none: then the worker looks for it on the LAN, net/discovery.py), its CURVE
public key, and the join key's secret half.
"""

from __future__ import annotations

import base64
import binascii
import os
import queue
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

import msgpack
import zmq

from meshnet.core import errors as E
from meshnet.core.errors import MeshnetError
from meshnet.core.home import meshnet_home
from meshnet.net import security
from meshnet.net.addresses import tcp_peer
from meshnet.net.security import KeyPair

PREFIX = "mnj1-"
COORDINATOR = "coordinator"   # NAME.key / NAME.key_secret under keys_dir()
JOIN = "join"
MAX_TOKEN_CHARS = 4096
MAX_ADDRESSES = 16
ENV = "MESHNET_JOIN"          # where `meshnet worker` reads a token from


def keys_dir() -> Path:
    return meshnet_home() / "keys"


def _key_pair(directory: Path, name: str) -> KeyPair:
    """NAME's key pair in DIRECTORY, made the first time it is asked for."""
    directory = Path(directory)
    secret = directory / f"{name}.key_secret"
    if not secret.exists():
        directory.mkdir(parents=True, exist_ok=True)
        directory.chmod(0o700)
        try:
            security.generate(directory, name)
        except MeshnetError:
            pass   # another process made it at the same moment: read theirs
    return security.load_secret(secret)


def coordinator_keys(directory: Path | None = None) -> KeyPair:
    """This host's coordinator key pair: the same from run to run, so that tokens hold."""
    return _key_pair(directory or keys_dir(), COORDINATOR)


class JoinKey:
    """The join key on disk, as the coordinator's gatekeeper asks for it at each handshake:
    read again whenever the file changed, so that a rotation takes effect at once."""

    def __init__(self, directory: Path | None = None):
        self.directory = Path(directory or keys_dir())
        self._seen: tuple | None = None
        self._public: bytes | None = None
        _key_pair(self.directory, JOIN)

    @property
    def path(self) -> Path:
        return self.directory / f"{JOIN}.key_secret"

    def pair(self) -> KeyPair:
        return security.load_secret(self.path)

    def public(self) -> bytes | None:
        try:
            st = self.path.stat()
            seen = (st.st_ino, st.st_size, st.st_mtime_ns)
            if seen != self._seen:
                self._public, self._seen = self.pair().public, seen
        except (OSError, MeshnetError):
            return None   # a key being rotated this instant: nobody is admitted by it
        return self._public

    def rotate(self) -> KeyPair:
        """A new join key; tokens carrying the old one are refused from now on."""
        with tempfile.TemporaryDirectory(dir=self.directory, prefix=".rotate-") as tmp:
            security.generate(tmp, JOIN)
            # the public half last: the gatekeeper reads the secret file, renamed whole
            os.replace(Path(tmp) / f"{JOIN}.key_secret", self.path)
            os.replace(Path(tmp) / f"{JOIN}.key", self.directory / f"{JOIN}.key")
        return self.pair()


@dataclass(frozen=True)
class Token:
    addresses: tuple[str, ...]   # the coordinator's control endpoints (tcp://HOST:PORT); empty: discover it
    coordinator_key: bytes       # its CURVE public key, z85
    join_secret: bytes           # the join key's secret half, z85

    def encode(self) -> str:
        body = msgpack.packb({"a": list(self.addresses), "c": self.coordinator_key.decode(),
                              "j": self.join_secret.decode()}, use_bin_type=True)
        return PREFIX + base64.urlsafe_b64encode(body).decode().rstrip("=")

    @property
    def keys(self) -> KeyPair:
        """The key pair a worker joins with."""
        return KeyPair(zmq.curve_public(self.join_secret), self.join_secret)

    def without_addresses(self) -> "Token":
        return Token((), self.coordinator_key, self.join_secret)


def make_token(addresses, coordinator: KeyPair, join: KeyPair) -> Token:
    return Token(tuple(tcp_peer(a, "a join token's address") for a in addresses), coordinator.public, join.secret)


def _z85_key(value, what: str) -> bytes:
    if not isinstance(value, str) or len(value) != 40:
        raise MeshnetError(E.JOIN_REFUSED, f"the join token's {what} is not a CURVE key")
    key = value.encode()
    try:
        zmq.utils.z85.decode(key)
    except (ValueError, binascii.Error, KeyError):
        raise MeshnetError(E.JOIN_REFUSED, f"the join token's {what} is not a CURVE key") from None
    return key


def parse_token(text: str) -> Token:
    """A token as `meshnet coordinator` printed it; join_refused saying what is wrong
    with anything else. Whether the mesh admits it is the coordinator's to say."""
    text = (text or "").strip()
    if not text.startswith(PREFIX) or len(text) > MAX_TOKEN_CHARS:
        raise MeshnetError(E.JOIN_REFUSED, f"'{text[:24]}...' is not a meshnet join token (they start with "
                           f"{PREFIX}): copy the whole line the coordinator printed")
    body = text[len(PREFIX):]
    try:
        fields = msgpack.unpackb(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)), raw=False)
    except Exception:   # base64 and msgpack raise several unrelated types on garbage
        raise MeshnetError(E.JOIN_REFUSED, "the join token is damaged (cut short or mistyped): copy the whole "
                           "line the coordinator printed") from None
    if not isinstance(fields, dict) or set(fields) != {"a", "c", "j"}:
        raise MeshnetError(E.JOIN_REFUSED, "the join token is not one this version of meshnet reads")
    addresses = fields["a"]
    if not isinstance(addresses, list) or len(addresses) > MAX_ADDRESSES:
        raise MeshnetError(E.JOIN_REFUSED, "the join token's addresses are not a list of endpoints")
    for address in addresses:
        if not isinstance(address, str):
            raise MeshnetError(E.JOIN_REFUSED, "the join token's addresses are not a list of endpoints")
        tcp_peer(address, "the join token's address")
    return Token(tuple(addresses), _z85_key(fields["c"], "coordinator key"), _z85_key(fields["j"], "join key"))


Answer = TypeVar("Answer")


def first_answer(endpoints, ask: Callable[[str], Answer]) -> tuple[str, Answer]:
    """(endpoint, ASK(endpoint)) of the first of ENDPOINTS to answer, all asked at once: a
    token names each address of the coordinator's host, and those on networks this machine
    is not on answer nothing, so asked one after another 16 dead addresses cost 16 silences.
    Silence (UNREACHABLE) waits for the others; any other outcome decides (a refused token
    is refused at every address). With none answering, UNREACHABLE naming them all."""
    endpoints = list(endpoints)
    outcomes: queue.Queue = queue.Queue()

    def one(endpoint: str) -> None:
        try:
            outcomes.put((endpoint, ask(endpoint), None))
        except Exception as e:   # (handed to the caller's thread, which raises it)
            outcomes.put((endpoint, None, e))
    for endpoint in endpoints:
        # daemons: those still waiting once one answered end at their own timeout, unwaited
        threading.Thread(target=one, args=(endpoint,), name="meshnet-join-probe", daemon=True).start()
    silent = None
    for _ in endpoints:
        endpoint, answer, error = outcomes.get()
        if error is None:
            return endpoint, answer
        if not (isinstance(error, MeshnetError) and error.code == E.UNREACHABLE):
            raise error
        silent = error
    if len(endpoints) == 1:
        raise silent
    raise MeshnetError(E.UNREACHABLE, f"no coordinator answered at {', '.join(endpoints)}")


def join_line(token: Token, mem: str = "8G") -> str:
    """What the coordinator prints for the operator of each other machine: the token in
    the worker's environment, which only its own user may read, not in its argv, which
    `ps` shows every user (the shell's assignment puts it in no process's argv)."""
    return f"{ENV}={token.encode()} meshnet worker --mem {mem}"
