"""ACCEPTANCE section B: real stage worker processes on loopback, real SmolLM2."""

import os
import signal
import time

import msgpack
import numpy as np
import pytest
import zmq

from meshnet import protocol as P
from meshnet.cluster import LocalCluster
from meshnet.engine import Entry, Stage
from meshnet.errors import MeshnetError
from meshnet.pipeline import LocalPipeline

from conftest import THREADS
from peers import FakeCoordinator, start_worker, wait_until

PROMPTS = [
    "The old lighthouse keeper climbed the stairs every night, and",
    "A recipe for bread needs flour, water, salt and",
    "In 1969 the first astronauts landed on the Moon, and",
    "The three laws of thermodynamics say that",
]
LONG_PROMPT = " ".join(PROMPTS * 5)  # 200+ tokens
HALVES = [(0, 15), (15, 30)]
THIRDS = [(0, 10), (10, 20), (20, 30)]
FAST_HEARTBEAT = dict(heartbeat_interval=0.1, heartbeat_liveness=10)  # a dead peer within ~1 s


@pytest.fixture(scope="module")
def reference(smollm2_path):
    """Whole model, one process: tokens and logits of each prompt, the truth to match."""
    results = {}
    with LocalPipeline(smollm2_path, [(0, 30)], n_ctx=1024, max_sessions=1, n_threads=THREADS) as whole:
        for prompt in [*PROMPTS, LONG_PROMPT]:
            tokens = whole.head.tokenize(prompt)
            results[prompt] = (tokens, whole.generate(tokens, 32, keep_logits=True, stop_at_eog=False))
    return results


def cluster(path, ranges, **options):
    options.setdefault("threads", THREADS)
    options.setdefault("n_ctx", 1024)
    options.setdefault("max_payload", 4 << 20)
    return LocalCluster(path, ranges, **options).start()


def stats_by_range(coordinator):
    return {tuple(s["layers"]): s for s in coordinator.stage_stats()}


# lifecycle and parity


def test_lifecycle_health_capability_fragmented_prefill_decode_release_shutdown(smollm2_path, reference):
    prompt_tokens, expected = reference[LONG_PROMPT]
    assert len(prompt_tokens) > 200
    c = cluster(smollm2_path, HALVES, prefill_chunk=64)
    try:
        coordinator = c.coordinator
        capabilities = sorted(coordinator.workers_snapshot(), key=lambda w: w["layers"])
        assert [w["layers"] for w in capabilities] == [[0, 15], [15, 30]]
        for w in capabilities:
            assert w["model_sha256"] == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
            assert w["engine_pin"].startswith("llama.cpp@0c1e57098") and w["backend"] == "CPU"
            assert w["admitted_bytes"] > w["n_embd"]
        session = coordinator.generate(prompt_tokens, 32, stop_at_eog=False, want_logits=True).result()
        assert session.tokens == expected.tokens
        assert max(float(np.abs(a - b).max()) for a, b in zip(session.logits, expected.logits)) == 0.0
        assert session.metrics["prompt_tokens"] == len(prompt_tokens)
        assert session.metrics["seam_bytes"] == (len(prompt_tokens) + 31) * 576 * 4
        # health is answered at once from the stage's last snapshot: the release shows within a job
        assert wait_until(lambda: all(s["n_sessions"] == 0 and s["kv_bytes_used"] == 0
                                      for s in stats_by_range(coordinator).values()))
        coordinator.shutdown_workers()
        for process in c.processes.values():
            assert process.wait(timeout=20) == 0
    finally:
        c.close()


def test_sigterm_stops_a_worker_gracefully_with_exit_code_0(smollm2_path):
    c = cluster(smollm2_path, HALVES)
    try:
        head = c.processes[(0, 15)]
        head.send_signal(signal.SIGTERM)
        assert head.wait(timeout=20) == 0
        # it said goodbye: the route is incomplete at once, not after a heartbeat timeout
        with pytest.raises(MeshnetError) as err:
            c.coordinator.route()
        assert err.value.code == "route_incomplete"
    finally:
        c.close()


@pytest.mark.parametrize("ranges", [HALVES, THIRDS], ids=["2-workers", "3-workers"])
def test_worker_processes_give_whole_model_tokens_and_bit_identical_logits(smollm2_path, reference, ranges):
    prompt_tokens, expected = reference[PROMPTS[0]]
    with cluster(smollm2_path, ranges) as c:
        session = c.coordinator.generate(prompt_tokens, 32, stop_at_eog=False, want_logits=True).result()
    assert session.tokens == expected.tokens
    assert len(session.logits) == 32
    assert max(float(np.abs(a - b).max()) for a, b in zip(session.logits, expected.logits)) == 0.0


def test_four_concurrent_sessions_each_give_their_own_tokens(smollm2_path, reference):
    with cluster(smollm2_path, HALVES) as c:
        sessions = [c.coordinator.generate(reference[p][0], 32, stop_at_eog=False) for p in PROMPTS]
        results = [s.result() for s in sessions]
    for prompt, session in zip(PROMPTS, results):
        assert session.tokens == reference[prompt][1].tokens


# cancellation


def test_cancel_mid_prefill_and_mid_decode_leaves_other_sessions_untouched(smollm2_path, reference):
    long_tokens = reference[LONG_PROMPT][0] * 4  # ~900 tokens: a prefill that takes a while
    with cluster(smollm2_path, HALVES, prefill_chunk=32) as c:
        coordinator = c.coordinator
        others = [coordinator.generate(reference[p][0], 32, stop_at_eog=False) for p in PROMPTS[:2]]
        in_prefill = coordinator.generate(long_tokens, 8)
        in_decode = coordinator.generate(reference[PROMPTS[2]][0], 200, stop_at_eog=False)

        time.sleep(0.3)  # well inside a prompt that takes seconds to read
        t0 = time.monotonic()
        in_prefill.cancel()
        with pytest.raises(MeshnetError) as err:
            in_prefill.result()
        assert err.value.code == "cancelled" and time.monotonic() - t0 < 1.0
        assert in_prefill.tokens == []  # it never got past its prompt

        decoded = []
        for event in in_decode:
            decoded.append(event.token)
            if len(decoded) == 5:
                in_decode.cancel()
                break
        with pytest.raises(MeshnetError) as err:
            in_decode.result()
        assert err.value.code == "cancelled"

        for prompt, session in zip(PROMPTS, others):
            assert session.result().tokens == reference[prompt][1].tokens
        assert wait_until(lambda: all(s["n_sessions"] == 0 and s["kv_bytes_used"] == 0
                                      for s in stats_by_range(coordinator).values()))


# failures: a dead or hung worker is a bounded, structured error


@pytest.mark.parametrize("victim", [(0, 15), (15, 30)], ids=["head", "tail"])
@pytest.mark.parametrize("how", ["kill", "stop"])
def test_lost_worker_mid_decode_is_a_structured_error_and_a_replacement_restores_service(smollm2_path, reference, victim, how):
    prompt_tokens, expected = reference[PROMPTS[1]]
    c = cluster(smollm2_path, HALVES, **FAST_HEARTBEAT)
    try:
        coordinator = c.coordinator
        callers = [coordinator.generate(reference[p][0], 400, stop_at_eog=False) for p in PROMPTS[:2]]
        for session in callers:  # both are decoding now: each has streamed its first token
            next(iter(session))
        assert [len(s.tokens) for s in callers] == [1, 1]

        process = c.processes[victim]
        os.kill(process.pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        t0 = time.monotonic()
        for session in callers:
            with pytest.raises(MeshnetError) as err:
                session.result()
            error = err.value.to_dict()
            assert error["code"] == "stage_lost"
            assert error["stage"] == f"[{victim[0]},{victim[1]})"
            assert error["worker"] and error["session"] == session.sid
            assert error["elapsed_ms"] <= 3000
        assert time.monotonic() - t0 < 3.0

        survivor = (15, 30) if victim == (0, 15) else (0, 15)
        assert wait_until(lambda: stats_by_range(coordinator)[survivor]["n_sessions"] == 0)
        with pytest.raises(MeshnetError) as err:
            coordinator.generate(prompt_tokens, 4).result()
        assert err.value.code == "route_incomplete"

        c.spawn_worker(victim)
        coordinator.wait_for_route(60, n_stages=2)
        session = coordinator.generate(prompt_tokens, 32, stop_at_eog=False).result()
        assert session.tokens == expected.tokens
    finally:
        if process.poll() is None:  # the stopped one, replaced: the cluster no longer owns it
            process.send_signal(signal.SIGCONT)
            process.kill()
            process.wait()
        c.close()


def test_a_long_prefill_on_a_busy_worker_is_not_declared_dead(smollm2_path, reference):
    long_tokens = (reference[LONG_PROMPT][0] * 5)[:1000]
    # the whole prompt in one forward call: seconds of compute, far past the liveness window
    with cluster(smollm2_path, HALVES, prefill_chunk=1024, heartbeat_interval=0.1, heartbeat_liveness=5) as c:
        session = c.coordinator.generate(long_tokens, 4, stop_at_eog=False).result()
        assert len(session.tokens) == 4
        assert session.metrics["ttft_ms"] > 500  # it really was longer than the 0.5 s liveness window
        assert c.coordinator.counters["workers_lost"] == 0


# malformed input


@pytest.fixture
def fake_coordinator():
    fake = FakeCoordinator()
    yield fake
    fake.close()


def test_malformed_messages_at_the_worker_get_structured_errors_and_it_keeps_serving(smollm2_path, fake_coordinator, reference):
    prompt_tokens, expected = reference[PROMPTS[0]]
    worker = start_worker(smollm2_path, fake_coordinator.endpoint, (15, 30))
    try:
        fake = fake_coordinator
        capability = fake.wait_ready()
        n_embd = capability["n_embd"]

        # the residual a real head gives for the prompt
        with Stage(smollm2_path, (0, 15), n_ctx=256, max_sessions=1, n_threads=THREADS) as head:
            head.open_session(1)
            residual = head.forward([Entry(1, 0, tokens=np.array(prompt_tokens))]).residual
        assert fake.request(P.OPEN, sid=7).type == P.OK

        def bad(frames, code):
            msg = fake.reply_to(frames)
            assert msg.type == P.ERROR and msg["code"] == code, msg
            assert msg["message"]

        bad([os.urandom(64)], "malformed")
        bad([msgpack.packb({"v": 1, "type": "forward", "rid": 5})[:-3]], "malformed")
        bad([msgpack.packb({"v": 99, "type": "health", "rid": 5})], "bad_version")
        bad([msgpack.packb({"v": 1, "type": "make_coffee", "rid": 6})], "unknown_type")
        bad(P.encode(P.FORWARD, 8, payload=b"\0" * (4 * 512 * n_embd + 4), sid=7, pos=0, n=1, shape=[1, n_embd], dtype="f32"),
            "oversized")
        wrong_width = np.zeros((len(prompt_tokens), n_embd - 8), np.float32)
        bad(P.encode(P.FORWARD, 9, payload=P.f32_payload(wrong_width), sid=7, pos=0, n=len(prompt_tokens),
                     shape=list(wrong_width.shape), dtype="f32"), "bad_width")
        bad(P.encode(P.FORWARD, 10, payload=residual.astype(np.float64).tobytes(), sid=7, pos=0, n=len(prompt_tokens),
                     shape=list(residual.shape), dtype="f64"), "bad_field")
        bad(P.encode(P.FORWARD, 11, payload=residual.tobytes()[:-4], sid=7, pos=0, n=len(prompt_tokens),
                     shape=list(residual.shape), dtype="f32"), "bad_payload")
        bad(P.encode(P.FORWARD, 12, payload=P.f32_payload(residual), sid=12345, pos=0, n=len(prompt_tokens),
                     shape=list(residual.shape), dtype="f32"), "unknown_session")
        bad(P.encode(P.OPEN, 12, sid=8), "duplicate_request")  # rid 12 was used just above

        # after all that, the session gives exactly the whole model's first token
        result = fake.request(P.FORWARD, payload=P.f32_payload(residual), sid=7, pos=0, n=len(prompt_tokens),
                              shape=list(residual.shape), dtype="f32")
        assert result.type == P.RESULT and result["token"] == expected.tokens[0]
        health = fake.request(P.HEALTH)
        assert health.type == P.OK and health["info"]["n_sessions"] == 1
        assert worker.poll() is None
    finally:
        worker.terminate()
        worker.wait(timeout=20)


def test_malformed_messages_at_the_coordinator_get_structured_errors_and_it_keeps_serving(smollm2_path, reference):
    prompt_tokens, expected = reference[PROMPTS[3]]
    with cluster(smollm2_path, HALVES) as c:
        ctx = zmq.Context()
        peer = ctx.socket(zmq.DEALER)
        peer.setsockopt(zmq.LINGER, 0)
        peer.connect(c.coordinator.endpoint)
        try:
            session = c.coordinator.generate(prompt_tokens, 32, stop_at_eog=False)

            def bad(frames, code):
                peer.send_multipart(frames)
                assert peer.poll(5000), "no answer from the coordinator"
                msg = P.decode(peer.recv_multipart(), 1 << 30)
                assert msg.type == P.ERROR and msg["code"] == code, msg

            bad([os.urandom(100)], "malformed")
            bad([msgpack.packb({"v": 1, "type": "ready", "rid": 1})[:-2]], "malformed")
            bad([msgpack.packb({"v": 2, "type": "ready", "rid": 1})], "bad_version")
            bad([msgpack.packb({"v": 1, "type": "teleport", "rid": 2})], "unknown_type")
            bad(P.encode(P.READY, 3, capability={"layers": "all of them"}), "bad_field")
            bad([P.encode(P.HEARTBEAT, 4)[0], b"\0" * (5 << 20)], "oversized")
            bad(P.encode(P.FORWARD, 5, sid=1, pos=0, n=1, tokens=[1]), "unknown_type")
            assert session.result().tokens == expected.tokens
            assert c.coordinator.generate(prompt_tokens, 32, stop_at_eog=False).result().tokens == expected.tokens
        finally:
            peer.close()
            ctx.term()


# backpressure


def test_flooding_a_worker_past_its_queue_gives_busy_and_bounded_memory(smollm2_path, fake_coordinator):
    worker = start_worker(smollm2_path, fake_coordinator.endpoint, (0, 15), "--max-queue", "4", "--ctx", "2048")
    try:
        fake = fake_coordinator
        fake.wait_ready()
        assert fake.request(P.OPEN, sid=1).type == P.OK

        def rss_kib():
            with open(f"/proc/{worker.pid}/status") as f:
                return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))

        rss_before = rss_kib()
        n_sent = 300
        for i in range(n_sent):  # 300 prompt chunks of 64 tokens, as fast as the socket takes them
            fake.router.send_multipart([fake.identity, *P.encode(P.FORWARD, 5000 + i, sid=1, pos=64 * i, n=64,
                                                                  tokens=list(range(100, 164)))])
        replies = []
        while len(replies) < n_sent:
            msg = P.decode(fake.recv(30), 1 << 30)
            if msg.type != P.HEARTBEAT:
                replies.append(msg)
        codes = [m["code"] if m.type == P.ERROR else m.type for m in replies]
        assert codes.count("busy") > n_sent / 2
        assert codes.count(P.RESULT) >= 1
        assert rss_kib() - rss_before < 64 * 1024  # bounded: the refused requests were not kept
        assert worker.poll() is None
    finally:
        worker.terminate()
        worker.wait(timeout=20)


def test_a_worker_that_loses_its_coordinator_releases_its_sessions_and_announces_again(smollm2_path, fake_coordinator):
    worker = start_worker(smollm2_path, fake_coordinator.endpoint, (0, 15), "--heartbeat-interval", "0.1",
                          "--heartbeat-liveness", "5")
    try:
        fake = fake_coordinator
        fake.wait_ready()
        first_identity = fake.identity
        assert fake.request(P.OPEN, sid=3).type == P.OK
        assert fake.request(P.HEALTH)["info"]["n_sessions"] == 1
        t0 = time.monotonic()
        fake.wait_ready(timeout=10)  # we stay silent: after 0.5 s it gives us up and announces itself again
        assert time.monotonic() - t0 < 5
        assert fake.identity == first_identity  # on the same connection: libzmq keeps it, nothing is torn down
        assert wait_until(lambda: fake.request(P.HEALTH)["info"]["n_sessions"] == 0, timeout=5)
    finally:
        worker.terminate()
        worker.wait(timeout=20)


def test_a_request_past_its_deadline_ends_the_session_with_a_structured_error(smollm2_path, reference):
    long_tokens = (reference[LONG_PROMPT][0] * 5)[:1000]
    with cluster(smollm2_path, HALVES, prefill_chunk=1024, request_timeout=0.3) as c:
        t0 = time.monotonic()
        with pytest.raises(MeshnetError) as err:
            c.coordinator.generate(long_tokens, 4).result()
        assert err.value.code == "deadline_exceeded"
        assert err.value.context["stage"] == "[0,15)" and "[0,15)" in err.value.message
        assert time.monotonic() - t0 < 1.5
        # the stages drop the session, and the route still serves
        assert wait_until(lambda: all(s["n_sessions"] == 0 for s in c.coordinator.stage_stats()))
        assert len(c.coordinator.generate(reference[PROMPTS[0]][0], 4).result().tokens) == 4
