"""A GGUF written again as N split files, the way llama.cpp's gguf-split writes them
(`NAME-00001-of-0000N.gguf`, the metadata in the first, split.no / split.count /
split.tensors.count in each), with the gguf package: the tensors are cut by count, in the
file's order, so each split holds a run of layers. Random weights are all a test needs."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from long_model import field_value


def write_splits(source: str | Path, directory: str | Path, n_splits: int = 3) -> list[Path]:
    """SOURCE's tensors and metadata as N_SPLITS files under DIRECTORY; their paths, first
    split first."""
    reader = GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    stem = Path(directory) / Path(source).stem
    per_split = math.ceil(len(reader.tensors) / n_splits)
    writer = GGUFWriter(f"{stem}.gguf", arch, split_max_tensors=per_split)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value, kind, sub = field_value(field)
        if kind == GGUFValueType.ARRAY and not value:
            continue   # (the writer refuses an empty array; llama.cpp reads none as empty)
        writer.add_key_value(key, value, kind, sub_type=sub)
    for tensor in reader.tensors:
        # the raw bytes and the type as stored: a quantized tensor is written as it was
        writer.add_tensor(tensor.name, np.array(tensor.data), raw_shape=list(reversed(tensor.shape.tolist())),
                          raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    paths = [Path(f"{stem}-{i:05d}-of-{n_splits:05d}.gguf") for i in range(1, n_splits + 1)]
    missing = [p for p in paths if not p.is_file()]
    assert not missing, f"the writer made other files than {missing}"
    return paths
