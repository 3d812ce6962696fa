"""The KV cache's element types (llama.cpp's -ctk / -ctv): a stage's K and V cells in f16
(the default), or quantized to hold a longer context in the same memory.

A type is named as llama.cpp names it; `--kv-type q8_0` keeps K and V in it, `--kv-type
q8_0,f16` K in the first and V in the second. A quantized V needs flash attention (without
it llama.cpp keeps V transposed, a cell's values strided apart). The type is part of a
route's compatibility class: the cache rounds what attention reads, so two stages with
different types give different tokens. Both numerics classes stay what they promise with
any type: a cell is quantized on its own as it is written, whatever its batch.
"""

from __future__ import annotations

from meshnet.core.errors import INVALID_ARGUMENT, MeshnetError

# meshnet_kv_type's order (engine_c/meshnet_engine.h)
TYPES = ("f16", "f32", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl")
DEFAULT = "f16"
_UNQUANTIZED = ("f16", "f32", "bf16")


def parse(text: str) -> str:
    """The canonical name of --kv-type TEXT: one type ("q8_0") where K and V share it, else
    "K,V". Raises INVALID_ARGUMENT naming the choices."""
    parts = [part.strip().lower() for part in str(text).split(",")]
    if len(parts) not in (1, 2) or any(part not in TYPES for part in parts):
        raise MeshnetError(INVALID_ARGUMENT, f"KV type {text!r}: give one of {', '.join(TYPES)} for K and V, "
                           "or two of them as K,V (q8_0,f16)")
    k, v = parts if len(parts) == 2 else parts * 2
    return k if k == v else f"{k},{v}"


def split(kv_type: str) -> tuple[str, str]:
    """(K's type, V's type) of a canonical name."""
    k, _, v = parse(kv_type).partition(",")
    return k, v or k


def codes(kv_type: str) -> tuple[int, int]:
    """The engine's meshnet_kv_type values for K and V."""
    k, v = split(kv_type)
    return TYPES.index(k), TYPES.index(v)


def needs_flash_attn(kv_type: str) -> bool:
    return split(kv_type)[1] not in _UNQUANTIZED


def check(kv_type: str, flash_attn: bool) -> str:
    """The canonical name, or INVALID_ARGUMENT where it needs flash attention and has none."""
    name = parse(kv_type)
    if needs_flash_attn(name) and not flash_attn:
        raise MeshnetError(INVALID_ARGUMENT, f"a {split(name)[1]} V cache needs flash attention: add --flash-attn, "
                           f"or keep V in f16 (--kv-type {split(name)[0]},f16)")
    return name


def is_canonical(text) -> bool:
    """TEXT is a name as parse() gives it (what a worker's capability carries)."""
    try:
        return parse(text) == text
    except MeshnetError:
        return False
