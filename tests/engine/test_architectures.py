"""The support table (engine_c/architectures.tsv) against the engine and the generated
models: every architecture it lists as splitting gives the whole model's logits bit for
bit when split, and every other one is refused a range with the table's reason."""

import os
import re

import pytest

from meshnet.core.errors import MeshnetError
from meshnet.engine.binding import Stage, arch_support
from meshnet.evidence import parity

from conftest import ROOT, THREADS, generated_models, model_arch, read_arch_table

ARCH_TABLE = read_arch_table()
TABLE = ARCH_TABLE.read_table()
SPLITS = [line.arch for line in TABLE if line.status == "splits"]
MODELS = generated_models()


def pin_architectures() -> list[str]:
    """Every architecture name of the pinned tree (LLM_ARCH_NAMES in src/llama-arch.cpp)."""
    source = open(os.path.join(ROOT, "build", "llama.cpp-pristine", "src", "llama-arch.cpp")).read()
    block = source.split("LLM_ARCH_NAMES = {", 1)[1].split("};", 1)[0]
    return [name for name in re.findall(r'"([^"]+)"', block) if name != "(unknown)"]


def test_the_table_lists_every_architecture_of_the_pin_once():
    listed = [line.arch for line in TABLE]
    assert len(listed) == len(set(listed)), sorted(a for a in listed if listed.count(a) > 1)
    assert sorted(listed) == sorted(pin_architectures())


def test_the_engine_s_table_is_the_tsv():
    for line in TABLE:
        assert arch_support(line.arch) == (line.status, line.reason), line.arch
    assert arch_support("no-such-arch")[0] == "unknown"


def test_every_generated_model_is_of_an_architecture_the_table_lists():
    assert MODELS, "no generated models: run `make test-models` (make test does)"
    listed = {line.arch for line in TABLE}
    assert {model_arch(stem) for stem in MODELS} <= listed


def test_the_readme_s_table_is_the_tsv_s():
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert ARCH_TABLE.with_table(readme, ARCH_TABLE.markdown(TABLE)) == readme, \
        "README.md's table is stale: run tools/arch_table.py --write"


@pytest.mark.parametrize("arch", SPLITS)
def test_an_architecture_that_splits_gives_the_whole_model_s_logits_exactly(arch):
    # 2 and 3 stages, the prompt in uneven chunks, 16 greedy steps, 2 sessions batched, and
    # the whole model's own rows token by token: every logit equal (meshnet/evidence/parity.py)
    variants = {stem: path for stem, path in MODELS.items() if model_arch(stem) == arch}
    assert variants, f"'{arch}' is listed as splitting but has no generated model to hold it to"
    for stem, path in variants.items():
        report = parity.check(path, n_threads=THREADS)
        assert report.arch == arch
        assert report.n_layer >= 3, f"{stem}: {report.n_layer} layers leave no 3-stage split"
        assert report.exact, f"{stem}: {report.failures()}"


@pytest.mark.parametrize("stem", [stem for stem in MODELS if model_arch(stem) not in SPLITS])
def test_an_architecture_that_does_not_split_is_refused_a_range_with_the_table_s_reason(stem):
    path = MODELS[stem]
    status, reason = arch_support(model_arch(stem))
    assert status in ("whole", "not-text")
    with pytest.raises(MeshnetError) as refused:
        Stage(path, (0, 2), n_ctx=64, max_sessions=1, n_threads=THREADS)
    assert refused.value.code == "unsupported_arch"
    assert model_arch(stem) in refused.value.message and reason in refused.value.message


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_a_generated_model_of_the_first_three_architectures_loads_as_every_range(arch, arch_models):
    # these files carry rope_freqs, biases and per-tensor scales as real GGUFs do; before 0006
    # a stage could not load them ("done_getting_tensors: wrong number of tensors")
    path = arch_models[arch]
    with Stage(path, n_ctx=64, max_sessions=1, n_threads=THREADS) as whole:
        n_layer = whole.info().n_layer
    for start in range(n_layer):
        for end in range(start + 1, n_layer + 1):
            with Stage(path, (start, end), n_ctx=64, max_sessions=1, n_threads=THREADS) as stage:
                info = stage.info()
                assert (info.layer_start, info.layer_end) == (start, end)
                assert info.is_head == (start == 0) and info.is_tail == (end == n_layer)


# DeepSeek V4's cache (llama-kv-cache-dsv4.cpp: a raw K-only window, two compressed caches
# at their own ratios, an indexer cache and per-sequence state) is not modelled per layer
# yet: the planner counts it as attention layers, a bound it is not held to here
PLANNER_APPROXIMATE = {"deepseek4"}


@pytest.mark.parametrize("kv_type", ["f16", "q8_0", "q4_0,f16"])
@pytest.mark.parametrize("arch", [arch for arch in SPLITS if arch not in PLANNER_APPROXIMATE])
def test_the_planner_counts_each_stage_s_kv_and_state_as_the_engine_allocates_them(arch, kv_type):
    # per layer type (full attention, sliding window, MLA, indexer keys, recurrent state),
    # from engine.layer_memory, for every split of every generated model of the architecture,
    # with the KV cache in f16, in q8_0 (flash attention) and with K alone quantized; types
    # the model cannot keep (blocks that do not divide its heads, MLA's one cache for K and
    # V, Grok without flash attention) are refused alike by both, saying why
    from meshnet.core import kv_cache
    from meshnet.core.planner import ModelCost
    from meshnet.engine.binding import layer_memory
    from meshnet.engine.gguf_layout import read_layout

    # (a context longer than window + n_batch, so a window that capped its cache would show)
    n_ctx, n_sessions, n_batch = 1024, 2, 256
    attention = dict(kv_type=kv_type, flash_attn=kv_cache.needs_flash_attn(kv_type))
    for stem, path in MODELS.items():
        if model_arch(stem) != arch:
            continue
        try:
            cost = ModelCost.from_layout(read_layout(path), layer_memory(path, kv_type))
        except MeshnetError as refused:
            assert refused.code == "invalid_argument" and "cache" in refused.message, refused
            with pytest.raises(MeshnetError) as also:
                Stage(path, n_ctx=n_ctx, max_sessions=n_sessions, n_threads=THREADS, **attention)
            assert also.value.message == refused.message
            continue
        for ranges in [[(0, cost.n_layer)]] + parity.splits(cost.n_layer):
            for start, end in ranges:
                layers = None if (start, end) == (0, cost.n_layer) else (start, end)
                with Stage(path, layers, n_ctx=n_ctx, max_sessions=n_sessions, n_batch=n_batch,
                           n_threads=THREADS, **attention) as stage:
                    allocated = stage.info().kv_bytes
                assert cost.memory_bytes(start, end, n_ctx, n_sessions) == allocated, (stem, start, end)


@pytest.mark.parametrize("stem", ["qwen3moe-moe", "jamba-dense", "granitehybrid-dense", "gemma3-dense"])
def test_the_planner_s_stage_is_the_engine_s_on_a_moe_a_hybrid_and_a_windowed_model(stem):
    # weights, KV or state and compute buffers (everything but the process overhead) for
    # each stage of a 3-stage split, against what the engine reserves at a long context:
    # within 6%; a stage of recurrent layers only may reserve masks it never fills, which
    # the planner leaves out (tools/plan_rss.py holds the sum to the peak RSS)
    from meshnet.core.planner import ModelCost, Settings, stage_need
    from meshnet.engine.binding import layer_memory
    from meshnet.engine.gguf_layout import read_layout

    path = MODELS[stem]
    settings = Settings(n_ctx=16384, n_sessions=2, n_batch=512)
    cost = ModelCost.from_layout(read_layout(path), layer_memory(path))
    for start, end in ((0, 1), (1, 2), (2, cost.n_layer)):
        with Stage(path, (start, end), n_ctx=settings.n_ctx, max_sessions=settings.n_sessions,
                   n_batch=settings.n_batch, n_threads=THREADS) as stage:
            info = stage.info()
        reserved = info.model_bytes + info.kv_bytes + info.compute_bytes
        predicted = stage_need(cost, start, end, settings, overhead=0)
        if cost.attended_cells(start, end, settings.n_ctx):
            assert abs(predicted - reserved) <= 0.06 * reserved, (start, end, predicted, reserved)
        else:
            assert info.model_bytes + info.kv_bytes < predicted <= reserved, (start, end, predicted, reserved)


def test_the_planner_s_estimate_of_a_real_model_is_within_2_percent_of_what_the_engine_allocates(smollm2_path):
    from meshnet.core.planner import ModelCost, Settings, stage_need
    from meshnet.engine.gguf_layout import read_layout

    cost = ModelCost.from_layout(read_layout(smollm2_path))
    settings = Settings(n_ctx=256, n_sessions=2, n_batch=64)
    for start, end in ((0, 10), (10, 20), (20, 30)):
        with Stage(smollm2_path, (start, end), n_ctx=256, max_sessions=2, n_batch=64, n_threads=1) as stage:
            info = stage.info()
            engine = info.model_bytes + info.kv_bytes + info.compute_bytes
        estimate = stage_need(cost, start, end, settings, overhead=0)
        assert abs(estimate - engine) <= 0.02 * engine + (4 << 20), (start, end, estimate, engine)


def with_metadata(path: str, tmp_path, key: str, value: int) -> str:
    """A copy of the generated model at PATH with one u32 metadata value changed in place."""
    import shutil

    from gguf import GGUFReader

    copy = str(tmp_path / os.path.basename(path))
    shutil.copyfile(path, copy)
    field = GGUFReader(copy, "r+").fields[key]
    field.parts[-1][0] = value
    return copy


def test_a_gemma4_whose_last_layers_share_earlier_kv_is_refused_a_range(tmp_path):
    # Gemma 4 E2B/E4B: their last layers read the KV of earlier ones, which no other stage holds
    path = with_metadata(MODELS["gemma4-dense"], tmp_path, "gemma4.attention.shared_kv_layers", 2)
    with pytest.raises(MeshnetError) as refused:
        Stage(path, (0, 2), n_ctx=64, max_sessions=1, n_threads=THREADS)
    assert refused.value.code == "unsupported_arch"
    assert "layers 3..4 reuse the KV cache of earlier layers" in refused.value.message


def test_a_deepseek4_stage_past_the_head_may_not_start_inside_its_token_routed_layers(tmp_path):
    path = with_metadata(MODELS["deepseek4-moe"], tmp_path, "deepseek4.hash_layer_count", 2)
    with pytest.raises(MeshnetError) as refused:
        Stage(path, (1, 4), n_ctx=64, max_sessions=1, n_threads=THREADS)
    assert refused.value.code == "bad_range"
    assert "layers 0..1 route experts by token id" in refused.value.message and "layer 2 or later" in refused.value.message
