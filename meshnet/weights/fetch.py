"""A worker without the model file fetches the bytes it needs from the mesh's holders.

The file is stored as a sparse file with the original's layout under
$MESHNET_HOME/models/mesh/SHA256/: the spans fetched are byte-identical to the original
and the rest are holes, so the engine maps it as it would the whole file and disk use is
about the stage's share. A model of several files (gguf-split) is stored as its files,
side by side, each sparse, each with its header (the engine opens every split). Each span (the header, a tensor) is checked against the sha256 of
the manifest the coordinator vouches for (never a holder's: weights/manifest.py) as its
last byte arrives; a span that fails, or a holder that goes silent, sends the rest of the
fetch to the next holder. What is checked is written down beside the file after each span,
with the hash it was checked against, so a fetch that is stopped resumes where it was, and
a span checked against another manifest (another coordinator's) is fetched again.

The disk's free space is looked at before a fetch writes; a disk that fills anyway ends the
fetch with fetch_failed, and what that fetch wrote is removed (its spans punched back to
holes), so a full disk is left as it was found.

Requests go out a window at a time on one DEALER per holder (the credit-based flow of
the ZeroMQ guide's file transfer), so the link stays busy while memory stays bounded by
WINDOW x CHUNK however large the model.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import ctypes
import hashlib
import itertools
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import zmq

from meshnet.core import errors as E
from meshnet.core.errors import MeshnetError
from meshnet.core.home import meshnet_home
from meshnet.net import protocol as P
from meshnet.net import security, sockets
from meshnet.net.addresses import reachable
from meshnet.net.fields import peer_endpoint
from meshnet.net.security import KeyPair
from meshnet.core.planner import format_size
from meshnet.weights import manifest as manifests
from meshnet.weights.manifest import Manifest, Span

log = logging.getLogger("meshnet.weights.fetch")

CHUNK = 1 << 20          # bytes a FETCH asks for
WINDOW = 8               # FETCHes in flight per holder: memory is bounded by WINDOW x CHUNK
SILENCE_S = 15.0         # a holder that sends nothing for this long is given up for the next
STOP_POLL_S = 0.25       # a wait that can be cancelled looks this often whether it is
STATE_SUFFIX = ".have"   # beside the file: the spans fetched and checked, by name, with what they were checked against
STATE_EVERY_S = 0.25     # ... written down this often at most while a fetch runs (and at its end): a stopped
                         # fetch redoes at most this much, and a model of many small tensors is not slowed


@dataclass(frozen=True)
class HolderAddress:
    endpoint: str
    key: bytes | None    # its CURVE public key (z85); None on a link without keys


class HolderFailed(Exception):
    """This holder could not give a span: the next one is asked."""


@dataclass(frozen=True)
class MeshModel:
    """The coordinator's answer to HOLDERS: the model it routes, who serves its bytes, and the
    manifest it vouches for (None while it has none: it has no file of its own and is still
    hashing a holder's, CHECKING (bytes done, of), or found none it could vouch for, WHY)."""
    sha256: str | None
    holders: list[HolderAddress]
    manifest: Manifest | None
    checking: tuple[int, int] | None = None
    why: str | None = None


def store_path(manifest: Manifest) -> Path:
    return meshnet_home() / "models" / "mesh" / manifest.sha256 / manifest.filename


class Fetch:
    def __init__(self, manifest: Manifest, holders: list[HolderAddress], keys: KeyPair | None,
                 coordinator: str = "", path: Path | None = None, silence_s: float = SILENCE_S,
                 refresh: Callable[[], list[HolderAddress]] | None = None):
        self.manifest = manifest
        self.coordinator = coordinator
        self.holders = self._reachable(holders)
        self.refresh = refresh          # who holds the bytes now (the coordinator's HOLDERS), before each run
        self.keys = keys
        self.silence_s = silence_s
        self.path = Path(path or store_path(manifest))   # the first file: the one the engine is given
        self.files = [(self.path if i == 0 else self.path.with_name(name), start, size)
                      for i, (name, start, size) in enumerate(manifest.files())]
        self.state_path = self.path.with_name(self.path.name + STATE_SUFFIX)
        self.have = self._prepare()
        self._saved_at = 0.0
        self._unsaved = False
        self.fetched_bytes = 0          # over the wire, this process
        self.seconds = 0.0
        self.failures: list[str] = []   # each holder given up, and why

    def _reachable(self, holders: list[HolderAddress]) -> list[HolderAddress]:
        # a holder bound to every interface is reached on the coordinator's host
        return [HolderAddress(reachable(h.endpoint, self.coordinator) if self.coordinator else h.endpoint, h.key)
                for h in holders]

    # the file and what of it is here

    def _prepare(self) -> set[str]:
        """The sparse file at its full size, and the spans already checked in it against this
        manifest's hashes (a name alone says nothing of the bytes)."""
        spans = {s.name: [s.offset, s.size, s.sha256] for s in (self.manifest.header, *self.manifest.tensors)}
        have: set[str] = set()
        try:
            state = json.loads(self.state_path.read_text())
            if state.get("sha256") == self.manifest.sha256 and isinstance(state.get("have"), dict) \
                    and all(path.stat().st_size == size for path, _, size in self.files):
                have = {name for name, checked in state["have"].items() if spans.get(name) == checked}
        except (OSError, ValueError, AttributeError):
            pass   # nothing fetched yet, or a state this version cannot read: fetch again
        if not have:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                for path, _, size in self.files:
                    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
                    try:
                        os.ftruncate(fd, 0)   # holes, not stale bytes of another attempt
                        os.ftruncate(fd, size)
                    finally:
                        os.close(fd)
            except OSError as e:
                self._forget_all()
                raise MeshnetError(E.FETCH_FAILED, f"cannot make the model's file at {self.path}: {e.strerror}") \
                    from None
        return have

    def _save_state(self, now: bool = True) -> None:
        if not now and time.monotonic() - self._saved_at < STATE_EVERY_S:
            self._unsaved = True
            return
        self._saved_at, self._unsaved = time.monotonic(), False
        spans = {s.name: [s.offset, s.size, s.sha256] for s in (self.manifest.header, *self.manifest.tensors)
                 if s.name in self.have}
        tmp = self.state_path.with_name(self.state_path.name + ".tmp")
        tmp.write_text(json.dumps({"sha256": self.manifest.sha256, "have": spans}))
        os.replace(tmp, self.state_path)

    def missing(self, spans: list[Span]) -> list[Span]:
        return [s for s in spans if s.name not in self.have]

    def disk_bytes(self) -> int:
        """What the sparse file(s) take on disk: their blocks, not their length."""
        return sum(path.stat().st_blocks * 512 for path, _, _ in self.files)

    def _open(self) -> list[tuple[int, int, int]]:
        """(fd, first byte, bytes) of each file, open for writing."""
        opened = []
        try:
            for path, start, size in self.files:
                opened.append((os.open(path, os.O_WRONLY), start, size))
        except OSError:
            _close(opened)
            raise
        return opened

    # the fetch

    def run(self, spans: list[Span], progress: Callable[[int, int], None] | None = None) -> None:
        """Fetch and check every span of SPANS not here yet; FETCH_FAILED when no holder
        could give them all, naming each holder's failure, or when the disk cannot take them
        (and then what this run wrote is removed)."""
        wanted = self.missing(spans)
        if not wanted:
            return
        self._refresh_holders()
        self._check_room(wanted)
        total = sum(s.size for s in wanted)
        done = [0]

        def advanced(n: int) -> None:
            done[0] += n
            if progress is not None:
                progress(done[0], total)
        began = time.monotonic()
        left = wanted
        try:
            for holder in self.holders:
                if not left:
                    break
                try:
                    self._from(holder, left, advanced)
                except HolderFailed as e:
                    self.failures.append(f"{holder.endpoint}: {e}")
                    log.warning("fetch: %s failed (%s); %s", holder.endpoint, e,
                                "asking the next holder" if holder is not self.holders[-1] else "no holder is left")
                left = self.missing(left)
        except OSError as e:
            self._undo(wanted)
            raise MeshnetError(E.FETCH_FAILED, f"writing the model's bytes to {self.path} failed ({e.strerror}): "
                               "what this fetch wrote is removed") from None
        finally:
            self.seconds += time.monotonic() - began
        if left:
            why = "; ".join(self.failures) or "the mesh has no holder of this model's bytes"
            raise MeshnetError(E.FETCH_FAILED, f"{len(left)} of the model's spans ({sum(s.size for s in left)} "
                               f"bytes) could not be fetched: {why}")

    def _refresh_holders(self) -> None:
        if self.refresh is None:
            return
        try:
            holders = self.refresh()
        except MeshnetError as e:   # the coordinator is away: the holders known before may still serve
            log.warning("fetch: could not ask the coordinator who holds the bytes now (%s)", e)
            return
        if holders:
            self.holders = self._reachable(holders)
        else:
            # its probe gives a holder less time than a fetch does: one busy for a moment is
            # unlisted for a moment, and may well serve
            log.info("fetch: the coordinator lists no holder that answers now; asking those it listed before")

    def _check_room(self, spans: list[Span]) -> None:
        """FETCH_FAILED unless the disk holding the file has room for SPANS (each rounded out
        to whole blocks) and the state beside it; a file that holds nothing checked yet is
        removed then, as nothing else made it."""
        st = os.statvfs(self.path.parent)
        block = st.f_frsize or 4096
        need = sum(-(-s.size // block) * block + block for s in spans) + 2 * (len(self.manifest.tensors) + 1) * 256
        free = st.f_bavail * st.f_frsize
        if need > free:
            if not self.have:
                self._forget_all()
            raise MeshnetError(E.FETCH_FAILED, f"the disk holding {self.path.parent} has {format_size(free)} free; "
                               f"the {len(spans)} span(s) to fetch need {format_size(need)}")

    def _undo(self, spans: list[Span]) -> None:
        """Remove what a failed run wrote: its spans back to holes and out of the state; the
        whole file and state where holes cannot be punched, or where nothing else is left."""
        undone = {s.name for s in spans}
        self.have -= undone
        try:
            if not self.have:
                raise OSError("nothing checked is left")
            opened = self._open()
            try:
                for start, end in _runs(self.manifest, undone):
                    for fd, first, size in opened:   # a run may go on from one split into the next
                        lo, hi = max(start, first), min(end, first + size)
                        if hi > lo:
                            _punch_hole(fd, lo - first, hi - lo)
            finally:
                _close(opened)
            self._save_state()
        except OSError:
            self._forget_all()

    def _forget_all(self) -> None:
        self.have = set()
        for path in (*(path for path, _, _ in self.files), self.state_path,
                     self.state_path.with_name(self.state_path.name + ".tmp")):
            with contextlib.suppress(OSError):
                path.unlink()

    def _from(self, holder: HolderAddress, spans: list[Span], advanced: Callable[[int], None]) -> None:
        """Every span of SPANS from one holder; HolderFailed at its first failure (what was
        checked before it stays); OSError when the disk refuses a write."""
        digests: dict[str, hashlib._Hash] = {}
        opened = self._open()
        ends = list(itertools.accumulate(size for _, _, size in opened))
        try:
            with contextlib.closing(stream(holder, self.keys, ((s, s.offset, s.size) for s in spans),
                                           self.silence_s)) as chunks:
                for span, offset, data in chunks:
                    if len(data):   # a piece lies in one span, and a span in one file (Manifest.check)
                        fd, first, _ = opened[bisect.bisect_right(ends, offset)]
                        os.pwrite(fd, data, offset - first)
                    digest = digests.setdefault(span.name, hashlib.sha256())
                    digest.update(data)
                    self.fetched_bytes += len(data)
                    advanced(len(data))
                    if offset + len(data) == span.offset + span.size:
                        self._checked(span, digests.pop(span.name))
        finally:
            _close(opened)
            if self._unsaved:
                self._save_state()

    def _checked(self, span: Span, digest) -> None:
        if digest.hexdigest() != span.sha256:
            raise HolderFailed(f"{span.name} does not have the manifest's sha256 (the holder's copy is corrupt)")
        self.have.add(span.name)
        self._save_state(now=False)


def _runs(manifest: Manifest, names: set[str]) -> list[tuple[int, int]]:
    """[start, end) of each run of the file's spans that are all in NAMES: punched whole, so
    that the blocks two neighbouring spans share are freed too (the padding between them is
    a hole in the copy already), while a block shared with a span kept is kept."""
    runs: list[tuple[int, int]] = []
    run = None
    for span in (manifest.header, *manifest.tensors):
        if span.name in names:
            run = (run[0] if run else span.offset, span.offset + span.size)
        elif run is not None:
            runs.append(run)
            run = None
    return runs + ([run] if run else [])


def _close(opened: list[tuple[int, int, int]]) -> None:
    for fd, _, _ in opened:
        os.close(fd)


_fallocate = getattr(ctypes.CDLL(None, use_errno=True), "fallocate", None)
if _fallocate is not None:
    _fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
_FALLOC_PUNCH_HOLE = 0x01 | 0x02   # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE (linux/falloc.h)


def _punch_hole(fd: int, offset: int, size: int) -> None:
    """Free the blocks of [OFFSET, OFFSET + SIZE) and read zeros there, as before they were
    written; OSError where the system or the filesystem cannot."""
    if _fallocate is None:
        raise OSError("fallocate is not available here")
    if size and _fallocate(fd, _FALLOC_PUNCH_HOLE, offset, size) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))


def stream(holder: HolderAddress, keys: KeyPair | None, ranges: Iterable[tuple[object, int, int]],
           silence_s: float = SILENCE_S,
           cancel: threading.Event | None = None) -> Iterator[tuple[object, int, memoryview | bytes]]:
    """The bytes of each (TAG, OFFSET, SIZE) of RANGES from one holder, in order, as (TAG,
    OFFSET, DATA) pieces of at most CHUNK (an empty range gives one empty piece), WINDOW
    requests in flight on one DEALER (the credit-based flow of the ZeroMQ guide's file
    transfer); HolderFailed at the first failure, or once CANCEL is set."""
    chunks = ((tag, offset, min(CHUNK, start + size - offset))
              for tag, start, size in ranges for offset in range(start, start + max(size, 1), CHUNK))
    in_flight: collections.deque = collections.deque()
    rid = 0
    ctx = zmq.Context()
    try:
        sock = _to_holder(ctx, holder.endpoint, holder.key, keys, CHUNK + 2 * P.MAX_HEADER_BYTES)
        pending = next(chunks, None)
        while pending is not None or in_flight:
            while pending is not None and len(in_flight) < WINDOW:
                tag, offset, length = pending
                if length:
                    rid += 1
                    sock.send_multipart(P.encode(P.FETCH, rid, offset=offset, length=length))
                in_flight.append((rid if length else None, tag, offset, length))
                pending = next(chunks, None)
            while in_flight and in_flight[0][0] is None:   # an empty range: nothing was asked
                _, tag, offset, _ = in_flight.popleft()
                yield tag, offset, b""
            if not in_flight:
                continue
            if not _readable(sock, silence_s, cancel):
                raise HolderFailed(f"no answer within {silence_s:.0f} s")
            frames, why = P.recv_frames(sock, 2, CHUNK + P.MAX_HEADER_BYTES)
            if why is not None:
                raise HolderFailed(why)
            try:
                msg = P.decode(frames, CHUNK)
            except P.ProtocolError as e:
                raise HolderFailed(f"a malformed answer: {e}") from None
            want_rid, tag, offset, length = in_flight.popleft()
            if msg.type == P.ERROR:
                raise HolderFailed(f"[{msg['code']}] {msg['message']}")
            if msg.rid != want_rid or msg.get("offset") != offset or msg.payload is None \
                    or len(msg.payload) != length:
                raise HolderFailed(f"an answer that is not the bytes [{offset}, {offset + length}) asked for")
            yield tag, offset, msg.payload
    except zmq.ZMQError as e:   # its socket failed: this holder fails, the next one is asked
        raise HolderFailed(f"its connection failed: {e}") from None
    finally:
        ctx.destroy(linger=0)


def _readable(sock: zmq.Socket, timeout: float, cancel: threading.Event | None) -> bool:
    """Whether SOCK has a message within TIMEOUT; HolderFailed once CANCEL is set."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        if cancel is not None and cancel.is_set():
            raise HolderFailed("cancelled")
        if sock.poll(int(min(left, STOP_POLL_S if cancel is not None else left) * 1000) + 1):
            return True
    return False


def _to_holder(ctx: zmq.Context, endpoint: str, key: bytes | None, keys: KeyPair | None,
               max_frame: int) -> zmq.Socket:
    """A DEALER connected to a holder, CURVE to its KEY where both sides have keys;
    HolderFailed (and no socket left open) where libzmq refuses the endpoint."""
    sock = sockets.fetch_dealer(ctx, max_frame=max_frame)
    try:
        if keys is not None and key is not None:
            security.client(sock, keys, key)
        sock.connect(endpoint)
    except zmq.ZMQError as e:
        sock.close(linger=0)
        raise HolderFailed(f"cannot connect to it: {e.strerror}") from None
    return sock


def holders_of(coordinator: str, keys: KeyPair | None, coordinator_key: bytes | None,
               timeout: float = SILENCE_S) -> MeshModel:
    """Ask the coordinator (HOLDERS) which model it routes, who serves its bytes and the
    manifest it vouches for. It is also the first word a joining worker has with it: a
    token the coordinator does not admit fails here, with join_refused, instead of a
    worker that waits forever. With a token the answer comes over CURVE from the key the
    token names, so the manifest is the coordinator's own word."""
    from zmq.utils.monitor import recv_monitor_message

    ctx = zmq.Context()
    sock = sockets.fetch_dealer(ctx, max_frame=manifests.MAX_WIRE_BYTES + 2 * P.MAX_HEADER_BYTES)
    monitor = sock.get_monitor_socket(security.HANDSHAKE_FAILED)
    try:
        if keys is not None:
            security.client(sock, keys, coordinator_key)
        sock.connect(coordinator)
        sock.send_multipart(P.encode(P.HOLDERS, 1))
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            events = dict(poller.poll(int(left * 1000) + 1))
            if monitor in events:
                recv_monitor_message(monitor)
                raise MeshnetError(E.JOIN_REFUSED, f"the coordinator at {coordinator} refused this worker's key in "
                                   "the CURVE handshake: the join token was rotated (meshnet keys rotate-join) or is "
                                   "not this mesh's, or the coordinator runs without keys; use the line "
                                   "`meshnet coordinator` prints now")
            if sock in events:
                return _mesh_model(coordinator, P.decode(sock.recv_multipart(copy=False), manifests.MAX_WIRE_BYTES))
        raise MeshnetError(E.UNREACHABLE, f"no coordinator answered at {coordinator} within {timeout:.0f} s")
    except P.ProtocolError as e:
        raise MeshnetError(E.FETCH_FAILED, f"the coordinator at {coordinator} answered with {e}") from None
    finally:
        sock.disable_monitor()
        ctx.destroy(linger=0)


def _mesh_model(coordinator: str, msg: P.Message) -> MeshModel:
    if msg.type != P.OK:
        raise MeshnetError(msg.get("code", E.INTERNAL), f"the coordinator at {coordinator} would not say "
                           f"who holds the model: {msg.get('message')}")
    info = msg.get("info") or {}
    holders, sha256 = info.get("holders"), info.get("model_sha256")
    checking, why = info.get("checking"), info.get("why")
    well_formed = (isinstance(holders, list)
                   and all(isinstance(h, list) and len(h) == 2 and isinstance(h[0], str) and peer_endpoint(h[0])
                           and (h[1] is None or isinstance(h[1], str)) for h in holders)
                   and (sha256 is None or isinstance(sha256, str)) and (why is None or isinstance(why, str))
                   and (checking is None or isinstance(checking, list) and len(checking) == 2
                        and all(isinstance(n, int) for n in checking)))
    if not well_formed:
        raise MeshnetError(E.FETCH_FAILED, f"the coordinator at {coordinator} sent a malformed list of holders")
    manifest = None
    if msg.payload is not None:
        try:
            manifest = Manifest.from_wire(msg.payload)
        except MeshnetError as e:
            raise MeshnetError(e.code, f"the coordinator at {coordinator} vouches for a manifest this worker "
                               f"refuses, and fetches nothing: {e.message}") from None
        if manifest.sha256 != sha256:
            raise MeshnetError(E.FETCH_FAILED, f"the coordinator at {coordinator} vouches for a manifest of model "
                               f"{manifest.sha256[:12]}, not of the model {str(sha256)[:12]} it routes")
    # printed by the worker: plain printable text only, however the coordinator wrote it
    why = "".join(c if c.isprintable() else "?" for c in why[:2000]) if why else None
    return MeshModel(sha256, [HolderAddress(h[0], h[1].encode() if h[1] else None) for h in holders], manifest,
                     tuple(checking) if checking else None, why)
