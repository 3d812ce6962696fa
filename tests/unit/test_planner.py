"""The memory planner with plain numbers (a made-up model named as such), and once
against what the engine really allocates for SmolLM2."""

import dataclasses

import pytest

from meshnet.core.errors import MeshnetError
from meshnet.core import defaults
from meshnet.core.planner import ModelCost, Node, Settings, fitted_pool, format_size, parse_size, plan, stage_need

MIB = 1 << 20
TINY = Settings(n_ctx=16, n_sessions=1, n_batch=1)

# a fake model for pure arithmetic: 10 layers of 10 MiB, a 25 MiB embedding on the head,
# a 5 MiB output on the tail, no KV, compute of a few bytes beside the planner's 4 MiB slack
FAKE_MODEL = ModelCost(n_layer=10, layer_bytes=(10 * MIB,) * 10, input_bytes=25 * MIB, output_bytes=5 * MIB,
                       shared_bytes=0, tied_embeddings=False, token_embd_bytes=25 * MIB, kv_bytes_per_cell=0,
                       n_embd=1, n_ff=1, n_head=1, n_vocab=1)


def nodes(**mems):
    return [Node(name, mem * MIB, TINY) for name, mem in mems.items()]


def spans(result):
    return [(s.node, s.layers.start, s.layers.end) for s in result.stages]


def need(start, end):
    return stage_need(FAKE_MODEL, start, end, TINY, overhead=0)


def test_each_node_in_route_order_takes_as_many_layers_as_its_budget_allows_and_the_ranges_cover_exactly():
    result = plan(FAKE_MODEL, nodes(a=70, b=70), overhead=0)
    assert spans(result) == [("a", 0, 4), ("b", 4, 10)]
    assert [s.bytes for s in result.stages] == [need(0, 4), need(4, 10)]
    assert all(s.bytes <= 70 * MIB for s in result.stages)
    assert result.left_out == {}


def test_one_node_that_holds_everything_is_a_plan_of_one_and_later_nodes_are_not_needed():
    result = plan(FAKE_MODEL, nodes(big=1000, other=1000), overhead=0)
    assert spans(result) == [("big", 0, 10)]
    assert "not needed" in result.left_out["other"]


def test_the_tail_s_output_matrix_counts_where_it_lands():
    # each stage: 4 MiB slack; b has room for 2 layers (24 MiB), not 3 + the output (39 MiB)
    result = plan(FAKE_MODEL, nodes(a=100, b=38, c=20), overhead=0)
    assert spans(result) == [("a", 0, 7), ("b", 7, 9), ("c", 9, 10)]


def test_a_shortfall_is_refused_with_the_missing_bytes():
    with pytest.raises(MeshnetError) as err:
        plan(FAKE_MODEL, nodes(a=60, b=60), overhead=0)
    assert err.value.code == "model_does_not_fit"
    # a holds [0,3) (59 MiB); b holds [3,8) and would need 79 MiB for [3,10): 19 MiB short
    assert err.value.context["shortfall_bytes"] == need(3, 10) - 60 * MIB
    assert 19 * MIB <= err.value.context["shortfall_bytes"] < 19 * MIB + 1024
    assert "layers 8..9 fit on no node" in err.value.message and "19.00 MiB" in err.value.message


def test_one_node_too_small_for_the_whole_model_is_refused_with_the_shortfall():
    with pytest.raises(MeshnetError) as err:
        plan(FAKE_MODEL, nodes(only=100), overhead=0)
    assert err.value.context["shortfall_bytes"] == need(0, 10) - 100 * MIB


def test_a_budget_too_small_for_the_head_s_embeddings_is_left_out_with_the_reason():
    result = plan(FAKE_MODEL, nodes(small=30, big=200), overhead=0)
    assert spans(result) == [("big", 0, 10)]
    assert "layer 0 alone needs 39.00 MiB (with the token embedding)" in result.left_out["small"]
    with pytest.raises(MeshnetError) as err:
        plan(FAKE_MODEL, nodes(small=30), overhead=0)
    assert err.value.context["shortfall_bytes"] == need(0, 10) - 30 * MIB


def test_kv_for_the_context_and_sessions_and_the_overhead_are_counted():
    with_kv = dataclasses.replace(FAKE_MODEL, kv_bytes_per_cell=1024)
    settings = Settings(n_ctx=1024, n_sessions=4, n_batch=1)
    assert (stage_need(with_kv, 0, 2, settings, overhead=7) - stage_need(FAKE_MODEL, 0, 2, settings, overhead=0)
            == 2 * 1024 * 1024 * 4 + 7)
    # the head: 25 MiB embedding + 4 MiB compute slack + 14 MiB per layer (10 weights, 4 KV)
    assert plan(with_kv, [Node("a", 100 * MIB, settings), Node("b", 1000 * MIB, settings)],
                overhead=0).stages[0].layers.end == 5


def test_a_part_of_the_model_can_be_planned_alone_to_fill_a_gap():
    result = plan(FAKE_MODEL, nodes(spare=40), overhead=0, start=4, end=7)
    assert spans(result) == [("spare", 4, 7)]


def test_cost_round_trips_through_plain_data():
    assert ModelCost.from_dict(FAKE_MODEL.to_dict()) == FAKE_MODEL


@pytest.mark.parametrize("text,value", [("800M", 800 * MIB), ("1.5G", int(1.5 * (1 << 30))), ("512MiB", 512 * MIB),
                                        ("64k", 64 << 10), ("1048576", 1 << 20), ("2gb", 2 << 30)])
def test_sizes_parse_in_binary_units(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "M", "-1G", "0", "lots", "1.5X"])
def test_bad_sizes_are_refused(text):
    with pytest.raises(MeshnetError) as err:
        parse_size(text)
    assert err.value.code == "invalid_argument"


def test_format_size():
    assert format_size(1536 * MIB) == "1.50 GiB" and format_size(12) == "12 B"


# a fake hybrid model for pure arithmetic: attention, a sliding-window layer, a recurrent
# layer, attention again (per-layer memory as engine.layer_memory gives it)
FAKE_HYBRID = dataclasses.replace(FAKE_MODEL, n_layer=4, layer_bytes=(MIB,) * 4, kv_bytes_per_cell=1000,
                                  layer_kv_bytes=(1000, 1000, 0, 1000), layer_window=(0, 100, 0, 0),
                                  layer_state_bytes=(0, 0, 5 * MIB, 0))


def test_each_layer_keeps_its_own_kind_of_memory():
    # attention: n_ctx cells, a sliding-window layer too (the engine keeps the full-size
    # window cache); recurrent: its state, whatever the context; all of it per session
    assert FAKE_HYBRID.memory_bytes(0, 1, 4096, 2) == 2 * 1000 * 4096
    assert FAKE_HYBRID.memory_bytes(1, 2, 4096, 2) == 2 * 1000 * 4096
    assert FAKE_HYBRID.memory_bytes(2, 3, 4096, 3) == 3 * 5 * MIB
    assert FAKE_HYBRID.memory_bytes(0, 4, 4096, 1) == 1000 * 3 * 4096 + 5 * MIB
    # without per-layer memory every layer counts as full-context attention
    uniform = dataclasses.replace(FAKE_HYBRID, layer_kv_bytes=(), layer_window=(), layer_state_bytes=())
    assert uniform.memory_bytes(2, 3, 4096, 3) == 3 * 1000 * 4096


def test_an_attention_stage_pays_for_the_masks_of_every_cache_of_the_model():
    # the graph fills one F32 mask per cache of the model, whichever layers a stage holds:
    # a second where a layer has a window; a recurrent stage fills none
    settings = Settings(n_ctx=4096, n_sessions=1, n_batch=512)
    no_window = dataclasses.replace(FAKE_HYBRID, layer_window=(0,) * 4)
    mask = 4 * 512 * 4096
    assert (FAKE_HYBRID.attention_masks, no_window.attention_masks) == (2, 1)
    assert stage_need(FAKE_HYBRID, 3, 4, settings, overhead=0) - stage_need(no_window, 3, 4, settings, overhead=0) == mask
    assert stage_need(FAKE_HYBRID, 2, 3, settings, overhead=0) == stage_need(no_window, 2, 3, settings, overhead=0)


def test_the_per_layer_memory_crosses_the_wire_and_is_left_out_when_unknown():
    assert ModelCost.from_dict(FAKE_HYBRID.to_dict()) == FAKE_HYBRID
    assert "layer_kv_bytes" not in FAKE_MODEL.to_dict() and ModelCost.from_dict(FAKE_MODEL.to_dict()) == FAKE_MODEL


def test_a_recurrent_stage_is_planned_by_its_state_not_by_a_context_of_kv():
    settings = Settings(n_ctx=4096, n_sessions=8, n_batch=512)
    recurrent = stage_need(FAKE_HYBRID, 2, 3, settings, overhead=0)
    attention = stage_need(FAKE_HYBRID, 3, 4, settings, overhead=0)
    assert attention - recurrent > 8 * 1000 * 4096 - 8 * 5 * MIB - 1


def test_a_kv_pool_costs_its_cells_however_many_sessions_share_it():
    with_kv = ModelCost(**{**FAKE_MODEL.to_dict(), "kv_bytes_per_cell": 10})
    kv = lambda settings: stage_need(with_kv, 0, 2, settings, overhead=0) - stage_need(FAKE_MODEL, 0, 2, settings, overhead=0)
    streams = kv(Settings(n_ctx=2048, n_sessions=8))
    assert kv(Settings(n_ctx=8192, n_sessions=8, kv_pool=16384)) == streams == 2 * 10 * 16384   # 2 layers
    assert kv(Settings(n_ctx=8192, n_sessions=64, kv_pool=16384)) == streams   # 64 sessions in the same cells
    assert kv(Settings(n_ctx=2048, n_sessions=64)) == 8 * streams               # 64 streams of 2048


def test_a_pool_a_hybrid_cannot_share_holds_whole_contexts():
    # the engine gives a model with a recurrent layer a stream per session: a pool of
    # 16384 cells with contexts of 4096 holds 4 whole sessions, each a state and its KV
    settings = Settings(n_ctx=4096, n_sessions=64, n_batch=1, kv_pool=16384)
    assert not FAKE_HYBRID.shares_pool and FAKE_MODEL.shares_pool
    assert stage_need(FAKE_HYBRID, 0, 4, settings, overhead=0) == stage_need(
        FAKE_HYBRID, 0, 4, Settings(n_ctx=4096, n_sessions=4, n_batch=1), overhead=0)


@pytest.mark.parametrize("trained, given_ctx, given_pool, expected", [
    (8192, None, None, (8192, 16384)),     # SmolLM2: its context, a pool of 64 one-block sessions
    (32768, None, None, (32768, 36864)),   # a 32k model: one whole context and short ones beside it
    (131072, None, None, (32768, 36864)),  # a 128k model: capped
    (256, None, None, (2048, 16384)),      # a generated test model: at least 2048
    (0, None, None, (2048, 16384)),        # a file that does not say
    (8192, 4096, None, (4096, 16384)),     # --ctx: a cap
    (8192, None, 4096, (4096, 4096)),      # --kv-pool smaller than the model's context caps it
    (8192, None, 0, (8192, 0)),            # --kv-pool 0: a stream per session
    (8192, 4096, 0, (4096, 0)),
])
def test_a_worker_s_context_and_pool_come_from_the_model_s_trained_context(trained, given_ctx, given_pool, expected):
    assert defaults.kv_settings(trained, given_ctx, given_pool) == expected


def test_a_default_pool_is_no_larger_than_every_session_at_its_whole_context():
    assert defaults.kv_settings(8192, 512, None, max_sessions=2) == (512, 1024)


def test_a_default_pool_takes_what_the_memory_leaves_beside_the_range_down_to_one_context():
    with_kv = ModelCost(**{**FAKE_MODEL.to_dict(), "kv_bytes_per_cell": 1024})   # 1 KiB a cell: 4 blocks a MiB
    settings = Settings(n_ctx=2048, n_sessions=64, n_batch=1, kv_pool=16384, pool_floor=2048)
    at_floor = stage_need(with_kv, 1, 3, settings, overhead=0)
    assert at_floor == stage_need(with_kv, 1, 3, dataclasses.replace(settings, kv_pool=2048, pool_floor=0), overhead=0)
    # 6 MiB more than the floor needs: the largest pool in blocks that fits
    fixed = lambda cells: dataclasses.replace(settings, kv_pool=cells, pool_floor=0)
    pool = fitted_pool(with_kv, 1, 3, settings, at_floor + 6 * MIB, overhead=0)
    assert 2048 < pool < 16384 and pool % 256 == 0
    assert stage_need(with_kv, 1, 3, fixed(pool), overhead=0) <= at_floor + 6 * MIB \
        < stage_need(with_kv, 1, 3, fixed(pool + 256), overhead=0)
    assert fitted_pool(with_kv, 1, 3, settings, 10 << 30, overhead=0) == 16384    # no more than the pool asked
    assert fitted_pool(with_kv, 1, 3, settings, at_floor - 1, overhead=0) == 2048  # (the planner's floor)
    assert fitted_pool(with_kv, 1, 3, dataclasses.replace(settings, pool_floor=0), 1, overhead=0) == 16384
    # the planner gives a node the layers that fit with the floor's pool
    wide = plan(with_kv, [Node("a", at_floor + 10 * MIB, settings), Node("b", 1 << 30, settings)], overhead=0, start=1)
    narrow = plan(with_kv, [Node("a", at_floor + 10 * MIB, dataclasses.replace(settings, pool_floor=0)),
                            Node("b", 1 << 30, settings)], overhead=0, start=1)
    assert wide.stages[0].layers.end > narrow.stages[0].layers.end
