"""What a worker fetching part of a model file trusts each byte by: the file's sha256 and
size, the header's place and hash, and each tensor's place, size and sha256.

Only a coordinator vouches for a manifest, never a holder: it computes one from a file
whose sha256 it checked (its own --model, or a holder's bytes streamed once and hashed
whole, weights/vouch.py), and a worker takes it from the coordinator it authenticated with
the token's key. A manifest is kept under $MESHNET_HOME/hashes keyed by the file's sha256,
as the file's own hash is: it then stays what the file held when its sha256 was checked,
and a byte changed on a holder's disk later fails the fetcher's check instead of being
published anew.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import msgpack

from meshnet.core import errors as E
from meshnet.core.errors import MeshnetError
from meshnet.core.home import meshnet_home
from meshnet.core.layers import LayerRange
from meshnet.engine.gguf_layout import stage_holds, tensor_role

HEADER = "<header>"          # the span of the GGUF header: metadata and tensor infos
MAX_TENSORS = 1 << 17
READ_CHUNK = 1 << 22
# a bound on the file a manifest describes: above the largest GGUF there is (about 1.5 TiB),
# far below the sizes at which a sparse file of that length is refused or costs metadata
MAX_FILE_BYTES = 1 << 42
MAX_NAME = 512               # a tensor's name (GGUF's own limit is 64)
MAX_WIRE_BYTES = 32 << 20    # a manifest of MAX_TENSORS spans fits


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
    tensors: tuple[Span, ...]

    def spans_for(self, layers: LayerRange) -> list[Span]:
        """The header and the tensors the stage LAYERS loads: its own layers, and the head's
        or tail's extra tensors (the engine's rule, engine/gguf_layout.stage_holds)."""
        return [self.header] + [t for t in self.tensors
                                if stage_holds(tensor_role(t.name), t.name, layers.start, layers.end, self.n_layer,
                                               self.tied_embeddings)]

    def to_wire(self) -> bytes:
        body = asdict(self)
        body["tensors"] = [[t.name, t.offset, t.size, t.sha256] for t in self.tensors]
        body["header"] = [self.header.name, self.header.offset, self.header.size, self.header.sha256]
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
            manifest = cls(sha256=_hex(body["sha256"]), file_bytes=_count(body["file_bytes"]),
                           filename=_filename(body["filename"]), n_layer=_count(body["n_layer"]),
                           tied_embeddings=bool(body["tied_embeddings"]), header=_span(body["header"]),
                           tensors=tuple(_span(t) for t in tensors))
        except _Refused as e:
            raise MeshnetError(E.FETCH_FAILED, f"the manifest is refused: {e}") from None
        except (ValueError, TypeError, KeyError, IndexError, msgpack.ExtraData, msgpack.FormatError,
                msgpack.StackError):
            raise MeshnetError(E.FETCH_FAILED, "a manifest this version of meshnet cannot read") from None
        manifest.check()
        return manifest

    def check(self) -> None:
        """The rules that bound what a fetch of this manifest writes: every span inside the
        file, the header at its start, the tensors after it in order, none overlapping
        another (so no byte is fetched twice and the spans sum to at most the file), each
        name once."""
        def refused(why: str):
            return MeshnetError(E.FETCH_FAILED, f"the manifest is refused: {why}")
        if self.file_bytes > MAX_FILE_BYTES:
            raise refused(f"a file of {self.file_bytes} bytes is over the {MAX_FILE_BYTES}-byte bound")
        if self.header.name != HEADER or self.header.offset != 0:
            raise refused("its first span is not the GGUF header at offset 0")
        end, names = 0, set()
        for span in (self.header, *self.tensors):
            if span.offset < end:
                raise refused(f"{span.name!r} overlaps the span before it or is out of order")
            end = span.offset + span.size
            if end > self.file_bytes:
                raise refused(f"{span.name!r} ends past the end of the {self.file_bytes}-byte file")
            if span.name in names:
                raise refused(f"{span.name!r} is named twice")
            names.add(span.name)


class _Refused(ValueError):
    """A field of a manifest that is readable and refused: the reason names the rule."""


def _hex(value) -> str:
    if not isinstance(value, str) or len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
        raise ValueError("sha256")
    return value


def _count(value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 62:
        raise ValueError("count")
    return value


def _filename(value) -> str:
    # it names a file under MESHNET_HOME and is printed: a path in it would write elsewhere,
    # and a control character (an escape, a newline) would forge what the terminal shows
    if not isinstance(value, str) or not value or not value.isprintable() or "/" in value or "\\" in value \
            or value.startswith(".") or len(value) > 255:
        raise _Refused("its file name is not a plain printable file name")
    return value


def _span(value) -> Span:
    name, offset, size, sha = value
    # printed in a failure's reason: plain printable text only
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME or not name.isprintable():
        raise _Refused(f"a tensor name is not 1 to {MAX_NAME} printable characters")
    return Span(name, _count(offset), _count(size), _hex(sha))


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


def layout(path: str | Path) -> Layout:
    """The layout of the GGUF at PATH, read from its header alone (a sparse file whose
    header is there and whose data are holes reads the same)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    tensors = sorted(((t.name, int(t.data_offset), int(t.n_bytes)) for t in reader.tensors), key=lambda t: t[1])
    arch = reader.fields["general.architecture"].contents()
    return Layout(data_start=tensors[0][1] if tensors else Path(path).stat().st_size,
                  n_layer=int(reader.fields[f"{arch}.block_count"].contents()),
                  tied_embeddings=not any(name.startswith("output.") for name, _, _ in tensors),
                  tensors=tuple(tensors))


def compute(path: str | Path, sha256: str) -> Manifest:
    """The manifest of the GGUF at PATH, whose sha256 the caller checked: one read of the file."""
    path = Path(path)
    found = layout(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        header = Span(HEADER, 0, found.data_start, _sha256_of_range(fd, 0, found.data_start))
        spans = tuple(Span(name, offset, size, _sha256_of_range(fd, offset, size))
                      for name, offset, size in found.tensors)
    finally:
        os.close(fd)
    return Manifest(sha256=sha256, file_bytes=path.stat().st_size, filename=path.name, n_layer=found.n_layer,
                    tied_embeddings=found.tied_embeddings, header=header, tensors=spans)


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
    if manifest is not None and manifest.file_bytes == Path(path).stat().st_size:
        return dataclasses.replace(manifest, filename=Path(path).name)
    manifest = compute(path, sha256)
    remember(manifest)
    return manifest
