"""ACCEPTANCE section B: real stage worker processes on loopback, real SmolLM2."""

import os
import signal
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq

from meshnet.core.errors import MeshnetError
from meshnet.engine.binding import Entry, Stage
from meshnet.engine.gguf_layout import read_layout
from meshnet.engine.pipeline import LocalPipeline
from meshnet.evidence.prompts import SHORT
from meshnet.launch.local_cluster import LocalCluster
from meshnet.net import protocol as P

from conftest import THREADS, whole_model_tokens
from peers import KEY, FakeCoordinator, start_worker, wait_until

PROMPTS = SHORT
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
        # each seam crossed once per step: the rows, and a header of at most 128 bytes
        crossings = -(-len(prompt_tokens) // 64) + 31
        assert session.metrics["seam_crossings"] == [crossings]
        assert 0 < session.metrics["seam_bytes"] - (len(prompt_tokens) + 31) * 576 * 4 <= 128 * crossings
        assert session.metrics["decode_crossings_per_token"] == 1.0
        assert 576 * 4 < session.metrics["decode_seam_bytes_per_token"] <= 576 * 4 + 128
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
    # stage to stage: every seam crossed once per step (the prompt in one chunk, then 31 decode steps)
    assert session.metrics["seam_crossings"] == [32] * (len(ranges) - 1)
    assert session.metrics["decode_crossings_per_token"] == 1.0


def test_four_concurrent_sessions_are_batched_and_each_gives_its_own_tokens_and_bit_identical_logits(smollm2_path,
                                                                                                      reference):
    with cluster(smollm2_path, HALVES, prefill_chunk=16) as c:
        sessions = [c.coordinator.generate(reference[p][0], 32, stop_at_eog=False, want_logits=True) for p in PROMPTS]
        results = [s.result(60) for s in sessions]
        stats = c.coordinator.stage_stats()
    for prompt, session in zip(PROMPTS, results):
        expected = reference[prompt][1]
        assert session.tokens == expected.tokens
        assert max(float(np.abs(a - b).max()) for a, b in zip(session.logits, expected.logits)) == 0.0
    for stage in stats:  # the sessions really shared forward calls
        assert stage["batched_entries"] > stage["forwards"]


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two one-thread stages pipeline only on two CPUs or more")
def test_stages_that_pipeline_keep_one_micro_batch_of_the_decoding_sessions_in_each_and_change_no_token(smollm2_path):
    """Two one-thread stages on their own CPUs: the head splits four decoding sessions into
    two groups of two, one computed in each stage at once (one batch of four would leave
    a stage idle while the other computes); each session's tokens are the whole model's."""
    with LocalPipeline(smollm2_path, [(0, 30)], n_ctx=1024, max_sessions=1, n_threads=1) as whole:
        expected = [whole.generate(whole.head.tokenize(p), 32, stop_at_eog=False).tokens for p in PROMPTS]
    with cluster(smollm2_path, HALVES, threads=1) as c:
        sessions = [c.coordinator.generate(c.coordinator.tokenize(p), 32, stop_at_eog=False) for p in PROMPTS]
        results = [s.result(120) for s in sessions]
        stats = c.coordinator.stage_stats()
    assert [r.tokens for r in results] == expected
    head = stats[0]   # the sessions shared forward calls, never more than two in one
    assert head["batched_entries"] > head["forwards"] and head["largest_batch"] == 2, head


def test_a_failing_step_among_concurrent_sessions_ends_only_its_own_session(smollm2_path, reference):
    with cluster(smollm2_path, HALVES) as c:
        good = [c.coordinator.generate(reference[p][0], 32, stop_at_eog=False) for p in PROMPTS[:3]]
        bad = c.coordinator.generate(reference[PROMPTS[3]][0] + [10 ** 6], 32)   # a token id past the vocabulary
        with pytest.raises(MeshnetError) as err:
            bad.result(30)
        assert err.value.code == "bad_token" and err.value.context["stage"] == "[0,15)"
        for prompt, session in zip(PROMPTS, good):
            assert session.result(60).tokens == reference[prompt][1].tokens


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


@pytest.mark.parametrize("victim", [(0, 10), (10, 20), (20, 30)], ids=["head", "middle", "tail"])
@pytest.mark.parametrize("when", ["prefill", "decode"])
@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_lost_stage_is_a_structured_error_within_3_s_the_survivors_free_the_kv_and_a_replacement_serves(
        smollm2_path, reference, victim, when, how):
    prompt_tokens, expected = reference[PROMPTS[1]]
    long_tokens = reference[LONG_PROMPT][0] * 4  # ~900 tokens in chunks of 16: seconds of prefill
    c = cluster(smollm2_path, THIRDS, prefill_chunk=16, **FAST_HEARTBEAT)
    process = c.processes[victim]
    try:
        coordinator = c.coordinator
        if when == "decode":
            callers = [coordinator.generate(reference[p][0], 400, stop_at_eog=False) for p in PROMPTS[:2]]
            for session in callers:  # both are decoding now: each has streamed its first token
                next(iter(session))
            assert [len(s.tokens) for s in callers] == [1, 1]
        else:
            callers = [coordinator.generate(long_tokens, 4) for _ in range(2)]
            # the prompt is on its way through every stage: the tail has done work for it
            assert wait_until(lambda: stats_by_range(coordinator)[(20, 30)]["forwards"] > 2, timeout=20)

        os.kill(process.pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        t0 = time.monotonic()
        for session in callers:
            with pytest.raises(MeshnetError) as err:
                session.result(10)
            error = err.value.to_dict()
            assert error["code"] == "stage_lost", error
            assert error["stage"] == f"[{victim[0]},{victim[1]})"
            assert error["worker"] and error["session"] == session.sid
            assert error["elapsed_ms"] <= 3000
        assert time.monotonic() - t0 < 3.0
        if when == "prefill":
            assert all(s.tokens == [] for s in callers)

        survivors = [r for r in THIRDS if r != victim]
        assert wait_until(lambda: all(stats_by_range(coordinator)[r]["n_sessions"] == 0
                                      and stats_by_range(coordinator)[r]["kv_bytes_used"] == 0 for r in survivors))
        with pytest.raises(MeshnetError) as err:
            coordinator.generate(prompt_tokens, 4).result(10)
        assert err.value.code == "route_incomplete"

        c.spawn_worker(victim)
        coordinator.wait_for_route(60, n_stages=3)
        session = coordinator.generate(prompt_tokens, 32, stop_at_eog=False).result(30)
        assert session.tokens == expected.tokens
    finally:
        if process.poll() is None:  # the stopped one, replaced: the cluster no longer owns it
            process.send_signal(signal.SIGCONT)
            process.kill()
            process.wait()
        c.close()


def test_a_long_prefill_on_a_busy_worker_is_not_declared_dead(smollm2_path, reference):
    long_tokens = (reference[LONG_PROMPT][0] * 5)[:1000]
    # chunks of n_batch (512) rows, each call about as long as the liveness window at one
    # thread and seconds in all (1.5 s: a loaded 2-core machine may hold a process off its
    # CPU for a second)
    with cluster(smollm2_path, HALVES, prefill_chunk=1024, heartbeat_interval=0.1, heartbeat_liveness=15) as c:
        session = c.coordinator.generate(long_tokens, 4, stop_at_eog=False).result()
        assert len(session.tokens) == 4
        assert session.metrics["ttft_ms"] > 1500  # it really was longer than the liveness window
        assert c.coordinator.counters()["workers_lost"] == 0


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
        n_embd = capability.n_embd
        # the engine names where the layers run: the CPU here, by the name ggml gives it
        assert capability.backend == "CPU" and capability.device

        # the residual a real head gives for the prompt
        with Stage(smollm2_path, (0, 15), n_ctx=256, max_sessions=1, n_threads=THREADS) as head:
            head.open_session(1)
            residual = head.forward([Entry(1, 0, tokens=np.array(prompt_tokens))]).residual
        assert fake.open(7, prompt_len=len(prompt_tokens)).type == P.OK

        # the control socket answers every bad message with a structured error
        def bad(frames, code):
            msg = fake.reply_to(frames)
            assert msg.type == P.ERROR and msg["code"] == code, msg
            assert msg["message"]

        bad([os.urandom(64)], "malformed")
        bad([msgpack.packb({"v": P.VERSION, "type": "open", "rid": 5})[:-3]], "malformed")
        bad([msgpack.packb({"v": 99, "type": "health", "rid": 5})], "bad_version")
        bad([msgpack.packb({"v": P.VERSION, "type": "make_coffee", "rid": 6})], "unknown_type")
        bad(P.encode(P.ACT, 7, sid=7, key=KEY, pos=0, n=1, tokens=[1]), "unknown_type")  # data goes to the data socket
        bad(P.encode(P.OPEN, 8, sid=9, key=1, stage=1, next="nowhere", reply=fake.data_endpoint, prompt_len=1,
                     max_tokens=1, stop_at_eog=True), "bad_field")
        bad(P.encode(P.HEALTH, fake.rid), "duplicate_request")  # the rid of the OPEN above

        # the data socket has no one to answer: what cannot be used is dropped and counted...
        fake.send_data([os.urandom(64)])
        fake.send_data([P.encode(P.ACT, 0, sid=7, key=KEY, pos=0, n=1)[0], b"\0" * (4 * 512 * n_embd + 4)])
        fake.act(7, 0, residual=residual, key=KEY + 1)            # without the session's key
        fake.act(12345, 0, residual=residual)                      # a session that is not open here
        fake.send_data(P.encode(P.TOKEN, 0, sid=7, key=KEY, pos=0, n=1, token=1, eog=False))  # not a stage's input
        dropped = {"malformed": 1, "oversized": 1, "bad_key": 1, "unknown_session": 1, "unknown_type": 1}
        assert wait_until(lambda: fake.request(P.HEALTH)["info"]["dropped"] == dropped)
        # ...and what names the session with its key but cannot run ends that session with an error
        wrong_width = np.zeros((len(prompt_tokens), n_embd - 8), np.float32)
        for rows, code in [(wrong_width, "bad_width"), (residual[:, :-1].copy(), "bad_width")]:
            msg = fake.forward(7, 0, residual=rows)
            assert msg.type == P.ERROR and msg["code"] == code and msg["sid"] == 7, msg
        fake.send_data(P.encode(P.ACT, 0, payload=P.f32_payload(residual)[:-4], sid=7, key=KEY, pos=0,
                                n=len(prompt_tokens)))
        msg = fake.outcome()
        assert msg.type == P.ERROR and msg["code"] == "bad_payload", msg

        # after all that, the session gives exactly the whole model's first token
        result = fake.forward(7, 0, residual=residual)
        assert result.type == P.TOKEN and result["token"] == expected.tokens[0]
        health = fake.request(P.HEALTH)
        assert health.type == P.OK and health["info"]["n_sessions"] == 1
        assert worker.poll() is None
    finally:
        worker.terminate()
        worker.wait(timeout=20)


def test_malformed_messages_at_the_coordinator_get_structured_errors_and_it_keeps_serving(smollm2_path, reference):
    prompt_tokens, expected = reference[PROMPTS[3]]
    # keyless, as meshnet coordinator is on loopback: the raw peer must reach its checks
    with cluster(smollm2_path, HALVES, secure=False) as c:
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
            bad([msgpack.packb({"v": P.VERSION, "type": "ready", "rid": 1})[:-2]], "malformed")
            bad([msgpack.packb({"v": P.VERSION + 1, "type": "ready", "rid": 1})], "bad_version")
            bad([msgpack.packb({"v": P.VERSION, "type": "teleport", "rid": 2})], "unknown_type")
            bad(P.encode(P.READY, 3, capability={"layers": "all of them"}), "bad_field")
            bad([P.encode(P.HEARTBEAT, 4)[0], b"\0" * (5 << 20)], "oversized")
            bad(P.encode(P.ACT, 5, sid=1, key=1, pos=0, n=1, tokens=[1]), "unknown_type")
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
        assert fake.open(1, prompt_len=64 * 300).type == P.OK

        def rss_kib():
            with open(f"/proc/{worker.pid}/status") as f:
                return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))

        rss_before = rss_kib()
        n_sent = 300
        for i in range(n_sent):  # 300 prompt chunks of 64 tokens, as fast as the socket takes them
            fake.act(1, 64 * i, tokens=list(range(100, 164)))
        outcomes = []
        while len(outcomes) < n_sent:  # each step ran (its rows come to us) or was refused (an error)
            msg = fake.outcome(30)
            outcomes.append(msg["code"] if msg.type == P.ERROR else msg.type)
        assert outcomes.count("busy") > n_sent / 2
        assert outcomes.count(P.ACT) >= 1
        assert rss_kib() - rss_before < 64 * 1024  # bounded: the refused steps were not kept
        assert worker.poll() is None
    finally:
        worker.terminate()
        worker.wait(timeout=20)


def test_a_worker_that_loses_its_coordinator_releases_its_sessions_and_announces_again(smollm2_path, fake_coordinator):
    # 3 s of silence and it gives the coordinator up: the fake's steps (which answer no
    # heartbeat between them) stay well within that on a loaded machine
    worker = start_worker(smollm2_path, fake_coordinator.endpoint, (0, 15), "--heartbeat-interval", "0.1",
                          "--heartbeat-liveness", "30")
    try:
        fake = fake_coordinator
        fake.wait_ready()
        first_identity = fake.identity
        assert fake.open(3).type == P.OK
        assert fake.request(P.HEALTH)["info"]["n_sessions"] == 1
        t0 = time.monotonic()
        fake.wait_ready(timeout=20)  # we stay silent: after 3 s it gives us up and announces itself again
        assert time.monotonic() - t0 < 15
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
        # long before the prompt's first token would have come (seconds at one thread); a
        # loaded machine may hold the processes off their CPUs for a second or two
        assert time.monotonic() - t0 < 5
        # the stages drop the session, and the route still serves
        assert wait_until(lambda: all(s["n_sessions"] == 0 for s in c.coordinator.stage_stats()))
        assert len(c.coordinator.generate(reference[PROMPTS[0]][0], 4).result().tokens) == 4


# where the per-token work runs

@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="placement needs two CPUs")
def test_a_local_route_handles_its_tokens_on_the_tail_s_cpu_away_from_the_head_s(arch_models):
    """Each stage's data path has its CPU; the coordinator's token handling takes the
    tail's, which is idle while the head computes the next token. The tokens stay the
    whole model's."""
    path = arch_models["llama"]
    n_layer = read_layout(path).n_layer
    prompt_tokens, expected = whole_model_tokens(path, PROMPTS[0], 8)
    cpus = sorted(os.sched_getaffinity(0))
    with cluster(path, [(0, n_layer // 2), (n_layer // 2, n_layer)], threads=1, max_sessions=1) as c:
        loop = next(t for t in threading.enumerate() if t.name == "meshnet-coordinator")
        assert os.sched_getaffinity(loop.native_id) == {cpus[1]}
        assert os.sched_getaffinity(0) == set(cpus)   # the caller's own thread keeps every CPU
        assert c.coordinator.generate(prompt_tokens, 8, stop_at_eog=False).result(60).tokens == expected


def test_sessions_in_one_kv_pool_give_the_whole_model_s_tokens_and_one_the_pool_cannot_hold_waits_its_turn(
        smollm2_path):
    """Two stages of one KV pool of 1024 cells (4 blocks of 256) each, four sessions of 300
    tokens: each takes a block for its prompt, then needs a second. The pool holds two
    such sessions at once: a session that finds no room leaves its route and is replayed
    when room comes, and every session completes with exactly the whole model's tokens."""
    prompts = [p + " Tell me more." for p in PROMPTS]
    with LocalPipeline(smollm2_path, [(0, 30)], n_ctx=1024, max_sessions=1, n_threads=THREADS) as whole:
        expected = {p: whole.generate(whole.head.tokenize(p), 300, stop_at_eog=False).tokens for p in prompts}
    with cluster(smollm2_path, HALVES, max_sessions=4, kv_pool=1024) as c:
        sessions = {p: c.coordinator.generate(c.coordinator.tokenize(p), 300, stop_at_eog=False) for p in prompts}
        outcomes = {p: s.result(600) for p, s in sessions.items()}
        counters = c.coordinator.metrics()["counters"]
    assert {p: o.tokens for p, o in outcomes.items()} == expected
    assert counters["kv_pauses"] >= 2 and sum(o.metrics.get("kv_pauses", 0) for o in outcomes.values()) >= 2
