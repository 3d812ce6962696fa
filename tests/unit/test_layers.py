"""One layer-range type from the command line to the engine binding: plain data, no model."""

import pytest

from meshnet.core.errors import BAD_RANGE, MeshnetError
from meshnet.core.layers import LayerRange, balanced_ranges, even_ranges, parse_seams, ranges_from_seams


def refused(fn, *args, **kwargs) -> str:
    with pytest.raises(MeshnetError) as err:
        fn(*args, **kwargs)
    assert err.value.code == BAD_RANGE
    return err.value.message


def test_parse_reads_a_half_open_range_and_unpacks_like_a_pair():
    r = LayerRange.parse("0:15")
    assert r == LayerRange(0, 15) and r.n_layer is None
    start, end = r
    assert (start, end) == r.as_tuple() == (0, 15)
    assert r.label == "[0,15)"
    assert LayerRange.parse(" 15 : 30 ", n_layer=30) == LayerRange(15, 30, 30)


@pytest.mark.parametrize("text", ["", "15", "a:b", "0:15:30", "0-15", "1.5:3", ":15"])
def test_parse_refuses_what_is_not_a_range_saying_what_a_range_looks_like(text):
    assert "is not a layer range A:B" in refused(LayerRange.parse, text)


@pytest.mark.parametrize("text", ["5:5", "20:10", "-1:4"])
def test_parse_refuses_an_empty_reversed_or_negative_range(text):
    assert "empty or reversed" in refused(LayerRange.parse, text)


def test_parse_with_the_model_known_refuses_a_range_past_its_last_layer():
    message = refused(LayerRange.parse, "0:31", n_layer=30)
    assert "[0,31)" in message and "30 layers" in message
    assert LayerRange.parse("0:30", n_layer=30).is_tail


def test_bounds_must_be_integers():
    for start, end in ((0.0, 15), (True, 15), ("0", 15)):
        refused(LayerRange, start, end)
    refused(LayerRange, 0, 15, n_layer=0)


def test_within_binds_a_range_to_the_model_and_checks_it():
    r = LayerRange(15, 30)
    bound = r.within(30)
    assert bound == LayerRange(15, 30, 30) and bound.is_tail and not r.is_tail
    assert "outside the model's 20 layers" in refused(r.within, 20)
    assert "given for a model of 30 layers" in refused(bound.within, 40)
    assert bound.within(30) == bound


def test_head_and_tail():
    head, middle, tail = LayerRange(0, 10, 30), LayerRange(10, 20, 30), LayerRange(20, 30, 30)
    assert head.is_head and not head.is_tail
    assert not middle.is_head and not middle.is_tail
    assert tail.is_tail and not tail.is_head
    whole = LayerRange(0, 30, 30)
    assert whole.is_head and whole.is_tail
    assert LayerRange(0, 30).is_head and not LayerRange(0, 30).is_tail  # the tail is unknown until the model is


def test_a_range_is_a_frozen_hashable_value():
    r = LayerRange(0, 15, 30)
    with pytest.raises(AttributeError):
        r.start = 1
    assert {r: "head"}[LayerRange(0, 15, 30)] == "head"
    assert LayerRange(0, 15) != r  # a range bound to a model is not the same as one that is not


@pytest.mark.parametrize("n_layer,n_stages,expected", [
    (30, 1, [(0, 30)]),
    (30, 2, [(0, 15), (15, 30)]),
    (30, 3, [(0, 10), (10, 20), (20, 30)]),
    (30, 4, [(0, 8), (8, 15), (15, 22), (22, 30)]),
    (5, 5, [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]),
])
def test_even_ranges_cover_the_model_in_near_equal_bound_ranges(n_layer, n_stages, expected):
    ranges = even_ranges(n_layer, n_stages)
    assert [r.as_tuple() for r in ranges] == expected
    assert all(r.n_layer == n_layer for r in ranges)
    assert ranges[0].is_head and ranges[-1].is_tail


@pytest.mark.parametrize("n_stages", [0, 31])
def test_even_ranges_refuse_more_stages_than_layers_or_none(n_stages):
    assert "cannot split 30 layers" in refused(even_ranges, 30, n_stages)


def test_seams_split_the_model_where_they_say():
    assert [r.label for r in ranges_from_seams(30, [15])] == ["[0,15)", "[15,30)"]
    assert [r.as_tuple() for r in ranges_from_seams(30, [10, 20])] == [(0, 10), (10, 20), (20, 30)]
    assert ranges_from_seams(30, []) == [LayerRange(0, 30, 30)]


@pytest.mark.parametrize("seams", [[0], [30], [40], [20, 10], [10, 10]])
def test_seams_must_rise_strictly_inside_the_model(seams):
    assert "must rise strictly between 0 and 30" in refused(ranges_from_seams, 30, seams)


def test_parse_seams_reads_a_comma_separated_list():
    assert parse_seams("10,20") == [10, 20]
    assert parse_seams("15") == [15]
    assert parse_seams(" 10 , 20 ,") == [10, 20]
    assert "comma-separated list of layer numbers" in refused(parse_seams, "10;20")
    assert "comma-separated list of layer numbers" in refused(parse_seams, "ten")


def test_balanced_ranges_give_the_tail_fewer_layers_for_its_output_matrix():
    # ten layers of work 10; the output matrix is worth 20: [0,6) = 60 and [6,10) = 40 + 20
    assert [r.label for r in balanced_ranges([10] * 10, 20, 2)] == ["[0,6)", "[6,10)"]
    assert [r.label for r in balanced_ranges([10] * 10, 0, 2)] == ["[0,5)", "[5,10)"]
    three = balanced_ranges([10] * 12, 30, 3)
    assert [r.label for r in three] == ["[0,5)", "[5,10)", "[10,12)"] and three[-1].is_tail
    assert [r.as_tuple() for r in balanced_ranges([1, 1, 100, 1], 0, 2)] == [(0, 2), (2, 4)]


def test_balanced_ranges_refuse_more_stages_than_layers():
    assert "cannot split 3 layers" in refused(balanced_ranges, [1, 1, 1], 0, 4)
