"""A session survives the loss of a stage when a replacement exists (ACCEPTANCE G): the
coordinator replays its prompt and the tokens generated so far on the new route, and the
caller gets exactly the tokens of a run with no failure. Real worker processes, killed
with SIGKILL mid-prefill and mid-decode, four sessions at once, greedy and sampled."""

import collections
import os
import signal
import threading
import time

import pytest

from meshnet.core import errors as E
from meshnet.core.errors import MeshnetError
from meshnet.core.generation import FeedHead, Generation, StopRule
from meshnet.core.metrics import prometheus_text
from meshnet.core.sampling import Sampling
from meshnet.launch.local_cluster import LocalCluster

from conftest import THREADS
from streams import follow_while

HALVES = [(0, 15), (15, 30)]
MAX_TOKENS = 24
CHUNK = 16                 # prompt chunks: a long prompt is many of them, so a kill lands mid-prefill
STAGE_LOST_BOUND_S = 3.0
PROMPTS = [
    "The old lighthouse keeper climbed the stairs every night, and " * 12,
    "In a quiet village at the edge of the forest, the baker " * 12,
    "Once upon a time there was a small robot who wanted to learn " * 12,
    "The history of the printing press begins in the fifteenth century, when " * 12,
]
SAMPLINGS = [None, Sampling(temperature=0.8, top_p=0.95, seed=42), None,
             Sampling(temperature=1.0, top_k=40, repeat_penalty=1.1, seed=7)]


# ---- the replay, as plain data -------------------------------------------------------------

def test_a_replay_feeds_the_prompt_in_its_chunks_then_each_generated_token_alone():
    g = Generation(list(range(100, 110)), StopRule(6), chunk=4, tail_feeds_head=True, depth=2)
    g.opened()
    g.head_took(0, 4)
    g.tail_gave(0, 4, 0, False)
    g.head_took(4, 4)
    g.tail_gave(4, 4, 0, False)
    g.head_took(8, 2)
    g.tail_gave(8, 2, 7, False)        # token 7, then the ring decodes two more
    g.tail_gave(10, 1, 8, False)
    g.tail_gave(11, 1, 9, False)
    replay = g.replay()
    assert replay.prompt == list(range(100, 110)) + [7, 8, 9] and replay.n_prompt == 10 and replay.replayed == 3
    assert replay.tokens == [7, 8, 9] and replay.chunk_ends == [4, 8, 10, 11, 12, 13]
    replay.depth = 99
    fed = [replay.opened()[0]]
    while fed[-1].pos + len(fed[-1].tokens) < 13:
        fed += replay.head_took(fed[-1].pos, len(fed[-1].tokens))
    assert [(f.pos, f.tokens) for f in fed] == [
        (0, (100, 101, 102, 103)), (4, (104, 105, 106, 107)), (8, (108, 109)), (10, (7,)), (11, (8,)), (12, (9,))]
    assert all(isinstance(f, FeedHead) and f.prompt for f in fed)
    # the replayed chunks give no token to the caller; the one after them is the fourth
    assert replay.tail_gave(11, 1, 0, False) == []
    actions = replay.tail_gave(12, 1, 42, False)
    assert [a.token for a in actions if hasattr(a, "token")] == [42] and replay.tokens == [7, 8, 9, 42]
    metrics = replay.metrics([(0, 30)], 0)
    assert metrics["prompt_tokens"] == 10 and metrics["generated_tokens"] == 4


def test_a_replay_before_any_token_is_the_prompt_again_and_a_finished_one_has_none():
    g = Generation(list(range(10)), StopRule(1), chunk=4, tail_feeds_head=True)
    assert g.replay().chunk_ends == [4, 8, 10] and g.replay().tokens == []
    g.opened()
    g.tail_gave(0, 10, 5, False)
    with pytest.raises(MeshnetError):
        g.replay()


# ---- real workers ------------------------------------------------------------------------

class Stages:
    """The worker processes of each range, the route's first: a killed one's range is
    taken by the next (a spare), and a new spare is started behind it."""

    def __init__(self, cluster: LocalCluster):
        self.cluster = cluster
        self.queues = {r: collections.deque([cluster.processes[r]]) for r in HALVES}
        self.all = list(cluster.processes.values())

    def add_spare(self, layers):
        process = self.cluster.spawn_worker(layers)
        self.queues[layers].append(process)
        self.all.append(process)
        self.cluster.wait_offered(process)

    def kill_route_stage(self, layers):
        os.kill(self.queues[layers].popleft().pid, signal.SIGKILL)

    def close(self):
        for process in self.all:
            if process.poll() is None:
                process.kill()
                process.wait()


@pytest.fixture(scope="module")
def stages(smollm2_path):
    # no prefix store: every run of the same prompts reads them again, so that a kill 0.2 s
    # in lands mid-prefill (tests/process/test_prefix_reuse.py holds the store to the same tokens)
    with LocalCluster(smollm2_path, HALVES, threads=THREADS, n_ctx=1024, max_sessions=4, prefill_chunk=CHUNK,
                      heartbeat_interval=0.1, heartbeat_liveness=10, prefix_cache_mib=0) as cluster:
        s = Stages(cluster)
        try:
            yield s
        finally:
            s.close()


@pytest.fixture(scope="module")
def expected(stages):
    """Each request's tokens with no failure."""
    coordinator = stages.cluster.coordinator
    tokens = [coordinator.tokenize(p) for p in PROMPTS]
    handles = [coordinator.generate(t, MAX_TOKENS, sampling=s, stop_at_eog=False) for t, s in zip(tokens, SAMPLINGS)]
    return tokens, [h.result(120).tokens for h in handles]


def run_and_kill(stages, expected, layers, when):
    """Four sessions at once; the route's stage for `layers` is killed mid-prefill or
    once every session has streamed a few tokens."""
    coordinator = stages.cluster.coordinator
    prompts, want = expected
    handles = [coordinator.generate(t, MAX_TOKENS, sampling=s, stop_at_eog=False) for t, s in zip(prompts, SAMPLINGS)]

    def kill():
        if when == "prefill":
            time.sleep(0.2)   # the prompts are hundreds of tokens in chunks of 16: the heads are still reading them
        stages.kill_route_stage(layers)

    got, errors = follow_while(handles, kill, after_tokens=4 if when == "decode" else None)
    return handles, got, errors, want


@pytest.mark.parametrize("layers, when", [(HALVES[0], "prefill"), (HALVES[1], "decode"), (HALVES[0], "decode"),
                                          (HALVES[1], "prefill")])
def test_a_killed_stage_with_a_spare_loses_no_session_and_changes_no_token(stages, expected, layers, when):
    stages.add_spare(layers)
    handles, got, errors, want = run_and_kill(stages, expected, layers, when)
    assert errors == [None] * 4
    assert got == want   # greedy and seeded sampling alike: the same tokens as with no failure
    for h in handles:
        resumed = h.metrics["resumed"]
        assert len(resumed) == 1 and resumed[0]["stage"] == f"[{layers[0]},{layers[1]})", resumed
        assert resumed[0]["elapsed_ms"] > 0
    before = [h.metrics["resumed"][0]["generated_before"] for h in handles]
    if when == "decode":
        assert all(n >= 4 for n in before), before
    else:
        assert 0 in before, before   # at least one had not given its first token
    snapshot = stages.cluster.coordinator.metrics()
    resumes = snapshot["resumes"]
    assert resumes["count"] >= 4 and resumes["ms_p50"] > 0 and resumes["replayed_tokens"] > 0
    text = prometheus_text(snapshot)
    assert f"meshnet_resumes_total{{}} {resumes['count']}" in text and 'meshnet_resume_ms{quantile="0.99"}' in text


def test_a_text_request_whose_worker_is_lost_before_it_answers_goes_to_the_spare(stages, expected):
    """Tokenizing holds no state on the head: a request in flight when the head is lost is
    asked again of the spare that took the range, and the caller never sees the loss."""
    coordinator = stages.cluster.coordinator
    head = HALVES[0]
    stages.add_spare(head)
    want = coordinator.tokenize(PROMPTS[0])
    before = coordinator.counters()["text_retries"]
    stalled = stages.queues[head].popleft()
    os.kill(stalled.pid, signal.SIGSTOP)   # it takes the request and never answers
    try:
        outcome = {}
        asked = threading.Thread(target=lambda: outcome.update(tokens=coordinator.tokenize(PROMPTS[0], timeout=60)))
        asked.start()
        deadline = time.monotonic() + 60   # lost once it misses its heartbeats
        while len(coordinator.workers_snapshot()) > len(stages.queues[HALVES[0]]) + len(stages.queues[HALVES[1]]):
            assert time.monotonic() < deadline, "the coordinator never dropped a stopped worker"
            time.sleep(0.05)
        asked.join(60)
    finally:
        stalled.kill()
        stalled.wait()
    assert outcome == {"tokens": want}
    assert coordinator.counters()["text_retries"] == before + 1
    assert f"meshnet_text_retries_total{{}} {before + 1}" in prometheus_text(coordinator.metrics())


def test_with_no_spare_and_no_wait_a_lost_stage_ends_its_sessions_at_once(stages, expected):
    coordinator = stages.cluster.coordinator
    tail = HALVES[1]
    while len(stages.queues[tail]) > 1:   # no spare for the tail
        n = len(coordinator.workers_snapshot())
        process = stages.queues[tail].pop()
        process.kill()
        process.wait()
        deadline = time.monotonic() + 60   # the coordinator drops it once it misses its heartbeats
        while len(coordinator.workers_snapshot()) >= n:
            assert time.monotonic() < deadline, "the coordinator never dropped a killed worker"
            time.sleep(0.05)
    assert coordinator.config.resume_wait == 0
    handles, got, errors, want = run_and_kill(stages, expected, tail, "decode")
    assert all(e is not None and e.code == E.STAGE_LOST for e in errors), errors
    assert all(e.context["elapsed_ms"] <= STAGE_LOST_BOUND_S * 1000 for e in errors)
    assert all(g == w[:len(g)] for g, w in zip(got, want))   # what came before the loss was right


def test_a_replacement_that_registers_within_the_resume_wait_resumes_the_sessions(stages, expected):
    coordinator = stages.cluster.coordinator
    tail = HALVES[1]
    stages.add_spare(tail)   # the route again (the last test left none for the tail)
    # long enough for a worker process to start and load its layers on a loaded machine: the
    # sessions wait for it however long that takes within the bound (the replacement comes
    # a second after the loss, so a resume still takes more than that)
    coordinator.set_resume_wait(60.0)
    try:
        outcome = {}
        runner = threading.Thread(target=lambda: outcome.update(run=run_and_kill(stages, expected, tail, "decode")))
        runner.start()
        # the replacement comes a second after the kill (run_and_kill kills once every
        # session has streamed); started from this thread, which outlives it (a worker
        # dies with the thread that started it)
        deadline = time.monotonic() + 60
        while stages.queues[tail]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(1.0)
        stages.all.append(stages.cluster.spawn_worker(tail))
        runner.join(120)
        handles, got, errors, want = outcome["run"]
        assert errors == [None] * 4 and got == want
        for h in handles:
            assert h.metrics["resumed"][0]["elapsed_ms"] >= 1000
    finally:
        coordinator.set_resume_wait(0.0)
