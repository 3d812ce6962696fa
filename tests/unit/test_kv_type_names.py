"""--kv-type's spelling (meshnet/core/kv_cache.py): one canonical name per pair of types,
the engine's codes, and a quantized V refused without flash attention."""

import pytest

from meshnet.core import kv_cache
from meshnet.core.errors import MeshnetError


@pytest.mark.parametrize("given, canonical, pair", [
    ("f16", "f16", ("f16", "f16")),
    ("Q8_0", "q8_0", ("q8_0", "q8_0")),
    ("q8_0,q8_0", "q8_0", ("q8_0", "q8_0")),
    ("q4_0, f16", "q4_0,f16", ("q4_0", "f16")),
    ("f16,q8_0", "f16,q8_0", ("f16", "q8_0")),
])
def test_a_kv_type_has_one_name_and_splits_into_k_and_v(given, canonical, pair):
    assert kv_cache.parse(given) == canonical
    assert kv_cache.split(canonical) == pair
    assert kv_cache.codes(canonical) == tuple(kv_cache.TYPES.index(t) for t in pair)
    assert kv_cache.is_canonical(canonical) and (given == canonical or not kv_cache.is_canonical(given))


@pytest.mark.parametrize("given", ["q3_k", "", "q8_0,f16,f16", "fp16", 16])
def test_a_type_llama_cpp_has_no_cache_of_is_refused_naming_the_choices(given):
    with pytest.raises(MeshnetError, match="q8_0") as refused:
        kv_cache.parse(given)
    assert refused.value.code == "invalid_argument"
    assert not kv_cache.is_canonical(given)


def test_a_quantized_v_needs_flash_attention_and_a_quantized_k_alone_does_not():
    assert kv_cache.check("q8_0", flash_attn=True) == "q8_0"
    assert kv_cache.check("q8_0,f16", flash_attn=False) == "q8_0,f16"
    with pytest.raises(MeshnetError, match="--flash-attn, or keep V in f16 \\(--kv-type q4_0,f16\\)"):
        kv_cache.check("q4_0", flash_attn=False)
