"""Prefix reuse across sessions over worker processes: a session that starts as an ended
one did restores that prefix on every stage and computes only the rest, with the tokens
a route without the store gives; a stage that no longer holds the prefix makes it a full
prefill, with nothing lost; a model with recurrent state keeps no store, and says why."""

import os
import time

import numpy as np
import pytest

from meshnet.core.prefix import BLOCK
from meshnet.core.sampling import Sampling
from meshnet.launch.local_cluster import LocalCluster

from conftest import TEST_MODELS

# one layer, then three: the second stage's memory is three times the first's, so a cap can
# hold an ended session on the first stage and not on the second
UNEVEN = [(0, 1), (1, 4)]
SEEDED = Sampling(temperature=0.9, top_k=40, repeat_penalty=1.1, seed=11)
SETTLE_S = 60.0   # a loaded 2-core machine's bound for the stages' statistics to show what they did


def model(stem: str) -> str:
    path = os.path.join(TEST_MODELS, f"{stem}.gguf")
    assert os.path.isfile(path), f"{path} is missing: run `make test-models` (make test does)"
    return path


def tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 128, n).tolist()


def conversation(cluster, turns: list[list[int]], n_new: int = 8, sampling=None) -> list[tuple[list[int], int]]:
    """Each turn's tokens after the history so far (its answers included), and how many of
    its prompt tokens the route restored."""
    history, out = [], []
    for turn in turns:
        history += turn
        session = cluster.coordinator.generate(history, n_new, stop_at_eog=False, sampling=sampling).result(120)
        out.append((session.tokens, session.metrics["cached_tokens"]))
        history += session.tokens
    return out


def stage_caches(cluster, stored: int | None = None) -> list[dict]:
    """Each stage's prefix store, once every stage has stored STORED sessions: a session's
    end reaches the caller before its stages have kept it."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        caches = [s["prefix_cache"] for s in cluster.coordinator.stage_stats()]
        if stored is None or all(c and c["stored"] == stored for c in caches):
            return caches
        assert time.monotonic() < deadline, f"not {stored} sessions stored on every stage within {SETTLE_S} s: {caches}"
        time.sleep(0.05)


def test_the_turns_of_a_conversation_reuse_the_history_with_the_tokens_of_a_full_prefill():
    turns = [tokens(150, 1), tokens(40, 2), tokens(40, 3)]
    with LocalCluster(model("llama-dense"), [(0, 2), (2, 4)], threads=1, n_ctx=1024, max_sessions=2,
                      prefix_cache_mib=0) as cluster:
        plain = conversation(cluster, turns)
        assert stage_caches(cluster) == [None, None]
    with LocalCluster(model("llama-dense"), [(0, 2), (2, 4)], threads=1, n_ctx=1024, max_sessions=2,
                      prefix_cache_mib=16) as cluster:
        reused = conversation(cluster, turns)
        caches = stage_caches(cluster, stored=3)
        counters = cluster.coordinator.counters()
    assert [t for t, _ in reused] == [t for t, _ in plain]
    cached = [c for _, c in reused]
    # each turn restores the last one's prompt and answer to its last whole block
    assert cached[0] == 0 and cached[1] == (150 + 7) // BLOCK * BLOCK and cached[2] == (150 + 8 + 40 + 7) // BLOCK * BLOCK
    assert all(c["hits"] == 2 and c["stored"] == 3 for c in caches)
    assert counters["prefix_hits"] == 2 and counters["prefix_hit_tokens"] == cached[1] + cached[2]


@pytest.mark.parametrize("ranges", [UNEVEN, [(0, 3), (3, 4)]], ids=["small head", "small tail"])
def test_a_stage_that_no_longer_holds_the_prefix_makes_it_a_full_prefill_with_the_same_tokens(ranges):
    a, b, more = tokens(1000, 4), tokens(1000, 5), tokens(20, 6)
    # about 1 MB of memory on the one-layer stage per session of 1000 tokens, 3 MB on the
    # three-layer one: 4 MiB keep both sessions on the first, only the later one on the second
    small, large = (0, 1) if ranges[0] == (0, 1) else (1, 0)
    with LocalCluster(model("llama-dense"), ranges, threads=1, n_ctx=2048, max_sessions=2,
                      prefix_cache_mib=4) as cluster:
        conversation(cluster, [a])
        conversation(cluster, [b])
        caches = stage_caches(cluster, stored=2)
        assert caches[small]["entries"] == 2 and caches[large]["entries"] == 1 and caches[large]["evictions"] == 1
        [(b_more, b_cached)] = conversation(cluster, [b + more])   # held by both stages
        # held by the small stage alone, which cuts back to 0 at the first step (the tail
        # then tells its sampler the prompt again)
        [(a_more, a_cached)] = conversation(cluster, [a + more], sampling=SEEDED)
        caches = stage_caches(cluster, stored=4)
    with LocalCluster(model("llama-dense"), ranges, threads=1, n_ctx=2048, max_sessions=2,
                      prefix_cache_mib=0) as cluster:
        [(plain_b, _)] = conversation(cluster, [b + more])
        [(plain_a, _)] = conversation(cluster, [a + more], sampling=SEEDED)
    assert b_cached == (1000 + 7) // BLOCK * BLOCK and a_cached == 0
    assert (b_more, a_more) == (plain_b, plain_a)
    assert (caches[small]["hits"], caches[small]["misses"]) == (2, 2)
    assert (caches[large]["hits"], caches[large]["misses"]) == (1, 3)


@pytest.mark.parametrize("stem", ["jamba-dense", "mamba-dense"])
def test_a_stage_with_recurrent_state_keeps_no_store_and_the_route_gives_the_same_tokens(stem):
    turns = [tokens(40, 8), tokens(20, 9)]
    with LocalCluster(model(stem), [(0, 2), (2, 4)], threads=1, n_ctx=256, max_sessions=2,
                      prefix_cache_mib=16) as cluster:
        got = conversation(cluster, turns)
        # a stage of attention layers alone keeps one (a hybrid's); the route never has the prefix whole
        assert None in stage_caches(cluster)
    with LocalCluster(model(stem), [(0, 4)], threads=1, n_ctx=256, max_sessions=2, prefix_cache_mib=0) as cluster:
        assert conversation(cluster, turns) == got
    assert [c for _, c in got] == [0, 0]
