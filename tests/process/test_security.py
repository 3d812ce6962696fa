"""ACCEPTANCE section E (the control link so far): CURVE keys, an allow-list checked in the
handshake, and refusals that are logged and counted, on real worker processes."""

import logging
import os
import re
import subprocess
import sys
import time

import pytest
import zmq

from meshnet.engine.pipeline import LocalPipeline
from meshnet.net import security
from meshnet.route.config import CoordinatorConfig
from meshnet.route.coordinator import Coordinator

from conftest import THREADS
from peers import start_worker, wait_until

PROMPT_TOKENS = [1, 504, 3458, 282, 4649, 314]


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    root = tmp_path_factory.mktemp("keys")
    for name in ("coordinator", "other-coordinator", "head", "tail", "stranger"):
        security.generate(root, name)
    (root / "allowed").mkdir()
    for name in ("head", "tail"):
        (root / "allowed" / f"{name}.key").write_bytes((root / f"{name}.key").read_bytes())
    return root


def keyed_worker(path, coordinator, layers, keys, name, server="coordinator", **popen):
    return start_worker(path, coordinator.endpoint, layers, "--secret", str(keys / f"{name}.key_secret"),
                        "--coordinator-key", str(keys / f"{server}.key"), **popen)


def stop(processes):
    for p in processes:
        if p.poll() is None:
            p.terminate()
    return [p.communicate(timeout=20)[1] or b"" for p in processes]


def test_keys_generate_writes_a_pair_and_never_overwrites(tmp_path):
    run = lambda: subprocess.run([sys.executable, "-m", "meshnet.cli.main", "keys", "generate", str(tmp_path), "--name", "w1"],
                                 capture_output=True, text=True, timeout=60)
    first = run()
    assert first.returncode == 0, first.stderr
    assert security.load_secret(tmp_path / "w1.key_secret").public == security.load_public(tmp_path / "w1.key")
    assert (tmp_path / "w1.key_secret").stat().st_mode & 0o077 == 0
    again = run()
    assert again.returncode == 5 and "never overwritten" in again.stderr


def test_only_workers_with_an_allowed_key_for_this_coordinator_get_in(smollm2_path, keys, caplog, tmp_path):
    caplog.set_level(logging.WARNING)
    own = security.load_secret(keys / "coordinator.key_secret")
    allowed = security.load_allowed(keys / "allowed")
    logs = [tmp_path / f"intruder{i}.log" for i in range(3)]
    with Coordinator(CoordinatorConfig(keys=own, allowed_workers=allowed, heartbeat_interval=0.1, heartbeat_liveness=10)) as coordinator:
        assert security.mechanism(coordinator.router) == "CURVE"
        files = [open(log, "wb") for log in logs]
        intruders = [
            start_worker(smollm2_path, coordinator.endpoint, (0, 30), stderr=files[0]),          # no key
            keyed_worker(smollm2_path, coordinator, (0, 30), keys, "stranger", stderr=files[1]),  # not allowed
            keyed_worker(smollm2_path, coordinator, (0, 30), keys, "head", server="other-coordinator",
                         stderr=files[2]),                                                      # another's key
        ]
        try:
            # each of them has tried, and been told no
            assert wait_until(lambda: all(b"refused the handshake" in log.read_bytes() for log in logs), 30), \
                [log.read_bytes()[-300:] for log in logs]
            time.sleep(0.5)
            assert coordinator.workers_snapshot() == []     # none of them got a message through
            counters = coordinator.metrics()["counters"]
            assert counters["refused_handshakes"] >= 3
            assert counters["refused_peers"] >= 1           # the stranger's key, refused by the allow-list
            assert counters.get("registrations", 0) == 0
        finally:
            stop(intruders)
            for f in files:
                f.close()
        log = caplog.text
        assert "is not allowed" in log and "refused a peer" in log
        stranger_public = security.load_public(keys / "stranger.key").decode()
        assert stranger_public in log
        assert b"wants one and this worker has none" in logs[0].read_bytes()

        good = [keyed_worker(smollm2_path, coordinator, (0, 19), keys, "head"),
                keyed_worker(smollm2_path, coordinator, (19, 30), keys, "tail")]
        try:
            coordinator.wait_for_route(60, n_stages=2)
            got = coordinator.generate(PROMPT_TOKENS, 16, stop_at_eog=False).result(60).tokens
        finally:
            stop(good)
    with LocalPipeline(smollm2_path, [(0, 30)], n_ctx=256, max_sessions=1, n_threads=THREADS) as whole:
        assert got == whole.generate(PROMPT_TOKENS, 16, stop_at_eog=False).tokens


def test_a_coordinator_without_keys_is_not_reached_by_a_keyed_worker(smollm2_path, keys, tmp_path):
    with Coordinator(CoordinatorConfig(heartbeat_interval=0.1, heartbeat_liveness=10)) as coordinator:
        assert security.mechanism(coordinator.router) == "NULL"
        log = tmp_path / "worker.log"
        worker = keyed_worker(smollm2_path, coordinator, (0, 30), keys, "head", stderr=open(log, "wb"))
        try:
            # decided by what the worker says, not by a time it was given to say it
            assert wait_until(lambda: b"refused the handshake" in log.read_bytes(), 120), log.read_bytes()
            assert coordinator.workers_snapshot() == []
        finally:
            stop([worker])


def test_bad_key_files_are_refused_with_bad_key(tmp_path):
    (tmp_path / "junk.key").write_text("not a key")
    with pytest.raises(security.MeshnetError) as err:
        security.load_public(tmp_path / "junk.key")
    assert err.value.code == "bad_key"
    security.generate(tmp_path, "pub")
    with pytest.raises(security.MeshnetError) as err:
        security.load_secret(tmp_path / "pub.key")     # a public key where a secret one is needed
    assert err.value.code == "bad_key" and "no secret key" in err.value.message


def test_every_link_of_a_keyed_route_is_curve_and_a_stranger_cannot_push_into_a_stage(smollm2_path, keys):
    own = security.load_secret(keys / "coordinator.key_secret")
    with Coordinator(CoordinatorConfig(keys=own, allowed_workers=security.load_allowed(keys / "allowed"),
                     heartbeat_interval=0.1, heartbeat_liveness=10)) as coordinator:
        workers = [keyed_worker(smollm2_path, coordinator, (0, 19), keys, "head"),
                   keyed_worker(smollm2_path, coordinator, (19, 30), keys, "tail")]
        try:
            coordinator.wait_for_route(60, n_stages=2)
            sessions = [coordinator.generate(PROMPT_TOKENS, 16, stop_at_eog=False) for _ in range(2)]
            got = [s.result(60).tokens for s in sessions]
            # while a session runs (a stage keeps a push only while a session uses it)
            running = coordinator.generate(PROMPT_TOKENS, 240, stop_at_eog=False)
            for i, _ in enumerate(running):
                if i == 4:
                    break
            # the coordinator's own links: control, the tokens' PULL, the prompt's PUSH to the head
            assert security.mechanism(coordinator.router) == "CURVE"
            assert security.mechanism(coordinator.data) == "CURVE"
            assert {security.mechanism(s) for s in coordinator.pushes.values()} == {"CURVE"}
            # each stage's: control, its data endpoint, its pushes to the next stage and to the coordinator
            assert wait_until(lambda: all(len(s["mechanisms"]["pushes"]) == 2 for s in coordinator.stage_stats()), 5)
            stats = coordinator.stage_stats()
            for s in stats:
                m = s["mechanisms"]
                assert m["control"] == m["data"] == "CURVE", m
                assert set(m["pushes"].values()) == {"CURVE"}, m
            running.cancel()
            assert wait_until(lambda: all(s["n_sessions"] == 0 for s in coordinator.stage_stats()), 10)
            time.sleep(0.3)
            head = next(s for s in coordinator.stage_stats() if s["layers"] == [0, 19])
            ctx = zmq.Context()
            try:
                for stranger in (None, security.load_secret(keys / "stranger.key_secret")):
                    push = ctx.socket(zmq.PUSH)
                    push.setsockopt(zmq.LINGER, 0)
                    if stranger is not None:
                        security.client(push, stranger, security.load_public(keys / "head.key"))
                    push.connect(head["data_endpoint"])
                    from meshnet.net import protocol as P
                    push.send_multipart(P.encode(P.ACT, 0, sid=1, key=1, pos=0, n=1, tokens=[1]), flags=zmq.NOBLOCK) \
                        if push.poll(500, zmq.POLLOUT) else None
                time.sleep(1.0)
            finally:
                ctx.destroy(linger=0)
            after = next(s for s in coordinator.stage_stats() if s["layers"] == [0, 19])
            assert after["dropped"] == head["dropped"]      # nothing of theirs reached the stage
            assert after["refused_peers"] >= 1              # the stranger's key, refused in the handshake
            assert coordinator.generate(PROMPT_TOKENS, 16, stop_at_eog=False).result(60).tokens == got[0]
        finally:
            stop(workers)
    with LocalPipeline(smollm2_path, [(0, 30)], n_ctx=256, max_sessions=1, n_threads=THREADS) as whole:
        assert got == [whole.generate(PROMPT_TOKENS, 16, stop_at_eog=False).tokens] * 2


def test_listening_beyond_loopback_without_keys_is_refused_unless_insecure_is_said(tmp_path):
    def meshnet(*args):
        return subprocess.run([sys.executable, "-m", "meshnet.cli.main", *args], capture_output=True, text=True,
                              timeout=60, env=dict(os.environ, MESHNET_HOME=str(tmp_path)))

    # a coordinator has keys unless told otherwise (this host's, made once), and says how to join it
    keyed = meshnet("coordinator", "--bind", "tcp://0.0.0.0:0", "--prompt", "hi", "--wait", "0.2")
    assert "WARNING" not in keyed.stderr and re.search(r"^MESHNET_JOIN=mnj1-\S+ meshnet worker --mem 8G$", keyed.stderr,
                                                       re.M), keyed.stderr
    assert keyed.returncode == 4 and "route_incomplete" in keyed.stderr
    assert (tmp_path / "keys" / "coordinator.key_secret").is_file() and (tmp_path / "keys" / "join.key_secret").is_file()
    told = meshnet("coordinator", "--bind", "tcp://0.0.0.0:0", "--insecure", "--prompt", "hi", "--wait", "0.2")
    assert "WARNING: --bind tcp://0.0.0.0:0 without keys" in told.stderr
    assert told.returncode == 4 and "route_incomplete" in told.stderr     # it served; no worker came
    worker = meshnet("worker", "--coordinator", "tcp://127.0.0.1:9", "--layers", "0:30", "--data-bind", "tcp://0.0.0.0:0")
    assert worker.returncode == 2 and "--data-bind tcp://0.0.0.0:0 is reachable beyond this machine" in worker.stderr


def test_loopback_is_told_apart_from_the_network():
    assert all(security.is_loopback(e) for e in ("tcp://127.0.0.1:5555", "tcp://localhost:1", "tcp://[::1]:5",
                                                 "ipc:///tmp/x", "inproc://x", "tcp://127.8.9.10:0"))
    assert not any(security.is_loopback(e) for e in ("tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://10.0.0.1:1",
                                                     "tcp://[::]:5", "tcp://example.org:5"))


def test_run_uses_fresh_keys_on_loopback_by_default_and_gives_the_same_tokens_as_insecure(arch_models):
    def run(*extra):
        result = subprocess.run([sys.executable, "-m", "meshnet.cli.main", "run", "--model", arch_models["llama"],
                                 "--max-tokens", "8", "--json", "--threads", str(THREADS), *extra],
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        import json
        return json.loads(result.stdout.strip().splitlines()[-1])

    secure, plain = run(), run("--insecure")
    # a random-weight model may end before 8 tokens: the same tokens, keys or not, is the point
    assert secure["tokens"] == plain["tokens"] and 0 < len(secure["tokens"]) <= 8
    assert secure["metrics"]["curve"] is True and plain["metrics"]["curve"] is False


def test_a_local_cluster_with_secure_runs_curve_on_every_link_and_leaves_no_keys_behind(smollm2_path):
    from meshnet.launch.local_cluster import LocalCluster

    with LocalCluster(smollm2_path, [(0, 19), (19, 30)], threads=THREADS, n_ctx=256, secure=True) as cluster:
        keys_dir = cluster.keys_dir.name
        running = cluster.coordinator.generate(PROMPT_TOKENS, 200, stop_at_eog=False)
        for i, _ in enumerate(running):
            if i == 3:
                break
        assert wait_until(lambda: all(len(s["mechanisms"]["pushes"]) == 2 for s in cluster.coordinator.stage_stats()), 5)
        for s in cluster.coordinator.stage_stats():
            m = s["mechanisms"]
            assert {m["control"], m["data"], *m["pushes"].values()} == {"CURVE"}, m
        running.cancel()
    import os
    assert not os.path.exists(keys_dir)


def test_refusals_are_counted_in_the_prometheus_text():
    from meshnet.core.metrics import prometheus_text

    text = prometheus_text({"stages": [{"stage": "[0,19)", "worker": "w", "refused_peers": 2}],
                            "counters": {"refused_handshakes": 3, "refused_peers": 1}})
    assert "meshnet_refused_handshakes_total{} 3" in text and "meshnet_refused_peers_total{} 1" in text
    assert 'meshnet_stage_refused_peers_total{stage="[0,19)"} 2' in text
