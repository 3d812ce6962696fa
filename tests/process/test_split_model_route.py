"""A model in split GGUF files over worker processes: each worker given the first split
(or any), the route gives the single file's tokens and logits, max |diff| 0."""

import numpy as np

from meshnet.engine.pipeline import LocalPipeline
from meshnet.launch.local_cluster import LocalCluster

from conftest import THREADS, generated_models
from split_model import write_splits

PROMPT = [1, 5, 9, 13, 17, 21, 25, 29]
N_TOKENS = 12


def test_two_workers_on_a_model_of_three_splits_give_the_single_file_s_logits(tmp_path):
    whole = generated_models()["llama-dense"]
    splits = write_splits(whole, tmp_path, 3)
    with LocalPipeline(whole, [(0, 4)], n_ctx=256, max_sessions=1, n_threads=THREADS) as single:
        want = single.generate(PROMPT, N_TOKENS, stop_at_eog=False, keep_logits=True)
    with LocalCluster(str(splits[0]), [(0, 2), (2, 4)], threads=THREADS, n_ctx=256, max_sessions=2) as cluster:
        got = cluster.coordinator.generate(PROMPT, N_TOKENS, stop_at_eog=False, want_logits=True).result(120)
    assert got.tokens == want.tokens
    assert max(float(np.abs(a - b).max()) for a, b in zip(got.logits, want.logits)) == 0.0
