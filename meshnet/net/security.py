"""Who may talk to whom: ZeroMQ CURVE keys and the allow-list that checks them.

Keys are pyzmq's certificate files (`zmq.auth.create_certificates`): NAME.key holds the
public key, NAME.key_secret both. A serving socket (the coordinator's ROUTER) is a CURVE
server whose every handshake goes to a ZAP authenticator (pyzmq's, on its own thread):
a peer whose public key is not on the allow-list is refused there, before any of its
messages reaches meshnet's code. Each refusal is logged (once per key) and counted.
"""

from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from meshnet.core import errors as E
from meshnet.core.errors import MeshnetError

log = logging.getLogger("meshnet.net.security")

ZAP_DOMAIN = "meshnet"


# the monitor events of a refused CURVE handshake, on either side
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


@dataclass(frozen=True)
class KeyPair:
    public: bytes     # z85, 40 bytes
    secret: bytes


def generate(directory: str | Path, name: str) -> tuple[Path, Path]:
    """NAME.key (public, to hand out) and NAME.key_secret (keep) in DIRECTORY."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for suffix in (".key", ".key_secret"):
        if (directory / f"{name}{suffix}").exists():
            raise MeshnetError(E.INVALID_ARGUMENT, f"{directory / (name + suffix)} exists already: keys are never "
                               "overwritten; choose another name or directory")
    public, secret = zmq.auth.create_certificates(str(directory), name)
    Path(secret).chmod(0o600)
    return Path(public), Path(secret)


def load_secret(path: str | Path) -> KeyPair:
    public, secret = _load(path)
    if secret is None:
        raise MeshnetError(E.BAD_KEY, f"{path} holds no secret key: give the NAME.key_secret file")
    return KeyPair(public, secret)


def load_public(path: str | Path) -> bytes:
    return _load(path)[0]


def load_allowed(path: str | Path) -> set[bytes]:
    """The public keys in a .key file, or in every .key file of a directory."""
    path = Path(path)
    files = sorted(path.glob("*.key")) if path.is_dir() else [path]
    if not files:
        raise MeshnetError(E.BAD_KEY, f"no public keys (*.key) in {path}")
    return {load_public(f) for f in files}


def _load(path: str | Path) -> tuple[bytes, bytes | None]:
    try:
        return zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as e:
        raise MeshnetError(E.BAD_KEY, f"cannot read a CURVE key from {path}: {e}") from None


class Gatekeeper:
    """A ZAP authenticator for one context: CURVE peers whose public key is allowed get
    in; the others are refused in the handshake, logged once per key and counted."""

    def __init__(self, ctx: zmq.Context, allowed: set[bytes], join_key: Callable[[], bytes | None] | None = None):
        self.allowed = set(allowed)
        # the join key's public half as it is now (net/join.py JoinKey.public): asked at each
        # handshake, so a rotated key admits nobody from then on
        self.join_key = join_key
        self.refused: collections.Counter = collections.Counter()   # by public key (z85)
        self._lock = threading.Lock()
        self.auth = ThreadAuthenticator(ctx, log=logging.getLogger("meshnet.zap"))
        self.auth.start()
        self.auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=self)

    def callback(self, domain: str, key: bytes) -> bool:
        """Called by the authenticator's thread with a peer's public key (z85)."""
        with self._lock:
            if key in self.allowed or (self.join_key is not None and key == self.join_key()):
                return True
            self.refused[key] += 1
            first = self.refused[key] == 1
        if first:
            log.warning("refused a peer whose CURVE key %s is not allowed", key.decode(errors="replace"))
        return False

    def allow(self, key: bytes) -> None:
        with self._lock:
            self.allowed.add(key)

    @property
    def refusals(self) -> int:
        with self._lock:
            return sum(self.refused.values())

    def stop(self) -> None:
        self.auth.stop()


@dataclass
class DataCurve:
    """CURVE on the data plane: this stage's keys, the coordinator's public key, and the
    allow-list of its data endpoint (the coordinator, then each session's previous stage)."""

    keys: KeyPair
    coordinator_key: bytes
    gatekeeper: Gatekeeper


def serve(sock: zmq.Socket, keys: KeyPair) -> None:
    """Make SOCK a CURVE server (before it binds); the Gatekeeper decides who gets in."""
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True


def client(sock: zmq.Socket, keys: KeyPair, server_public: bytes) -> None:
    """Make SOCK a CURVE client of the server with that public key (before it connects)."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = server_public


def is_loopback(endpoint: str) -> bool:
    """Whether an address is reachable from this machine only (loopback, ipc, inproc)."""
    scheme, _, rest = endpoint.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    host = rest.rpartition(":")[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def mechanism(sock: zmq.Socket) -> str:
    """The socket's security mechanism, as ZeroMQ reports it: 'CURVE' or 'NULL'."""
    return {zmq.NULL: "NULL", zmq.PLAIN: "PLAIN", zmq.CURVE: "CURVE"}.get(sock.getsockopt(zmq.MECHANISM), "?")
