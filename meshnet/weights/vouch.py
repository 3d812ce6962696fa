"""The coordinator's word on its model's bytes (its answer to HOLDERS): the manifest it
vouches for, and the holders that answer.

The rule: a coordinator vouches only for a manifest it computed from bytes whose sha256 it
checked itself. With its own --model that is its file (the manifest is computed once and
kept under $MESHNET_HOME/hashes). Without one, it streams the whole file once from a
holder that registered with the model, hashing every byte as it passes (nothing is kept
but the file's header, in memory): the whole file's sha256 must be the model's, and each
tensor's hash is taken from those same bytes, so a holder that serves a changed copy under
the model's sha256 is refused (and no longer listed) instead of believed. Until it vouches
for one it sends no manifest, and a joining worker waits (launch/joining.py). A holder's
own MANIFEST is only the hint that says how long the file is and where its header ends,
both checked by the hash.

What a holder can cost the coordinator is bounded: its header is read within the header's
bytes (manifest.layout_of), its stream must keep MIN_RATE (so a copy is hashed within its
length at MIN_RATE and PACE_SLACK_S more, or given up), and one that fails is asked again
only after a back-off that doubles.

Each holder the coordinator lists is asked on a clock, on a thread of its own (so that
hashing a copy, however long, never stops it), whether it still answers (a HEARTBEAT); one
that does not is left out of the list until it answers again.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import itertools
import logging
import threading
import time
from typing import Callable

import zmq

from meshnet.core.errors import MeshnetError
from meshnet.core.planner import format_size
from meshnet.engine.gguf_splits import model_identity
from meshnet.net import protocol as P
from meshnet.net.addresses import reachable
from meshnet.net.security import KeyPair
from meshnet.weights import manifest as manifests
from meshnet.weights.fetch import SILENCE_S, STOP_POLL_S, HolderAddress, HolderFailed, _to_holder, stream
from meshnet.weights.manifest import HEADER, Manifest, Span

log = logging.getLogger("meshnet.weights.vouch")

PROBE_S = 2.0            # how often each listed holder is asked whether it still answers ...
PROBE_TIMEOUT_S = 5.0    # ... and how long it has to answer before it is left out of the list
# the pace a holder streams its copy at, at least (the rate route/config.MIN_FETCH_RATE gives
# a fetching worker), once PACE_SLACK_S have passed for its connection and first bytes
MIN_RATE = 1 << 20
PACE_SLACK_S = 30.0
BACKOFF_S = 5.0          # a holder that failed is asked again after this, twice as long at each failure ...
MAX_BACKOFF_S = 300.0    # ... up to this
# holders considered (probed, listed) at once: an answer's header is bounded (protocol.MAX_HEADER_BYTES)
# and each costs a socket at each probe
MAX_HOLDERS = 64
REFUSED_REMEMBERED = 4096   # holders remembered as refused: each would be hashed again if forgotten
WHY_SHOWN = 4            # the latest refusals and failures a waiting worker is told ...
WHY_EACH = 300           # ... each cut to this many characters ...
MAX_WHY = 1024           # ... and all to this many
GIVEN_REMEMBERED = 4096  # connections remembered as given the manifest: each is sent it once, so a peer
                         # that asks again and again without reading queues small answers, not manifests


class NotTheModel(Exception):
    """A holder whose bytes are not the model's (or not a GGUF): never listed again."""


class Voucher:
    """The answer to HOLDERS, kept by the coordinator's I/O thread (answer), a thread that
    probes the holders and a thread that, without a file of the coordinator's, vouches."""

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
        self._probed = threading.Event()   # set once the holders were probed: only those that answer are hashed
        self._refused: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._why: collections.deque[str] = collections.deque(maxlen=WHY_SHOWN)
        self._backoff: dict[str, tuple[float, float]] = {}   # endpoint -> (not asked before, the last delay)
        self._checking: tuple[int, int] | None = None
        self._given: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def answer(self, identity: bytes, registered: list[tuple[str, str | None, str]]) -> tuple[dict, bytes | None]:
        """HOLDERS asked on connection IDENTITY, the workers that serve their file being
        REGISTERED as (endpoint, public key, model sha256): (the OK's info, its payload)."""
        with self._lock:
            model = self.sha256 or next((sha for _, _, sha in registered), None)
            self._model = model
            own = [self.own] if self.own is not None else []
            others = (HolderAddress(endpoint, key.encode() if key else None) for endpoint, key, sha in registered
                      if sha == model and endpoint not in self._refused)
            self._holders = own + list(itertools.islice(others, MAX_HOLDERS - len(own)))
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
                if self._why:
                    info["why"] = "; ".join(reversed(self._why))[:MAX_WHY]
            if not self._threads and self._holders:
                self._threads = [threading.Thread(target=self._probing, name="meshnet-voucher-probe", daemon=True),
                                 threading.Thread(target=self._run, name="meshnet-voucher", daemon=True)]
                for thread in self._threads:
                    thread.start()
        if not vouched:
            self._wake.set()
        return info, payload

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        for thread in self._threads:
            # each wait of its threads looks at _stop every STOP_POLL_S
            thread.join(timeout=10 * STOP_POLL_S + 5)

    # ---- the probing thread -------------------------------------------------------------

    def _probing(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                holders = list(self._holders)
            try:
                self._probe(holders)
            except Exception:   # a bug here must not end the probing for good
                log.exception("coordinator: probing the holders failed")
            self._probed.set()
            self._stop.wait(self.probe_s)

    def _probe(self, holders: list[HolderAddress]) -> None:
        """A HEARTBEAT to each holder at once; those without an answer in probe_timeout_s
        (or that cannot be connected to) are left out of the list, those that answer are put back."""
        if not holders:
            return
        answers = _ask_each([self._reached(h) for h in holders], self.keys, P.encode(P.HEARTBEAT, 1), 0,
                            self.probe_timeout_s, self._stop)
        if self._stop.is_set():
            return   # unanswered because it was cut short, not because they are silent
        answered = {h.endpoint for i, h in enumerate(holders)
                    if isinstance(answers[i], P.Message) and answers[i].type == P.OK}
        with self._lock:
            self._silent &= {h.endpoint for h in self._holders}   # those gone are forgotten
            for holder in holders:
                if holder.endpoint in answered and holder.endpoint in self._silent:
                    log.info("coordinator: holder %s answers again", holder.endpoint)
                    self._silent.discard(holder.endpoint)
                elif holder.endpoint not in answered and holder.endpoint not in self._silent:
                    log.warning("coordinator: holder %s does not answer; it is not listed until it does",
                                holder.endpoint)
                    self._silent.add(holder.endpoint)

    # ---- the vouching thread ------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.probe_s)
            self._wake.clear()
            with self._lock:
                model, holders, manifest = self._model, list(self._holders), self._manifest
            if self._stop.is_set() or not self._probed.is_set():
                continue
            if model is not None and (manifest is None or manifest.sha256 != model):
                try:
                    self._vouch(model, holders)
                except Exception:   # a bug here must not end the vouching for good
                    log.exception("coordinator: vouching for the model's bytes failed")
            # one round a probe period at most, however often waiting workers ask
            self._stop.wait(self.probe_s)

    def _vouch(self, model: str, holders: list[HolderAddress]) -> None:
        manifest = manifests.cached(model)
        if manifest is None:
            now = time.monotonic()
            with self._lock:
                self._backoff = {h.endpoint: self._backoff[h.endpoint] for h in holders if h.endpoint in self._backoff}
                asked = [h for h in holders if h.endpoint not in self._refused and h.endpoint not in self._silent
                         and self._backoff.get(h.endpoint, (0.0, 0.0))[0] <= now]
            # the shortest claim first: a holder that claims a longer file than another's is hashed
            # only after the shorter one, so that a false claim costs at most the true file's length
            for hint, _, holder in sorted(self._hints(model, asked), key=lambda h: (h[0].file_bytes, h[1])):
                if self._stop.is_set():
                    return
                log.info("coordinator: hashing the model's bytes from holder %s, to vouch for them", holder.endpoint)
                try:
                    manifest = check_holder(self._reached(holder), self.keys, model, hint, progress=self._progress,
                                            cancel=self._stop)
                    break
                except NotTheModel as e:
                    self._refuse(holder, e)
                except (HolderFailed, MemoryError) as e:
                    self._failed(holder, f"failed as its copy was hashed: {e}")
                finally:
                    with self._lock:
                        self._checking = None
        if manifest is not None:
            manifests.remember(manifest)
            with self._lock:
                self._manifest, self._wire = manifest, manifest.to_wire()
                self._backoff.clear()
            log.info("coordinator: vouches for model %s (%d tensors)", model[:12], len(manifest.tensors))

    def _hints(self, model: str, holders: list[HolderAddress]) -> list[tuple[Manifest, int, HolderAddress]]:
        """(hint, index, holder) of each of HOLDERS that gave a manifest of MODEL within the
        bounds, all asked at once; the others are refused or backed off."""
        answers = _ask_each([self._reached(h) for h in holders], self.keys, P.encode(P.MANIFEST, 1),
                            manifests.MAX_WIRE_BYTES, SILENCE_S, self._stop)
        hinted = []
        for i, holder in enumerate(holders):
            try:
                hinted.append((_hint(answers[i], model), i, holder))
            except NotTheModel as e:
                self._refuse(holder, e)
            except HolderFailed as e:
                if not self._stop.is_set():
                    self._failed(holder, f"gave no manifest to start from: {e}")
        return hinted

    def _refuse(self, holder: HolderAddress, why: NotTheModel) -> None:
        why = _printable(str(why))
        log.warning("coordinator: holder %s is refused and no longer listed: %s", holder.endpoint, why)
        with self._lock:
            self._refused[holder.endpoint] = None
            self._refused.move_to_end(holder.endpoint)
            while len(self._refused) > REFUSED_REMEMBERED:
                self._refused.popitem(last=False)
            self._why.append(f"{holder.endpoint}: {why}"[:WHY_EACH])

    def _failed(self, holder: HolderAddress, why: str) -> None:
        """HOLDER failed without proving its bytes are not the model's: asked again after a back-off."""
        why = _printable(why)
        with self._lock:
            delay = min(max(2 * self._backoff.get(holder.endpoint, (0.0, 0.0))[1], BACKOFF_S), MAX_BACKOFF_S)
            self._backoff[holder.endpoint] = (time.monotonic() + delay, delay)
            self._why.append(f"{holder.endpoint}: {why}"[:WHY_EACH])
        log.warning("coordinator: holder %s %s; asked again in %.0f s", holder.endpoint, why, delay)

    def _progress(self, done: int, total: int) -> None:
        with self._lock:
            self._checking = (done, total)

    def _reached(self, holder: HolderAddress) -> HolderAddress:
        # this host's own holder may be bound to every interface: reach it on loopback
        return HolderAddress(reachable(holder.endpoint, "tcp://127.0.0.1:0"), holder.key)


def _ask_each(holders: list[HolderAddress], keys: KeyPair | None, frames: list, max_payload: int, timeout: float,
              stop: threading.Event) -> list:
    """FRAMES sent to each of HOLDERS at once on a connection of its own, and what each
    answered within TIMEOUT, in order: a decoded P.Message, or the HolderFailed that says
    why none came (one that cannot be connected to fails alone). Cut short when STOP is set."""
    answers: list = [None] * len(holders)
    ctx = zmq.Context()
    asked: dict[zmq.Socket, int] = {}
    try:
        for i, holder in enumerate(holders):
            try:
                sock = _to_holder(ctx, holder.endpoint, holder.key, keys, max_payload + 2 * P.MAX_HEADER_BYTES)
                sock.send_multipart(frames, flags=zmq.NOBLOCK)
                asked[sock] = i
            except (HolderFailed, zmq.ZMQError) as e:
                answers[i] = e if isinstance(e, HolderFailed) else HolderFailed(f"cannot ask it: {e}")
        poller = zmq.Poller()
        for sock in asked:
            poller.register(sock, zmq.POLLIN)
        deadline = time.monotonic() + timeout
        while asked and (left := deadline - time.monotonic()) > 0 and not stop.is_set():
            for sock, _ in poller.poll(int(min(left, STOP_POLL_S) * 1000) + 1):
                i = asked.pop(sock)
                poller.unregister(sock)
                got, why = P.recv_frames(sock, 2, max_payload + P.MAX_HEADER_BYTES)
                try:
                    answers[i] = P.decode(got, max_payload) if why is None else HolderFailed(why)
                except P.ProtocolError as e:
                    answers[i] = HolderFailed(f"a malformed answer: {e}")
    finally:
        ctx.destroy(linger=0)
    return [a if a is not None else HolderFailed(f"no answer within {timeout:.0f} s") for a in answers]


def _printable(text: str) -> str:
    # a holder's words go into the coordinator's log and a waiting worker's: no escape forges a line there
    return "".join(c if c.isprintable() else "?" for c in text)


def _hint(answer, sha256: str) -> Manifest:
    """The holder's own MANIFEST, from its ANSWER: trusted for nothing, read for the file's
    length and where its header ends (the whole file's hash then checks both); NotTheModel
    when it is not a manifest of model SHA256 within the bounds (Manifest.check)."""
    if isinstance(answer, HolderFailed):
        raise answer
    if answer.type != P.OK or answer.payload is None:
        raise HolderFailed(f"no manifest: {answer.get('message')}")
    try:
        hint = Manifest.from_wire(answer.payload)
    except MeshnetError as e:
        raise NotTheModel(f"its own manifest: {e.message}") from None
    if hint.sha256 != sha256:
        raise NotTheModel(f"it serves model {hint.sha256[:12]}, not {sha256[:12]}")
    return hint


class _Pace:
    """A holder's stream of TOTAL bytes keeps MIN_RATE once PACE_SLACK_S have passed: it is
    then done within TOTAL / MIN_RATE + PACE_SLACK_S, or given up as soon as it falls behind."""

    def __init__(self, total: int):
        self.total, self.began = total, time.monotonic()

    def check(self, done: int) -> None:
        elapsed = time.monotonic() - self.began
        if done < (elapsed - PACE_SLACK_S) * MIN_RATE:
            raise HolderFailed(f"it streamed {format_size(done)} of {format_size(self.total)} in {elapsed:.0f} s, "
                               f"under the {MIN_RATE / (1 << 20):g} MiB/s a holder keeps")


def check_holder(holder: HolderAddress, keys: KeyPair | None, sha256: str, hint: Manifest,
                 progress: Callable[[int, int], None] | None = None, silence_s: float = SILENCE_S,
                 cancel: threading.Event | None = None) -> Manifest:
    """The manifest of model SHA256 computed from HOLDER's bytes, streamed once and hashed
    whole, starting from its HINT (_hint): NotTheModel when they are not the model's (their
    sha256 differs, or they are not a GGUF whose tensors lie in order inside the file);
    HolderFailed when the holder fails, falls below MIN_RATE, or CANCEL is set. A model of
    several files is streamed file by file, each from its own header, and its sha256 is the
    one over the files' (engine/gguf_splits.model_identity)."""
    total = hint.file_bytes
    pace = _Pace(total)
    header_sizes = {s.offset: s.size for s in (hint.header, *hint.tensors) if manifests.is_header(s.name)}
    spans: list[Span] = []
    file_hashes: list[str] = []
    first = None
    for i, (_, base, size) in enumerate(hint.files()):
        found, hashing = _check_file(holder, keys, i, base, size, header_sizes.get(base, 0), pace, progress,
                                     silence_s, cancel)
        first = first or found
        spans += hashing.spans()
        file_hashes.append(hashing.whole.hexdigest())
    if model_identity(file_hashes) != sha256:
        raise NotTheModel(f"its bytes do not have the model's sha256 {sha256[:12]}: it serves a changed copy")
    manifest = Manifest(sha256=sha256, file_bytes=total, filename=hint.filename, n_layer=first.n_layer,
                        tied_embeddings=not any(s.name.startswith("output.") for s in spans), header=spans[0],
                        tensors=tuple(spans[1:]), splits=hint.splits)
    try:
        manifest.check()
    except MeshnetError as e:
        raise NotTheModel(e.message) from None
    return manifest


def _check_file(holder: HolderAddress, keys: KeyPair | None, index: int, base: int, size: int, header_size: int,
                pace: "_Pace", progress: Callable[[int, int], None] | None, silence_s: float,
                cancel: threading.Event | None) -> tuple[manifests.Layout, "_SpanHashes"]:
    """The layout of the model's file INDEX (SIZE bytes from BASE in the concatenation) and
    its spans' and its own hashes, from its header (HEADER_SIZE bytes, the hint's word) on."""
    header = bytearray()
    with contextlib.closing(stream(holder, keys, [(None, base, header_size)], silence_s, cancel)) as chunks:
        for _, _, data in chunks:
            header += data
            pace.check(base + len(header))
    try:
        found = manifests.layout_of(header, size, index == 0)
    except MeshnetError as e:   # not a GGUF header within the bounds: these bytes are not the model's
        raise NotTheModel(f"its header{f' of split {index + 1}' if index else ''}: {e.message}") from None
    except MemoryError:   # this machine's trouble, not proof of the holder's bytes
        raise HolderFailed("this machine had no memory to read its header") from None
    if found.data_start > len(header):
        raise NotTheModel("its manifest says the header ends before the GGUF header does")
    hashing = _SpanHashes([(HEADER if index == 0 else f"<header {index + 1}>", base, found.data_start),
                           *((name, base + offset, n) for name, offset, n in found.tensors)])
    hashing.feed(base, header)
    if progress is not None:
        progress(base + len(header), pace.total)
    with contextlib.closing(stream(holder, keys, [(None, base + len(header), size - len(header))], silence_s,
                                   cancel)) as chunks:
        for _, offset, data in chunks:
            hashing.feed(offset, data)
            pace.check(offset + len(data))
            if progress is not None:
                progress(offset + len(data), pace.total)
    return found, hashing


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
