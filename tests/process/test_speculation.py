"""Speculative decoding over worker processes: the head drafts from the session's own
tokens, the route verifies a round's drafts in one pass, and the tokens are exactly those
decoded one at a time, greedy and seeded alike, one session or several batched; a model
with recurrent state decodes without drafts and says so."""

import os

import pytest

from meshnet.core.sampling import Sampling
from meshnet.launch.local_cluster import LocalCluster

from conftest import TEST_MODELS

SEEDED = Sampling(temperature=0.9, top_k=40, top_p=0.95, repeat_penalty=1.1, seed=3)
# the sampler's path (a seeded draw, its history of the session's tokens) that draws what
# greedy would: a random-weight model's greedy output repeats, and drafts get kept
NARROW = Sampling(temperature=0.7, top_k=1, seed=3)
# a period the proposer drafts from as soon as the prompt has shown it
REPEATING = [5, 9, 17, 33, 2, 71, 40] * 6
N_NEW = 48


def model(stem: str) -> str:
    path = os.path.join(TEST_MODELS, f"{stem}.gguf")
    assert os.path.isfile(path), f"{path} is missing: run `make test-models` (make test does)"
    return path


def generate(path, ranges, prompts, samplings, speculate):
    """Each prompt's tokens and metrics, all sessions at once."""
    with LocalCluster(path, ranges, threads=1, n_ctx=256, max_sessions=len(prompts), prefix_cache_mib=0,
                      speculate=speculate) as cluster:
        handles = [cluster.coordinator.generate(p, N_NEW, sampling=s, stop_at_eog=False)
                   for p, s in zip(prompts, samplings)]
        return [(h.result(120).tokens, h.metrics) for h in handles]


@pytest.mark.parametrize("sampling", [None, NARROW, SEEDED], ids=["greedy", "seeded-narrow", "seeded"])
@pytest.mark.parametrize("ranges", [[(0, 2), (2, 4)], [(0, 4)]], ids=["2 stages", "1 stage"])
def test_drafts_give_the_tokens_of_decoding_one_at_a_time(ranges, sampling):
    plain = generate(model("llama-dense"), ranges, [REPEATING], [sampling], speculate=0)
    drafted = generate(model("llama-dense"), ranges, [REPEATING], [sampling], speculate=6)
    assert [t for t, _ in drafted] == [t for t, _ in plain]
    spec = drafted[0][1]["speculation"]
    assert spec["drafts_max"] == 6 and 0 <= spec["accepted"] <= spec["drafted"]
    assert spec["rounds"] == N_NEW - 1 - spec["accepted"]   # every kept draft saved a round
    if sampling is not SEEDED:   # a broad draw's output need not repeat: it may draft nothing
        assert spec["accepted"] > 0
    assert "speculation" not in plain[0][1]


def test_sessions_drafting_side_by_side_each_get_what_they_get_alone():
    prompts = [REPEATING, list(range(20, 60)), REPEATING[3:] + [1, 2, 3]]
    samplings = [None, SEEDED, None]
    alone = [generate(model("llama-dense"), [(0, 2), (2, 4)], [p], [s], speculate=0)[0][0]
             for p, s in zip(prompts, samplings)]
    together = generate(model("llama-dense"), [(0, 2), (2, 4)], prompts, samplings, speculate=6)
    assert [t for t, _ in together] == alone


@pytest.mark.parametrize("stem", ["mamba-dense", "jamba-dense"])
def test_a_model_with_recurrent_state_decodes_without_drafts_and_says_so(stem):
    plain = generate(model(stem), [(0, 2), (2, 4)], [REPEATING], [None], speculate=0)
    asked = generate(model(stem), [(0, 2), (2, 4)], [REPEATING], [None], speculate=6)
    assert asked[0][0] == plain[0][0]
    spec = asked[0][1]["speculation"]
    assert spec["drafts_max"] == 0 and spec["drafted"] == 0
