"""The engine verifies drafted tokens: the tail draws after every row of a verify entry as
it would have, had the rows come one by one, keeps the rows up to the first draft that
differs, and drops the rest, so a session fed drafts gives exactly the tokens (and the
sampler's draws) of one decoded a token at a time. On generated random-weight models."""

import os

import numpy as np
import pytest

from meshnet.core.errors import MeshnetError
from meshnet.core.sampling import Sampling
from meshnet.engine.binding import Entry, Stage

from conftest import TEST_MODELS, THREADS

N_NEW = 24
SAMPLED = Sampling(temperature=0.9, top_k=40, top_p=0.95, repeat_penalty=1.1, seed=77)


def model(stem: str) -> str:
    path = os.path.join(TEST_MODELS, f"{stem}.gguf")
    assert os.path.isfile(path), f"{path} is missing: run `make test-models` (make test does)"
    return path


class Route:
    """A head and a tail stage of one model, in this process."""

    def __init__(self, path, ranges=((0, 2), (2, 4)), **options):
        self.stages = [Stage(path, r, n_ctx=256, max_sessions=2, n_threads=THREADS, **options) for r in ranges]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for stage in self.stages:
            stage.close()

    def open(self, sid, prompt, sampling=None):
        for stage in self.stages:
            stage.open_session(sid)
        self.stages[-1].set_sampling(sid, sampling, prompt)

    def step(self, sid, pos, rows, verify=False):
        rows = np.asarray(rows, dtype=np.int32)
        head, tail = self.stages
        if head.session_length(sid) > pos:   # what a stage before the tail does with a refused draft's row
            head.truncate_session(sid, pos)
        residual = head.forward([Entry(sid, pos, tokens=rows)]).residual
        entries = [Entry(sid, pos, tokens=rows, residual=residual, verify=verify)]
        out = tail.forward(entries)
        return out.draws(entries, 0), out.logits[0].copy()


def one_by_one(route, sid, prompt, sampling=None):
    route.open(sid, prompt, sampling)
    (token,), _ = route.step(sid, 0, prompt)
    tokens = [token]
    for pos in range(len(prompt), len(prompt) + N_NEW - 1):
        (token,), _ = route.step(sid, pos, [tokens[-1]])
        tokens.append(token)
    return tokens


def with_drafts(route, sid, prompt, want, sampling=None, k=4, wrong_every=3):
    """Decode with K drafts a round: WANT's next tokens, the WRONG_EVERY-th round's with one
    of them changed; returns the tokens and each round's kept count."""
    route.open(sid, prompt, sampling)
    (token,), _ = route.step(sid, 0, prompt)
    tokens, kept, pos, rounds = [token], [], len(prompt), 0
    while len(tokens) < N_NEW:
        drafts = list(want[len(tokens):len(tokens) + k])
        if drafts and rounds % wrong_every == wrong_every - 1:
            j = rounds % len(drafts)
            drafts[j] = (drafts[j] + 1) % 128
        draws, _ = route.step(sid, pos, [tokens[-1]] + drafts, verify=True)
        kept.append(len(draws) - 1)
        assert route.stages[-1].session_length(sid) == pos + len(draws)   # the refused rows are gone
        tokens += draws
        pos += len(draws)
        rounds += 1
    return tokens[:N_NEW], kept


# (flash attention's rows and a quantized cache's cells are each their own too: 0016, 0015)
ATTENTION = {"plain": {}, "flash q8_0": {"flash_attn": True, "kv_type": "q8_0"}}


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("sampling", [None, SAMPLED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("stem", ["llama-dense", "gemma3-dense", "qwen3moe-moe"])
def test_drafts_give_the_tokens_of_decoding_one_at_a_time(stem, sampling, attention):
    with Route(model(stem), **ATTENTION[attention]) as route:
        prompt = list(range(3, 40))
        want = one_by_one(route, 1, prompt, sampling)
        for stage in route.stages:
            stage.release_session(1)
        got, kept = with_drafts(route, 2, prompt, want, sampling)
        assert got == want
        assert max(kept) == 4 and min(kept) < 4   # rounds that kept every draft, and rounds cut at the wrong one


def test_a_round_keeps_the_drafts_up_to_the_first_that_differs_and_its_logits_are_the_last_kept_row_s():
    with Route(model("llama-dense")) as route:
        prompt = list(range(5, 30))
        want = one_by_one(route, 1, prompt)
        for stage in route.stages:
            stage.release_session(1)
        route.open(2, prompt)
        route.step(2, 0, prompt)
        wrong = (want[3] + 1) % 128
        draws, logits = route.step(2, len(prompt), [want[0], want[1], want[2], wrong, want[4]], verify=True)
        assert draws == want[1:4]     # two drafts kept; the draw after the second is the third new token
        for stage in route.stages:
            stage.release_session(2)
        route.open(3, prompt)
        route.step(3, 0, prompt)
        route.step(3, len(prompt), [want[0]])
        route.step(3, len(prompt) + 1, [want[1]])
        _, alone = route.step(3, len(prompt) + 2, [want[2]])
        assert np.array_equal(logits, alone)


def test_a_model_with_recurrent_state_refuses_drafts_and_goes_on_without_them():
    with Route(model("mamba-dense")) as route:
        prompt = list(range(3, 20))
        route.open(1, prompt)
        (token,), _ = route.step(1, 0, prompt)
        with pytest.raises(MeshnetError) as refused:
            route.step(1, len(prompt), [token, 7, 8], verify=True)
        assert refused.value.code == "cannot_roll_back" and "without drafts" in refused.value.message
        assert route.stages[-1].session_length(1) == len(prompt)   # the tail refused before it computed
