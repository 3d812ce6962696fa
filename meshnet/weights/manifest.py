"""What a worker fetching part of a model file trusts each byte by: the file's sha256 and
size, the header's place and hash, and each tensor's place, size and sha256.

A model of several files (gguf-split) is described as their concatenation, in order: one
run of bytes whose spans each lie in one file, each file's header a span of its own (every
stage fetches every header: the engine opens every split), and the files' lengths, so that
a fetcher writes each span into its own file and a holder reads it from its own.

Only a coordinator vouches for a manifest, never a holder: it computes one from a file
whose sha256 it checked (its own --model, or a holder's bytes streamed once and hashed
whole, weights/vouch.py), and a worker takes it from the coordinator it authenticated with
the token's key. A manifest is kept under $MESHNET_HOME/hashes keyed by the file's sha256,
as the file's own hash is: it then stays what the file held when its sha256 was checked,
and a byte changed on a holder's disk later fails the fetcher's check instead of being
published anew.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import itertools
import os
import struct
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import msgpack

from meshnet.core import errors as E
from meshnet.core.errors import MeshnetError
from meshnet.core.home import meshnet_home
from meshnet.core.layers import LayerRange
from meshnet.engine.gguf_layout import stage_holds, tensor_role
from meshnet.engine.gguf_splits import SPLIT_NAME, split_name

HEADER = "<header>"          # the span of the GGUF header: metadata and tensor infos
MAX_TENSORS = 1 << 17
READ_CHUNK = 1 << 22
# a bound on the file a manifest describes: above the largest GGUF there is (about 1.5 TiB),
# far below the sizes at which a sparse file of that length is refused or costs metadata
MAX_FILE_BYTES = 1 << 42
# a GGUF header: the largest vocabularies and merge lists take under 20 MiB. The coordinator
# holds a holder's header in memory before its bytes are proven the model's, and every
# worker fetches it whole
MAX_HEADER_BYTES = 64 << 20
MAX_NAME = 512               # a tensor's name (GGUF's own limit is 64)
MAX_WIRE_BYTES = 32 << 20    # a manifest of MAX_TENSORS spans fits
MAX_SPLITS = 9999            # a model's files (gguf-split numbers them in 5 digits; the largest models take tens)


@dataclass(frozen=True)
class Span:
    """A run of the file's bytes the fetcher checks as one: a tensor's data, or the header."""
    name: str
    offset: int
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    sha256: str           # the whole file's: the model's identity and compatibility class
    file_bytes: int
    filename: str
    n_layer: int
    tied_embeddings: bool
    header: Span
    tensors: tuple[Span, ...]   # for a model of several files, the headers of the second and later too
    splits: tuple[int, ...] = ()   # each file's bytes, in order, for a model of several files (gguf-split)

    def spans_for(self, layers: LayerRange) -> list[Span]:
        """The headers and the tensors the stage LAYERS loads: its own layers, and the head's
        or tail's extra tensors (the engine's rule, engine/gguf_layout.stage_holds)."""
        return [self.header] + [t for t in self.tensors
                                if is_header(t.name)
                                or stage_holds(tensor_role(t.name), t.name, layers.start, layers.end, self.n_layer,
                                               self.tied_embeddings)]

    def headers(self) -> list[Span]:
        """Each file's header: the first file's, then each later split's."""
        return [self.header] + [t for t in self.tensors if is_header(t.name)]

    def files(self) -> list[tuple[str, int, int]]:
        """(name, first byte in the concatenation, bytes) of each of the model's files."""
        if not self.splits:
            return [(self.filename, 0, self.file_bytes)]
        prefix = SPLIT_NAME.match(self.filename)["prefix"]
        starts = itertools.accumulate(self.splits, initial=0)
        return [(split_name(prefix, i, len(self.splits)), start, size)
                for i, (start, size) in enumerate(zip(starts, self.splits))]

    def to_wire(self) -> bytes:
        body = asdict(self)
        body["tensors"] = [[t.name, t.offset, t.size, t.sha256] for t in self.tensors]
        body["header"] = [self.header.name, self.header.offset, self.header.size, self.header.sha256]
        body["splits"] = list(self.splits)
        return msgpack.packb(body, use_bin_type=True)

    @classmethod
    def from_wire(cls, raw) -> "Manifest":
        """A manifest as the coordinator sent it, checked field by field and as a whole: a
        bad one is refused whole, before any byte of the file is written."""
        try:
            body = msgpack.unpackb(bytes(raw), raw=False)
            tensors = body["tensors"]
            if not isinstance(tensors, list) or len(tensors) > MAX_TENSORS:
                raise ValueError("tensors")
            splits = body.get("splits", [])
            if not isinstance(splits, list) or len(splits) > MAX_SPLITS:
                raise ValueError("splits")
            manifest = cls(sha256=_hex(body["sha256"]), file_bytes=_count(body["file_bytes"]),
                           filename=_text(body["filename"]), n_layer=_count(body["n_layer"]),
                           tied_embeddings=bool(body["tied_embeddings"]), header=_span(body["header"]),
                           tensors=tuple(_span(t) for t in tensors), splits=tuple(_count(n) for n in splits))
        except (ValueError, TypeError, KeyError, IndexError, msgpack.ExtraData, msgpack.FormatError,
                msgpack.StackError):
            raise MeshnetError(E.FETCH_FAILED, "a manifest this version of meshnet cannot read") from None
        manifest.check()
        return manifest

    def check(self) -> None:
        """The rules that bound what a fetch of this manifest writes and prints: every span
        inside the file, the header at its start and within a GGUF header's bound, at most
        MAX_TENSORS tensors after it in order, none overlapping another (so no byte is
        fetched twice and the spans sum to at most the file), each name once and plain
        printable text, the file name a plain file name. The coordinator checks what it
        vouches for by these rules, as every worker checks what it is sent."""
        def refused(why: str):
            return MeshnetError(E.FETCH_FAILED, f"the manifest is refused: {why}")
        if self.file_bytes > MAX_FILE_BYTES:
            raise refused(f"a file of {self.file_bytes} bytes is over the {MAX_FILE_BYTES}-byte bound")
        if not _plain_filename(self.filename):
            raise refused("its file name is not a plain printable file name")
        if self.header.name != HEADER or self.header.offset != 0:
            raise refused("its first span is not the GGUF header at offset 0")
        if self.header.size > MAX_HEADER_BYTES:
            raise refused(f"a header of {self.header.size} bytes is over the {MAX_HEADER_BYTES}-byte bound of a GGUF "
                          "header")
        if len(self.tensors) > MAX_TENSORS:
            raise refused(f"{len(self.tensors)} tensors are over the bound of {MAX_TENSORS}")
        files = self._checked_files(refused)
        headers = {f"<header {i + 1}>": start for i, (_, start, _) in enumerate(files) if i}
        ends = [start + size for _, start, size in files]
        end, names = 0, set()
        for span in (self.header, *self.tensors):
            # printed in a failure's reason: plain printable text only
            if not 0 < len(span.name) <= MAX_NAME or not span.name.isprintable():
                raise refused(f"a tensor name is not 1 to {MAX_NAME} printable characters")
            if span.offset < end:
                raise refused(f"{span.name!r} overlaps the span before it or is out of order")
            end = span.offset + span.size
            if end > self.file_bytes:
                raise refused(f"{span.name!r} ends past the end of the {self.file_bytes}-byte file")
            if span.name in names:
                raise refused(f"{span.name!r} is named twice")
            names.add(span.name)
            if is_header(span.name) and span.name != HEADER:
                if headers.get(span.name) != span.offset:
                    raise refused(f"{span.name!r} is not the header at the start of its split")
                if span.size > MAX_HEADER_BYTES:
                    raise refused(f"{span.name!r} of {span.size} bytes is over the {MAX_HEADER_BYTES}-byte bound "
                                  "of a GGUF header")
            if span.size and bisect.bisect_right(ends, span.offset) != bisect.bisect_left(ends, end):
                raise refused(f"{span.name!r} runs over the end of its file into the next")
        if missing := set(headers) - names:
            raise refused(f"no span for {sorted(missing)[0]}: every split's header is fetched")

    def _checked_files(self, refused) -> list[tuple[str, int, int]]:
        if not self.splits:
            return self.files()
        m = SPLIT_NAME.match(self.filename)
        if not 2 <= len(self.splits) <= MAX_SPLITS or not m or int(m["no"]) != 1 \
                or int(m["count"]) != len(self.splits):
            raise refused(f"{len(self.splits)} splits under the name {self.filename!r}, which is not the first of "
                          "as many splits as llama.cpp names them")
        if sum(self.splits) != self.file_bytes or 0 in self.splits:
            raise refused(f"its splits' lengths do not add up to its {self.file_bytes} bytes")
        return self.files()


def is_header(name: str) -> bool:
    """Whether a span is a file's header (the first file's, or a later split's)."""
    return name == HEADER or (name.startswith("<header ") and name.endswith(">"))


def _hex(value) -> str:
    if not isinstance(value, str) or len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
        raise ValueError("sha256")
    return value


def _count(value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 62:
        raise ValueError("count")
    return value


def _text(value) -> str:
    if not isinstance(value, str):
        raise ValueError("text")
    return value


def _plain_filename(value: str) -> bool:
    # it names a file under MESHNET_HOME and is printed: a path in it would write elsewhere,
    # and a control character (an escape, a newline) would forge what the terminal shows
    return bool(value) and value.isprintable() and "/" not in value and "\\" not in value \
        and not value.startswith(".") and len(value) <= 255


def _span(value) -> Span:
    name, offset, size, sha = value
    return Span(_text(name), _count(offset), _count(size), _hex(sha))


def _sha256_of_range(fd: int, offset: int, size: int) -> str:
    digest = hashlib.sha256()
    done = 0
    while done < size:
        chunk = os.pread(fd, min(READ_CHUNK, size - done), offset + done)
        if not chunk:
            raise MeshnetError(E.TRUNCATED_GGUF, "the model file is shorter than its header says")
        digest.update(chunk)
        done += len(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class Layout:
    """What a GGUF's header says of its file: where the data starts, each tensor's
    (name, offset, size) in file order, and what spans_for needs."""
    data_start: int
    n_layer: int
    tied_embeddings: bool
    tensors: tuple[tuple[str, int, int], ...]


def layout(path: str | Path, first: bool = True) -> Layout:
    """The layout of the GGUF at PATH, read from its header (layout_of)."""
    with open(path, "rb") as f:
        return layout_of(f.read(MAX_HEADER_BYTES), os.fstat(f.fileno()).st_size, first)


def layout_of(header, file_bytes: int, first: bool = True) -> Layout:
    """The layout of a GGUF of FILE_BYTES bytes, from the bytes of its HEADER alone (what
    the gguf package's reader finds in the file); NOT_GGUF when they are not a GGUF header
    (version 2 or 3, little-endian) whose every count and length lies inside them.

    The coordinator reads a holder's header with it before the whole file's hash proves it
    the model's, so what it costs is bounded by the header's bytes: nothing is kept but
    the architecture, the block count, the alignment and the tensors (at most MAX_TENSORS,
    refused before one is read), and an array of strings is stepped over, never built. (The
    gguf package's reader makes objects for each value: a header of a million empty strings
    took it 22 s and 1.5 GiB.)

    A model's second and later splits (not FIRST) hold tensors and the split keys, not the
    model's metadata: their n_layer is 0."""
    return _Header(memoryview(header)).layout(file_bytes, first)


# GGUF's value types (gguf.GGUFValueType): the bytes of each fixed-size one, and how an integer one reads
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_INTEGER = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 10: "<Q", 11: "<q"}
_UINT32, _STRING, _ARRAY = 4, 8, 9
_MAX_NESTING = 4      # arrays of arrays: GGUF's writers make none deeper than two
_MAX_DIMS = 4         # GGML_MAX_DIMS: llama.cpp loads no tensor of more
_BLOCK_COUNTS = 16    # "ARCH.block_count" keys kept before the architecture is known (a model has one)
_MAX_KV = 1 << 16     # metadata keys: a model has a few dozen
_U64 = struct.Struct("<Q")


def _not_gguf(why: str) -> MeshnetError:
    return MeshnetError(E.NOT_GGUF, f"not a GGUF header: {why}")


class _Header:
    """A GGUF header read front to back; each read lies inside the bytes or is NOT_GGUF."""

    def __init__(self, data: memoryview):
        self.data, self.at = data, 0

    def _take(self, n: int) -> int:
        start = self.at
        if start + n > len(self.data):
            raise _not_gguf(f"a value runs past the header's {len(self.data)} bytes (it is cut short, or a count "
                            "or a length in it is false)")
        self.at = start + n
        return start

    def _read(self, fmt: str) -> int:
        return struct.unpack_from(fmt, self.data, self._take(struct.calcsize(fmt)))[0]

    def _string(self) -> memoryview:
        n = self._read("<Q")
        start = self._take(n)
        return self.data[start:start + n]

    def _text(self, what: str) -> str:
        try:
            return str(self._string(), "utf-8")
        except UnicodeDecodeError:
            raise _not_gguf(f"{what} is not UTF-8") from None

    def _skip(self, vtype: int, depth: int = 0) -> None:
        if vtype in _SCALAR_BYTES:
            self._take(_SCALAR_BYTES[vtype])
        elif vtype == _STRING:
            self._take(self._read("<Q"))
        elif vtype == _ARRAY and depth < _MAX_NESTING:
            itype, count = self._read("<I"), self._read("<Q")
            if itype in _SCALAR_BYTES:
                self._take(count * _SCALAR_BYTES[itype])
            elif itype == _STRING:
                self._skip_strings(count)
            else:
                for _ in range(count):   # each takes 12 bytes at least: the header's end ends a false count
                    self._skip(itype, depth + 1)
        elif vtype == _ARRAY:
            raise _not_gguf(f"arrays nested deeper than {_MAX_NESTING}")
        else:
            raise _not_gguf(f"a value of unknown type {vtype}")

    def _skip_strings(self, count: int) -> None:
        # the one loop a header's bytes can make long (8 bytes a string): kept to a step each
        data, at, end, unpack = self.data, self.at, len(self.data), _U64.unpack_from
        for _ in range(count):
            if at + 8 > end:
                break
            at += 8 + unpack(data, at)[0]
        else:
            if at <= end:
                self.at = at
                return
        raise _not_gguf("an array of strings runs past the header's end")

    def layout(self, file_bytes: int, first: bool = True) -> Layout:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        if bytes(self.data[:4]) != b"GGUF":
            raise _not_gguf("no GGUF magic")
        self._take(4)
        version = self._read("<I")
        if version not in (2, 3):
            raise _not_gguf(f"version {version} (2 and 3 are read, little-endian)")
        n_tensors, n_kv = self._read("<Q"), self._read("<Q")
        if n_tensors > MAX_TENSORS:
            raise _not_gguf(f"it claims {n_tensors} tensors, over the bound of {MAX_TENSORS}")
        if n_kv > _MAX_KV:
            raise _not_gguf(f"it claims {n_kv} metadata keys, over the bound of {_MAX_KV}")
        arch, alignment, block_counts = None, 32, {}
        for _ in range(n_kv):
            key = self._string()
            vtype = self._read("<I")
            if key == b"general.architecture" and vtype == _STRING:
                if arch is not None:
                    raise _not_gguf("general.architecture is given twice")
                arch = self._text("general.architecture")
            elif key == b"general.alignment":
                if vtype != _UINT32:
                    raise _not_gguf("general.alignment is not a uint32")
                alignment = self._read("<I")
                if alignment == 0 or alignment & (alignment - 1):
                    raise _not_gguf(f"an alignment of {alignment}, not a power of two")
            elif key[-12:] == b".block_count" and vtype in _INTEGER and len(block_counts) < _BLOCK_COUNTS:
                key = bytes(key)
                if key in block_counts:
                    raise _not_gguf(f"{key[:64]!r} is given twice")
                block_counts[key] = self._read(_INTEGER[vtype])
            else:
                self._skip(vtype)
        if arch is None and first:
            raise _not_gguf("no general.architecture")
        n_layer = block_counts.get(f"{arch}.block_count".encode()) if arch is not None else 0
        if n_layer is None or n_layer < 0:
            raise _not_gguf(f"no {arch[:64]!r}.block_count")
        infos, names = [], set()
        for _ in range(n_tensors):
            name = self._text("a tensor's name")
            if name in names:
                raise _not_gguf(f"the tensor {name[:64]!r} is named twice")
            names.add(name)
            n_dims = self._read("<I")
            if n_dims > _MAX_DIMS:
                raise _not_gguf(f"a tensor of {n_dims} dimensions (at most {_MAX_DIMS})")
            dims = struct.unpack_from(f"<{n_dims}Q", self.data, self._take(8 * n_dims))
            ggml_type, offset = self._read("<I"), self._read("<Q")
            try:
                block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
            except (ValueError, KeyError):
                raise _not_gguf(f"a tensor of unknown type {ggml_type}") from None
            n_elements = 1
            for d in dims:
                n_elements *= d
            infos.append((name, offset, n_elements * type_size // block_size))
        data_start = self.at + (-self.at % alignment)
        tensors = sorted(((name, data_start + offset, size) for name, offset, size in infos), key=lambda t: t[1])
        return Layout(data_start=tensors[0][1] if tensors else file_bytes, n_layer=n_layer,
                      tied_embeddings=not any(name.startswith("output.") for name, _, _ in tensors),
                      tensors=tuple(tensors))


def model_files(path: str | Path) -> list[Path]:
    """The files of the model whose (first) file is PATH: [PATH], or its splits in order."""
    from meshnet.engine.gguf_layout import read_layout

    return [Path(f.path) for f in read_layout(path).files]


def compute(path: str | Path, sha256: str) -> Manifest:
    """The manifest of the GGUF model at PATH (its first file), whose sha256 the caller
    checked: one read of each of its files."""
    files = model_files(path)
    spans, sizes, first = [], [], None
    for i, file in enumerate(files):
        found = layout(file, first=i == 0)
        first = first or found
        base = sum(sizes)
        fd = os.open(file, os.O_RDONLY)
        try:
            spans.append(Span(HEADER if i == 0 else f"<header {i + 1}>", base, found.data_start,
                              _sha256_of_range(fd, 0, found.data_start)))
            spans += [Span(name, base + offset, size, _sha256_of_range(fd, offset, size))
                      for name, offset, size in found.tensors]
            sizes.append(os.fstat(fd).st_size)
        finally:
            os.close(fd)
    manifest = Manifest(sha256=sha256, file_bytes=sum(sizes), filename=files[0].name, n_layer=first.n_layer,
                        tied_embeddings=not any(s.name.startswith("output.") for s in spans), header=spans[0],
                        tensors=tuple(spans[1:]), splits=tuple(sizes) if len(files) > 1 else ())
    manifest.check()   # one no worker would take is not served, nor vouched for
    return manifest


def _cache_path(sha256: str) -> Path:
    return meshnet_home() / "hashes" / f"tensors-{sha256}.msgpack"


def cached(sha256: str) -> Manifest | None:
    """The manifest this host computed before for the file SHA256, if it kept one."""
    try:
        manifest = Manifest.from_wire(_cache_path(sha256).read_bytes())
    except (OSError, MeshnetError):
        return None
    return manifest if manifest.sha256 == sha256 else None


def remember(manifest: Manifest) -> None:
    cache = _cache_path(manifest.sha256)
    tmp = None
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache.parent, prefix=cache.stem, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(manifest.to_wire())
        os.replace(tmp, cache)
    except OSError:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)   # an unwritable MESHNET_HOME only costs a read next time


def of_file(path: str | Path, sha256: str) -> Manifest:
    """The manifest of a file whose sha256 was just checked: computed the first time,
    then read from MESHNET_HOME/hashes (keyed by the sha256, never re-derived from bytes
    that may have changed since)."""
    manifest = cached(sha256)
    if manifest is not None and manifest.file_bytes == sum(f.stat().st_size for f in model_files(path)):
        return dataclasses.replace(manifest, filename=Path(path).name)
    manifest = compute(path, sha256)
    remember(manifest)
    return manifest
