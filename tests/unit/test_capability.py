"""A READY's capability parsed once into a typed Capability: what it keeps, and what it
refuses, as plain data."""

from __future__ import annotations

import pytest

from meshnet.core.planner import ModelCost
from meshnet.net.capability import Capability
from meshnet.net.fields import MAX_LAYERS, ProtocolError

from fakes import fake_wire_capability

COST = ModelCost(n_layer=4, layer_bytes=(10,) * 4, input_bytes=5, output_bytes=5, shared_bytes=0,
                 tied_embeddings=False, token_embd_bytes=5, kv_bytes_per_cell=2, n_embd=8, n_ff=16, n_head=2,
                 n_vocab=32, layer_kv_bytes=(2,) * 4, layer_window=(0,) * 4, layer_state_bytes=(0,) * 4)


def test_a_worker_s_map_parses_to_typed_fields_and_back_unchanged():
    wire = fake_wire_capability("w1", 0, 2)
    capability = Capability.parse(wire)
    assert capability.layers == (0, 2) and capability.holds_layers and capability.n_embd == 8
    assert capability.to_wire() == wire


@pytest.mark.parametrize("numerics", ["invariant", "stock"])
def test_flash_attention_is_kept_where_a_worker_names_it_and_left_off_the_wire_where_not(numerics):
    wire = dict(fake_wire_capability("w1", 0, 2), numerics=numerics, flash_attn=True)
    capability = Capability.parse(wire)
    assert capability.flash_attn and capability.to_wire() == wire
    assert not Capability.parse(fake_wire_capability("w1", 0, 2)).flash_attn


def test_a_kv_cache_type_is_kept_where_a_worker_names_it_and_left_off_the_wire_for_f16():
    wire = dict(fake_wire_capability("w1", 0, 2), flash_attn=True, kv_type="q8_0,f16")
    capability = Capability.parse(wire)
    assert capability.kv_type == "q8_0,f16" and capability.to_wire() == wire
    assert Capability.parse(fake_wire_capability("w1", 0, 2)).kv_type == "f16"
    assert "kv_type" not in Capability.parse(fake_wire_capability("w1", 0, 2)).to_wire()


def test_a_waiting_worker_s_cost_table_becomes_the_planner_s_model_cost():
    wire = {k: v for k, v in fake_wire_capability("w1", 0, 1).items() if k not in ("layers", "data_endpoint")}
    wire.update(mem_bytes=1 << 30, cost=COST.to_dict())
    capability = Capability.parse(wire)
    assert not capability.holds_layers and capability.cost == COST
    assert capability.to_wire() == wire


@pytest.mark.parametrize("change, why", [
    (dict(layers=None), "field 'layers' has a bad value"),
    (dict(data_endpoint=None), "gives its 'data_endpoint'"),
    (dict(layers=[2, 5]), "outside a model of 4 layers"),
    (dict(n_layer=MAX_LAYERS + 1), "field 'n_layer' has a bad value"),
    (dict(n_ctx=True), "field 'n_ctx' has a bad value"),            # a bool is not an int here
    (dict(wire_dtype="f16"), "field 'wire_dtype' has a bad value"),
    (dict(surprise=1), "unknown field"),
    (dict(flash_attn=1), "field 'flash_attn' has a bad value"),
    (dict(kv_type="q3_k"), "field 'kv_type' has a bad value"),
    (dict(kv_type="q8_0,q8_0"), "field 'kv_type' has a bad value"),   # (one spelling of a class: "q8_0")
])
def test_a_capability_no_route_can_use_is_refused_saying_which_field(change, why):
    wire = fake_wire_capability("w1", 0, 2)
    for name, value in change.items():
        if value is None and name == "data_endpoint":
            del wire[name]
        else:
            wire[name] = value
    with pytest.raises(ProtocolError, match=why) as refused:
        Capability.parse(wire)
    assert refused.value.code == "bad_field"


def test_a_cost_table_that_disagrees_with_the_model_is_refused():
    wire = {k: v for k, v in fake_wire_capability("w1", 0, 1).items() if k not in ("layers", "data_endpoint")}
    wire.update(mem_bytes=1 << 30, cost=dict(COST.to_dict(), n_vocab=64))
    with pytest.raises(ProtocolError, match="its n_vocab disagrees"):
        Capability.parse(wire)
