"""Issue 21: what one request or one local process could do to a route, and what a
single-stage run printed. Real workers on loopback; a fake peer appears only as the
intruder, the input of the code under test."""

import time

import pytest

from meshnet.core.conversation import prompt_tokens
from meshnet.core.errors import MeshnetError
from meshnet.core.layers import LayerRange
from meshnet.core.metrics import rss_bytes
from meshnet.core.planner import ModelCost, Node, plan
from meshnet.launch.local_cluster import LocalCluster
from meshnet.net import protocol as P
from meshnet.net.capability import Capability
from meshnet.net.fields import MAX_LAYERS
from meshnet.net.metrics_server import MetricsServer
from meshnet.route.config import CoordinatorConfig
from meshnet.route.coordinator import Coordinator
from meshnet.route.tracker import StageOffer, build_route, CompatClass

from conftest import THREADS, last_json_line, meshnet, whole_model_tokens
from peers import FakeCoordinator, FakeWorker, capability, start_worker, wait_until
from meshnet.cli.mesh import _status_table

PROMPT = "The old lighthouse keeper climbed the stairs every night, and"
HALVES = [(0, 15), (15, 30)]
N_TOKENS = 24


@pytest.fixture(scope="module")
def reference(smollm2_path):
    return whole_model_tokens(smollm2_path, PROMPT, N_TOKENS, n_ctx=1024)


# 2. one stage: the summary and --json, on workers and in one process

@pytest.mark.parametrize("mode", [[], ["--in-process"]], ids=["workers", "in-process"])
def test_a_run_of_one_stage_prints_its_summary_and_json_without_a_traceback(mode, arch_models):
    one_stage = ("run", "--model", arch_models["llama"], "--stages", "1", "--max-tokens", "4",
                 "--threads", str(THREADS), *mode)
    plain = meshnet(*one_stage)
    assert plain.returncode == 0 and "Traceback" not in plain.stderr, plain.stderr
    assert "[1 stage [0,4)" in plain.stderr and "hop p50" not in plain.stderr, plain.stderr
    as_json = meshnet(*one_stage, "--json")
    assert as_json.returncode == 0 and "Traceback" not in as_json.stderr, as_json.stderr
    assert len(last_json_line(as_json.stdout)["tokens"]) == 4


# 3. a prompt too long for the context is refused at once, whatever its size, and the
# sessions beside it are untouched

def test_prompts_far_past_the_context_are_refused_at_once_and_the_sessions_beside_them_go_on(smollm2_path, reference):
    prompt, expected = reference
    with LocalCluster(smollm2_path, HALVES, threads=THREADS, n_ctx=1024, max_sessions=4) as cluster:
        coordinator = cluster.coordinator
        innocents = [coordinator.generate(prompt, N_TOKENS, stop_at_eog=False) for _ in range(2)]
        for n_chars in (70_000, 3_000_000):
            text = ("lorem ipsum dolor sit amet " * (n_chars // 27 + 1))[:n_chars]
            with pytest.raises(MeshnetError) as raw:
                coordinator.tokenize(text, limit=1023)
            with pytest.raises(MeshnetError) as chat:
                prompt_tokens(coordinator, [{"role": "user", "content": text}], limit=1023)
            assert raw.value.code == chat.value.code == "context_full", (raw.value, chat.value)
        for handle in innocents:
            assert handle.result(120).tokens == expected
        # the head's link stayed up: a new session on the same route is exact too
        assert coordinator.generate(prompt, N_TOKENS, stop_at_eog=False).result(120).tokens == expected
        assert coordinator.metrics()["counters"].get("workers_lost", 0) == 0


def test_texts_and_their_answers_of_any_length_travel_as_payloads(smollm2_path):
    with LocalCluster(smollm2_path, HALVES, threads=THREADS, n_ctx=256, max_sessions=1) as cluster:
        coordinator = cluster.coordinator
        text = "é and ü, " * 20_000   # 200 KB: a header holds 64 KiB
        tokens = coordinator.tokenize(text)
        assert len(tokens) > 16_000
        assert coordinator.detokenize(tokens) == text
        prompt = coordinator.chat_prompt([{"role": "user", "content": text}])
        assert text in prompt


# 6. one local process cannot take the route over, nor make the coordinator work or
# hold memory past a bound

def test_a_local_cluster_refuses_a_keyless_intruder_that_claims_the_whole_model(smollm2_path, reference):
    prompt, expected = reference
    with LocalCluster(smollm2_path, HALVES, threads=THREADS, n_ctx=512) as cluster:   # keys by default
        intruder = FakeWorker(cluster.coordinator.endpoint)
        try:
            intruder.send(P.encode(P.READY, 1, capability=capability(layers=[0, 30], n_ctx=512)))
            intruder.heartbeat_forever()
            assert wait_until(lambda: cluster.coordinator.metrics()["counters"].get("refused_handshakes", 0) > 0)
            got = cluster.coordinator.generate(prompt, N_TOKENS, stop_at_eog=False).result(120)
            assert got.tokens == expected
            assert len(cluster.coordinator.workers_snapshot()) == 2
        finally:
            intruder.close()


def test_capabilities_past_the_limits_or_against_the_model_are_refused_in_bounded_time(smollm2_path, reference):
    prompt, expected = reference
    cost = {"n_layer": 30, "layer_bytes": [1] * 30, "input_bytes": 1, "output_bytes": 1, "shared_bytes": 0,
            "tied_embeddings": True, "token_embd_bytes": 1, "kv_bytes_per_cell": 1, "n_embd": 576, "n_ff": 1,
            "n_head": 1, "n_vocab": 49152}
    huge = 2 ** 31 - 1
    hostile = {
        "n_layer 2^31-1": capability(n_layer=huge, layers=[0, 30]),
        "64,800-layer cost table": capability(n_layer=64_800, layers=None, mem_bytes=1 << 40, data_endpoint=None,
                                              cost=dict(cost, n_layer=64_800, layer_bytes=[1] * 64_800)),
        "another shape for the model": capability(n_layer=4096, layers=[0, 4096]),
        "a cost table of another shape": capability(n_layer=4096, layers=None, mem_bytes=1 << 40, data_endpoint=None,
                                                    cost=dict(cost, n_layer=4096, layer_bytes=[1] * 4096)),
    }
    with LocalCluster(smollm2_path, HALVES, threads=THREADS, n_ctx=1024, secure=False) as cluster:
        coordinator = cluster.coordinator
        rss_before = rss_bytes()
        session = coordinator.generate(prompt, N_TOKENS, stop_at_eog=False)
        intruder = FakeWorker(coordinator.endpoint)
        try:
            for name, cap in hostile.items():
                t0 = time.monotonic()
                intruder.send(P.encode(P.READY, 1, capability={k: v for k, v in cap.items() if v is not None}))
                reply = intruder.recv(timeout=30)
                assert reply.type == P.ERROR and reply["code"] == "bad_field", (name, reply)
                print(f"READY with {name}: refused in {1000 * (time.monotonic() - t0):.1f} ms")
                assert time.monotonic() - t0 < 30, name
            assert session.result(120).tokens == expected
            assert len(coordinator.workers_snapshot()) == 2
            print(f"coordinator's process RSS {rss_before >> 20} -> {rss_bytes() >> 20} MiB; the session in flight exact")
            assert rss_bytes() - rss_before < 64 << 20
        finally:
            intruder.close()


def test_route_choice_and_planning_are_linear_in_the_layers():
    cls = CompatClass("a" * 64, "pin", "CPU", "f32", "invariant")
    n_layer = MAX_LAYERS
    offers = [StageOffer(f"w{i}", LayerRange(i, i + 1, n_layer), cls, registered=i) for i in range(n_layer)]
    t0 = time.monotonic()
    assert len(build_route(offers)) == n_layer
    cost = ModelCost(n_layer, (1,) * n_layer, 1, 1, 0, True, 1, 1, 8, 8, 1, 32)
    assert len(plan(cost, [Node(f"n{i}", 1 << 40) for i in range(4)], overhead=0).stages) == 1
    assert time.monotonic() - t0 < 30   # quadratic work over 4096 layers would take minutes
    with pytest.raises(P.ProtocolError):
        Capability.parse(capability(n_layer=MAX_LAYERS + 1, layers=[0, 30]))


# 8. small ones

def test_a_port_past_65535_is_refused_not_wrapped():
    result = meshnet("coordinator", "--bind", "tcp://127.0.0.1:99999", timeout=60)
    assert result.returncode == 2 and "bad_address" in result.stderr and "0..65535" in result.stderr, result.stderr
    with pytest.raises(MeshnetError) as refused:
        Coordinator(CoordinatorConfig("tcp://127.0.0.1:70000"))
    assert refused.value.code == "bad_address"


def test_status_marks_a_worker_kept_out_of_the_route_and_says_why():
    with Coordinator() as coordinator:
        server = MetricsServer(coordinator.metrics, 0)
        served, other = FakeWorker(coordinator.endpoint), FakeWorker(coordinator.endpoint)
        try:
            served.send(P.encode(P.READY, 1, capability=capability()))
            other.send(P.encode(P.READY, 1, capability=capability(model_sha256="b" * 64)))
            for peer in (served, other):
                peer.heartbeat_forever()
            assert wait_until(lambda: len(coordinator.workers_snapshot()) == 2)
            stages = coordinator.metrics(timeout=0.5)["stages"]
            kept = [s for s in stages if not s["in_route"]]
            assert len(kept) == 1 and "bbbbbbbbbbbb" in kept[0]["kept_out"], stages
            table = _status_table(coordinator.metrics(timeout=0.5))
            assert table.count("NOT IN THE ROUTE") == 1 and "hash mismatch" in table, table
        finally:
            server.close()
            served.close()
            other.close()


def test_a_stage_connects_to_its_next_hop_only_at_the_first_step(smollm2_path):
    # with CURVE the next stage lets this one in only once its own OPEN named it: a
    # connection made at open could be refused for good (the first session's hop_unreachable)
    fake = FakeCoordinator()
    worker = start_worker(smollm2_path, fake.endpoint, (0, 15))
    try:
        fake.wait_ready()
        assert fake.open(1, prompt_len=4).type == P.OK
        assert fake.request(P.HEALTH)["info"]["mechanisms"]["pushes"] == {}
        step = fake.forward(1, 0, tokens=[1, 2, 3, 4], ack=True)
        assert step.type == P.ACT
        # (the stage's statistics are a snapshot, taken after its next job)
        assert wait_until(lambda: list(fake.request(P.HEALTH)["info"]["mechanisms"]["pushes"]) == [fake.data_endpoint])
    finally:
        worker.terminate()
        worker.wait(timeout=20)
        fake.close()
