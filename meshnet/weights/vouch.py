"""The coordinator's word on its model's bytes (its answer to HOLDERS): the manifest it
vouches for, and the holders that answer.

The rule: a coordinator vouches only for a manifest it computed from bytes whose sha256 it
checked itself. With its own --model that is its file (the manifest is computed once and
kept under $MESHNET_HOME/hashes). Without one, it streams the whole file once from a
holder that registered with the model, hashing every byte as it passes (nothing is kept
but the file's header, in a sparse file that is removed after): the whole file's sha256
must be the model's, and each tensor's hash is taken from those same bytes, so a holder
that serves a changed copy under the model's sha256 is refused (and no longer listed)
instead of believed. Until it vouches for one it sends no manifest, and a joining worker
waits (launch/joining.py). A holder's own MANIFEST is only the hint that says how long the
file is and where its header ends, both checked by the hash.

Each holder the coordinator lists is asked on a clock whether it still answers (a
HEARTBEAT); one that does not is left out of the list until it answers again.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import logging
import tempfile
import threading
import time
from typing import Callable

import zmq

from meshnet.core.errors import MeshnetError
from meshnet.core.home import meshnet_home
from meshnet.net import protocol as P
from meshnet.net.addresses import reachable
from meshnet.net.security import KeyPair
from meshnet.weights import manifest as manifests
from meshnet.weights.fetch import SILENCE_S, HolderAddress, HolderFailed, _to_holder, stream
from meshnet.weights.manifest import HEADER, Manifest, Span

log = logging.getLogger("meshnet.weights.vouch")

PROBE_S = 2.0            # how often each listed holder is asked whether it still answers ...
PROBE_TIMEOUT_S = 5.0    # ... and how long it has to answer before it is left out of the list
# a GGUF header held in memory while it is read, at most: the largest vocabularies take a
# few tens of MiB (a holder's manifest claiming more is refused, not read)
MAX_HEADER_READ = 256 << 20
GIVEN_REMEMBERED = 4096  # connections remembered as given the manifest: each is sent it once, so a peer
                         # that asks again and again without reading queues small answers, not manifests


class NotTheModel(Exception):
    """A holder whose bytes are not the model's (or not a GGUF): never listed again."""


class Voucher:
    """The answer to HOLDERS, kept by the coordinator's I/O thread (answer) and a thread of
    its own that probes the holders and, without a file of the coordinator's, vouches."""

    def __init__(self, keys: KeyPair | None, sha256: str | None = None, own: tuple[str, str | None] | None = None,
                 probe_s: float = PROBE_S, probe_timeout_s: float = PROBE_TIMEOUT_S):
        self.keys = keys
        self.sha256 = sha256          # the model, when the coordinator has its file
        # that file's manifest, as this host's holder computed it from the file whose sha256 it
        # checked and kept it (manifest.of_file); without it kept, the thread hashes the file anew
        manifest = manifests.cached(sha256) if sha256 is not None else None
        self.own = HolderAddress(own[0], own[1].encode() if own[1] else None) if own is not None else None
        self.probe_s, self.probe_timeout_s = probe_s, probe_timeout_s
        self._lock = threading.Lock()
        self._manifest = manifest
        self._wire = manifest.to_wire() if manifest is not None else None
        self._model: str | None = sha256
        self._holders: list[HolderAddress] = [self.own] if self.own is not None else []
        self._silent: set[str] = set()
        self._refused: dict[str, str] = {}
        self._checking: tuple[int, int] | None = None
        self._given: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def answer(self, identity: bytes, registered: list[tuple[str, str | None, str]]) -> tuple[dict, bytes | None]:
        """HOLDERS asked on connection IDENTITY, the workers that serve their file being
        REGISTERED as (endpoint, public key, model sha256): (the OK's info, its payload)."""
        with self._lock:
            model = self.sha256 or next((sha for _, _, sha in registered), None)
            self._model = model
            self._holders = ([self.own] if self.own is not None else []) + [
                HolderAddress(endpoint, key.encode() if key else None) for endpoint, key, sha in registered
                if sha == model]
            listed = [h for h in self._holders if h.endpoint not in self._silent and h.endpoint not in self._refused]
            info: dict = {"model_sha256": model,
                          "holders": [[h.endpoint, h.key.decode() if h.key else None] for h in listed]}
            payload = None
            vouched = self._manifest is not None and self._manifest.sha256 == model
            if vouched and identity not in self._given:
                payload = self._wire
                self._given[identity] = None
                while len(self._given) > GIVEN_REMEMBERED:
                    self._given.popitem(last=False)
            elif not vouched:
                if self._checking is not None:
                    info["checking"] = list(self._checking)
                if self._refused:
                    info["why"] = "; ".join(f"{endpoint}: {why}" for endpoint, why in self._refused.items())
            if self._thread is None and self._holders:
                self._thread = threading.Thread(target=self._run, name="meshnet-voucher", daemon=True)
                self._thread.start()
        if not vouched:
            self._wake.set()
        return info, payload

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=self.probe_timeout_s + 5)

    # ---- its thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                model, holders, manifest = self._model, list(self._holders), self._manifest
            try:
                if model is not None and (manifest is None or manifest.sha256 != model):
                    self._vouch(model, holders)
                self._probe(holders)
            except Exception:   # a bug here must not end the probing for good
                log.exception("coordinator: checking the holders failed")
            self._wake.wait(self.probe_s)
            self._wake.clear()

    def _vouch(self, model: str, holders: list[HolderAddress]) -> None:
        manifest = manifests.cached(model)
        hinted = []
        for i, holder in enumerate(holders if manifest is None else []):
            with self._lock:
                if holder.endpoint in self._refused:
                    continue
            try:
                hinted.append((self._reached(holder), hint_of(self._reached(holder), self.keys, model), i, holder))
            except NotTheModel as e:
                self._refuse(holder, e)
            except (HolderFailed, MeshnetError, zmq.ZMQError) as e:
                log.warning("coordinator: holder %s gave no manifest to start from: %s", holder.endpoint, e)
        # the shortest claim first: a holder that claims a longer file than another's is hashed
        # only after the shorter one, so that a false claim costs at most the true file's length
        for reached, hint, _, holder in sorted(hinted, key=lambda h: (h[1].file_bytes, h[2])):
            if self._stop.is_set():
                break
            log.info("coordinator: hashing the model's bytes from holder %s, to vouch for them", holder.endpoint)
            try:
                manifest = check_holder(reached, self.keys, model, hint, progress=self._progress)
                break
            except NotTheModel as e:
                self._refuse(holder, e)
            except (HolderFailed, MeshnetError, zmq.ZMQError) as e:
                log.warning("coordinator: could not hash the model's bytes from holder %s: %s", holder.endpoint, e)
            finally:
                with self._lock:
                    self._checking = None
        if manifest is not None:
            manifests.remember(manifest)
            with self._lock:
                self._manifest, self._wire = manifest, manifest.to_wire()
            log.info("coordinator: vouches for model %s (%d tensors)", model[:12], len(manifest.tensors))

    def _refuse(self, holder: HolderAddress, why: NotTheModel) -> None:
        log.warning("coordinator: holder %s is refused and no longer listed: %s", holder.endpoint, why)
        with self._lock:
            self._refused[holder.endpoint] = str(why)

    def _progress(self, done: int, total: int) -> None:
        if self._stop.is_set():   # a coordinator that closes does not wait for the rest of a file
            raise HolderFailed("the coordinator is closing")
        with self._lock:
            self._checking = (done, total)

    def _reached(self, holder: HolderAddress) -> HolderAddress:
        # this host's own holder may be bound to every interface: reach it on loopback
        return HolderAddress(reachable(holder.endpoint, "tcp://127.0.0.1:0"), holder.key)

    def _probe(self, holders: list[HolderAddress]) -> None:
        """A HEARTBEAT to each holder at once; those without an answer in probe_timeout_s
        are left out of the list, those that answer are put back."""
        if not holders:
            return
        ctx = zmq.Context()
        asked: dict[zmq.Socket, HolderAddress] = {}
        try:
            for holder in holders:
                sock = _to_holder(ctx, self._reached(holder).endpoint, holder.key, self.keys,
                                  2 * P.MAX_HEADER_BYTES)
                sock.send_multipart(P.encode(P.HEARTBEAT, 1), flags=zmq.NOBLOCK)
                asked[sock] = holder
            answered = _answers(asked, self.probe_timeout_s)
        finally:
            for sock in asked:
                sock.close(linger=0)
            ctx.term()
        with self._lock:
            for holder in holders:
                if holder.endpoint in answered and holder.endpoint in self._silent:
                    log.info("coordinator: holder %s answers again", holder.endpoint)
                    self._silent.discard(holder.endpoint)
                elif holder.endpoint not in answered and holder.endpoint not in self._silent:
                    log.warning("coordinator: holder %s does not answer; it is not listed until it does",
                                holder.endpoint)
                    self._silent.add(holder.endpoint)


def _answers(asked: dict, timeout: float) -> set[str]:
    poller = zmq.Poller()
    for sock in asked:
        poller.register(sock, zmq.POLLIN)
    answered: set[str] = set()
    deadline = time.monotonic() + timeout
    while len(answered) < len(asked) and (left := deadline - time.monotonic()) > 0:
        for sock, _ in poller.poll(int(left * 1000) + 1):
            frames, why = P.recv_frames(sock, 2, 2 * P.MAX_HEADER_BYTES)
            poller.unregister(sock)
            with contextlib.suppress(P.ProtocolError):
                if why is None and P.decode(frames, 0).type == P.OK:
                    answered.add(asked[sock].endpoint)
    return answered


def hint_of(holder: HolderAddress, keys: KeyPair | None, sha256: str, timeout: float = SILENCE_S) -> Manifest:
    """The holder's own MANIFEST: trusted for nothing, read for the file's length and where
    its header ends (the whole file's hash then checks both); NotTheModel when it is not a
    manifest of model SHA256 within the bounds."""
    ctx = zmq.Context()
    sock = _to_holder(ctx, holder.endpoint, holder.key, keys, manifests.MAX_WIRE_BYTES + P.MAX_HEADER_BYTES)
    try:
        sock.send_multipart(P.encode(P.MANIFEST, 1))
        if not sock.poll(int(timeout * 1000)):
            raise HolderFailed(f"no manifest within {timeout:.0f} s")
        try:
            msg = P.decode(sock.recv_multipart(copy=False), manifests.MAX_WIRE_BYTES)
        except P.ProtocolError as e:
            raise HolderFailed(f"a malformed answer: {e}") from None
        if msg.type != P.OK or msg.payload is None:
            raise HolderFailed(f"no manifest: {msg.get('message')}")
        try:
            hint = Manifest.from_wire(msg.payload)
        except MeshnetError as e:
            raise NotTheModel(f"its own manifest: {e.message}") from None
    finally:
        sock.close(linger=0)
        ctx.term()
    if hint.sha256 != sha256:
        raise NotTheModel(f"it serves model {hint.sha256[:12]}, not {sha256[:12]}")
    if hint.header.size > MAX_HEADER_READ:
        raise NotTheModel(f"its manifest claims a header of {hint.header.size} bytes, over the {MAX_HEADER_READ}-byte "
                          "bound of a GGUF header")
    return hint


def check_holder(holder: HolderAddress, keys: KeyPair | None, sha256: str, hint: Manifest,
                 progress: Callable[[int, int], None] | None = None, silence_s: float = SILENCE_S) -> Manifest:
    """The manifest of model SHA256 computed from HOLDER's bytes, streamed once and hashed
    whole, starting from its HINT (hint_of): NotTheModel when they are not the model's
    (their sha256 differs, or they are not a GGUF whose tensors lie in order inside the file)."""
    header = bytearray()
    with contextlib.closing(stream(holder, keys, [(None, 0, hint.header.size)], silence_s)) as chunks:
        for _, _, data in chunks:
            header += data
    home = meshnet_home() / "tmp"
    home.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=home, suffix=".gguf") as sparse:
        sparse.write(header)
        sparse.truncate(hint.file_bytes)
        sparse.flush()
        try:
            found = manifests.layout(sparse.name)
        except Exception as e:   # the GGUF reader raises many kinds on bytes that are not a GGUF
            raise NotTheModel(f"its header is not a GGUF header ({type(e).__name__})") from None
    if found.data_start > len(header):
        raise NotTheModel("its manifest says the header ends before the GGUF header does")
    hashing = _SpanHashes([(HEADER, 0, found.data_start), *found.tensors])
    hashing.feed(0, header)
    total = hint.file_bytes
    if progress is not None:
        progress(len(header), total)
    with contextlib.closing(stream(holder, keys, [(None, len(header), total - len(header))], silence_s)) as chunks:
        for _, offset, data in chunks:
            hashing.feed(offset, data)
            if progress is not None:
                progress(offset + len(data), total)
    if hashing.whole.hexdigest() != sha256:
        raise NotTheModel(f"its bytes do not have the model's sha256 {sha256[:12]}: it serves a changed copy")
    spans = hashing.spans()
    manifest = Manifest(sha256=sha256, file_bytes=total, filename=hint.filename, n_layer=found.n_layer,
                        tied_embeddings=found.tied_embeddings, header=spans[0], tensors=tuple(spans[1:]))
    try:
        manifest.check()
    except MeshnetError as e:
        raise NotTheModel(e.message) from None
    return manifest


class _SpanHashes:
    """The whole file's sha256 and each span's, from the file's bytes fed in order."""

    def __init__(self, spans: list[tuple[str, int, int]]):
        self.layout = sorted(spans, key=lambda s: s[1])
        self.digests = [hashlib.sha256() for _ in self.layout]
        self.whole = hashlib.sha256()
        self.at = 0   # the first span not wholly fed yet

    def feed(self, offset: int, data) -> None:
        self.whole.update(data)
        end, view = offset + len(data), memoryview(data)
        i = self.at
        while i < len(self.layout):
            _, start, size = self.layout[i]
            if start >= end:
                break
            lo, hi = max(start, offset), min(start + size, end)
            if hi > lo:
                self.digests[i].update(view[lo - offset:hi - offset])
            if start + size > end:
                break   # it goes on in the next piece
            i += 1
        self.at = i
        # (spans that overlap another hash wrongly here, and Manifest.check refuses them)

    def spans(self) -> list[Span]:
        return [Span(name, start, size, digest.hexdigest())
                for (name, start, size), digest in zip(self.layout, self.digests)]
