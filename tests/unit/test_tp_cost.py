"""The tensor-parallel cost model (core/tp_cost.py) on plain numbers."""

import pytest

from meshnet.core import tp_cost

# Qwen2.5-Coder-1.5B's shape (gguf_layout): 28 layers, 1536 wide, 12 heads of 128, FFN 8960
QWEN = dict(n_layer=28, n_embd=1536, attn_width=1536, n_ff=8960, n_vocab=151936,
            layer_weights=1_310_339_072, output_weights=233_373_696)


def test_a_group_of_two_gathers_four_times_a_layer_and_once_for_the_logits():
    shape = tp_cost.group_shape(2, **QWEN)
    assert shape.gathers == 113
    # half of every gathered row, to one peer, with each message's header and tag:
    # what tools/tp_bench.py counts the engine sending (1069 kB a token)
    assert shape.sent_bytes == 4 * (28 * (1536 + 1536 + 8960 + 1536) + 151936) // 2 + 113 * (32 + 16)
    assert round(shape.sent_bytes / 1e3) == 1069
    assert shape.member_share == 0.5


def test_more_members_send_to_more_peers_and_read_less():
    two, four = tp_cost.group_shape(2, **QWEN), tp_cost.group_shape(4, **QWEN)
    assert four.gathers == two.gathers
    assert four.sent_bytes > two.sent_bytes   # 3 peers x a quarter against 1 peer x a half
    assert four.member_share == 0.25


def test_weights_every_member_reads_whole_raise_its_share():
    shape = tp_cost.group_shape(2, **dict(QWEN, layer_weights=1000, output_weights=0), replicated_weights=200)
    assert shape.member_share == pytest.approx((800 / 2 + 200) / 1000)


def test_the_groups_time_is_its_members_compute_and_its_exchange():
    shape = tp_cost.group_shape(2, **QWEN)
    link = tp_cost.LinkCost(gather_us=20.0, bandwidth=1e9)
    exchange = 113 * 20e-3 + shape.sent_bytes / 1e6
    assert tp_cost.exchange_ms(shape, link) == pytest.approx(exchange)
    assert tp_cost.group_ms(30.0, shape, link) == pytest.approx(30.0 + exchange)
    assert tp_cost.member_ms_from_whole(60.0, shape) == pytest.approx(30.0)


def test_the_break_even_gather_is_where_the_group_is_as_slow_as_the_whole_model():
    shape = tp_cost.group_shape(2, **QWEN)
    at = tp_cost.break_even_gather_us(60.0, 30.0, shape, bandwidth=1e9)
    link = tp_cost.LinkCost(gather_us=at, bandwidth=1e9)
    assert tp_cost.group_ms(30.0, shape, link) == pytest.approx(60.0)
    # a slow link's bytes alone can take all the room: then no latency pays
    assert tp_cost.break_even_gather_us(60.0, 30.0, shape, bandwidth=1e7) < 0


def test_a_group_of_one_is_refused():
    with pytest.raises(ValueError):
        tp_cost.group_shape(1, **QWEN)


def test_a_group_without_the_output_layer_gathers_no_logits_and_unsealed_rows_carry_no_tag():
    middle = tp_cost.group_shape(2, **dict(QWEN, n_vocab=0, output_weights=0))
    assert middle.gathers == 112
    plain = tp_cost.group_shape(2, **QWEN, sealed=False)
    assert tp_cost.group_shape(2, **QWEN).sent_bytes - plain.sent_bytes == 113 * 16
