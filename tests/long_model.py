"""A generated model trained (by its header) on a long context, cheap to run over it: the
pin's generated llama-dense cut to 2 layers and one attention head of 64 (its rows and
columns sliced from the random weights it has), its context_length set to 32768. Random
weights are all a test of exactness needs; a long prompt's attention is what costs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter

N_LAYER, HEAD_DIM = 2, 64


def field_value(field):
    value = field.contents()
    kind = field.types[0]
    if kind == GGUFValueType.ARRAY:
        return value, kind, field.types[1] if len(field.types) > 1 else None
    return value, kind, None


def write_long_context_model(source: str | Path, target: str | Path, n_ctx_train: int = 32768) -> Path:
    reader = GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    assert arch == "llama", arch
    changed = {f"{arch}.context_length": n_ctx_train, f"{arch}.block_count": N_LAYER,
               f"{arch}.attention.head_count": 1, f"{arch}.attention.head_count_kv": 1,
               f"{arch}.attention.key_length": HEAD_DIM, f"{arch}.attention.value_length": HEAD_DIM,
               f"{arch}.attention.key_length_swa": HEAD_DIM, f"{arch}.attention.value_length_swa": HEAD_DIM,
               f"{arch}.rope.dimension_count": HEAD_DIM, f"{arch}.rope.dimension_count_swa": HEAD_DIM,
               f"{arch}.rope.scaling.original_context_length": n_ctx_train}
    n_layer = reader.fields[f"{arch}.block_count"].contents()
    writer = GGUFWriter(str(target), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value, kind, sub = field_value(field)
        if kind == GGUFValueType.ARRAY:
            if not value:
                continue   # (the writer refuses an empty array; llama.cpp reads none as empty)
            if key.startswith(f"{arch}.") and len(value) == n_layer:
                value = value[:N_LAYER]   # one value per layer
        writer.add_key_value(key, changed.get(key, value), kind, sub_type=sub)
    for tensor in reader.tensors:
        name = tensor.name
        if name.startswith("blk.") and int(name.split(".")[1]) >= N_LAYER:
            continue
        data = np.array(tensor.data)
        if name.endswith(("attn_q.weight", "attn_k.weight", "attn_v.weight")):
            data = data[:HEAD_DIM, :]          # (ggml's [in, out] is numpy's [out, in]): the head's output rows
        elif name.endswith(("attn_q.bias", "attn_k.bias", "attn_v.bias")):
            data = data[:HEAD_DIM]
        elif name.endswith("attn_output.weight"):
            data = data[:, :HEAD_DIM]          # the head's input columns
        elif name == "rope_freqs.weight":
            data = data[:HEAD_DIM // 2]
        writer.add_tensor(name, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(target)
