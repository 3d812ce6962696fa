"""A grammar at the tail (llama.cpp's grammar sampler, before the chain): every draw is one
the grammar takes, greedy and seeded; a draw stays a pure function of the seed and the
tokens so far, so a replay whose history holds tokens generated under the grammar, or a
session cut back, goes on exactly. On a generated random-weight model (its 128 tokens are
the hex strings "0" to "7f"). And a template that knows tools, through llama.cpp's common
chat code (meshnet_chat_apply, meshnet_chat_parse), on Qwen2.5-Coder."""

import json
import os
import re

import numpy as np
import pytest

from meshnet.core.errors import MeshnetError
from meshnet.core.sampling import Sampling
from meshnet.engine.binding import Entry, Stage, chat_parse, json_schema_grammar

from conftest import TEST_MODELS, THREADS

N_NEW = 16
LOW_DIGITS = 'root ::= [0-3]+ "2"'   # a token of low digits, any number, ending in 2
PROMPT = [5, 9, 17, 40, 3]


@pytest.fixture(scope="module")
def whole():
    path = os.path.join(TEST_MODELS, "llama-dense.gguf")
    assert os.path.isfile(path), f"{path} is missing: run `make test-models` (make test does)"
    with Stage(path, None, n_ctx=256, max_sessions=2, n_threads=THREADS) as stage:
        yield stage


def decode(stage, sid, history, sampling, n, grammar_from=None):
    """Open SID, feed HISTORY, draw N tokens; the tokens drawn."""
    stage.open_session(sid)
    try:
        stage.set_sampling(sid, sampling, history, grammar_from)
        tokens = [int(stage.forward([Entry(sid, 0, tokens=np.array(history))], want_logits=False).token[0])]
        while len(tokens) < n:
            pos = len(history) + len(tokens) - 1
            tokens.append(int(stage.forward([Entry(sid, pos, tokens=np.array(tokens[-1:]))], want_logits=False).token[0]))
        return tokens
    finally:
        stage.release_session(sid)


@pytest.mark.parametrize("sampling", [Sampling(grammar=LOW_DIGITS),
                                      Sampling(temperature=1.0, seed=5, grammar=LOW_DIGITS)], ids=["greedy", "seeded"])
def test_every_draw_is_one_the_grammar_takes(whole, sampling):
    tokens = decode(whole, 1, PROMPT, sampling, N_NEW)
    text = whole.detokenize([t for t in tokens if not whole.is_eog(t)])
    assert re.fullmatch(r"[0-3]+", text), text
    free = decode(whole, 1, PROMPT, Sampling(temperature=sampling.temperature, seed=sampling.seed), N_NEW)
    assert not re.fullmatch(r"[0-3]+", whole.detokenize(free))   # the grammar, not the model, kept them low


def test_a_replay_of_tokens_drawn_under_the_grammar_goes_on_as_the_session_did(whole):
    sampling = Sampling(temperature=1.0, seed=11, grammar=LOW_DIGITS)
    tokens = decode(whole, 1, PROMPT, sampling, N_NEW)
    for k in (1, 5, N_NEW - 2):
        # the replay's history: the prompt and the first k tokens; the grammar took those k too
        again = decode(whole, 2, PROMPT + tokens[:k], sampling, N_NEW - k, grammar_from=len(PROMPT))
        assert again == tokens[k:], k


def test_a_session_cut_back_and_told_its_tokens_again_draws_again_what_it_drew(whole):
    sampling = Sampling(temperature=1.0, seed=3, grammar=LOW_DIGITS)
    want = decode(whole, 1, PROMPT, sampling, N_NEW)
    whole.open_session(1)
    try:
        whole.set_sampling(1, sampling, PROMPT)
        tokens = [int(whole.forward([Entry(1, 0, tokens=np.array(PROMPT))], want_logits=False).token[0])]
        cut = False
        while len(tokens) < N_NEW:
            pos = len(PROMPT) + len(tokens) - 1
            tokens.append(int(whole.forward([Entry(1, pos, tokens=np.array(tokens[-1:]))], want_logits=False).token[0]))
            if len(tokens) == 10 and not cut:   # back to 4 tokens after the prompt (the cut takes the sampler's
                whole.truncate_session(1, len(PROMPT) + 4)   # history with it), the 5th to be fed again
                tokens, cut = tokens[:5], True
                whole.set_sampling(1, sampling, PROMPT + tokens, len(PROMPT))
        assert tokens == want
    finally:
        whole.release_session(1)


def test_drafts_under_a_grammar_keep_what_one_at_a_time_draws():
    path = os.path.join(TEST_MODELS, "llama-dense.gguf")
    sampling = Sampling(temperature=1.0, seed=8, grammar=LOW_DIGITS)
    with Stage(path, None, n_ctx=256, max_sessions=1, n_threads=THREADS) as alone:
        want = decode(alone, 1, PROMPT, sampling, N_NEW)
    with Stage(path, (0, 2), n_ctx=256, max_sessions=1, n_threads=THREADS) as head, \
            Stage(path, (2, 4), n_ctx=256, max_sessions=1, n_threads=THREADS) as tail:
        for stage in (head, tail):
            stage.open_session(1)
        tail.set_sampling(1, sampling, PROMPT)

        def step(pos, rows, verify):
            if head.session_length(1) > pos:
                head.truncate_session(1, pos)
            rows = np.array(rows, dtype=np.int32)
            entries = [Entry(1, pos, tokens=rows, residual=head.forward([Entry(1, pos, tokens=rows)]).residual,
                             verify=verify)]
            return tail.forward(entries, want_logits=False).draws(entries, 0)
        tokens, pos, rounds = step(0, PROMPT, False), len(PROMPT), 0
        while len(tokens) < N_NEW:
            drafts = list(want[len(tokens):len(tokens) + 3])
            if rounds % 2 and drafts:   # every other round, its last draft one the grammar refuses
                drafts[-1] = 127
            draws = step(pos, [tokens[-1]] + drafts, True)
            pos, tokens, rounds = pos + len(draws), tokens + draws, rounds + 1
        assert tokens[:N_NEW] == want


def test_a_bad_grammar_or_start_is_refused_and_the_session_is_untouched(whole):
    whole.open_session(1)
    try:
        for sampling, history, start in ((Sampling(grammar="root ::= ("), PROMPT, None),
                                         (Sampling(grammar="start ::= [0-3]"), PROMPT, None),   # no root rule
                                         (Sampling(grammar=LOW_DIGITS), PROMPT, len(PROMPT) + 1)):
            with pytest.raises(MeshnetError) as refused:
                whole.set_sampling(1, sampling, history, start)
            assert refused.value.code == "invalid_argument" and "grammar" in refused.value.message
        assert int(whole.forward([Entry(1, 0, tokens=np.array(PROMPT))], want_logits=False).token[0]) >= 0
    finally:
        whole.release_session(1)


def test_a_history_the_grammar_does_not_take_fails_the_draw_with_a_clear_error(whole):
    whole.open_session(1)
    try:
        # the replay's history says the session drew "7f" under a grammar of low digits
        whole.set_sampling(1, Sampling(grammar=LOW_DIGITS), PROMPT + [127], len(PROMPT))
        with pytest.raises(MeshnetError) as refused:
            whole.forward([Entry(1, 0, tokens=np.array(PROMPT + [127]))], want_logits=False)
        assert refused.value.code == "invalid_argument" and "does not follow the grammar" in refused.value.message
    finally:
        whole.release_session(1)


def test_a_json_schema_becomes_llama_cpps_grammar_and_a_bad_one_is_refused():
    grammar = json_schema_grammar('{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}')
    assert "root ::=" in grammar and '\\"n\\"' in grammar
    for bad in ("{not json", '{"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}'):
        with pytest.raises(MeshnetError) as refused:
            json_schema_grammar(bad)
        assert refused.value.code == "invalid_argument"


# ---- a template that knows tools (Qwen2.5's Hermes format), by llama.cpp's common chat code

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


def test_a_template_that_knows_tools_gets_them_and_its_calls_are_parsed_back(qwen_path):
    with Stage(qwen_path, (0, 1), n_ctx=256, max_sessions=1, n_threads=THREADS) as head:
        ask = [{"role": "user", "content": "What is the weather in Paris?"}]
        chat = head.chat_apply({"messages": ask, "tools": [WEATHER], "tool_choice": "auto"})
        assert '"name": "get_weather"' in chat["prompt"] and chat["prompt"].endswith(chat["generation_prompt"])
        assert chat["grammar_lazy"] and chat["trigger_patterns"] and "root ::=" in chat["grammar"]
        required = head.chat_apply({"messages": ask, "tools": [WEATHER], "tool_choice": "required"})
        assert not required["grammar_lazy"] and "root ::=" in required["grammar"]
        # (patch 0010) required: the calls at once after the assistant's header, no text
        # before them; one call unless parallel_tool_calls
        rules = dict(line.split(" ::= ", 1) for line in required["grammar"].splitlines() if " ::= " in line)
        assert rules["root"] == json.dumps(required["generation_prompt"]) + " space tool-calls"
        assert rules["tool-calls"] == "tool-call space"
        parallel = head.chat_apply({"messages": ask, "tools": [WEATHER], "tool_choice": "required",
                                    "parallel_tool_calls": True})
        assert "tool-calls ::= (tool-call space)+" in parallel["grammar"].splitlines()
        assert chat["caps"]["supports_tools"] and chat["caps"]["supports_tool_calls"]
        message = chat_parse(chat, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
        (call,) = message["tool_calls"]
        assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
        assert chat_parse(chat, "It is sunny.")["content"] == "It is sunny."
        # the call and its result go back into the template
        history = ask + [{"role": "assistant", "content": None, "tool_calls": [dict(call, id="c1")]},
                         {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 degrees"}]
        again = head.chat_apply({"messages": history, "tools": [WEATHER]})
        assert "<tool_response>" in again["prompt"] and "sunny, 21 degrees" in again["prompt"]
        with pytest.raises(MeshnetError) as refused:
            head.chat_apply({"messages": ask, "tools": [WEATHER], "tool_choice": "sometimes"})
        assert refused.value.code == "invalid_argument"
