"""The ZeroMQ endpoints meshnet is given (tcp://HOST:PORT), checked before they reach
libzmq: it takes a port past 65535 modulo 65536 and listens somewhere nobody asked for."""

from __future__ import annotations

from meshnet.core import errors as E
from meshnet.core.errors import MeshnetError


def checked(endpoint: str, what: str) -> str:
    """ENDPOINT itself, or MeshnetError(bad_address) naming WHAT (an option) and why."""
    scheme, sep, rest = str(endpoint).partition("://")
    if not sep or scheme != "tcp":
        return endpoint   # ipc://, inproc://: libzmq's own checks say what is wrong
    host, colon, port = rest.rpartition(":")
    if not colon or not host:
        raise MeshnetError(E.BAD_ADDRESS, f"{what} {endpoint!r} has no port: an address looks like tcp://127.0.0.1:5555")
    if port == "*":
        return endpoint
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise MeshnetError(E.BAD_ADDRESS, f"{what} {endpoint!r}: the port must be 0..65535 (0 or * for a free one), "
                           f"not {port!r}")
    return endpoint


def same_host_any_port(endpoint: str) -> str:
    """tcp://host:port -> tcp://host:0: a free port on the same interface (where the
    coordinator's data plane listens beside its control socket)."""
    if not endpoint.startswith("tcp://"):
        raise MeshnetError(E.BAD_ADDRESS, f"the coordinator needs a tcp:// address to serve the data plane, "
                           f"not {endpoint!r}")
    return endpoint.rsplit(":", 1)[0] + ":0"
