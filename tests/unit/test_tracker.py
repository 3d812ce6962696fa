"""Route building from plain offers: no sockets, no models (meshnet.route.tracker promises this)."""

import itertools

import pytest

from meshnet.core.errors import MeshnetError
from meshnet.core.layers import LayerRange
from meshnet.net.capability import Capability
from meshnet.route.tracker import CompatClass, StageOffer, build_route, choose_route, offer_from_capability

SHA_A = "a" * 64
SHA_B = "b" * 64
CPU = ("llama.cpp@0c1e57098", "CPU", "f32", "invariant")
_order = itertools.count()


def offer(worker, start, end, *, sha=SHA_A, n_layer=30, compat=CPU, registered=None, n_embd=576):
    return StageOffer(worker=worker, layers=LayerRange(start, end, n_layer), compat_class=CompatClass(sha, *compat),
                      registered=next(_order) if registered is None else registered, n_embd=n_embd)


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
    assert message.startswith("gap:")
    assert "w2 [15,30) (hash mismatch" in message
    assert SHA_A[:12] in message and SHA_B[:12] in message


def test_incompatible_class_is_refused_naming_the_difference():
    gpu = ("llama.cpp@0c1e57098", "CUDA", "f32", "invariant")
    message = refusal([offer("w1", 0, 15), offer("w2", 15, 30, compat=gpu)])
    assert "w2 [15,30) (incompatible class" in message
    assert "backend CUDA vs CPU" in message


def test_a_route_that_mixes_numerics_classes_is_refused_naming_both():
    stock = ("llama.cpp@0c1e57098", "CPU", "f32", "stock")
    message = refusal([offer("w1", 0, 15), offer("w2", 15, 30, compat=stock)])
    assert "w2 [15,30) (incompatible class" in message
    assert "numerics stock vs invariant" in message


def test_flash_attention_is_a_class_of_its_own_within_the_stock_class():
    stock = ("llama.cpp@0c1e57098", "CPU", "f32", "stock")
    message = refusal([offer("w1", 0, 15, compat=stock), offer("w2", 15, 30, compat=(*stock, True))])
    assert "w2 [15,30) (incompatible class" in message and "flash attn True vs False" in message
    assert "numerics stock flash attention" in str(CompatClass(SHA_A, *stock, True))
    assert spans(build_route([offer("h", 0, 15, compat=(*stock, True)), offer("t", 15, 30, compat=(*stock, True))])) \
        == [(0, 15), (15, 30)]


def test_a_kv_cache_type_is_a_class_of_its_own():
    invariant = ("llama.cpp@0c1e57098", "CPU", "f32", "invariant", True)
    message = refusal([offer("w1", 0, 15, compat=(*invariant, "q8_0")), offer("w2", 15, 30, compat=invariant)])
    assert "w2 [15,30) (incompatible class" in message and "kv type f16 vs q8_0" in message
    assert str(CompatClass(SHA_A, *invariant, "q4_0")).endswith("numerics invariant flash attention kv q4_0")
    assert spans(build_route([offer("h", 0, 15, compat=(*invariant, "q8_0")),
                              offer("t", 15, 30, compat=(*invariant, "q8_0"))])) == [(0, 15), (15, 30)]


def test_a_worker_of_another_class_never_makes_the_route_incomplete_for_the_compatible_ones():
    gpu = ("llama.cpp@0c1e57098", "CUDA", "f32", "invariant")
    other_pin = ("llama.cpp@0c1e57098 patches=ffff", "CPU", "f32", "invariant")
    intruders = [offer("stranger", 0, 30, sha=SHA_B, n_layer=30, registered=-3),
                 offer("gpu", 0, 15, compat=gpu, registered=-2), offer("pin", 15, 30, compat=other_pin, registered=-1)]
    for permutation in itertools.permutations([offer("h", 0, 15), offer("t", 15, 30), *intruders]):
        route = choose_route(permutation, model_sha256=SHA_A)
        assert [o.worker for o in route.stages] == ["h", "t"]
        assert route.kept_out["stranger"].startswith("hash mismatch") and SHA_B[:12] in route.kept_out["stranger"]
        assert route.kept_out["gpu"].startswith("incompatible class") and "backend CUDA vs CPU" in route.kept_out["gpu"]
        assert "engine pin" in route.kept_out["pin"]


def test_between_complete_routes_fewer_stages_win_then_the_earliest_registered():
    offers = [offer("h1", 0, 15, registered=1), offer("t1", 15, 30, registered=2),
              offer("whole", 0, 30, registered=9), offer("h0", 0, 15, registered=5), offer("t0", 15, 30, registered=0)]
    for permutation in itertools.permutations(offers):
        assert [o.worker for o in build_route(permutation)] == ["whole"]
    without_whole = [o for o in offers if o.worker != "whole"]
    for permutation in itertools.permutations(without_whole):
        route = choose_route(permutation)
        assert [o.worker for o in route.stages] == ["h1", "t0"]   # the earliest head, then the earliest tail
        assert route.kept_out == {"h0": "spare: another worker holds [0,15) in the route",
                                  "t1": "spare: another worker holds [15,30) in the route"}


def test_a_spare_takes_the_place_of_a_lost_stage():
    head, tail, spare = offer("h", 0, 15), offer("t", 15, 30), offer("t-spare", 15, 30)
    assert [o.worker for o in build_route([head, tail, spare])] == ["h", "t"]
    assert [o.worker for o in build_route([head, spare])] == ["h", "t-spare"]   # t lost


def test_two_models_each_with_a_route_the_earliest_registered_serves_without_a_filter():
    offers = [offer("b-head", 0, 10, sha=SHA_B, n_layer=20, registered=0), offer("b-tail", 10, 20, sha=SHA_B, n_layer=20, registered=1),
              offer("a-head", 0, 15, sha=SHA_A, registered=2), offer("a-tail", 15, 30, sha=SHA_A, registered=3)]
    assert [o.worker for o in build_route(offers, model_sha256=SHA_A)] == ["a-head", "a-tail"]
    assert [o.worker for o in build_route(offers, model_sha256=SHA_B)] == ["b-head", "b-tail"]
    route = choose_route(offers)
    assert [o.worker for o in route.stages] == ["b-head", "b-tail"]
    assert route.kept_out["a-head"].startswith("hash mismatch")


def test_allow_mixed_lets_other_classes_of_the_same_shape_in_and_says_the_route_is_mixed():
    gpu = ("llama.cpp@0c1e57098", "CUDA", "f32", "invariant")
    offers = [offer("h", 0, 15), offer("t-gpu", 15, 30, compat=gpu), offer("other-model", 0, 10, sha=SHA_B, n_layer=20)]
    assert "incompatible class" in refusal(offers[:2])
    route = choose_route(offers, allow_mixed=True)
    assert [o.worker for o in route.stages] == ["h", "t-gpu"] and route.mixed
    assert route.kept_out["other-model"].startswith("hash mismatch")
    assert not choose_route([offer("h", 0, 15), offer("t", 15, 30)], allow_mixed=True).mixed
    # a model of another width cannot continue the residual, mixed or not
    head = offer("h", 0, 15)
    assert "t-wide [15,30) (hash mismatch" in refusal([head, offer("t-wide", 15, 30, sha=SHA_B, n_embd=1536)],
                                                      allow_mixed=True)


def test_allow_mixed_still_never_mixes_the_numerics_classes():
    gpu_stock = ("llama.cpp@0c1e57098", "CUDA", "f32", "stock")
    message = refusal([offer("h", 0, 15), offer("t-gpu", 15, 30, compat=gpu_stock)], allow_mixed=True)
    assert "t-gpu [15,30) (incompatible class" in message and "numerics stock vs invariant" in message
    cpu_stock = ("llama.cpp@0c1e57098", "CPU", "f32", "stock")
    route = choose_route([offer("h", 0, 15, compat=cpu_stock), offer("t-gpu", 15, 30, compat=gpu_stock)],
                         allow_mixed=True)
    assert [o.worker for o in route.stages] == ["h", "t-gpu"] and route.mixed


def test_model_filter_with_no_worker_for_that_model_says_so():
    message = refusal([offer("w1", 0, 30, sha=SHA_A)], model_sha256=SHA_B)
    assert "no worker has registered" in message and SHA_B[:12] in message


def test_no_offers_is_refused():
    assert "no worker has registered" in refusal([])


def test_offer_from_capability_reads_the_fields_a_worker_announces():
    capability = Capability(worker_id="w9", model_sha256=SHA_A, arch="llama", layers=(15, 30), n_layer=30,
                            n_embd=576, n_vocab=49152, engine_pin=CPU[0], backend="CPU", wire_dtype="f32",
                            numerics="invariant", max_sessions=1, n_ctx=256, n_batch=64, admitted_bytes=1,
                            clock_id="host", data_endpoint="tcp://10.0.0.9:7000")
    assert offer_from_capability("w9", capability, registered=4) == offer("w9", 15, 30, registered=4)


def test_a_head_gathers_its_sessions_only_when_its_machine_s_stages_would_fight_for_cores():
    from meshnet.route.tracker import head_gathers

    def stage(host, threads, cpus=2):
        return Capability(worker_id=host, model_sha256=SHA_A, arch="llama", n_layer=2, n_embd=8, n_vocab=32,
                          engine_pin=CPU[0], backend="CPU", wire_dtype="f32", numerics="invariant", max_sessions=1,
                          n_ctx=256, n_batch=64, admitted_bytes=1, clock_id=host, n_threads=threads, n_cpus=cpus)

    assert head_gathers([stage("a", 2), stage("a", 2)])                  # 4 threads on 2 cores
    assert not head_gathers([stage("a", 1), stage("a", 1)])              # one core each: pipeline
    assert not head_gathers([stage("a", 2), stage("b", 2)])              # two hosts: pipeline
    assert head_gathers([stage("a", 2), stage("b", 2), stage("a", 1)])   # 3 threads on the head's 2 cores
    assert not head_gathers([stage("a", 8, cpus=16), stage("a", 8, cpus=16)])
    assert not head_gathers([stage("a", 2)])                             # alone: nothing to gather
