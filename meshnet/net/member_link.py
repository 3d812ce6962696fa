"""The stream between two members of a tensor-parallel group: a TCP connection, keyed by a
handshake over the members' CURVE keys, on which the engine exchanges rows at every gather
(engine_c/tp_link.cpp seals and opens them itself).

Why not a ZeroMQ socket like every other link: a group exchanges four times a layer (113
times a token for a 28-layer model), and each ZeroMQ message passes through two I/O
threads, 100-200 us a gather here against the ~15 us of a socket the compute thread reads
itself; that difference is the whole of what a group gains. The keys are still the CURVE
keys, and the cipher is libsodium's (the library CURVE itself runs on, loaded by pyzmq).

The handshake (each side's fixed-size messages, read under a deadline):
  connector -> binder: MAGIC, its rank, a fresh ephemeral X25519 public key
  binder -> connector: MAGIC, its rank, its ephemeral public key
  both: key = BLAKE2b(LABEL, the group's id, the four DH results of Noise's KK pattern
        (static-static, static-ephemeral both ways, ephemeral-ephemeral), both static
        publics, both ephemerals, both ranks), then each sends a tag sealed with it, which
        the other opens.
Only the holders of the two expected secret keys derive the key, for this group only, and a
new one each link (a recorded stream stays sealed if a key leaks later). A peer that fails
the handshake is closed; a binder keeps listening for the right one until its deadline
(handshakes are taken one at a time, each for 2 s at most). Without keys (loopback,
--insecure) the ranks are exchanged and nothing else.
"""

from __future__ import annotations

import logging
import socket
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import cffi
import zmq
from zmq.utils import z85

from meshnet.core import errors
from meshnet.core.errors import MeshnetError
from meshnet.net import addresses

log = logging.getLogger("meshnet.net.member_link")

MAGIC = b"mntplk01"
LABEL = b"meshnet tensor-parallel link v1"
KEY_BYTES = 32
TAG_BYTES = 16
CONFIRM_COUNT = 2**64 - 1   # the confirmation's nonce count: never a data message's
HELLO = struct.Struct("<8si32s")
# one connection's handshake (two small messages each way): a stranger that connects and says
# nothing holds the listener this long at most; a binder's whole wait is longer
HANDSHAKE_SECONDS = 2.0

_ffi = cffi.FFI()
_ffi.cdef("""
int sodium_init(void);
void randombytes_buf(void * buf, size_t size);
int crypto_box_keypair(unsigned char * pk, unsigned char * sk);
int crypto_scalarmult(unsigned char * q, const unsigned char * n, const unsigned char * p);
int crypto_generichash(unsigned char * out, size_t outlen, const unsigned char * in, unsigned long long inlen,
                       const unsigned char * key, size_t keylen);
int crypto_aead_chacha20poly1305_ietf_encrypt(unsigned char * c, unsigned long long * clen, const unsigned char * m,
    unsigned long long mlen, const unsigned char * ad, unsigned long long adlen, const unsigned char * nsec,
    const unsigned char * npub, const unsigned char * k);
int crypto_aead_chacha20poly1305_ietf_decrypt(unsigned char * m, unsigned long long * mlen, unsigned char * nsec,
    const unsigned char * c, unsigned long long clen, const unsigned char * ad, unsigned long long adlen,
    const unsigned char * npub, const unsigned char * k);
""")
_sodium = None


def sodium():
    """libsodium as this process has it: the copy pyzmq's libzmq loaded (its mapped file),
    else the system's."""
    global _sodium
    if _sodium is None:
        zmq.Context.instance()   # (pyzmq's libzmq, and the libsodium it links, are loaded by now)
        mapped = sorted({line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
                         if "libsodium" in line.split()[-1]})
        candidates = mapped + ["libsodium.so.23", "libsodium.so"]
        for name in candidates:
            try:
                _sodium = _ffi.dlopen(name)
                break
            except OSError:
                continue
        else:
            raise MeshnetError(errors.INTERNAL, "no libsodium in this process or on this machine (pyzmq's wheels "
                               "bring one): a tensor-parallel group cannot seal its rows")
        if _sodium.sodium_init() < 0:
            raise MeshnetError(errors.INTERNAL, "libsodium failed to initialise")
    return _sodium


def cipher_addresses() -> tuple[int, int]:
    """The addresses of the AEAD's seal and open, for the engine's link."""
    lib = sodium()
    return tuple(int(_ffi.cast("uintptr_t", _ffi.addressof(lib, name))) for name in
                 ("crypto_aead_chacha20poly1305_ietf_encrypt", "crypto_aead_chacha20poly1305_ietf_decrypt"))


@dataclass(frozen=True)
class Keys:
    """This member's CURVE key pair and the peer's public key (z85, as in meshnet's key files)."""
    public: bytes
    secret: bytes
    peer_public: bytes


def _raw(z85_key: bytes, what: str) -> bytes:
    try:
        raw = z85.decode(z85_key)
    except (ValueError, TypeError, KeyError):
        raw = b""
    if len(raw) != KEY_BYTES:
        raise MeshnetError(errors.BAD_KEY, f"{what} is not a CURVE key (40 z85 characters)")
    return raw


def _nonce(rank: int, count: int) -> bytes:
    return struct.pack("<iQ", rank, count)


def seal(key: bytes, rank: int, count: int, plain: bytes, ad: bytes) -> bytes:
    lib = sodium()
    out = _ffi.new("unsigned char[]", len(plain) + TAG_BYTES)
    n = _ffi.new("unsigned long long *")
    lib.crypto_aead_chacha20poly1305_ietf_encrypt(out, n, plain, len(plain), ad, len(ad), _ffi.NULL,
                                                  _nonce(rank, count), key)
    return bytes(_ffi.buffer(out, n[0]))


def opens(key: bytes, rank: int, count: int, sealed: bytes, ad: bytes) -> bool:
    lib = sodium()
    if len(sealed) < TAG_BYTES:
        return False
    out = _ffi.new("unsigned char[]", max(1, len(sealed) - TAG_BYTES))
    n = _ffi.new("unsigned long long *")
    return lib.crypto_aead_chacha20poly1305_ietf_decrypt(out, n, _ffi.NULL, sealed, len(sealed), ad, len(ad),
                                                         _nonce(rank, count), key) == 0


def _ephemeral() -> tuple[bytes, bytes]:
    lib = sodium()
    pk, sk = _ffi.new("unsigned char[32]"), _ffi.new("unsigned char[32]")
    lib.crypto_box_keypair(pk, sk)
    return bytes(pk), bytes(sk)


def _dh(secret: bytes, public: bytes) -> bytes:
    out = _ffi.new("unsigned char[32]")
    if sodium().crypto_scalarmult(out, secret, public) != 0:
        # (libsodium refuses a low-order point: a peer's key that would make the secret known)
        raise ValueError("a peer's key is not a usable X25519 point")
    return bytes(out)


def _derive(keys: Keys, group: bytes, own_eph: tuple[bytes, bytes], peer_eph: bytes, binder: bool,
            own_rank: int, peer_rank: int) -> bytes:
    """The link's key from four Diffie-Hellman results, as Noise's KK pattern takes them:
    static-static and both static-ephemeral pairs (only the two key holders derive it, and a
    stolen secret key does not let its thief pose as a peer to its owner), and
    ephemeral-ephemeral (a new key each link); bound to the group and the whole transcript."""
    own_secret = _raw(keys.secret, "this member's secret key")
    own_static, peer_static = _raw(keys.public, "this member's public key"), _raw(keys.peer_public, "the peer's key")
    eph_secret, eph_public = own_eph
    ss = _dh(own_secret, peer_static)
    ee = _dh(eph_secret, peer_eph)
    # es: the binder's static with the connector's ephemeral; se: the other way round
    es = _dh(own_secret, peer_eph) if binder else _dh(eph_secret, peer_static)
    se = _dh(eph_secret, peer_static) if binder else _dh(own_secret, peer_eph)
    ordered = ((own_static, peer_static, eph_public, peer_eph, own_rank, peer_rank) if binder
               else (peer_static, own_static, peer_eph, eph_public, peer_rank, own_rank))
    material = (LABEL + struct.pack("<I", len(group)) + group + ss + ee + es + se + b"".join(ordered[:4])
                + struct.pack("<ii", *ordered[4:]))
    out = _ffi.new("unsigned char[32]")
    sodium().crypto_generichash(out, KEY_BYTES, material, len(material), _ffi.NULL, 0)
    return bytes(out)


def _read(sock: socket.socket, n: int, deadline: float) -> bytes:
    got = bytearray(n)
    view, done = memoryview(got), 0
    while done < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        sock.settimeout(left)
        chunk = sock.recv_into(view[done:])
        if not chunk:
            raise ConnectionError("closed")
        done += chunk
    return bytes(got)


def _handshake(sock: socket.socket, binder: bool, rank: int, peer_rank: int, keys: Keys | None, group: bytes,
               deadline: float) -> bytes | None:
    """The key this link's rows are sealed with (None without keys); raises ValueError for a
    peer that is not the member expected, OSError/TimeoutError for a lost one."""
    eph_secret, eph_public = (None, bytes(32)) if keys is None else _ephemeral()[::-1]
    own = HELLO.pack(MAGIC, rank, eph_public)
    if not binder:
        sock.sendall(own)
    magic, their_rank, their_eph = HELLO.unpack(_read(sock, HELLO.size, deadline))
    if magic != MAGIC or their_rank != peer_rank:
        raise ValueError(f"a peer that is not member {peer_rank} of this group (it says {their_rank!r})")
    if binder:
        sock.sendall(own)
    if keys is None:
        return None
    key = _derive(keys, group, (eph_secret, eph_public), their_eph, binder, rank, peer_rank)
    sock.sendall(seal(key, rank, CONFIRM_COUNT, b"", MAGIC))
    if not opens(key, peer_rank, CONFIRM_COUNT, _read(sock, TAG_BYTES, deadline), MAGIC):
        raise ValueError(f"a peer without member {peer_rank}'s key, or of another group")
    return key


# a member whose host is gone (power, network) sends no FIN: its peer's kernel probes the
# idle stream after KEEPALIVE_IDLE_S and gives up after KEEPALIVE_PROBES unanswered probes,
# and the stream then reads as failed (GroupLink.lost, the engine's next gather)
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 5, 2, 3


def _tune(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                          ("TCP_KEEPCNT", KEEPALIVE_PROBES)):
        if hasattr(socket, option):   # (Linux's names)
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
    sock.settimeout(None)
    return sock


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """("host", port) from "tcp://host:port" (meshnet's endpoint spelling)."""
    scheme, _, rest = endpoint.partition("://")
    host, _, port = rest.rpartition(":")
    if scheme != "tcp" or not host or not port.isdigit():
        raise MeshnetError(errors.BAD_ADDRESS, f"{endpoint!r} is not a tcp://HOST:PORT endpoint")
    return host.strip("[]"), int(port)


def listen(address: str) -> tuple[socket.socket, str]:
    """A listening socket at ADDRESS (tcp://HOST:PORT, port 0 for any) and its endpoint."""
    host, port = split_endpoint(address)
    listener = addresses.tcp_listener(host, port, 4, "give a group member's listener another address")
    bound_host, bound_port = listener.getsockname()[:2]
    return listener, f"tcp://{'[' + bound_host + ']' if ':' in bound_host else bound_host}:{bound_port}"


def accept(listener: socket.socket, rank: int, peer_rank: int, keys: Keys | None, group: bytes,
           timeout_s: float) -> tuple[socket.socket, bytes | None]:
    """The connection of member PEER_RANK, handshaken: others that come first are closed."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise MeshnetError(errors.TIMEOUT, f"member {peer_rank} did not link to member {rank} in {timeout_s:g} s")
        listener.settimeout(left)
        try:
            sock, origin = listener.accept()
        except TimeoutError:
            continue
        try:
            key = _handshake(sock, True, rank, peer_rank, keys, group,
                             min(deadline, time.monotonic() + HANDSHAKE_SECONDS))
            return _tune(sock), key
        except (ValueError, OSError, struct.error) as e:
            log.warning("member %d refused a link from %s: %s", rank, origin, e or type(e).__name__)
            sock.close()
        except BaseException:
            sock.close()
            raise


def connect(endpoint: str, rank: int, peer_rank: int, keys: Keys | None, group: bytes,
            timeout_s: float) -> tuple[socket.socket, bytes | None]:
    """A connection to member PEER_RANK's listener, handshaken."""
    host, port = split_endpoint(endpoint)
    deadline = time.monotonic() + timeout_s
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as e:
        raise MeshnetError(errors.UNREACHABLE, f"member {rank} cannot reach member {peer_rank} at {endpoint}: "
                           f"{e.strerror or e}") from None
    try:
        return _tune(sock), _handshake(sock, False, rank, peer_rank, keys, group, deadline)
    except ValueError as e:
        sock.close()
        raise MeshnetError(errors.BAD_KEY, f"member {rank} refused the link at {endpoint}: {e}") from None
    except (OSError, struct.error) as e:
        sock.close()
        raise MeshnetError(errors.UNREACHABLE, f"member {peer_rank} at {endpoint} broke off the link's handshake "
                           f"({e or type(e).__name__})") from None
    except BaseException:
        sock.close()
        raise
