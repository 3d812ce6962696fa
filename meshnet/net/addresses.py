"""The ZeroMQ endpoints meshnet is given (tcp://HOST:PORT): checked before they reach
libzmq (it takes a port past 65535 modulo 65536 and listens somewhere nobody asked for),
and the address a peer can reach for one bound to every interface."""

from __future__ import annotations

import socket

from meshnet.core import errors as E
from meshnet.core.errors import MeshnetError


def checked(endpoint: str, what: str) -> str:
    """ENDPOINT itself, or MeshnetError(bad_address) naming WHAT (an option) and why."""
    scheme, sep, rest = str(endpoint).partition("://")
    if not sep:
        raise MeshnetError(E.BAD_ADDRESS, f"{what} {endpoint!r} names no transport: an address looks like "
                           "tcp://127.0.0.1:5555")
    if scheme != "tcp":
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


def tcp_peer(endpoint: str, what: str) -> str:
    """ENDPOINT, a tcp://HOST:PORT a peer can be reached at, or MeshnetError(bad_address).
    What another machine is given to connect to (a join token's addresses) is TCP alone:
    ipc:// and inproc:// name nothing beyond this host, and libzmq takes a transport it
    was not built with (udp://, pgm://) only to raise at connect."""
    scheme, _, rest = str(endpoint).partition("://")
    if scheme != "tcp":
        raise MeshnetError(E.BAD_ADDRESS, f"{what} {endpoint!r} is not a TCP address: a coordinator is reached "
                           "at tcp://HOST:PORT")
    checked(endpoint, what)
    port = rest.rpartition(":")[2]
    if port == "*" or int(port) == 0:
        raise MeshnetError(E.BAD_ADDRESS, f"{what} {endpoint!r} names no port to connect to: give the one the "
                           "coordinator listens on")
    return endpoint


def same_host_any_port(endpoint: str) -> str:
    """tcp://host:port -> tcp://host:0: a free port on the same interface (where the
    coordinator's data plane listens beside its control socket)."""
    if not endpoint.startswith("tcp://"):
        raise MeshnetError(E.BAD_ADDRESS, f"the coordinator needs a tcp:// address to serve the data plane, "
                           f"not {endpoint!r}")
    return endpoint.rsplit(":", 1)[0] + ":0"


def reachable(endpoint: str, coordinator: str) -> str:
    """A coordinator bound to every interface advertises a wildcard host for its data
    endpoint: reach it on the host its control socket was reached on."""
    scheme, _, rest = endpoint.partition("://")
    host, _, port = rest.rpartition(":")
    if scheme == "tcp" and host in ("*", "0.0.0.0", "[::]", "::"):
        coordinator_host = coordinator.partition("://")[2].rpartition(":")[0]
        return f"tcp://{coordinator_host}:{port}"
    return endpoint


def advertised(endpoint: str, coordinator: str) -> str:
    """A data endpoint bound to every interface (tcp://0.0.0.0:P) is useless to a peer as
    written: advertise the address this host reaches the coordinator from, which the
    other stages, on the coordinator's side of the network, can reach too."""
    scheme, _, rest = endpoint.partition("://")
    host, _, port = rest.rpartition(":")
    if scheme != "tcp" or host not in ("*", "0.0.0.0", "[::]", "::"):
        return endpoint
    coordinator_host, _, coordinator_port = coordinator.partition("://")[2].rpartition(":")
    try:
        family, _, _, _, address = socket.getaddrinfo(coordinator_host.strip("[]"), int(coordinator_port),
                                                      type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)   # UDP: no packet is sent, the kernel only picks the route
            local = probe.getsockname()[0]
    except (OSError, ValueError, IndexError):
        return endpoint
    return f"tcp://{f'[{local}]' if ':' in local else local}:{port}"


def tcp_listener(host: str, port: int, backlog: int, why: str, reuse_address: bool = False) -> socket.socket:
    """A TCP socket bound to HOST:PORT (an IPv6 host where it has a colon) and listening;
    MeshnetError(address_in_use or bad_address) saying which address, and WHY (what the
    caller can do about it), where it cannot be."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    if reuse_address:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        code = E.ADDRESS_IN_USE if e.errno == 98 else E.BAD_ADDRESS
        raise MeshnetError(code, f"cannot listen on {host}:{port}: {e.strerror}; {why}") from None
    sock.listen(backlog)
    return sock
