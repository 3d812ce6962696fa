"""The engine's exchange for a tensor-parallel member (meshnet_tp_link) over ZeroMQ sockets
that the caller made and secured: at each gather the engine sends and receives the rows on
its compute thread, without Python. It calls the zmq_send and zmq_recv of the libzmq that
pyzmq loaded, on the sockets' own handles (pyzmq's Socket.underlying): the sockets stay
pyzmq's, closed by their owner after the stage that uses them."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import zmq

from meshnet.core import errors
from meshnet.core.errors import MeshnetError
from meshnet.engine.binding import _ffi, library

_ffi.cdef("int zmq_send(void *, const void *, size_t, int); int zmq_recv(void *, void *, size_t, int);")
_zmq = None


def _libzmq():
    """The libzmq this process's pyzmq runs on (its mapped file), for its two functions."""
    global _zmq
    if _zmq is None:
        mapped = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
                  if "libzmq" in line.split()[-1]}
        if len(mapped) != 1:
            raise MeshnetError(errors.INTERNAL, f"pyzmq's libzmq is not one mapped file here ({sorted(mapped)}): the "
                               "engine cannot share its sockets")
        _zmq = _ffi.dlopen(mapped.pop())
    return _zmq


class EngineLink:
    """A meshnet_tp_link (cdata, freed with its last reference) and the sockets it sends
    on, which it keeps open for as long as it lives: a Stage's tp_link."""

    def __init__(self, cdata, sockets: Sequence[zmq.Socket | None]):
        self.cdata, self.sockets = cdata, list(sockets)


def engine_link(rank: int, size: int, sockets: Sequence[zmq.Socket | None]) -> EngineLink:
    """Member RANK's meshnet_tp_link over SOCKETS, one to each other member (None for itself)."""
    zlib, lib = _libzmq(), library()
    peers = _ffi.new("void *[]", [_ffi.NULL if s is None else _ffi.cast("void *", s.underlying) for s in sockets])
    link = lib.meshnet_tp_link_new(rank, size, peers, _ffi.addressof(zlib, "zmq_send"), _ffi.addressof(zlib, "zmq_recv"))
    if link == _ffi.NULL:
        raise MeshnetError(errors.INVALID_ARGUMENT, f"member {rank} of {size} needs a socket to each other member "
                           "and none to itself")
    return EngineLink(_ffi.gc(link, lib.meshnet_tp_link_free), sockets)
