"""What a holder of a model file publishes so that a worker can fetch part of it and trust
each byte: the file's sha256 and size, the header's bytes and hash, and each tensor's
place, size and sha256.

A holder computes it once per file (one read of the file) and keeps it under
$MESHNET_HOME/hashes keyed by the file's sha256, as the file's own hash is kept: the
manifest then stays what the file held when its sha256 was checked, and a byte changed
on the holder's disk later fails the fetcher's check instead of being published anew.
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
        """A manifest as a holder sent it, checked field by field: a bad one is refused whole."""
        try:
            body = msgpack.unpackb(bytes(raw), raw=False)
            tensors = body["tensors"]
            if not isinstance(tensors, list) or len(tensors) > MAX_TENSORS:
                raise ValueError("tensors")
            manifest = cls(sha256=_hex(body["sha256"]), file_bytes=_count(body["file_bytes"]),
                           filename=_filename(body["filename"]), n_layer=_count(body["n_layer"]),
                           tied_embeddings=bool(body["tied_embeddings"]), header=_span(body["header"]),
                           tensors=tuple(_span(t) for t in tensors))
        except (ValueError, TypeError, KeyError, IndexError, msgpack.ExtraData, msgpack.FormatError,
                msgpack.StackError):
            raise MeshnetError(E.FETCH_FAILED, "a holder sent a manifest this version of meshnet cannot read") from None
        for span in (manifest.header, *manifest.tensors):
            if span.offset + span.size > manifest.file_bytes:
                raise MeshnetError(E.FETCH_FAILED, f"the manifest places {span.name} past the end of the file")
        return manifest


def _hex(value) -> str:
    if not isinstance(value, str) or len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
        raise ValueError("sha256")
    return value


def _count(value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 62:
        raise ValueError("count")
    return value


def _filename(value) -> str:
    # it names a file under MESHNET_HOME: a path in it would write elsewhere
    if not isinstance(value, str) or not value or "/" in value or "\\" in value or value in (".", "..") \
            or len(value) > 255 or "\0" in value:
        raise ValueError("filename")
    return value


def _span(value) -> Span:
    name, offset, size, sha = value
    if not isinstance(name, str) or len(name) > 512:
        raise ValueError("name")
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


def compute(path: str | Path, sha256: str) -> Manifest:
    """The manifest of the GGUF at PATH, whose sha256 the caller checked: one read of the file."""
    import gguf

    path = Path(path)
    reader = gguf.GGUFReader(str(path))
    tensors = sorted(reader.tensors, key=lambda t: int(t.data_offset))
    data_start = int(tensors[0].data_offset) if tensors else path.stat().st_size
    arch = reader.fields["general.architecture"].contents()
    n_layer = int(reader.fields[f"{arch}.block_count"].contents())
    fd = os.open(path, os.O_RDONLY)
    try:
        header = Span(HEADER, 0, data_start, _sha256_of_range(fd, 0, data_start))
        spans = tuple(Span(t.name, int(t.data_offset), int(t.n_bytes),
                           _sha256_of_range(fd, int(t.data_offset), int(t.n_bytes))) for t in tensors)
    finally:
        os.close(fd)
    return Manifest(sha256=sha256, file_bytes=path.stat().st_size, filename=path.name, n_layer=n_layer,
                    tied_embeddings=not any(t.name.startswith("output.") for t in tensors), header=header,
                    tensors=spans)


def _cache_path(sha256: str) -> Path:
    return meshnet_home() / "hashes" / f"tensors-{sha256}.msgpack"


def of_file(path: str | Path, sha256: str) -> Manifest:
    """The manifest of a file whose sha256 was just checked: computed the first time,
    then read from MESHNET_HOME/hashes (keyed by the sha256, never re-derived from bytes
    that may have changed since)."""
    cache = _cache_path(sha256)
    try:
        manifest = Manifest.from_wire(cache.read_bytes())
        if manifest.sha256 == sha256 and manifest.file_bytes == Path(path).stat().st_size:
            return dataclasses.replace(manifest, filename=Path(path).name)
    except (OSError, MeshnetError):
        pass
    manifest = compute(path, sha256)
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
    return manifest
