"""What a GGUF model holds, read with the gguf package: architecture, sizes, quant types
and bytes per layer, over every file of a model written as splits (gguf_splits.py). The
route planner sizes stages from these numbers."""

from __future__ import annotations

import copy
import functools
import math
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import gguf

from meshnet.core import errors
from meshnet.core.errors import MeshnetError
from meshnet.core.layers import LayerRange, balanced_ranges
from meshnet.engine.gguf_splits import SPLIT_NAME, SplitFile, named_splits, split_name

_LAYER = re.compile(r"^blk\.(\d+)\.")
_INPUT_TENSORS = ("token_embd.", "token_types.", "position_embd.")


def tensor_role(name: str) -> int | str:
    """Which stages hold a tensor, as the engine's loader decides (patch 0001): its layer's
    number, "input" (the head), "output" (the tail) or "shared" (every stage)."""
    if m := _LAYER.match(name):
        return int(m.group(1))
    if name.startswith(_INPUT_TENSORS):
        return "input"
    if name.startswith(("output.", "output_norm.")):
        return "output"
    return "shared"


def stage_holds(role: int | str, name: str, start: int, end: int, n_layer: int, tied_embeddings: bool) -> bool:
    """Whether the stage [start, end) holds a tensor of this role (the tail of a model with
    tied embeddings holds token_embd as its output matrix): the bytes stage_bytes counts."""
    if isinstance(role, int):
        return start <= role < end
    if role == "input":
        return start == 0 or (end == n_layer and tied_embeddings and name.startswith("token_embd."))
    if role == "output":
        return end == n_layer
    return True


@dataclass
class ModelLayout:
    path: str
    arch: str
    n_layer: int
    n_embd: int
    n_vocab: int
    file_bytes: int
    layer_bytes: list[int]
    input_bytes: int        # token embedding: held by the head
    output_bytes: int       # output norm + output matrix: held by the tail
    shared_bytes: int       # tensors every stage needs (rope factors)
    tied_embeddings: bool   # no output matrix: the tail reuses token_embd
    token_embd_bytes: int
    quant_types: dict[str, int] = field(default_factory=dict)
    layer_weights: list[int] = field(default_factory=list)   # weights each layer multiplies per token
    output_weights: int = 0   # ... the output matrix (token_embd when tied): the tail's extra work
    n_head: int = 0
    n_ff: int = 0
    attn_width: int = 0         # the attention heads' output: heads x value length
    kv_bytes_per_cell: int = 0  # one layer's K and V of one token at f16, the engine's cache type
    n_ctx_train: int = 0        # the context it was trained on (0: the file does not say)
    files: list[SplitFile] = field(default_factory=list)   # the model's files: one, or its splits in order

    def balanced_ranges(self, n_stages: int) -> list[LayerRange]:
        """n_stages ranges with as even a share of the per-token work as whole layers allow
        (the tail's share includes the output matrix): pipelined stages go at the pace of
        the slowest."""
        return balanced_ranges(self.layer_weights, self.output_weights, n_stages)

    def stage_bytes(self, start: int, end: int) -> int:
        """Weight bytes a stage [start, end) loads."""
        total = sum(self.layer_bytes[start:end]) + self.shared_bytes
        if start == 0:
            total += self.input_bytes
        if end == self.n_layer:
            total += self.output_bytes + (self.token_embd_bytes if self.tied_embeddings and start != 0 else 0)
        return total


def _field(reader: gguf.GGUFReader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


class _Truncated(Exception):
    def __init__(self, needed: int, present: int):
        super().__init__(needed, present)
        self.needed = needed
        self.present = present


def _tensor_end(info: gguf.gguf_reader.ReaderField) -> int:
    """Where a tensor's data ends, relative to the start of the tensor data, from its
    tensor info alone, sized the way GGUFReader sizes it."""
    _name_len, _name, _n_dims, dims, raw_dtype, offset = info.parts
    block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(raw_dtype[0]))]
    return int(offset[0]) + math.prod(int(d) for d in dims) * type_size // block_size


class _CheckedReader(gguf.GGUFReader):
    # GGUFReader views each tensor's bytes with numpy, so a file cut short fails there with
    # a reshape error that says nothing about the file. Sizing the tensor data from the
    # tensor infos first turns that into the two numbers a person can check.
    def _build_tensors(self, start_offs, fields):
        try:
            needed = max((_tensor_end(info) for info in fields), default=0)
        except (AttributeError, IndexError, KeyError, TypeError, ValueError):
            needed = None  # another gguf version's internals: read on, with its own error
        present = len(self.data) - start_offs
        if needed is not None and needed > present:
            raise _Truncated(needed, present)
        super()._build_tensors(start_offs, fields)


def _has_gguf_magic(path: str | Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == gguf.GGUF_MAGIC.to_bytes(4, "little")
    except OSError:
        return False


def read_layout(path: str | Path) -> ModelLayout:
    """The layout of the GGUF at PATH. Read once per process while the file's size, mtime
    and ctime hold: the gguf package takes seconds over a large vocabulary, and resolving a
    model reads it to check it is GGUF just before its caller wants the layout. (Every
    split's stat is in the key: a split copied again is read again.)"""
    try:
        identity = tuple((st.st_size, st.st_mtime_ns, st.st_ctime_ns)
                         for st in map(os.stat, named_splits(Path(path))))
    except (OSError, MeshnetError):
        return _read_layout(str(path))  # says why, in the same words as any unreadable file
    return copy.deepcopy(_read_layout_once(str(path), identity))


@functools.lru_cache(maxsize=8)
def _read_layout_once(path: str, identity: tuple) -> ModelLayout:
    return _read_layout(path)


def _open(path: str) -> gguf.GGUFReader:
    try:
        return _CheckedReader(path)
    except _Truncated as t:
        raise MeshnetError(
            errors.TRUNCATED_GGUF,
            f"'{path}' is truncated: its header says {t.needed} bytes of tensor data, the file has "
            f"{max(t.present, 0)}; copy or download it again",
        ) from None
    except OSError as e:
        raise MeshnetError(errors.NOT_GGUF, f"'{path}' is not a readable GGUF file: {e.strerror or e}") from e
    except Exception as e:  # the gguf package raises plain ValueError/numpy errors on bad files
        if not _has_gguf_magic(path):
            raise MeshnetError(errors.NOT_GGUF, f"'{path}' is not a GGUF file: it does not start with 'GGUF'") from e
        raise MeshnetError(
            errors.NOT_GGUF,
            f"'{path}' starts like a GGUF file but its header cannot be read ({e}): it is "
            "truncated or corrupt; copy or download it again",
        ) from e


def _split_readers(path: str, reader: gguf.GGUFReader) -> list[tuple[str, gguf.GGUFReader]]:
    """The model's files and their readers: [PATH] alone, or every split from the first, each
    checked to be the split its name says (the engine's checks, said before it loads)."""
    count = int(_scalar(_field(reader, "split.count")) or 1)
    if count < 2:
        return [(path, reader)]
    m = SPLIT_NAME.match(Path(path).name)
    if _field(reader, "split.no") != 0 or not m or int(m["no"]) != 1 or int(m["count"]) != count:
        raise MeshnetError(errors.NOT_GGUF, f"'{path}' is a split of a model of {count} files but not its first "
                           f"one named as llama.cpp names splits (NAME-00001-of-{count:05d}.gguf): give that one")
    files = [(path, reader)]
    for i in range(1, count):
        split = str(Path(path).with_name(split_name(m["prefix"], i, count)))
        if not os.path.isfile(split):
            raise MeshnetError(errors.MODEL_NOT_FOUND, f"'{path}' is split 1 of {count} and split {i + 1}, "
                               f"'{split}', is not beside it; put every split in one folder")
        other = _open(split)
        if _field(other, "split.no") != i or int(_scalar(_field(other, "split.count")) or 1) != count:
            raise MeshnetError(errors.NOT_GGUF, f"'{split}' does not say it is split {i + 1} of {count}: "
                               "the files are of different models or were renamed")
        files.append((split, other))
    return files


def _split_file(path: str, reader: gguf.GGUFReader) -> SplitFile:
    layers = [r for r in (tensor_role(t.name) for t in reader.tensors) if isinstance(r, int)]
    roles = {r for r in (tensor_role(t.name) for t in reader.tensors) if not isinstance(r, int)}
    return SplitFile(path=path, file_bytes=os.path.getsize(path), tensors=len(reader.tensors),
                     layers=(min(layers), max(layers) + 1) if layers else None,
                     roles=tuple(r for r in ("input", "output", "shared") if r in roles))


def _read_layout(path: str) -> ModelLayout:
    reader = _open(path)
    files = _split_readers(path, reader)
    arch = _field(reader, "general.architecture")
    n_layer = _field(reader, f"{arch}.block_count")
    if not arch or n_layer is None:
        raise MeshnetError(errors.NOT_GGUF, f"'{path}' does not describe a layered language model")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    n_vocab = _field(reader, f"{arch}.vocab_size") or (len(tokens.data) if tokens else 0)

    layer_bytes = [0] * n_layer
    layer_weights = [0] * n_layer
    input_bytes = output_bytes = shared_bytes = token_embd_bytes = 0
    output_weights = token_embd_weights = 0
    has_output = False
    quant = Counter()
    for t in (t for _, r in files for t in r.tensors):
        n = int(t.n_bytes)
        quant[t.tensor_type.name] += 1
        role = tensor_role(t.name)
        if isinstance(role, int):
            layer_bytes[role] += n
            layer_weights[role] += int(t.n_elements)
        elif role == "input":
            input_bytes += n
            if t.name.startswith("token_embd."):
                token_embd_bytes += n
                token_embd_weights += int(t.n_elements)
        elif role == "output":
            output_bytes += n
            has_output |= t.name.startswith("output.")
            if t.name.startswith("output."):
                output_weights += int(t.n_elements)
        else:
            shared_bytes += n

    n_embd = int(_field(reader, f"{arch}.embedding_length") or 0)
    n_head = _scalar(_field(reader, f"{arch}.attention.head_count")) or 0
    n_head_kv = _scalar(_field(reader, f"{arch}.attention.head_count_kv")) or n_head
    head_dim = n_embd // n_head if n_head else 0
    key_dim = _field(reader, f"{arch}.attention.key_length") or head_dim
    value_dim = _field(reader, f"{arch}.attention.value_length") or head_dim
    return ModelLayout(
        path=str(path),
        arch=arch,
        n_layer=int(n_layer),
        n_embd=n_embd,
        n_vocab=int(n_vocab),
        file_bytes=sum(os.path.getsize(p) for p, _ in files),
        layer_bytes=layer_bytes,
        input_bytes=input_bytes,
        output_bytes=output_bytes,
        shared_bytes=shared_bytes,
        tied_embeddings=not has_output,
        token_embd_bytes=token_embd_bytes,
        quant_types=dict(quant.most_common()),
        layer_weights=layer_weights,
        output_weights=output_weights if has_output else token_embd_weights,
        n_head=int(n_head),
        n_ff=int(_scalar(_field(reader, f"{arch}.feed_forward_length")) or 0),
        attn_width=int(n_head) * int(_scalar(value_dim) or 0),
        kv_bytes_per_cell=2 * int(n_head_kv) * (int(key_dim) + int(value_dim)),
        n_ctx_train=int(_scalar(_field(reader, f"{arch}.context_length")) or 0),
        files=[_split_file(p, r) for p, r in files],
    )


def _scalar(value):
    """A per-model number that some architectures give per layer (a list): the largest."""
    if isinstance(value, (list, tuple)):
        return max(value, default=0)
    return value
