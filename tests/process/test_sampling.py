"""Seeded sampling at the tail through llama.cpp's sampler chain, and chat templates from
the GGUF: the parameters' rules as plain data, then the real engine, then real routes."""

import numpy as np
import pytest

from meshnet.core import errors as E
from meshnet.core.errors import MeshnetError
from meshnet.core.sampling import GREEDY, Sampling
from meshnet.engine.binding import Entry, Stage
from meshnet.engine.pipeline import LocalPipeline
from meshnet.launch.local_cluster import LocalCluster
from meshnet.serve.tools import knows_tools

from conftest import THREADS

SEEDED = Sampling(temperature=0.8, top_p=0.95, seed=42)
PROMPT = "Once upon a time, in a small village by the sea,"


# ---- the parameters, as plain data ----------------------------------------------------

def test_the_default_is_greedy_and_goes_on_the_wire_as_nothing():
    assert GREEDY.greedy and not GREEDY.uses_history and GREEDY.to_wire() == {}
    assert Sampling(temperature=0.0, repeat_penalty=1.1).uses_history
    assert not Sampling(temperature=0.0, repeat_penalty=1.1).greedy   # the penalties still apply
    assert SEEDED.to_wire() == {"temperature": 0.8, "top_p": 0.95, "seed": 42}
    assert Sampling.from_wire(SEEDED.to_wire()) == SEEDED


@pytest.mark.parametrize("fields, name", [
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 1.5}, "top_p"), ({"top_k": -1}, "top_k"), ({"top_k": 2.5}, "top_k"), ({"min_p": -1}, "min_p"),
    ({"repeat_penalty": 0.0}, "repeat_penalty"), ({"penalty_last_n": -2}, "penalty_last_n"),
    ({"frequency_penalty": 3}, "frequency_penalty"), ({"seed": -1}, "seed"), ({"seed": 2**64}, "seed"),
    ({"seed": True}, "seed"), ({"temperature": "hot"}, "temperature"),
])
def test_a_bad_parameter_is_refused_naming_it(fields, name):
    with pytest.raises(MeshnetError) as e:
        Sampling(**fields)
    assert e.value.code == E.INVALID_ARGUMENT and e.value.context["field"] == name and name in e.value.message
    with pytest.raises(MeshnetError) as e:   # the same on the wire, as a protocol error
        Sampling.from_wire(fields)
    assert e.value.code == E.BAD_FIELD


def test_unknown_fields_on_the_wire_are_refused():
    with pytest.raises(MeshnetError) as e:
        Sampling.from_wire({"temperature": 0.5, "mirostat": 2})
    assert e.value.code == E.BAD_FIELD and "mirostat" in e.value.message


# ---- the engine ---------------------------------------------------------------------------

def _generate(stage: Stage, prompt: list[int], n: int, sampling: Sampling | None, sid: int = 1,
              replay: list[int] = ()) -> list[int]:
    """n tokens after the prompt: the prompt in one forward call, then one call per token.
    With replay, a session rebuilt after a loss: the tokens it had generated are fed again
    one per call, as they were first computed (a prefill of them would round differently),
    and the sampler, told them as history, only picks the tokens after them."""
    stage.open_session(sid)
    try:
        stage.set_sampling(sid, sampling, list(prompt) + list(replay))
        out = stage.forward([Entry(sid, 0, tokens=np.array(prompt))], want_logits=False)
        for i, token in enumerate(replay):
            out = stage.forward([Entry(sid, len(prompt) + i, tokens=np.array([token]))], want_logits=False)
        tokens = [int(out.token[0])]
        while len(tokens) < n:
            out = stage.forward([Entry(sid, len(prompt) + len(replay) + len(tokens) - 1, tokens=np.array(tokens[-1:]))],
                                want_logits=False)
            tokens.append(int(out.token[0]))
        return tokens
    finally:
        stage.release_session(sid)


@pytest.fixture(scope="module")
def whole(smollm2_path):
    with Stage(smollm2_path, None, n_ctx=512, max_sessions=2, n_threads=THREADS) as stage:
        yield stage


def test_a_seed_gives_the_same_tokens_every_time_and_another_seed_others(whole):
    prompt = whole.tokenize(PROMPT)
    first = _generate(whole, prompt, 32, SEEDED)
    assert _generate(whole, prompt, 32, SEEDED) == first
    assert _generate(whole, prompt, 32, Sampling(temperature=0.8, top_p=0.95, seed=43)) != first
    assert _generate(whole, prompt, 32, None) != first   # sampling is not the greedy path


def test_sampling_is_a_pure_function_of_the_tokens_so_far_so_a_replay_continues_exactly(whole):
    """A session rebuilt from its prompt and its first 12 tokens (a replay after a lost
    stage) goes on with the tokens the first session went on with: no sampler state
    carries over from one token to the next but the tokens themselves."""
    prompt = whole.tokenize(PROMPT)
    for sampling in (SEEDED, Sampling(temperature=1.0, top_k=40, min_p=0.05, repeat_penalty=1.2,
                                      frequency_penalty=0.3, presence_penalty=0.2, seed=7)):
        tokens = _generate(whole, prompt, 24, sampling)
        assert _generate(whole, prompt, 12, sampling, replay=tokens[:12]) == tokens[12:]


def test_greedy_with_penalties_differs_from_plain_greedy(whole):
    prompt = whole.tokenize("one two one two one two one two")
    plain = _generate(whole, prompt, 16, None)
    assert _generate(whole, prompt, 16, Sampling(repeat_penalty=1.5, penalty_last_n=-1)) != plain
    assert _generate(whole, prompt, 16, Sampling(temperature=0.0)) == plain   # no temperature, no penalty: argmax


def test_a_stage_refuses_rows_its_sampler_does_not_know_the_tokens_of(whole, smollm2_path):
    prompt = whole.tokenize(PROMPT)
    whole.open_session(5)
    try:
        whole.set_sampling(5, SEEDED, prompt[:3])   # told only three of the prompt's tokens
        with pytest.raises(MeshnetError) as e:
            whole.forward([Entry(5, 0, tokens=np.array(prompt))])
        assert e.value.code == E.INVALID_ARGUMENT and "sampler knows its tokens only up to 3" in e.value.message
        with pytest.raises(MeshnetError) as e:
            whole.set_sampling(5, SEEDED, [whole.n_vocab])
        assert e.value.code == E.BAD_TOKEN
    finally:
        whole.release_session(5)
    with Stage(smollm2_path, (0, 15), n_ctx=64, max_sessions=1, n_threads=THREADS) as head:
        head.open_session(1)
        with pytest.raises(MeshnetError) as e:
            head.set_sampling(1, SEEDED, prompt)
        assert e.value.code == E.INVALID_ARGUMENT and "only the tail" in e.value.message


def test_the_chat_template_is_the_models_own_applied_by_llama_cpp(whole):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    # SmolLM2's tokenizer.chat_template is ChatML
    assert whole.chat_template(messages) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                                             "<|im_start|>assistant\n")
    assert whole.chat_template(messages, add_assistant=False).endswith("Hi<|im_end|>\n")
    long = [{"role": "user", "content": "é" * 5000}]   # larger than the first buffer guess
    assert whole.chat_template(long).count("é") == 5000
    with pytest.raises(MeshnetError) as e:
        whole.chat_template([{"role": "user"}])
    assert e.value.code == E.INVALID_ARGUMENT


# ---- routes -----------------------------------------------------------------------------

def test_seeded_sampling_is_the_same_through_two_workers_three_workers_and_the_whole_model(smollm2_path):
    """Temperature 0.8, top-p 0.95, seed 42, 64 tokens; and a chat prompt by the model's
    template through the route, as llama-server builds one."""
    with LocalPipeline(smollm2_path, [(0, 30)], n_ctx=512, max_sessions=1, n_threads=THREADS) as pipe:
        prompt = pipe.head.tokenize(PROMPT)
        expected = pipe.generate(prompt, 64, sampling=SEEDED, stop_at_eog=False).tokens
        chat = [{"role": "user", "content": "What is the capital of France?"}]
        chat_text = pipe.head.chat_template(chat)
        chat_tokens = pipe.head.tokenize(chat_text, parse_special=True)
        applied = pipe.head.chat_apply({"messages": chat})   # the Jinja template, by llama.cpp's common chat code
    assert len(expected) == 64
    assert not knows_tools(applied["caps"])   # SmolLM2's template has no tool format: serve uses the generic one
    for ranges in ([(0, 15), (15, 30)], [(0, 10), (10, 20), (20, 30)]):
        with LocalCluster(smollm2_path, ranges, threads=THREADS, n_ctx=512, max_sessions=2) as cluster:
            coordinator = cluster.coordinator
            assert coordinator.tokenize(PROMPT) == prompt
            got = coordinator.generate(prompt, 64, sampling=SEEDED, stop_at_eog=False).result(120).tokens
            assert got == expected, f"{len(ranges)} stages"
            assert coordinator.chat_prompt(chat) == chat_text
            assert coordinator.tokenize(chat_text, parse_special=True) == chat_tokens
            assert chat_tokens != coordinator.tokenize(chat_text)   # the special tokens, parsed as such
            with pytest.raises(MeshnetError) as e:
                coordinator.chat_prompt([{"role": "user"}])
            assert e.value.code == E.INVALID_ARGUMENT
            assert coordinator.chat_apply({"messages": chat}) == applied   # the CHAT message, to the head
            with pytest.raises(MeshnetError) as e:
                coordinator.chat_apply({"messages": chat, "tool_choice": "sometimes"})
            assert e.value.code == E.INVALID_ARGUMENT and "tool_choice" in e.value.message
