"""ACCEPTANCE section C on real worker processes (SmolLM2, Qwen2.5-1.5B): workers that
take their range from the coordinator's planner, spares, and workers of another class
kept out of the route with their reason."""

import dataclasses
import random
import signal
import time

import pytest

from meshnet.core.planner import ModelCost, Node, Settings, plan, stage_need
from meshnet.engine.gguf_layout import read_layout
from meshnet.engine.pipeline import LocalPipeline
from meshnet.evidence.drift import DriftMeter
from meshnet.net.capability import Capability
from meshnet.route.config import CoordinatorConfig
from meshnet.route.coordinator import Coordinator

from conftest import THREADS
from peers import rss_kib, start_worker, wait_until

PROMPT = "The old lighthouse keeper climbed the stairs every night, and"
# a dead worker is noticed within ~3 s: far sooner than the defaults, and past the stalls of a
# loaded 2-core machine (a worker mapping its weights while others compute)
FAST_HEARTBEAT = dict(heartbeat_interval=0.1, heartbeat_liveness=30)
# SmolLM2 with 2048 tokens of context for 4 sessions: three workers of 300 MiB are needed
# (the planner says so below), two are not enough
AUTO = dict(ctx=2048, sessions=4, mem=300 << 20)


def whole_model(path, n_ctx, n_tokens=24, prompt=PROMPT):
    with LocalPipeline(path, [(0, read_layout(path).n_layer)], n_ctx=n_ctx, max_sessions=1, n_threads=THREADS) as whole:
        tokens = whole.head.tokenize(prompt)
        return tokens, whole.generate(tokens, n_tokens, stop_at_eog=False).tokens


def auto_worker(path, coordinator, mem, ctx, sessions, **popen):
    # (a KV stream per session, no pool: the plan below counts them so)
    return start_worker(path, coordinator.endpoint, "auto", "--mem", str(mem), "--max-sessions", str(sessions),
                        "--kv-pool", "0", "--heartbeat-interval", "0.1", "--heartbeat-liveness", "10", ctx=ctx, **popen)


def generate(coordinator, prompt_tokens, n_tokens=24):
    return coordinator.generate(prompt_tokens, n_tokens, stop_at_eog=False).result(60).tokens


def route_of(coordinator):
    return [tuple(map(int, s.split("@")[0].strip("[)").split(","))) for s in coordinator.route_report()["route"] or []]


def stop(processes):
    for p in processes:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.terminate()
    for p in processes:
        try:
            p.wait(timeout=15)
        except Exception:
            p.kill()


def test_auto_workers_registered_in_random_order_form_the_planned_route_and_a_standby_replaces_a_lost_stage(smollm2_path):
    cost = ModelCost.from_layout(read_layout(smollm2_path))
    settings = Settings(AUTO["ctx"], AUTO["sessions"])
    planned = [s.layers.as_tuple() for s in plan(cost, [Node(str(i), AUTO["mem"], settings) for i in range(3)]).stages]
    assert len(planned) == 3
    with pytest.raises(Exception):
        plan(cost, [Node(str(i), AUTO["mem"], settings) for i in range(2)])
    prompt_tokens, expected = whole_model(smollm2_path, AUTO["ctx"])

    with Coordinator(CoordinatorConfig(**FAST_HEARTBEAT)) as coordinator:
        workers = []
        try:
            for _ in range(4):    # three make the route, the fourth stands by
                workers.append(auto_worker(smollm2_path, coordinator, **AUTO))
                time.sleep(random.uniform(0, 0.3))   # the order they register in is not the order they started
            assert wait_until(lambda: route_of(coordinator) == planned and coordinator.route_report()["standby"],
                              timeout=60), coordinator.route_report()
            report = coordinator.route_report()
            assert list(report["standby"].values()) == ["standby"], report
            assert generate(coordinator, prompt_tokens) == expected

            # every stage loaded only its share: the engine's own count, within its budget
            stats = {tuple(s["layers"]): s for s in coordinator.stage_stats() if "layers" in s}
            for layers in planned:
                assert stats[layers]["model_bytes"] < cost.weight_bytes(0, 30)
            pids = {tuple(w["layers"]): w["pid"] for w in coordinator.workers_snapshot() if "layers" in w}
            for layers, pid in pids.items():
                assert rss_kib(pid) * 1024 <= AUTO["mem"], (layers, rss_kib(pid))

            # the middle stage dies: the standby worker is planned into its range, no restart
            middle = planned[1]
            victim = next(p for p in workers if p.pid == pids[middle])
            victim.kill()
            lost_at = time.monotonic()
            assert wait_until(lambda: route_of(coordinator) == planned and not coordinator.route_report()["standby"],
                              timeout=30), coordinator.route_report()
            replaced_after = time.monotonic() - lost_at
            assert generate(coordinator, prompt_tokens) == expected
            print(f"standby replaced the lost stage {middle} in {replaced_after:.2f} s")
        finally:
            stop(workers)


def test_an_auto_worker_alone_too_small_waits_with_the_shortfall(smollm2_path):
    with Coordinator(CoordinatorConfig(**FAST_HEARTBEAT)) as coordinator:
        workers = [auto_worker(smollm2_path, coordinator, **AUTO)]
        try:
            assert wait_until(lambda: coordinator.route_report()["standby"], timeout=30)
            assert wait_until(lambda: coordinator.route_report()["plan_note"], timeout=5)
            report = coordinator.route_report()
            assert report["route"] is None and "no worker has registered" in report["error"]
            assert "wait for more memory" in report["plan_note"] and "short" in report["plan_note"]
        finally:
            stop(workers)


def mutated_copy(path, tmp_path):
    """The same weights under another sha256: one letter of general.name changed."""
    data = bytearray(open(path, "rb").read())
    name = read_layout(path).path and b"Smollm2 135M"
    at = data.find(name)
    assert at > 0
    data[at] = ord("s")
    copy = tmp_path / "smollm2-renamed.gguf"
    copy.write_bytes(bytes(data))
    return str(copy)


def test_a_worker_of_another_model_is_kept_out_with_its_reason_and_the_route_of_the_others_serves(smollm2_path, tmp_path):
    other = mutated_copy(smollm2_path, tmp_path)
    prompt_tokens, expected = whole_model(smollm2_path, 256)
    with Coordinator(CoordinatorConfig(**FAST_HEARTBEAT)) as coordinator:
        workers = []
        try:
            # the stranger registers first and offers the tail: it must not stop the route
            workers.append(start_worker(other, coordinator.endpoint, (19, 30)))
            assert wait_until(lambda: len(coordinator.workers_snapshot()) == 1, 30)
            workers += [start_worker(smollm2_path, coordinator.endpoint, (0, 19)),
                        start_worker(smollm2_path, coordinator.endpoint, (19, 30))]
            assert wait_until(lambda: route_of(coordinator) == [(0, 19), (19, 30)], timeout=30), coordinator.route_report()
            report = coordinator.route_report()
            (reason,) = report["kept_out"].values()
            assert reason.startswith("hash mismatch") and "model sha256" in reason
            assert not report["mixed"]
            assert generate(coordinator, prompt_tokens) == expected
        finally:
            stop(workers)


def test_a_killed_stage_is_replaced_by_its_spare_for_new_sessions_within_the_heartbeat_bound(smollm2_path):
    prompt_tokens, expected = whole_model(smollm2_path, 256)
    with Coordinator(CoordinatorConfig(**FAST_HEARTBEAT)) as coordinator:
        workers = []
        try:
            hb = ["--heartbeat-interval", "0.1", "--heartbeat-liveness", "10"]
            workers += [start_worker(smollm2_path, coordinator.endpoint, (0, 19), *hb)]
            workers += [start_worker(smollm2_path, coordinator.endpoint, (19, 30), *hb) for _ in range(2)]
            assert wait_until(lambda: len(coordinator.route_report()["kept_out"]) == 1, timeout=30)
            report = coordinator.route_report()
            (spare_name, reason), = report["kept_out"].items()
            assert reason.startswith("spare")
            assert generate(coordinator, prompt_tokens) == expected

            tail_name = report["route"][1].split("@")[1]
            pids = {w["name"]: w["pid"] for w in coordinator.workers_snapshot()}
            next(p for p in workers if p.pid == pids[tail_name]).kill()
            killed_at = time.monotonic()
            # the spare takes the range once the liveness window has passed: what a loaded
            # machine adds to that is its scheduling, not a session's time
            assert wait_until(lambda: (coordinator.route_report()["route"] or [""])[-1].endswith(spare_name),
                              timeout=30)
            switched_after = time.monotonic() - killed_at
            bound = FAST_HEARTBEAT["heartbeat_interval"] * FAST_HEARTBEAT["heartbeat_liveness"]
            assert switched_after < bound + 5.0, switched_after
            while True:   # a session opened before the loss was noticed may still fail, with a bounded error
                try:
                    tokens = generate(coordinator, prompt_tokens)
                    break
                except Exception as e:
                    assert getattr(e, "code", None) in ("stage_lost", "hop_unreachable", "route_incomplete"), e
                    assert time.monotonic() - killed_at < 60
            assert tokens == expected
        finally:
            stop(workers)


def test_a_model_bigger_than_one_node_is_split_by_the_planner_across_two(qwen_path):
    ctx, sessions, mem = 512, 2, 1 << 30
    cost = ModelCost.from_layout(read_layout(qwen_path))
    settings = Settings(ctx, sessions)
    with pytest.raises(Exception) as refusal:
        plan(cost, [Node("one", mem, settings)])
    assert refusal.value.context["shortfall_bytes"] > 0
    planned = [s.layers.as_tuple() for s in plan(cost, [Node(n, mem, settings) for n in "ab"]).stages]
    assert len(planned) == 2
    prompt_tokens, expected = whole_model(qwen_path, ctx, n_tokens=16, prompt="def fibonacci(n):")

    with Coordinator(CoordinatorConfig(**FAST_HEARTBEAT)) as coordinator:
        workers = [auto_worker(qwen_path, coordinator, mem, ctx, sessions)]
        try:
            assert wait_until(lambda: coordinator.route_report()["plan_note"], timeout=60)
            assert "short" in coordinator.route_report()["plan_note"]   # one node alone: refused, with the shortfall
            workers.append(auto_worker(qwen_path, coordinator, mem, ctx, sessions))
            assert wait_until(lambda: route_of(coordinator) == planned, timeout=120), coordinator.route_report()
            assert generate(coordinator, prompt_tokens, 16) == expected
            pids = {tuple(w["layers"]): w["pid"] for w in coordinator.workers_snapshot() if "layers" in w}
            rss = {layers: rss_kib(pid) * 1024 for layers, pid in pids.items()}
            print("RSS per worker (MiB):", {k: round(v / (1 << 20)) for k, v in rss.items()})
            for layers, n in rss.items():
                assert n <= mem
                assert n < cost.weight_bytes(0, cost.n_layer) + (128 << 20)
        finally:
            stop(workers)


def test_allow_mixed_lets_another_class_in_and_every_run_reports_its_drift_from_the_whole_model(smollm2_path, tmp_path):
    other = mutated_copy(smollm2_path, tmp_path)    # another sha256, the same weights: no drift to find
    prompt_tokens, expected = whole_model(smollm2_path, 256)
    with Coordinator(CoordinatorConfig(allow_mixed=True, **FAST_HEARTBEAT), drift_meter=DriftMeter(smollm2_path)) as coordinator:
        workers = []
        try:
            workers += [start_worker(smollm2_path, coordinator.endpoint, (0, 19)),
                        start_worker(other, coordinator.endpoint, (19, 30))]
            assert wait_until(lambda: route_of(coordinator) == [(0, 19), (19, 30)], timeout=30), coordinator.route_report()
            assert coordinator.route_report()["mixed"]
            session = coordinator.generate(prompt_tokens, 24, stop_at_eog=False).result(120)
            assert session.tokens == expected
            drift = session.metrics["drift"]
            assert drift["measured"] and len(drift["steps"]) == 24
            assert drift["top1_agreement"] == 1.0 and drift["max_abs_logit_diff"] == 0.0
            assert len(set(session.metrics["route_classes"])) == 2
        finally:
            stop(workers)


# the assignment protocol, against a real worker started with --layers auto


def test_an_auto_worker_refuses_sessions_until_assigned_then_loads_its_range_and_offers_it(smollm2_path):
    from meshnet.net import protocol as P
    from peers import FakeCoordinator

    fake = FakeCoordinator()
    # (a KV stream per session, no pool to shrink: 8 x 256 cells)
    worker = start_worker(smollm2_path, fake.endpoint, "auto", "--mem", "300M", "--kv-pool", "0", "--max-sessions", "8")
    try:
        cap = fake.wait_ready()
        assert cap.layers is None and cap.mem_bytes == 300 << 20 and cap.cost.n_layer == 30
        refused = fake.request(P.OPEN, sid=1, key=1, stage=0, next=fake.data_endpoint, reply=fake.data_endpoint,
                               prompt_len=1, max_tokens=1, stop_at_eog=False)
        assert refused.type == P.ERROR and refused["code"] == "unassigned"
        assert fake.request(P.HEALTH).type == P.OK                    # answered while it holds nothing
        too_big = fake.request(P.ASSIGN, layers=[0, 30])              # 300 MiB cannot hold it at --ctx 256 x 8
        assert too_big.type == P.ERROR and too_big["code"] == "model_does_not_fit" and "--mem" in too_big["message"]
        assert fake.request(P.ASSIGN, layers=[0, 40])["code"] == "bad_range"
        fake.rid += 1
        ok = fake.reply_to(P.encode(P.ASSIGN, fake.rid, layers=[0, 12]), timeout=60)
        assert ok.type == P.OK, ok.fields
        offered = P.decode(fake.recv(10), 1 << 30)
        assert offered.type == P.READY and offered["capability"].layers == (0, 12)
        assert offered["capability"].data_endpoint
        again = fake.request(P.ASSIGN, layers=[12, 30])
        assert again.type == P.ERROR and again["code"] == "invalid_argument"   # a range is assigned once
    finally:
        stop([worker])
        fake.close()


def test_an_auto_worker_s_default_kv_pool_takes_what_its_memory_leaves_beside_its_range(smollm2_path):
    """A default pool (64 sessions of up to the model's 8192 tokens: 16384 cells) does not fit
    300 MiB beside layers 0..11: the worker takes the largest pool that does, at least one
    whole context, and offers that."""
    from meshnet.net import protocol as P
    from peers import FakeCoordinator

    fake = FakeCoordinator()
    worker = start_worker(smollm2_path, fake.endpoint, "auto", "--mem", "300M", ctx=8192)
    try:
        cap = fake.wait_ready()
        assert (cap.kv_pool, cap.kv_pool_floor, cap.n_ctx, cap.max_sessions) == (16384, 8192, 8192, 64)
        fake.rid += 1
        assert fake.reply_to(P.encode(P.ASSIGN, fake.rid, layers=[0, 12]), timeout=60).type == P.OK
        offered = P.decode(fake.recv(10), 1 << 30)["capability"]
        settings = Settings(8192, 64, kv_pool=offered.kv_pool)
        assert 8192 <= offered.kv_pool < 16384 and not offered.kv_pool_floor, offered
        assert stage_need(cap.cost, 0, 12, settings) <= 300 << 20 < stage_need(
            cap.cost, 0, 12, dataclasses.replace(settings, kv_pool=offered.kv_pool + 256))
        assert fake.open(1, stage=0).type == P.OK
    finally:
        stop([worker])
        fake.close()


def _standby_capability(**overrides):
    from peers import capability

    cost = ModelCost(n_layer=30, layer_bytes=(1,) * 30, input_bytes=1, output_bytes=1, shared_bytes=0,
                     tied_embeddings=True, token_embd_bytes=1, kv_bytes_per_cell=1, n_embd=576, n_ff=1, n_head=1,
                     n_vocab=49152).to_dict()
    cap = capability(mem_bytes=1 << 30, cost=cost, **overrides)
    del cap["layers"], cap["data_endpoint"]
    return cap


@pytest.mark.parametrize("change,why", [
    (lambda c: c.pop("mem_bytes"), "'mem_bytes'"),
    (lambda c: c.pop("cost"), "'cost'"),
    (lambda c: c["cost"].update(n_layer=31), "disagree with n_layer"),
    (lambda c: c["cost"].update(layer_bytes=[1] * 29), "disagree with n_layer"),
    (lambda c: c["cost"].update(layer_bytes=[-1] * 30), "layer_bytes"),
    (lambda c: c["cost"].update(rogue=1), "unknown field"),
    (lambda c: c.update(layers=[0, 30]), "'data_endpoint'"),
], ids=["no-mem", "no-cost", "cost-n_layer", "short-layer-bytes", "negative-bytes", "unknown-cost-field", "layers-no-endpoint"])
def test_a_capability_is_either_a_range_with_its_endpoint_or_a_budget_with_the_model_s_costs(change, why):
    from meshnet.net import protocol as P

    assert Capability.parse(_standby_capability()).mem_bytes == 1 << 30
    cap = _standby_capability()
    change(cap)
    with pytest.raises(P.ProtocolError) as err:
        Capability.parse(cap)
    assert err.value.code == "bad_field" and why in err.value.message


def test_a_worker_bound_to_every_interface_advertises_the_address_it_reaches_the_coordinator_from():
    from meshnet.net.addresses import advertised

    assert advertised("tcp://0.0.0.0:7000", "tcp://127.0.0.1:5555") == "tcp://127.0.0.1:7000"
    assert advertised("tcp://*:7000", "tcp://localhost:5555") == "tcp://127.0.0.1:7000"
    assert advertised("tcp://10.1.2.3:7000", "tcp://127.0.0.1:5555") == "tcp://10.1.2.3:7000"   # as bound
