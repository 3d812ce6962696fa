"""ACCEPTANCE section E (the control link so far): CURVE keys, an allow-list checked in the
handshake, and refusals that are logged and counted, on real worker processes."""

import logging
import subprocess
import sys
import time

import pytest
import zmq

from meshnet import security
from meshnet.coordinator import Coordinator
from meshnet.pipeline import LocalPipeline

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
    run = lambda: subprocess.run([sys.executable, "-m", "meshnet.cli", "keys", "generate", str(tmp_path), "--name", "w1"],
                                 capture_output=True, text=True, timeout=60)
    first = run()
    assert first.returncode == 0, first.stderr
    assert security.load_secret(tmp_path / "w1.key_secret").public == security.load_public(tmp_path / "w1.key")
    assert (tmp_path / "w1.key_secret").stat().st_mode & 0o077 == 0
    again = run()
    assert again.returncode == 5 and "never overwritten" in again.stderr


def test_only_workers_with_an_allowed_key_for_this_coordinator_get_in(smollm2_path, keys, caplog):
    caplog.set_level(logging.WARNING)
    own = security.load_secret(keys / "coordinator.key_secret")
    allowed = security.load_allowed(keys / "allowed")
    with Coordinator(keys=own, allowed_workers=allowed, heartbeat_interval=0.1, heartbeat_liveness=10) as coordinator:
        assert security.mechanism(coordinator.router) == "CURVE"
        intruders = [
            start_worker(smollm2_path, coordinator.endpoint, (0, 30), stderr=subprocess.PIPE),          # no key
            keyed_worker(smollm2_path, coordinator, (0, 30), keys, "stranger", stderr=subprocess.PIPE),  # not allowed
            keyed_worker(smollm2_path, coordinator, (0, 30), keys, "head", server="other-coordinator",
                         stderr=subprocess.PIPE),                                                      # another's key
        ]
        try:
            assert wait_until(lambda: coordinator.metrics()["counters"].get("refused_handshakes", 0) >= 3, 30)
            time.sleep(1.0)
            assert coordinator.workers_snapshot() == []     # none of them got a message through
            counters = coordinator.metrics()["counters"]
            assert counters["refused_peers"] >= 1           # the stranger's key, refused by the allow-list
            assert counters.get("registrations", 0) == 0
        finally:
            stderr = stop(intruders)
        log = caplog.text
        assert "is not allowed" in log and "refused a peer" in log
        stranger_public = security.load_public(keys / "stranger.key").decode()
        assert stranger_public in log
        assert b"refused the handshake" in stderr[0] and b"refused the handshake" in stderr[1]

        good = [keyed_worker(smollm2_path, coordinator, (0, 19), keys, "head"),
                keyed_worker(smollm2_path, coordinator, (19, 30), keys, "tail")]
        try:
            coordinator.wait_for_route(60, n_stages=2)
            got = coordinator.generate(PROMPT_TOKENS, 16, stop_at_eog=False).result(60).tokens
        finally:
            stop(good)
    with LocalPipeline(smollm2_path, [(0, 30)], n_ctx=256, max_sessions=1, n_threads=THREADS) as whole:
        assert got == whole.generate(PROMPT_TOKENS, 16, stop_at_eog=False).tokens


def test_a_coordinator_without_keys_is_not_reached_by_a_keyed_worker(smollm2_path, keys):
    with Coordinator(heartbeat_interval=0.1, heartbeat_liveness=10) as coordinator:
        assert security.mechanism(coordinator.router) == "NULL"
        worker = keyed_worker(smollm2_path, coordinator, (0, 30), keys, "head", stderr=subprocess.PIPE)
        try:
            time.sleep(3)
            assert coordinator.workers_snapshot() == []
        finally:
            (stderr,) = stop([worker])
        assert b"refused the handshake" in stderr


def test_bad_key_files_are_refused_with_bad_key(tmp_path):
    (tmp_path / "junk.key").write_text("not a key")
    with pytest.raises(security.MeshnetError) as err:
        security.load_public(tmp_path / "junk.key")
    assert err.value.code == "bad_key"
    security.generate(tmp_path, "pub")
    with pytest.raises(security.MeshnetError) as err:
        security.load_secret(tmp_path / "pub.key")     # a public key where a secret one is needed
    assert err.value.code == "bad_key" and "no secret key" in err.value.message
