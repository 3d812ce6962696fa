"""The KV cache in another type (--kv-type, meshnet/core/kv_cache.py): the memory a long
context takes, as the planner counts it and the engine allocates it, and the refusals."""

import pytest

from meshnet.core.errors import MeshnetError
from meshnet.core.planner import ModelCost
from meshnet.engine.binding import Stage, layer_memory
from meshnet.engine.gguf_layout import read_layout

from conftest import THREADS


@pytest.mark.parametrize("model", ["smollm2", "qwen", "gemma3"])
def test_a_32k_context_s_kv_in_q8_0_is_what_the_planner_counts_and_about_half_of_f16(model, smollm2_path, qwen_path,
                                                                                      gemma3_path):
    path = {"smollm2": smollm2_path, "qwen": qwen_path, "gemma3": gemma3_path}[model]
    layout = read_layout(path)
    allocated = {}
    for kv_type, flash_attn in (("f16", False), ("q8_0", True), ("q4_0", True)):
        planned = ModelCost.from_layout(layout, layer_memory(path, kv_type)).memory_bytes(0, layout.n_layer, 32768, 1)
        with Stage(path, n_ctx=32768, max_sessions=1, n_threads=THREADS, flash_attn=flash_attn,
                   kv_type=kv_type) as stage:
            allocated[kv_type] = stage.info().kv_bytes
        assert abs(allocated[kv_type] - planned) <= 0.05 * planned, (kv_type, allocated[kv_type], planned)
    # a block of 32 values in 34 bytes (q8_0) and in 18 (q4_0), against 64
    assert allocated["q8_0"] / allocated["f16"] == pytest.approx(34 / 64)
    assert allocated["q4_0"] / allocated["f16"] == pytest.approx(18 / 64)


def test_a_quantized_v_without_flash_attention_is_refused_saying_so(arch_models):
    with pytest.raises(MeshnetError, match="needs flash attention") as refused:
        Stage(arch_models["llama"], n_ctx=64, max_sessions=1, n_threads=THREADS, kv_type="q8_0")
    assert refused.value.code == "invalid_argument"


def test_a_type_whose_blocks_do_not_divide_the_heads_is_refused_by_the_planner_and_the_engine(arch_models):
    # (laguna's generated model has heads of 80 values: a q8_0 block holds 32)
    path = arch_models["laguna"]
    with pytest.raises(MeshnetError, match="do not divide this model's key rows of 80") as planned:
        layer_memory(path, "q8_0")
    with pytest.raises(MeshnetError) as opened:
        Stage(path, n_ctx=64, max_sessions=1, n_threads=THREADS, kv_type="q8_0", flash_attn=True)
    assert planned.value.message == opened.value.message and opened.value.code == "invalid_argument"
    with Stage(path, n_ctx=64, max_sessions=1, n_threads=THREADS, kv_type="bf16") as stage:
        assert stage.info().kv_bytes > 0


def test_flash_attention_llama_cpp_turns_off_for_a_model_is_refused_rather_than_named_in_its_class(arch_models):
    with pytest.raises(MeshnetError, match="does not run flash attention for a 'grok' model") as refused:
        Stage(arch_models["grok"], n_ctx=64, max_sessions=1, n_threads=THREADS, flash_attn=True)
    assert refused.value.code == "invalid_argument"
