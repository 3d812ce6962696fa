"""Route building from plain offers: no sockets, no models (meshnet.tracker promises this)."""

import itertools

import pytest

from meshnet.errors import MeshnetError
from meshnet.layers import LayerRange
from meshnet.tracker import StageOffer, build_route, offer_from_capability

SHA_A = "a" * 64
SHA_B = "b" * 64
CPU = ("llama.cpp@0c1e57098", "CPU", "f32")


def offer(worker, start, end, *, sha=SHA_A, n_layer=30, compat=CPU):
    return StageOffer(worker=worker, model_sha256=sha, layers=LayerRange(start, end, n_layer), compat_class=compat)


def refusal(offers, **kwargs) -> str:
    with pytest.raises(MeshnetError) as err:
        build_route(offers, **kwargs)
    assert err.value.code == "route_incomplete"
    return err.value.message


def spans(route):
    return [(o.start, o.end) for o in route]


def test_exact_cover_comes_back_in_layer_order_whatever_order_the_offers_came_in():
    offers = [offer("tail", 20, 30), offer("head", 0, 10), offer("middle", 10, 20)]
    for permutation in itertools.permutations(offers):
        route = build_route(permutation)
        assert [o.worker for o in route] == ["head", "middle", "tail"]
        assert spans(route) == [(0, 10), (10, 20), (20, 30)]


def test_one_worker_holding_every_layer_is_a_route_of_one():
    assert spans(build_route([offer("whole", 0, 30)])) == [(0, 30)]


@pytest.mark.parametrize("offers,missing", [
    ([offer("w1", 5, 30)], "0..4"),
    ([offer("w1", 0, 10), offer("w2", 15, 30)], "10..14"),
    ([offer("w1", 0, 10), offer("w2", 10, 25)], "25..29"),
], ids=["start", "middle", "end"])
def test_a_gap_is_refused_naming_the_missing_layers(offers, missing):
    message = refusal(offers)
    assert message.startswith("gap:")
    assert f"layers {missing} of 30" in message


def test_overlapping_ranges_with_no_exact_cover_are_refused_naming_the_shared_layers():
    message = refusal([offer("w1", 0, 15), offer("w2", 10, 30)])
    assert message.startswith("overlap:")
    assert "[0,15)" in message and "[10,30)" in message and "layers 10..14" in message


def test_an_exact_cover_is_found_among_overlapping_offers():
    # [0,15) and [10,30) overlap, but [10,20)+[20,30) with [0,10) cover exactly: the overlap is no refusal
    offers = [offer("a", 0, 15), offer("b", 10, 30), offer("c", 0, 10), offer("d", 10, 20), offer("e", 20, 30)]
    route = build_route(offers)
    assert spans(route) in ([(0, 10), (10, 30)], [(0, 10), (10, 20), (20, 30)])


def test_a_dead_end_branch_is_backed_out_of():
    # [0,10) sorts first but nothing starts at 10: only [0,15)+[15,30) covers
    route = build_route([offer("short", 0, 10), offer("long", 0, 15), offer("tail", 15, 30)])
    assert [o.worker for o in route] == ["long", "tail"]


def test_hash_mismatch_is_refused_naming_both_models():
    message = refusal([offer("w1", 0, 15, sha=SHA_A), offer("w2", 15, 30, sha=SHA_B)])
    assert message.startswith("hash mismatch")
    assert SHA_A[:12] in message and SHA_B[:12] in message


def test_incompatible_class_is_refused_naming_the_difference():
    gpu = ("llama.cpp@0c1e57098", "CUDA", "f32")
    message = refusal([offer("w1", 0, 15), offer("w2", 15, 30, compat=gpu)])
    assert message.startswith("incompatible class")
    assert "CPU" in message and "CUDA" in message


def test_duplicate_ranges_give_one_chain_each_layer_once_the_same_for_any_offer_order():
    offers = [offer("h1", 0, 15), offer("h2", 0, 15), offer("t1", 15, 30), offer("t2", 15, 30)]
    routes = {tuple(o.worker for o in build_route(p)) for p in itertools.permutations(offers)}
    assert len(routes) == 1, routes  # deterministic: the order workers registered in does not matter
    (workers,) = routes
    assert len(workers) == 2 and workers[0] in ("h1", "h2") and workers[1] in ("t1", "t2")


def test_model_filter_builds_the_route_of_that_model_only():
    offers = [offer("a-head", 0, 15, sha=SHA_A), offer("a-tail", 15, 30, sha=SHA_A),
              offer("b-head", 0, 10, sha=SHA_B, n_layer=20), offer("b-tail", 10, 20, sha=SHA_B, n_layer=20)]
    assert [o.worker for o in build_route(offers, model_sha256=SHA_A)] == ["a-head", "a-tail"]
    assert [o.worker for o in build_route(offers, model_sha256=SHA_B)] == ["b-head", "b-tail"]
    # without the filter, two models is a mismatch, not a mixed route
    assert refusal(offers).startswith("hash mismatch")


def test_model_filter_with_no_worker_for_that_model_says_so():
    message = refusal([offer("w1", 0, 30, sha=SHA_A)], model_sha256=SHA_B)
    assert "no worker has registered" in message and SHA_B[:12] in message


def test_no_offers_is_refused():
    assert "no worker has registered" in refusal([])


def test_offer_from_capability_reads_the_fields_a_worker_announces():
    capability = {"model_sha256": SHA_A, "layers": [15, 30], "n_layer": 30, "engine_pin": CPU[0],
                  "backend": "CPU", "wire_dtype": "f32", "n_embd": 576}
    assert offer_from_capability("w9", capability) == offer("w9", 15, 30)


def test_a_head_gathers_its_sessions_only_when_its_machine_s_stages_would_fight_for_cores():
    from meshnet.tracker import head_gathers

    def stage(host, threads, cpus=2):
        return {"clock_id": host, "n_threads": threads, "n_cpus": cpus}

    assert head_gathers([stage("a", 2), stage("a", 2)])                  # 4 threads on 2 cores
    assert not head_gathers([stage("a", 1), stage("a", 1)])              # one core each: pipeline
    assert not head_gathers([stage("a", 2), stage("b", 2)])              # two hosts: pipeline
    assert head_gathers([stage("a", 2), stage("b", 2), stage("a", 1)])   # 3 threads on the head's 2 cores
    assert not head_gathers([stage("a", 8, cpus=16), stage("a", 8, cpus=16)])
    assert not head_gathers([stage("a", 2)])                             # alone: nothing to gather
