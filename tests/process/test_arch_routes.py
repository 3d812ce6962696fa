"""Architectures beyond llama over worker processes: one model of each kind of layer and
memory, split through `meshnet run`, gives the whole model's tokens; a model with
recurrent state fails over by replaying from the start, and refuses to drop tokens."""

import os
import signal

import pytest

from meshnet.core.errors import MeshnetError
from meshnet.engine.binding import Entry, Stage
from meshnet.launch.local_cluster import LocalCluster

from conftest import TEST_MODELS, THREADS, last_json_line, meshnet

# the kinds of the issue: dense, mixture of experts, sliding-window attention, MLA, and a
# hybrid of attention and recurrent (Mamba) layers; and state beside the residual, whose
# rows cross the wire wider than n_embd (RWKV-7's first-layer value, Gemma 4's per-layer inputs)
KINDS = {"dense": "llama-dense", "moe": "qwen3moe-moe", "sliding-window": "gemma3-dense",
         "mla": "deepseek2-moe", "hybrid-recurrent": "jamba-dense", "seam-state-recurrent": "rwkv7-dense",
         "seam-state-per-layer-inputs": "gemma4-dense"}
PROMPT = "the quick brown fox jumps over the lazy dog and runs far away"


def model(stem: str) -> str:
    path = os.path.join(TEST_MODELS, f"{stem}.gguf")
    assert os.path.isfile(path), f"{path} is missing: run `make test-models` (make test does)"
    return path


def run_tokens(path: str, *args) -> list[int]:
    done = meshnet("run", "--model", path, "--prompt", PROMPT, "--max-tokens", "16", "--threads", "1",
                   "--ctx", "128", "--json", *args, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    out = last_json_line(done.stdout)
    assert out["metrics"]["generated_tokens"] == len(out["tokens"]) > 0
    return out["tokens"]


@pytest.mark.parametrize("kind", list(KINDS))
def test_meshnet_run_over_worker_processes_gives_the_whole_model_s_tokens(kind):
    path = model(KINDS[kind])
    whole = run_tokens(path, "--in-process", "--stages", "1")
    assert run_tokens(path, "--stages", "2") == whole
    assert run_tokens(path, "--split", "1,3") == whole


def test_a_recurrent_state_refuses_to_drop_tokens_and_a_transformer_s_kv_does_not():
    tokens = list(range(3, 19))
    with Stage(model("mamba-dense"), (0, 2), n_ctx=64, max_sessions=1, n_threads=THREADS) as stage:
        stage.open_session(1)
        stage.forward([Entry(1, 0, tokens=tokens)])
        with pytest.raises(MeshnetError) as refused:
            stage.truncate_session(1, 8)
        assert refused.value.code == "cannot_roll_back" and "release the session" in refused.value.message
        assert stage.session_length(1) == 16   # unchanged, and it goes on from there
        stage.forward([Entry(1, 16, tokens=[5])])
        stage.truncate_session(1, 17)           # keeping every token is no rollback
    with Stage(model("llama-dense"), (0, 2), n_ctx=64, max_sessions=1, n_threads=THREADS) as stage:
        stage.open_session(1)
        stage.forward([Entry(1, 0, tokens=tokens)])
        stage.truncate_session(1, 8)
        assert stage.session_length(1) == 8


def test_a_hybrid_recurrent_model_fails_over_to_a_spare_with_the_same_tokens():
    # failover replays a session from the start on the new route, so a recurrent state
    # never has to roll back
    halves = [(0, 2), (2, 4)]
    MANY = 900   # a tiny model decodes hundreds of tokens a second: enough for the kill to land mid-decode
    with LocalCluster(model(KINDS["hybrid-recurrent"]), halves, threads=1, n_ctx=1024, max_sessions=2,
                      heartbeat_interval=0.1, heartbeat_liveness=10) as cluster:
        coordinator = cluster.coordinator
        prompt = coordinator.tokenize(PROMPT)
        want = coordinator.generate(prompt, MANY, stop_at_eog=False).result(120).tokens
        spare = cluster.spawn_worker(halves[1])
        try:
            cluster.wait_offered(spare)
            handle = coordinator.generate(prompt, MANY, stop_at_eog=False)
            got = []
            for event in handle:
                got.append(event.token)
                if len(got) == 4:   # the tail the session runs on, whichever of the two it is
                    tail = [w["pid"] for w in coordinator.workers_snapshot()
                            if w["sessions"] and list(w["layers"]) == [2, 4]]
                    assert len(tail) == 1, coordinator.workers_snapshot()
                    os.kill(tail[0], signal.SIGKILL)
        finally:
            spare.kill()
            spare.wait()
    assert got == want
    resumed = handle.metrics["resumed"]
    assert len(resumed) == 1 and resumed[0]["stage"] == "[2,4)" and resumed[0]["generated_before"] >= 4


@pytest.mark.parametrize("ranges", [[(0, 9), (9, 18)], [(0, 6), (6, 12), (12, 18)]], ids=["2-workers", "3-workers"])
def test_a_real_gemma3_over_worker_processes_gives_the_whole_model_s_tokens_and_logits(gemma3_path, ranges):
    import numpy as np

    from meshnet.evidence import parity

    with LocalCluster(gemma3_path, ranges, threads=1, n_ctx=256, max_sessions=1) as cluster:
        prompt = cluster.coordinator.tokenize("The old lighthouse keeper climbed the stairs and saw")
        session = cluster.coordinator.generate(prompt, 16, stop_at_eog=False, want_logits=True).result(300)
    with parity.route(gemma3_path, None, n_ctx=256, max_sessions=1, n_threads=THREADS) as whole:
        run = parity.generate(whole, np.asarray(prompt, dtype=np.int32), [0], 16)
    assert session.tokens == run.tokens
    assert max(float(np.abs(a - b).max()) for a, b in zip(session.logits, run.logits)) == 0.0


def test_a_pass_aborted_after_a_recurrent_state_moved_leaves_the_session_refused_until_fed_again():
    import threading

    tokens = [(7 * i) % 120 + 3 for i in range(1024)]
    with Stage(model("mamba-dense"), (0, 2), n_ctx=2048, max_sessions=1, n_batch=1024, n_threads=1) as stage:
        for attempt in range(20):   # an abort that lands before the pass starts is cleared by it: again
            stage.open_session(1)
            stage.forward([Entry(1, 0, tokens=tokens[:4])])   # a state to lose (from 0, a rollback is a reset)
            outcome = {}

            def forward():
                try:
                    stage.forward([Entry(1, 4, tokens=tokens[4:])])
                    outcome["error"] = None
                except MeshnetError as e:
                    outcome["error"] = e

            worker = threading.Thread(target=forward)
            worker.start()
            while worker.is_alive():
                stage.abort()
                worker.join(0.001)
            if outcome["error"] is not None:
                break
            stage.release_session(1)
        assert outcome["error"] is not None and outcome["error"].code == "aborted", "no abort landed in 20 passes"
        with pytest.raises(MeshnetError) as refused:
            stage.forward([Entry(1, 4, tokens=tokens[4:8])])
        assert refused.value.code == "cannot_roll_back" and "feed it again from the start" in refused.value.message
        stage.release_session(1)          # released, the slot starts afresh
        stage.open_session(1)
        stage.forward([Entry(1, 0, tokens=tokens[:4])])
        assert stage.session_length(1) == 4
