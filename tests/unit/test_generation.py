"""The generation state machine and the batching rule, driven with plain data: no model,
no socket, milliseconds (ACCEPTANCE B.1, B.7, B.8 as pure logic)."""

import collections
import itertools

import pytest

from meshnet.core.errors import MeshnetError
from meshnet.core.generation import FeedHead, Finish, Generation, StopRule, Token, tail_step
from meshnet.engine.batching import Step, group_size, take_batch

EOG = 2


def ticking_clock():
    ticks = itertools.count()
    return lambda: float(next(ticks))


def gen(prompt_len=10, max_tokens=4, chunk=4, stop_at_eog=True, ring=False, depth=2):
    return Generation(list(range(100, 100 + prompt_len)), StopRule(max_tokens, stop_at_eog), chunk,
                      tail_feeds_head=ring, depth=depth, clock=ticking_clock())


def run_to_end(g, tokens):
    """Drive a generation as a one-at-a-time pipeline would; the tail answers `tokens` in order."""
    fed, out = [], []
    queue = collections.deque(g.opened())
    answers = iter(tokens)
    while queue:
        action = queue.popleft()
        if isinstance(action, FeedHead):
            fed.append(action)
            queue.extend(g.head_took(action.pos, len(action.tokens)) if action.prompt else [])
            token = next(answers) if action.pos + len(action.tokens) >= len(g.prompt) else 0
            queue.extend(g.tail_gave(action.pos, len(action.tokens), token, token == EOG))
        else:
            out.append(action)
    return fed, out


def test_the_prompt_goes_to_the_head_in_chunks_each_once_the_previous_was_taken():
    g = gen(prompt_len=10, chunk=4)
    g.depth = 3
    assert g.opened() == [FeedHead(0, (100, 101, 102, 103), prompt=True)]
    assert g.head_took(0, 4) == [FeedHead(4, (104, 105, 106, 107), prompt=True)]
    assert g.head_took(4, 4) == [FeedHead(8, (108, 109), prompt=True)]
    assert g.head_took(8, 2) == []            # the last chunk: nothing more to feed
    assert g.head_took(0, 4) == []            # a repeated report changes nothing


def test_no_more_chunks_are_in_flight_than_the_pipeline_has_stages():
    g = gen(prompt_len=20, chunk=4)           # depth 2: a two-stage route
    assert g.opened() == [FeedHead(0, (100, 101, 102, 103), prompt=True)]
    assert g.head_took(0, 4) == [FeedHead(4, (104, 105, 106, 107), prompt=True)]
    assert g.head_took(4, 4) == []            # chunks 0 and 1 are in the tail's hands: wait
    assert g.tail_gave(0, 4, 7, False) == [FeedHead(8, (108, 109, 110, 111), prompt=True)]
    assert g.tail_gave(4, 4, 7, False) == []  # the head has not taken chunk 2 yet
    assert g.head_took(8, 4) == [FeedHead(12, (112, 113, 114, 115), prompt=True)]


def test_prompt_chunks_before_the_last_give_no_token():
    g = gen(prompt_len=10, chunk=4)
    g.opened()
    assert g.tail_gave(0, 4, 7, False) == [] and g.tail_gave(4, 4, 7, False) == []
    assert g.tokens == [] and g.state == "prefill"
    assert g.tail_gave(8, 2, 7, False) == [Token(7), FeedHead(10, (7,), prompt=False)]
    assert g.state == "decode"


def test_decode_steps_follow_one_position_at_a_time_until_max_tokens():
    g = gen(prompt_len=3, max_tokens=3, chunk=8)
    fed, out = run_to_end(g, [11, 12, 13, 14])
    assert [(f.pos, f.tokens) for f in fed] == [(0, (100, 101, 102)), (3, (11,)), (4, (12,))]
    assert out == [Token(11), Token(12), Token(13), Finish("length")]
    assert g.stop_reason == "length" and g.done


def test_an_end_of_generation_token_stops_unless_told_to_go_on():
    fed, out = run_to_end(gen(prompt_len=3, max_tokens=8), [11, EOG, 13])
    assert out == [Token(11), Token(EOG), Finish("eog")]
    fed, out = run_to_end(gen(prompt_len=3, max_tokens=3, stop_at_eog=False), [11, EOG, 13])
    assert out == [Token(11), Token(EOG), Token(13), Finish("length")]


def test_one_token_asked_is_one_token_given():
    fed, out = run_to_end(gen(prompt_len=5, max_tokens=1), [42])
    assert out == [Token(42), Finish("length")] and len(fed) == 2


def test_on_a_ring_the_tail_feeds_the_head_and_agrees_on_the_last_token():
    g = gen(prompt_len=2, max_tokens=3, chunk=8, ring=True)
    g.opened()
    rule, generated = g.rule, 0
    for pos, n, token in [(0, 2, 11), (2, 1, 12), (3, 1, 13)]:
        actions = g.tail_gave(pos, n, token, False)
        assert not any(isinstance(a, FeedHead) for a in actions)  # the coordinator feeds nothing in decode
        is_token, feed = tail_step(len(g.prompt), rule, generated, pos, n, False)
        generated += is_token
        assert is_token and feed == (not g.done)
    assert g.tokens == [11, 12, 13] and g.stop_reason == "length"
    assert tail_step(10, rule, 0, 0, 4, False) == (False, False)   # a prompt chunk before the last


def test_timings_come_from_the_clock_it_is_given():
    g = gen(prompt_len=3, max_tokens=2, chunk=8)
    run_to_end(g, [11, 12])
    assert (g.t_start, g.t_first, g.t_end) == (0.0, 1.0, 2.0)
    m = g.metrics([(0, 15), (15, 30)], seam_bytes=100)
    assert m["ttft_ms"] == 1000.0 and m["decode_tok_s"] == 1.0 and m["generated_tokens"] == 2


def test_a_failure_finishes_it_once_and_later_results_are_ignored():
    g = gen()
    g.opened()
    assert g.failed() == [Finish("error")]
    assert g.failed() == [] and g.tail_gave(8, 2, 5, False) == [] and g.stop_reason == "error"


@pytest.mark.parametrize("bad", [dict(prompt_len=0), dict(max_tokens=0), dict(chunk=0), dict(depth=0)])
def test_an_impossible_request_is_refused_before_anything_starts(bad):
    with pytest.raises(MeshnetError) as err:
        gen(**bad)
    assert err.value.code == "invalid_argument"


def test_events_in_the_wrong_state_are_a_clear_internal_error():
    g = gen()
    with pytest.raises(MeshnetError) as err:
        g.tail_gave(8, 2, 5, False)
    assert err.value.code == "internal"


# the batching rule


def steps(*specs):
    return collections.deque(Step(sid, pos, n) for sid, pos, n in specs)


def test_a_batch_takes_every_waiting_decode_step_and_one_prompt_chunk():
    waiting = steps((1, 10, 1), (2, 0, 64), (3, 0, 64), (4, 7, 1), (5, 3, 1))
    batch = take_batch(waiting, max_entries=8, max_rows=512)
    assert [(s.sid, s.n) for s in batch] == [(1, 1), (2, 64), (4, 1), (5, 1)]
    assert [(s.sid, s.n) for s in waiting] == [(3, 64)]   # the second chunk waits one batch, no longer


def test_a_session_is_never_twice_in_a_batch_and_its_steps_keep_their_order():
    waiting = steps((1, 0, 32), (1, 32, 32), (2, 5, 1), (1, 64, 1))
    first = take_batch(waiting, 8, 512)
    assert [(s.sid, s.pos) for s in first] == [(1, 0), (2, 5)]
    assert [(s.sid, s.pos) for s in take_batch(waiting, 8, 512)] == [(1, 32)]
    assert [(s.sid, s.pos) for s in take_batch(waiting, 8, 512)] == [(1, 64)]


def test_a_batch_keeps_to_the_stage_limits():
    waiting = steps(*[(sid, 0, 1) for sid in range(10)])
    assert len(take_batch(waiting, max_entries=4, max_rows=512)) == 4 and len(waiting) == 6
    waiting = steps((1, 0, 300), (2, 0, 1), (3, 0, 300))
    assert [s.sid for s in take_batch(waiting, 8, max_rows=300)] == [1]
    assert [s.sid for s in take_batch(waiting, 8, max_rows=300)] == [2]   # 301 rows would be too many
    assert [s.sid for s in take_batch(waiting, 8, max_rows=300)] == [3]


def test_a_pipelining_head_splits_its_decoding_sessions_into_one_micro_batch_per_stage():
    assert group_size(4, groups=2, max_entries=8) == 2     # two groups of two: one in each stage
    assert group_size(5, groups=2, max_entries=8) == 3
    assert group_size(4, groups=3, max_entries=8) == 2
    assert group_size(1, groups=2, max_entries=8) == 8     # one session: nothing to split
    assert group_size(16, groups=1, max_entries=8) == 8    # a gathering head (or one stage): one batch
    assert group_size(64, groups=2, max_entries=8) == 8    # never past the stage's own limit
    waiting = steps(*[(sid, 10, 1) for sid in range(1, 5)])
    assert [s.sid for s in take_batch(waiting, group_size(4, 2, 8), 512)] == [1, 2]
    assert [s.sid for s in take_batch(waiting, group_size(4, 2, 8), 512)] == [3, 4]
