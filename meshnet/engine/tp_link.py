"""The engine's exchange for a tensor-parallel member (meshnet_tp_link) over stream sockets
the caller connected and keyed (net/member_link.py): at each gather the engine sends and
receives the rows on its compute thread, without Python, sealing them with the cipher whose
functions it is given. The sockets stay the caller's, closed by their owner after the stage
that uses them."""

from __future__ import annotations

from collections.abc import Sequence

from meshnet.core import errors
from meshnet.core.errors import MeshnetError
from meshnet.engine.binding import _ffi, library


class EngineLink:
    """A meshnet_tp_link (cdata, freed with its last reference) and the sockets it reads,
    which it keeps open for as long as it lives: a Stage's tp_link."""

    def __init__(self, cdata, sockets: Sequence):
        self.cdata, self.sockets = cdata, list(sockets)

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
    fds = _ffi.new("int32_t[]", [-1 if s is None else s.fileno() for s in sockets])
    sealed = cipher is not None
    if sealed and (keys is None or len(keys) != size or
                   any(len(k or b"") != 32 for r, k in enumerate(keys) if r != rank)):
        raise MeshnetError(errors.BAD_KEY, f"member {rank} needs a 32-byte key for each other member to seal its rows")
    key_bytes = _ffi.new("uint8_t[]", b"".join((k or bytes(32)) if r != rank else bytes(32)
                                               for r, k in enumerate(keys)) if sealed else b"\0")
    seal = _ffi.cast("meshnet_tp_seal_fn", cipher[0]) if sealed else _ffi.NULL
    opener = _ffi.cast("meshnet_tp_open_fn", cipher[1]) if sealed else _ffi.NULL
    link = lib.meshnet_tp_link_new(rank, size, fds, key_bytes, seal, opener, timeout_ms, spin_us)
    if link == _ffi.NULL:
        raise MeshnetError(errors.INVALID_ARGUMENT, f"member {rank} of {size} needs a socket to each other member "
                           "and none to itself, and a positive timeout")
    return EngineLink(_ffi.gc(link, lib.meshnet_tp_link_free), sockets)
