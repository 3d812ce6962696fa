"""A model written as several GGUF files, as llama.cpp's gguf-split writes one too large for
one file (`NAME-00001-of-00005.gguf`, ...): which files they are, which of them a stage's
layers are in, and the one identity meshnet gives them.

llama.cpp loads such a model from its first file, finding the others by name (its
llama_split_prefix / llama_split_path) and checking each one's split.no; meshnet finds
them by the same rule, so the files it hashes, plans and fetches are the files the engine
opens."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from meshnet.core import errors
from meshnet.core.errors import MeshnetError

# llama.cpp's "%s-%05d-of-%05d.gguf", numbered from 1
SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
# the model's identity is one hash over its files' hashes, in order: a model of one file
# keeps its file's own sha256 (what every earlier version and every other tool calls it)
IDENTITY_TAG = b"meshnet gguf splits 1\n"


def split_name(prefix: str, index: int, count: int) -> str:
    """The name of split INDEX (0-based) of COUNT, as llama_split_path makes it."""
    return f"{prefix}-{index + 1:05d}-of-{count:05d}.gguf"


def named_splits(path: Path) -> list[Path]:
    """Every file of the model PATH's name says it is a split of (the first one first), or
    [PATH] for a name that is not a split's. Refused when one is missing: the engine would
    fail opening it, and a hash of fewer files is another model's."""
    m = SPLIT_NAME.match(path.name)
    if not m or int(m["count"]) < 2 or not 1 <= int(m["no"]) <= int(m["count"]):
        return [path]
    count = int(m["count"])
    files = [path.with_name(split_name(m["prefix"], i, count)) for i in range(count)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise MeshnetError(errors.MODEL_NOT_FOUND,
                           f"'{path}' is split {int(m['no'])} of a model of {count} files and "
                           f"{len(missing)} of them are not beside it: {', '.join(missing[:3])}"
                           + (" ..." if len(missing) > 3 else "") + "; put every split in one folder")
    return files


def model_identity(file_sha256s: list[str]) -> str:
    """The model's sha256: its file's for a model of one file, else one hash over the
    splits' hashes in order (a split changed, added, dropped or reordered is another model)."""
    if len(file_sha256s) == 1:
        return file_sha256s[0]
    digest = hashlib.sha256(IDENTITY_TAG)
    for sha in file_sha256s:
        digest.update(sha.encode() + b"\n")
    return digest.hexdigest()


@dataclass(frozen=True)
class SplitFile:
    """One file of a model, with what the stages need of it."""
    path: str
    file_bytes: int
    tensors: int
    layers: tuple[int, int] | None   # [first, last + 1) of the layers it holds tensors of; None: none
    roles: tuple[str, ...]           # "input", "output", "shared": the other tensors it holds

    def describe(self) -> str:
        held = []
        if "input" in self.roles:
            held.append("embeddings")
        if self.layers is not None:
            first, end = self.layers
            held.append(f"layer {first}" if end == first + 1 else f"layers {first}-{end - 1}")
        if "output" in self.roles:
            held.append("output")
        if "shared" in self.roles:
            held.append("shared tensors")
        return ", ".join(held) or "metadata only"
