"""A worker without the model file fetches the bytes it needs from the mesh's holders.

The file is stored as a sparse file with the original's layout under
$MESHNET_HOME/models/mesh/SHA256/: the spans fetched are byte-identical to the original
and the rest are holes, so the engine maps it as it would the whole file and disk use is
about the stage's share. Each span (the header, a tensor) is checked against the
manifest's sha256 as its last byte arrives; a span that fails, or a holder that goes
silent, sends the rest of the fetch to the next holder. What is checked is written down
beside the file after each span, so a fetch that is stopped resumes where it was.

Requests go out a window at a time on one DEALER per holder (the credit-based flow of
the ZeroMQ guide's file transfer), so the link stays busy while memory stays bounded by
WINDOW x CHUNK however large the model.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import zmq

from meshnet.core import errors as E
from meshnet.core.errors import MeshnetError
from meshnet.core.home import meshnet_home
from meshnet.net import protocol as P
from meshnet.net import security, sockets
from meshnet.net.addresses import reachable
from meshnet.net.security import KeyPair
from meshnet.weights.manifest import Manifest, Span

log = logging.getLogger("meshnet.weights.fetch")

CHUNK = 1 << 20          # bytes a FETCH asks for
WINDOW = 8               # FETCHes in flight per holder: memory is bounded by WINDOW x CHUNK
SILENCE_S = 15.0         # a holder that sends nothing for this long is given up for the next
STATE_SUFFIX = ".have"   # beside the file: the spans fetched and checked, by name
STATE_EVERY_S = 0.25     # ... written down this often at most while a fetch runs (and at its end): a stopped
                         # fetch redoes at most this much, and a model of many small tensors is not slowed


@dataclass(frozen=True)
class HolderAddress:
    endpoint: str
    key: bytes | None    # its CURVE public key (z85); None on a link without keys


class HolderFailed(Exception):
    """This holder could not give a span: the next one is asked."""


def store_path(manifest: Manifest) -> Path:
    return meshnet_home() / "models" / "mesh" / manifest.sha256 / manifest.filename


class Fetch:
    def __init__(self, manifest: Manifest, holders: list[HolderAddress], keys: KeyPair | None,
                 coordinator: str = "", path: Path | None = None, silence_s: float = SILENCE_S):
        self.manifest = manifest
        # a holder bound to every interface is reached on the coordinator's host
        self.holders = [HolderAddress(reachable(h.endpoint, coordinator) if coordinator else h.endpoint, h.key)
                        for h in holders]
        self.keys = keys
        self.silence_s = silence_s
        self.path = Path(path or store_path(manifest))
        self.state_path = self.path.with_name(self.path.name + STATE_SUFFIX)
        self.have = self._prepare()
        self._saved_at = 0.0
        self._unsaved = False
        self.fetched_bytes = 0          # over the wire, this process
        self.seconds = 0.0
        self.failures: list[str] = []   # each holder given up, and why

    # the file and what of it is here

    def _prepare(self) -> set[str]:
        """The sparse file at its full size, and the spans already checked in it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        have: set[str] = set()
        try:
            state = json.loads(self.state_path.read_text())
            if state.get("sha256") == self.manifest.sha256 and self.path.stat().st_size == self.manifest.file_bytes:
                have = set(state.get("have", []))
        except (OSError, ValueError, AttributeError):
            pass   # nothing fetched yet, or a state this version cannot read: fetch again
        if not have:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                os.ftruncate(fd, 0)   # holes, not stale bytes of another attempt
                os.ftruncate(fd, self.manifest.file_bytes)
            finally:
                os.close(fd)
        return have

    def _save_state(self, now: bool = True) -> None:
        if not now and time.monotonic() - self._saved_at < STATE_EVERY_S:
            self._unsaved = True
            return
        self._saved_at, self._unsaved = time.monotonic(), False
        tmp = self.state_path.with_name(self.state_path.name + ".tmp")
        tmp.write_text(json.dumps({"sha256": self.manifest.sha256, "have": sorted(self.have)}))
        os.replace(tmp, self.state_path)

    def missing(self, spans: list[Span]) -> list[Span]:
        return [s for s in spans if s.name not in self.have]

    def disk_bytes(self) -> int:
        """What the sparse file takes on disk: its blocks, not its length."""
        return self.path.stat().st_blocks * 512

    # the fetch

    def run(self, spans: list[Span], progress: Callable[[int, int], None] | None = None) -> None:
        """Fetch and check every span of SPANS not here yet; FETCH_FAILED when no holder
        could give them all, naming each holder's failure."""
        wanted = self.missing(spans)
        total = sum(s.size for s in wanted)
        done = [0]

        def advanced(n: int) -> None:
            done[0] += n
            if progress is not None:
                progress(done[0], total)
        began = time.monotonic()
        for holder in self.holders:
            if not wanted:
                break
            try:
                self._from(holder, wanted, advanced)
            except HolderFailed as e:
                self.failures.append(f"{holder.endpoint}: {e}")
                log.warning("fetch: %s failed (%s); %s", holder.endpoint, e,
                            "asking the next holder" if holder is not self.holders[-1] else "no holder is left")
            wanted = self.missing(wanted)
        self.seconds += time.monotonic() - began
        if wanted:
            why = "; ".join(self.failures) or "the mesh has no holder of this model's bytes"
            raise MeshnetError(E.FETCH_FAILED, f"{len(wanted)} of the model's spans ({sum(s.size for s in wanted)} "
                               f"bytes) could not be fetched: {why}")

    def _from(self, holder: HolderAddress, spans: list[Span], advanced: Callable[[int], None]) -> None:
        """Every span of SPANS from one holder, WINDOW requests in flight; HolderFailed at
        its first failure (what was checked before it stays)."""
        chunks = ((span, offset, min(CHUNK, span.offset + span.size - offset))
                  for span in spans for offset in range(span.offset, span.offset + max(span.size, 1), CHUNK))
        in_flight: collections.deque = collections.deque()
        digests: dict[str, hashlib._Hash] = {}
        rid = 0
        ctx = zmq.Context()
        sock = _to_holder(ctx, holder.endpoint, holder.key, self.keys, CHUNK + 2 * P.MAX_HEADER_BYTES)
        fd = os.open(self.path, os.O_WRONLY)
        try:
            pending = next(chunks, None)
            while pending is not None or in_flight:
                while pending is not None and len(in_flight) < WINDOW:
                    span, offset, length = pending
                    if length == 0:   # an empty tensor: nothing to ask for
                        self._checked(span, hashlib.sha256())
                    else:
                        rid += 1
                        sock.send_multipart(P.encode(P.FETCH, rid, offset=offset, length=length))
                        in_flight.append((rid, span, offset, length))
                    pending = next(chunks, None)
                if not in_flight:
                    continue
                if not sock.poll(int(self.silence_s * 1000)):
                    raise HolderFailed(f"no answer within {self.silence_s:.0f} s")
                frames, why = P.recv_frames(sock, 2, CHUNK + P.MAX_HEADER_BYTES)
                if why is not None:
                    raise HolderFailed(why)
                try:
                    msg = P.decode(frames, CHUNK)
                except P.ProtocolError as e:
                    raise HolderFailed(f"a malformed answer: {e}") from None
                want_rid, span, offset, length = in_flight.popleft()
                if msg.type == P.ERROR:
                    raise HolderFailed(f"[{msg['code']}] {msg['message']}")
                if msg.rid != want_rid or msg.get("offset") != offset or msg.payload is None \
                        or len(msg.payload) != length:
                    raise HolderFailed(f"an answer that is not the bytes [{offset}, {offset + length}) asked for")
                os.pwrite(fd, msg.payload, offset)
                digest = digests.setdefault(span.name, hashlib.sha256())
                digest.update(msg.payload)
                self.fetched_bytes += length
                advanced(length)
                if offset + length == span.offset + span.size:
                    self._checked(span, digests.pop(span.name))
        finally:
            os.close(fd)
            sock.close(linger=0)
            ctx.term()
            if self._unsaved:
                self._save_state()

    def _checked(self, span: Span, digest) -> None:
        if digest.hexdigest() != span.sha256:
            raise HolderFailed(f"{span.name} does not have the manifest's sha256 (the holder's copy is corrupt)")
        self.have.add(span.name)
        self._save_state(now=False)


def _to_holder(ctx: zmq.Context, endpoint: str, key: bytes | None, keys: KeyPair | None,
               max_frame: int) -> zmq.Socket:
    """A DEALER connected to a holder, CURVE to its KEY where both sides have keys."""
    sock = sockets.fetch_dealer(ctx, max_frame=max_frame)
    if keys is not None and key is not None:
        security.client(sock, keys, key)
    sock.connect(endpoint)
    return sock


def fetch_manifest(holders: list[HolderAddress], keys: KeyPair | None, coordinator: str, sha256: str,
                   timeout: float = SILENCE_S) -> Manifest:
    """The manifest of the model SHA256 from the first holder that gives one."""
    failures = []
    for holder in holders:
        endpoint = reachable(holder.endpoint, coordinator) if coordinator else holder.endpoint
        ctx, sock = zmq.Context(), None
        try:
            sock = _to_holder(ctx, endpoint, holder.key, keys, P.MAX_FETCH_BYTES * 32)
            sock.send_multipart(P.encode(P.MANIFEST, 1))
            if not sock.poll(int(timeout * 1000)):
                failures.append(f"{endpoint}: no answer within {timeout:.0f} s")
                continue
            msg = P.decode(sock.recv_multipart(copy=False), P.MAX_FETCH_BYTES * 32)
            if msg.type == P.ERROR or msg.payload is None:
                failures.append(f"{endpoint}: {msg.get('message', 'no manifest')}")
                continue
            manifest = Manifest.from_wire(msg.payload)
            if manifest.sha256 != sha256:
                failures.append(f"{endpoint}: it holds model {manifest.sha256[:12]}, not {sha256[:12]}")
                continue
            return manifest
        except (MeshnetError, zmq.ZMQError) as e:
            failures.append(f"{endpoint}: {e}")
        finally:
            if sock is not None:
                sock.close(linger=0)
            ctx.term()
    raise MeshnetError(E.FETCH_FAILED, "no holder gave the model's manifest: " + ("; ".join(failures) or
                                                                                "the mesh names no holder"))


def holders_of(coordinator: str, keys: KeyPair | None, coordinator_key: bytes | None,
               timeout: float = SILENCE_S) -> tuple[str | None, list[HolderAddress]]:
    """Ask the coordinator (HOLDERS) which model it routes and who serves its bytes. It is
    also the first word a joining worker has with it: a token the coordinator does not
    admit fails here, with join_refused, instead of a worker that waits forever."""
    from zmq.utils.monitor import recv_monitor_message

    ctx = zmq.Context()
    sock = sockets.fetch_dealer(ctx, max_frame=2 * P.MAX_HEADER_BYTES)
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
                msg = P.decode(sock.recv_multipart(copy=False), 0)
                if msg.type != P.OK:
                    raise MeshnetError(msg.get("code", E.INTERNAL), f"the coordinator at {coordinator} would not say "
                                       f"who holds the model: {msg.get('message')}")
                info = msg.get("info") or {}
                holders = info.get("holders")
                if not isinstance(holders, list) or not all(
                        isinstance(h, list) and len(h) == 2 and isinstance(h[0], str) for h in holders):
                    raise MeshnetError(E.FETCH_FAILED, "the coordinator's list of holders is malformed")
                return info.get("model_sha256"), [HolderAddress(h[0], h[1].encode() if h[1] else None)
                                                  for h in holders]
        raise MeshnetError(E.UNREACHABLE, f"no coordinator answered at {coordinator} within {timeout:.0f} s")
    except P.ProtocolError as e:
        raise MeshnetError(E.FETCH_FAILED, f"the coordinator at {coordinator} answered with {e}") from None
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
        ctx.term()
