"""Issue 7: every fault an outside probe found, one regression test each, on real
processes. A fake peer appears only as the attacker or the silent peer: the input of
the code under test."""

import os
import signal
import subprocess
import sys
import time
import urllib.request

import msgpack
import numpy as np
import pytest

from meshnet.core.errors import MeshnetError
from meshnet.core.metrics import rss_bytes
from meshnet.engine.binding import Entry, Stage
from meshnet.launch.local_cluster import LocalCluster, children_of
from meshnet.net import protocol as P
from meshnet.net.metrics_server import MetricsServer
from meshnet.route.config import CoordinatorConfig
from meshnet.route.coordinator import Coordinator

from conftest import THREADS, whole_model_tokens
from peers import FakeCoordinator, FakeWorker, capability, free_port, rss_kib, start_worker, wait_until

PROMPT = "The old lighthouse keeper climbed the stairs every night, and"
HALVES = [(0, 15), (15, 30)]
N_TOKENS = 12


@pytest.fixture(scope="module")
def reference(smollm2_path):
    return whole_model_tokens(smollm2_path, PROMPT, N_TOKENS, n_ctx=512)


def meshnet(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "meshnet.cli.main", *args], capture_output=True, timeout=timeout)


def assert_serves(coordinator, reference):
    prompt_tokens, expected = reference
    session = coordinator.generate(prompt_tokens, N_TOKENS, stop_at_eog=False).result(timeout=60)
    assert session.tokens == expected


@pytest.fixture
def fake_coordinator():
    fake = FakeCoordinator()
    yield fake
    fake.close()


# 1. the coordinator's loop survives two deadlines of one session in one clock tick


def test_two_deadlines_of_one_session_in_one_tick_end_it_once_and_the_coordinator_keeps_serving(smollm2_path, reference):
    with LocalCluster(smollm2_path, HALVES, threads=THREADS, n_ctx=512, request_timeout=0.5) as c:
        for process in c.processes.values():
            os.kill(process.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(MeshnetError) as err:
                c.coordinator.generate(reference[0], 4).result(timeout=10)
            assert err.value.code == "deadline_exceeded" and time.monotonic() - t0 < 2.0
        finally:
            for process in c.processes.values():
                os.kill(process.pid, signal.SIGCONT)
        assert c.coordinator.alive()
        assert c.coordinator.counters()["failed_deadline_exceeded"] == 1  # ended once, not once per request
        assert_serves(c.coordinator, reference)


# 2. a READY whose capability is wrong is refused, and nothing else changes


@pytest.mark.parametrize("bad", [
    {"engine_pin": ["a", "list"]}, {"n_ctx": None}, {"n_batch": "512"}, {"layers": [20, 10]}, {"layers": [0, 40]},
    {"n_embd": True}, {"worker_id": 7},
], ids=["pin-list", "no-n_ctx", "string-n_batch", "reversed-layers", "layers-past-model", "bool-n_embd", "int-id"])
def test_a_ready_with_a_bad_capability_is_refused_and_the_route_keeps_serving(smollm2_path, reference, bad):
    with LocalCluster(smollm2_path, HALVES, threads=THREADS, n_ctx=512, secure=False) as c:
        peer = FakeWorker(c.coordinator.endpoint)
        try:
            cap = {k: v for k, v in capability(**bad).items() if v is not None}
            peer.send(P.encode(P.READY, 1, capability=cap))
            reply = peer.recv()
            assert reply.type == P.ERROR and reply["code"] == "bad_field", reply
            assert len(c.coordinator.workers_snapshot()) == 2  # not registered
            assert c.coordinator.alive()
            assert_serves(c.coordinator, reference)
        finally:
            peer.close()


# 3. `meshnet status` answers from what the coordinator knows when a peer is silent


def test_status_with_a_silent_worker_answers_at_once_and_marks_it():
    with Coordinator() as coordinator:
        server = MetricsServer(coordinator.metrics, 0)
        peer = FakeWorker(coordinator.endpoint)
        try:
            peer.send(P.encode(P.READY, 1, capability=capability()))
            peer.heartbeat_forever()
            assert wait_until(lambda: len(coordinator.workers_snapshot()) == 1)
            t0 = time.monotonic()
            with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/status", timeout=10) as response:
                assert b'"silent": true' in response.read()
            assert time.monotonic() - t0 < 5
            t0 = time.monotonic()
            result = meshnet("status", "--url", f"http://127.0.0.1:{server.port}", timeout=30)
            assert result.returncode == 0, result.stderr
            assert time.monotonic() - t0 < 8
            assert b"SILENT" in result.stdout and b"[0,30)" in result.stdout
        finally:
            peer.close()
            server.close()


def test_status_reports_a_timeout_as_a_timeout():
    import socket

    with socket.socket() as listener:  # accepts the connection, never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        result = meshnet("status", "--url", f"http://127.0.0.1:{listener.getsockname()[1]}", timeout=60)
    assert result.returncode == 4
    assert b"error: [timeout]" in result.stderr and b"Traceback" not in result.stderr


# 4. every kind of request is bounded at the worker; health is never queued behind work


def test_a_flood_of_tokenize_requests_is_bounded_and_health_still_answers(smollm2_path, fake_coordinator):
    worker = start_worker(smollm2_path, fake_coordinator.endpoint, (0, 15))
    try:
        fake = fake_coordinator
        fake.wait_ready()
        rss_before = rss_kib(worker.pid)
        text = "the quick brown fox jumps over the lazy dog " * 1300  # ~58 KB
        # fewer than the worker's send high-water mark (1000): a reply past it would be
        # dropped while we are slow to read, and then the wait below could not end
        n_sent = 600
        for i in range(n_sent):
            fake.send(P.encode(P.TOKENIZE, 10_000 + i, payload=text.encode()))
        fake.send(P.encode(P.HEALTH, 99))
        t0 = time.monotonic()
        replies, health_after = [], None
        # the health reply may come after the last tokenize reply: the flood's refusals
        # leave before it, and the few admitted tokenize requests may all finish first
        while len(replies) < n_sent or health_after is None:
            assert time.monotonic() - t0 < 60, (len(replies), health_after)
            msg = fake.next_reply(timeout=60)
            if msg.rid == 99:
                health_after = time.monotonic() - t0
                assert msg.type == P.OK and "n_sessions" in msg["info"]
            else:
                replies.append(msg)
        codes = [m["code"] if m.type == P.ERROR else m.type for m in replies]
        assert codes.count("busy") > n_sent / 2 and codes.count(P.OK) >= 1
        assert health_after is not None and health_after < 2.0, health_after
        assert rss_kib(worker.pid) - rss_before < 64 * 1024
        assert worker.poll() is None
    finally:
        worker.terminate()
        worker.wait(timeout=20)


# 5. workers started before their coordinator, or a coordinator restarted under them


def test_workers_started_before_the_coordinator_serve_the_first_session(smollm2_path, reference):
    address = f"tcp://127.0.0.1:{free_port()}"
    beat = ["--heartbeat-interval", "0.1", "--heartbeat-liveness", "5"]
    workers = [start_worker(smollm2_path, address, layers, *beat) for layers in HALVES]
    try:
        time.sleep(4)  # several give-ups and back-offs of the workers, with nobody there
        for restart in range(2):  # a fresh coordinator, then one restarted under living workers
            with Coordinator(CoordinatorConfig(address, heartbeat_interval=0.1, heartbeat_liveness=5)) as coordinator:
                coordinator.wait_for_route(30, n_stages=2)
                assert_serves(coordinator, reference)
            time.sleep(1.5)
    finally:
        for w in workers:
            w.terminate()
        assert [w.wait(timeout=20) for w in workers] == [0, 0]


# 6. `meshnet run` watches its children while the route forms


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_run_reports_a_worker_lost_before_the_route_formed_at_once(how, arch_models):
    # any model does for the launcher's watch; a generated one keeps a plain pytest download-free
    run = subprocess.Popen([sys.executable, "-m", "meshnet.cli.main", "run", "--model", arch_models["llama"],
                            "--max-tokens", "4"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        child = None
        deadline = time.monotonic() + 30
        while child is None and time.monotonic() < deadline:
            # a worker that has started, not a fork still on its way to exec: stopped there,
            # it would hold its parent inside Popen, which waits for the exec
            child = next((pid for pid in children_of(run.pid) if b"worker" in _cmdline(pid)), None)
        assert child is not None
        os.kill(child, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        t0 = time.monotonic()
        _, stderr = run.communicate(timeout=30)
        assert time.monotonic() - t0 < 10
        assert run.returncode == 4, stderr
        assert b"error: [worker_exited]" in stderr
        assert (b"SIGKILL" if how == "kill" else b"stopped") in stderr
        assert b"Traceback" not in stderr
    finally:
        if run.poll() is None:
            run.kill()
        for pid in children_of(run.pid):
            os.kill(pid, signal.SIGKILL)


def test_a_worker_that_fails_to_start_is_reported_with_its_exit_status_and_last_words(tmp_path):
    not_a_model = tmp_path / "notes.gguf"
    not_a_model.write_bytes(b"GGUF" + os.urandom(100))
    t0 = time.monotonic()
    with pytest.raises(MeshnetError) as err:
        LocalCluster(str(not_a_model), HALVES, threads=THREADS).start(timeout=60)
    assert time.monotonic() - t0 < 20
    assert err.value.code == "worker_exited" and "exited with status 3" in err.value.message
    assert "error: [" in err.value.message  # the worker's own error line, from its stderr


# 7. a prompt that is not UTF-8


@pytest.mark.parametrize("mode", [[], ["--in-process"]], ids=["workers", "in-process"])
def test_a_prompt_that_is_not_utf8_is_a_clear_error_at_once(mode, arch_models):
    t0 = time.monotonic()
    result = meshnet("run", *mode, "--model", arch_models["llama"], "--prompt", b"caf\xe9")
    assert time.monotonic() - t0 < 15
    assert result.returncode == 5
    assert b"error: [invalid_argument]" in result.stderr and b"0xe9" in result.stderr
    assert b"Traceback" not in result.stderr


# 8. non-finite or absurd residual values are refused before computing; the session goes on


@pytest.mark.parametrize("poison", [np.nan, np.inf, -np.inf, 3e38], ids=["nan", "inf", "-inf", "3e38"])
def test_a_non_finite_residual_is_refused_and_the_session_continues(smollm2_path, fake_coordinator, reference, poison):
    prompt_tokens, expected = reference
    worker = start_worker(smollm2_path, fake_coordinator.endpoint, (15, 30))
    try:
        fake = fake_coordinator
        fake.wait_ready()
        with Stage(smollm2_path, (0, 15), n_ctx=256, max_sessions=1, n_threads=THREADS) as head:
            head.open_session(1)
            residual = head.forward([Entry(1, 0, tokens=np.array(prompt_tokens))]).residual
        assert fake.open(7, prompt_len=len(prompt_tokens)).type == P.OK
        poisoned = residual.copy()
        poisoned[len(prompt_tokens) // 2, 100] = poison

        refused = fake.forward(7, 0, residual=poisoned)
        assert refused.type == P.ERROR and refused["code"] == "bad_payload", refused
        assert "row" in refused["message"] and refused["sid"] == 7
        result = fake.forward(7, 0, residual=residual)  # the same session, from the same position
        assert result.type == P.TOKEN and result["token"] == expected[0]
    finally:
        worker.terminate()
        worker.wait(timeout=20)


def test_the_engine_refuses_non_finite_residuals_and_keeps_the_session_where_it_was(smollm2_path, reference):
    prompt_tokens, expected = reference
    with Stage(smollm2_path, (0, 15), n_ctx=256, max_sessions=1, n_threads=THREADS) as head, \
            Stage(smollm2_path, (15, 30), n_ctx=256, max_sessions=1, n_threads=THREADS) as tail:
        head.open_session(1)
        tail.open_session(1)
        residual = head.forward([Entry(1, 0, tokens=np.array(prompt_tokens))]).residual
        bad = residual.copy()
        bad[-1, -1] = np.nan
        with pytest.raises(MeshnetError) as err:
            tail.forward([Entry(1, 0, residual=bad)])
        assert err.value.code == "bad_payload"
        assert tail.session_length(1) == 0
        assert int(tail.forward([Entry(1, 0, residual=residual)], want_logits=False).token[0]) == expected[0]


# 9. error replies are always protocol-valid


@pytest.mark.parametrize("sid", [True, False, -1, -(2 ** 63)], ids=str)
def test_error_replies_never_echo_an_invalid_session_id(smollm2_path, fake_coordinator, sid):
    worker = start_worker(smollm2_path, fake_coordinator.endpoint, (0, 15))
    try:
        fake = fake_coordinator
        fake.wait_ready()
        for msg_type in (P.OPEN, P.RELEASE, P.CANCEL):
            reply = fake.reply_to([msgpack.packb({"v": P.VERSION, "type": msg_type, "rid": 77, "sid": sid})])
            assert reply.type == P.ERROR and reply["code"] == "bad_field" and "sid" not in reply.fields
        # on the data plane there is no one to answer: the message is dropped and counted
        fake.send_data([msgpack.packb({"v": P.VERSION, "type": P.ACT, "rid": 0, "sid": sid, "key": 1, "pos": 0, "n": 1,
                                       "tokens": [1]})])
        assert wait_until(lambda: fake.request(P.HEALTH)["info"]["dropped"].get("bad_field") == 1)
    finally:
        worker.terminate()
        worker.wait(timeout=20)


def test_the_coordinator_answers_invalid_session_ids_with_valid_errors():
    with Coordinator() as coordinator:
        peer = FakeWorker(coordinator.endpoint)
        try:
            for sid in (True, -1, -(2 ** 63)):
                peer.send([msgpack.packb({"v": P.VERSION, "type": "open", "rid": 5, "sid": sid})])
                reply = peer.recv()  # decoded: protocol-valid
                assert reply.type == P.ERROR and "sid" not in reply.fields
            assert coordinator.alive()
        finally:
            peer.close()


# 10. a CANCEL for a session that is not open poisons nothing; booleans are not token ids


def test_a_cancel_for_an_unopened_session_does_not_poison_its_id(smollm2_path, fake_coordinator, reference):
    prompt_tokens, expected = reference
    worker = start_worker(smollm2_path, fake_coordinator.endpoint, (0, 30))
    try:
        fake = fake_coordinator
        fake.wait_ready()
        assert fake.request(P.CANCEL, sid=42).type == P.OK
        assert fake.open(42, prompt_len=len(prompt_tokens)).type == P.OK
        result = fake.forward(42, 0, tokens=prompt_tokens)
        assert result.type == P.TOKEN and result["token"] == expected[0], result
        # cancelled while open, then opened again under the same id: clean again
        assert fake.request(P.CANCEL, sid=42).type == P.OK
        assert fake.open(42, prompt_len=len(prompt_tokens)).type == P.OK
        result = fake.forward(42, 0, tokens=prompt_tokens)
        assert result.type == P.TOKEN and result["token"] == expected[0], result

        # booleans are not token ids: the step is not used (dropped and counted), the session goes on
        fake.act(42, len(prompt_tokens), tokens=[True])
        assert wait_until(lambda: fake.request(P.HEALTH)["info"]["dropped"].get("bad_field") == 1)
    finally:
        worker.terminate()
        worker.wait(timeout=20)


# 11. clear one-line errors for addresses


def test_a_second_coordinator_on_a_port_in_use_is_a_one_line_error():
    address = f"tcp://127.0.0.1:{free_port()}"
    with Coordinator(CoordinatorConfig(address)):
        result = meshnet("coordinator", "--bind", address, "--prompt", "hi")
    assert result.returncode == 4
    assert result.stderr.decode().strip().splitlines()[-1].startswith("error: [address_in_use]")
    assert b"Traceback" not in result.stderr


@pytest.mark.parametrize("command", [["coordinator", "--bind", "tcp://127.0.0.1:notaport"],
                                     ["coordinator", "--bind", "nonsense"],
                                     ["worker", "--layers", "0:15", "--coordinator", "nonsense"]],
                         ids=["bind-port", "bind-scheme", "worker-coordinator"])
def test_a_malformed_address_is_a_one_line_error(command):
    result = meshnet(*command)
    assert result.returncode == 2, result.stderr
    assert b"error: [bad_address]" in result.stderr and b"Traceback" not in result.stderr


# 14. a message of many frames is dropped without gathering it


def test_a_message_of_many_frames_is_refused_and_its_memory_let_go(smollm2_path, reference):
    # the default payload limit (32 MiB, frames up to 64 MiB) and 40 MiB frames: buffers that
    # large are always mmapped by glibc, so RSS shows what is kept, not what malloc caches
    with LocalCluster(smollm2_path, HALVES, threads=THREADS, n_ctx=512, secure=False) as c:
        peer = FakeWorker(c.coordinator.endpoint)
        try:
            rss_before = rss_bytes()
            frame = b"\1" * (40 << 20)
            for _ in range(4):
                peer.send([P.encode(P.HEARTBEAT, 1)[0], *[frame] * 3])  # 120 MiB in one message
                reply = peer.recv(timeout=30)
                assert reply.type == P.ERROR and reply["code"] == "oversized", reply
            assert rss_bytes() - rss_before < 64 << 20
            assert_serves(c.coordinator, reference)
        finally:
            peer.close()


def test_a_worker_refuses_a_message_of_many_frames(smollm2_path, fake_coordinator):
    worker = start_worker(smollm2_path, fake_coordinator.endpoint, (0, 15))
    try:
        fake = fake_coordinator
        fake.wait_ready()
        reply = fake.reply_to([P.encode(P.HEALTH, 5)[0], b"x" * 1000, b"y" * 1000, b"z"])
        assert reply.type == P.ERROR and reply["code"] == "oversized"
        assert fake.request(P.HEALTH).type == P.OK
    finally:
        worker.terminate()
        worker.wait(timeout=20)
