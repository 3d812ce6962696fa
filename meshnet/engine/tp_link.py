"""The engine's exchange for a tensor-parallel member (meshnet_tp_link) over stream sockets
the caller connected and keyed (net/member_link.py): at each gather the engine sends and
receives the rows on its compute thread, without Python, sealing them with the cipher whose
functions it is given. The link works on its own copies of the sockets (dup), closed when
it is freed."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from meshnet.core import errors
from meshnet.core.errors import MeshnetError
from meshnet.engine.binding import _ffi, library


class EngineLink:
    """A meshnet_tp_link (cdata, freed with its last reference, which closes its copies of
    the sockets): a Stage's tp_link."""

    def __init__(self, cdata):
        self.cdata = cdata

    def stats(self) -> dict[str, int]:
        """The gathers so far: how many, their time and idle time (ns), bytes sent."""
        out = _ffi.new("meshnet_tp_link_stats *")
        library().meshnet_tp_link_get_stats(self.cdata, out)
        return {name: int(getattr(out, name)) for name in ("gathers", "gather_ns", "idle_ns", "bytes_sent")}


def engine_link(rank: int, size: int, sockets: Sequence, keys: Sequence[bytes | None] | None = None,
                cipher: tuple[int, int] | None = None, timeout_ms: int = 30_000, spin_us: int = 0) -> EngineLink:
    """Member RANK's meshnet_tp_link over SOCKETS (objects with fileno()), one to each other
    member (None for itself). With CIPHER (the addresses of an AEAD's seal and open, as
    libsodium's chacha20poly1305_ietf) every row is sealed with KEYS[r], the key shared with
    member r."""
    lib = library()
    sealed = cipher is not None
    if sealed and (keys is None or len(keys) != size or
                   any(len(k or b"") != 32 for r, k in enumerate(keys) if r != rank)):
        raise MeshnetError(errors.BAD_KEY, f"member {rank} needs a 32-byte key for each other member to seal its rows")
    # the link's own descriptors: the caller may close its sockets while a stage still runs
    # on the link, and a number reused by another connection must never receive rows
    owned = [-1 if s is None else os.dup(s.fileno()) for s in sockets]
    fds = _ffi.new("int32_t[]", owned)
    key_bytes = _ffi.new("uint8_t[]", b"".join((k or bytes(32)) if r != rank else bytes(32)
                                               for r, k in enumerate(keys)) if sealed else b"\0")
    seal = _ffi.cast("meshnet_tp_seal_fn", cipher[0]) if sealed else _ffi.NULL
    opener = _ffi.cast("meshnet_tp_open_fn", cipher[1]) if sealed else _ffi.NULL
    link = lib.meshnet_tp_link_new(rank, size, fds, key_bytes, seal, opener, timeout_ms, spin_us)
    if link == _ffi.NULL:
        for fd in owned:
            if fd >= 0:
                os.close(fd)
        raise MeshnetError(errors.INVALID_ARGUMENT, f"member {rank} of {size} needs a socket to each other member "
                           "and none to itself, and a positive timeout")
    return EngineLink(_ffi.gc(link, lib.meshnet_tp_link_free))


@dataclass(frozen=True)
class LinkFigures:
    """A group's exchange as measured through the engine's own gather: the median time of a
    gather of a few values once the members go in step (the link's latency and the member's
    work at each gather), and the bytes per second of a member's rows in a large one
    (core/tp_cost.py's inputs)."""

    gather_us: float
    bandwidth: float


SMALL_GATHERS = 32
LARGE_GATHERS = 4
LARGE_COLUMNS = 1 << 18   # a member's 1 MiB of rows: as much as a 128k-vocabulary model's logits


def measure(link: EngineLink, rank: int, size: int) -> LinkFigures:
    """Gathers outside any model (layer -1) in step with the group's other members, which
    measure at the same time: every member must call this once, right after linking."""
    lib = library()

    def gathers(first_point: int, count: int, n_local: int) -> list[float]:
        # as little Python between the gathers as can be: members in one process (meshnet
        # bench) take turns at the interpreter's lock there, and each waits on the other
        local = np.full(n_local, rank, dtype=np.float32)
        whole = np.zeros(n_local * size, dtype=np.float32)
        local_p, whole_p = _ffi.cast("float *", local.ctypes.data), _ffi.cast("float *", whole.ctypes.data)
        gather, clock, took, status = lib.meshnet_tp_link_gather, time.perf_counter, [], 0
        for point in range(first_point, first_point + count):
            began = clock()
            status |= gather(link.cdata, -1, point, local_p, n_local, rank * n_local, whole_p, n_local * size, 1)
            took.append(clock() - began)
        if status != 0:
            raise MeshnetError(errors.TP_EXCHANGE, "measuring the group's exchange failed: " +
                               _ffi.string(lib.meshnet_tp_link_error(link.cdata)).decode(errors="replace"))
        if not np.array_equal(whole, np.repeat(np.arange(size, dtype=np.float32), n_local)):
            raise MeshnetError(errors.TP_EXCHANGE, "the group's members gathered another's rows while measuring")
        return took

    # the first gathers find the members out of step (one waits for the other to arrive, or
    # finds its rows there already); after them each gather starts as the last one ends
    small = float(np.median(gathers(0, SMALL_GATHERS, 8)[SMALL_GATHERS // 4:]))
    large = float(np.median(gathers(SMALL_GATHERS, LARGE_GATHERS, LARGE_COLUMNS)))
    sent = (size - 1) * 4 * LARGE_COLUMNS
    # (a large gather measured as fast as a small one is noise: its time alone, then)
    return LinkFigures(small * 1e6, sent / (large - small if large > 2 * small else large))
