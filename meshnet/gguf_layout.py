"""What a GGUF file holds, read with the gguf package: architecture, sizes, quant
types and bytes per layer. The route planner sizes stages from these numbers."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import gguf

from .errors import MeshnetError

_LAYER = re.compile(r"^blk\.(\d+)\.")
_INPUT_TENSORS = ("token_embd.", "token_types.", "position_embd.")


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


def read_layout(path: str | Path) -> ModelLayout:
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the gguf package raises plain ValueError/struct errors on bad files
        raise MeshnetError("not_gguf", f"'{path}' is not a readable GGUF file: {e}") from e
    arch = _field(reader, "general.architecture")
    n_layer = _field(reader, f"{arch}.block_count")
    if not arch or n_layer is None:
        raise MeshnetError("not_gguf", f"'{path}' does not describe a layered language model")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    n_vocab = _field(reader, f"{arch}.vocab_size") or (len(tokens.data) if tokens else 0)

    layer_bytes = [0] * n_layer
    input_bytes = output_bytes = shared_bytes = token_embd_bytes = 0
    has_output = False
    quant = Counter()
    for t in reader.tensors:
        n = int(t.n_bytes)
        quant[t.tensor_type.name] += 1
        if m := _LAYER.match(t.name):
            layer_bytes[int(m.group(1))] += n
        elif t.name.startswith(_INPUT_TENSORS):
            input_bytes += n
            if t.name.startswith("token_embd."):
                token_embd_bytes += n
        elif t.name.startswith(("output.", "output_norm.")):
            output_bytes += n
            has_output |= t.name.startswith("output.")
        else:
            shared_bytes += n

    return ModelLayout(
        path=str(path),
        arch=arch,
        n_layer=int(n_layer),
        n_embd=int(_field(reader, f"{arch}.embedding_length") or 0),
        n_vocab=int(n_vocab),
        file_bytes=Path(path).stat().st_size,
        layer_bytes=layer_bytes,
        input_bytes=input_bytes,
        output_bytes=output_bytes,
        shared_bytes=shared_bytes,
        tied_embeddings=not has_output,
        token_embd_bytes=token_embd_bytes,
        quant_types=dict(quant.most_common()),
    )
