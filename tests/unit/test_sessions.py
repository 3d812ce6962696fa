"""The coordinator's session table driven with plain events and a fake clock: what it
asks the I/O loop to do at open, for each prompt chunk and token, at a cancel, at a
deadline, and when a stage is lost (mid-prefill, mid-decode, with and without a spare).

The workers here are registry records built from fake capabilities (named as such):
no socket, process or engine is involved."""

from __future__ import annotations

import pytest

from meshnet.core import errors as E
from meshnet.core.generation import Generation, StopRule
from meshnet.net import protocol as P
from meshnet.net.heartbeat import Liveness
from meshnet.route.chunk_budget import chunk_rows, row_cells
from meshnet.route.events import Done, Emit, Failed, Leave, Push, Request, TokenEvent
from meshnet.route.registry import Registry
from meshnet.route.requests import RequestKind
from meshnet.route.sessions import SessionTable, State

from fakes import FakeClock, fake_capability

TIMEOUT = 10.0
SUSPECT = 1.0


class Mesh:
    """A registry of fake workers and a session table over it, with a fake clock."""

    def __init__(self, resume_wait: float = 0.0, max_resumes: int = 2):
        self.clock = FakeClock()
        self.registry = Registry()
        self.table = SessionTable(self.registry.route, reply_endpoint="tcp://10.0.0.9:6000", request_timeout=TIMEOUT,
                                  suspect_window=SUSPECT, resume_wait=resume_wait, max_resumes=max_resumes,
                                  clock=self.clock)

    def add(self, worker_id: str, start: int, end: int, **capability):
        identity = worker_id.encode()
        return self.registry.add(identity, fake_capability(worker_id, start, end, **capability), Liveness(1.0, 3),
                                 None, 0)

    def lose(self, worker):
        self.registry.remove(worker.identity)
        return self.table.worker_lost(worker, "stopped answering heartbeats", 1500)

    def open(self, sid: int = 1, prompt=tuple(range(10)), max_tokens: int = 3, chunk: int = 4):
        gen = Generation(list(prompt), StopRule(max_tokens, stop_at_eog=True), chunk, tail_feeds_head=True)
        return self.table.open(sid, gen, want_logits=False)

    def confirm(self, sid: int = 1) -> list:
        effects = []
        for _ in self.table.sessions[sid].route:
            effects += self.table.opened(sid)
        return effects

    def key(self, sid: int = 1) -> int:
        return self.table.sessions[sid].key

    def took(self, pos: int, n: int, sid: int = 1, head: bool = False, tail: bool = False) -> list:
        return self.table.took(P.Message(P.TOOK, 0, {"sid": sid, "key": self.key(sid), "pos": pos, "n": n,
                                                     "head": head, "tail": tail}))

    def token(self, pos: int, n: int, token: int, sid: int = 1, eog: bool = False) -> list:
        return self.table.token(P.Message(P.TOKEN, 0, {"sid": sid, "key": self.key(sid), "pos": pos, "n": n,
                                                       "token": token, "eog": eog}))


def of(effects, kind):
    return [e for e in effects if isinstance(e, kind)]


def requests(effects, kind: RequestKind):
    return [(e.worker.name.split(".")[0], e.stage) for e in of(effects, Request) if e.kind is kind]


def pushed(effects):
    return [(e.fields["pos"], e.fields["tokens"]) for e in of(effects, Push)]


def caller(effects):
    return [e.event for e in of(effects, Emit)]


@pytest.fixture
def mesh():
    m = Mesh()
    m.head, m.tail = m.add("head", 0, 2), m.add("tail", 2, 4)
    return m


def test_a_session_opens_on_every_stage_and_is_fed_only_once_all_confirmed(mesh):
    effects = mesh.open()
    assert requests(effects, RequestKind.OPEN) == [("head", 0), ("tail", 1)]
    first, last = [e.fields for e in of(effects, Request)]
    assert first["next"] == mesh.tail.capability.data_endpoint   # a ring: the tail's next is the head
    assert last["next"] == mesh.head.capability.data_endpoint
    assert first["key"] == last["key"] == mesh.key() and first["prompt_len"] == 10
    assert not of(effects, Push) and mesh.table.sessions[1].state is State.OPENING
    assert mesh.table.opened(1) == []                     # one of two stages
    assert pushed(mesh.table.opened(1)) == [(0, [0, 1, 2, 3])]
    assert mesh.table.sessions[1].state is State.RUNNING


def test_prompt_chunks_enter_the_head_as_it_takes_them_with_at_most_one_per_stage_in_flight(mesh):
    mesh.open()
    mesh.confirm()
    assert pushed(mesh.took(0, 4, head=True)) == [(4, [4, 5, 6, 7])]
    assert pushed(mesh.took(4, 4, head=True)) == []       # two chunks in flight on two stages
    assert pushed(mesh.took(0, 4, tail=True)) == [(8, [8, 9])]
    mesh.took(8, 2, head=True)
    assert caller(mesh.token(8, 2, 21)) == [TokenEvent(21, b"", None)]
    assert caller(mesh.token(10, 1, 22)) == [TokenEvent(22, b"", None)]   # the tail feeds the head itself
    effects = mesh.token(11, 1, 23)
    events = caller(effects)
    assert events[0] == TokenEvent(23, b"", None) and isinstance(events[1], Done) and events[1].reason == "length"
    assert requests(effects, RequestKind.RELEASE) == [("head", 0), ("tail", 1)]
    assert 1 not in mesh.table.sessions and mesh.table.sessions_on(mesh.head.identity) == 0


def test_a_cancel_ends_the_session_on_every_stage_and_what_comes_after_is_dropped(mesh):
    mesh.open()
    mesh.confirm()
    key = mesh.key()
    effects = mesh.table.cancel(1)
    assert of(effects, Leave) == [Leave(1)]
    assert requests(effects, RequestKind.CANCEL) == [("head", 0), ("tail", 1)]
    assert [e.error.code for e in caller(effects)] == [E.CANCELLED]
    late = P.Message(P.TOKEN, 0, {"sid": 1, "key": key, "pos": 8, "n": 2, "token": 5, "eog": False})
    assert mesh.table.token(late) == [] and mesh.table.counters["dropped_late"] == 1
    again = mesh.table.cancel(1)   # after the end: no stage hears of it, only a caller (long gone: dropped)
    assert [type(e) for e in again] == [Emit] and isinstance(again[0].event, Failed)


def test_a_data_message_with_another_key_is_dropped(mesh):
    mesh.open()
    mesh.confirm()
    forged = P.Message(P.TOKEN, 0, {"sid": 1, "key": mesh.key() ^ 1, "pos": 8, "n": 2, "token": 5, "eog": False})
    assert mesh.table.token(forged) == [] and mesh.table.counters["dropped_bad_key"] == 1


def test_a_head_that_does_not_take_its_chunk_in_time_fails_the_session_naming_it(mesh):
    mesh.open()
    mesh.confirm()
    mesh.clock.t += TIMEOUT / 2
    assert mesh.table.tick() == []
    mesh.clock.t += TIMEOUT
    (failed,) = caller(mesh.table.tick())
    assert failed.error.code == E.DEADLINE_EXCEEDED and "did not take the prompt chunk" in failed.error.message
    assert failed.error.context["stage"] == "[0,2)"


def test_a_route_that_gives_no_token_in_time_fails_the_session(mesh):
    mesh.open(prompt=[1, 2, 3])
    mesh.confirm()
    mesh.took(0, 3, head=True)
    mesh.clock.t += TIMEOUT + 1
    (failed,) = caller(mesh.table.tick())
    assert failed.error.code == E.DEADLINE_EXCEEDED and "gave no token" in failed.error.message


def test_a_session_waiting_for_its_opens_is_left_to_their_own_deadlines(mesh):
    mesh.open()
    mesh.clock.t += TIMEOUT + 1
    assert mesh.table.tick() == []
    (failed,) = caller(mesh.table.open_expired(1, 1, "no answer from stage [2,4)"))
    assert failed.error.code == E.DEADLINE_EXCEEDED and failed.error.context["stage"] == "[2,4)"


def test_a_stage_lost_mid_prefill_without_a_spare_ends_the_session_and_tells_only_the_stages_left(mesh):
    mesh.open()
    mesh.confirm()
    effects = mesh.lose(mesh.tail)
    assert requests(effects, RequestKind.CANCEL) == [("head", 0)]
    (failed,) = caller(effects)
    assert failed.error.code == E.STAGE_LOST and failed.error.context["elapsed_ms"] == 1500
    assert failed.error.message.startswith("stage [2,4) (worker tail.")
    assert "stopped answering heartbeats (" in failed.error.message   # and why no route was there (in brackets)


def _decode_two_tokens(mesh):
    mesh.open(max_tokens=5)
    mesh.confirm()
    mesh.took(0, 4, head=True)
    mesh.took(4, 4, head=True)
    mesh.took(0, 4, tail=True)
    mesh.took(8, 2, head=True)
    mesh.token(8, 2, 21)
    mesh.token(10, 1, 22)


def test_a_stage_lost_mid_decode_with_a_spare_replays_there_and_the_caller_sees_no_token_twice(mesh):
    _decode_two_tokens(mesh)
    spare = mesh.add("spare", 2, 4)
    effects = mesh.lose(mesh.tail)
    assert requests(effects, RequestKind.CANCEL) == [("head", 0)]
    assert requests(effects, RequestKind.OPEN) == [("head", 0), ("spare", 1)]
    opening = of(effects, Request)[-1].fields
    assert opening["prompt_len"] == 12 and opening["max_tokens"] == 3   # the prompt holds the two tokens
    assert not caller(effects)
    assert pushed(mesh.confirm()) == [(0, [0, 1, 2, 3])]
    assert pushed(mesh.took(0, 4, head=True)) == [(4, [4, 5, 6, 7])]
    mesh.took(0, 4, tail=True)
    # the replay's chunks are the prompt's as fed, then each generated token alone
    assert pushed(mesh.took(4, 4, head=True)) == [(8, [8, 9])]
    mesh.took(4, 4, tail=True)
    assert pushed(mesh.took(8, 2, head=True)) == [(10, [21])]
    assert pushed(mesh.took(8, 2, tail=True)) == []     # the head has not taken [21] yet
    assert pushed(mesh.took(10, 1, head=True)) == [(11, [22])]
    mesh.took(10, 1, tail=True)
    mesh.took(11, 1, head=True)
    assert caller(mesh.token(11, 1, 23)) == [TokenEvent(23, b"", None)]   # the token after the two
    assert mesh.table.sessions[1].route[1] is spare
    mesh.token(12, 1, 24)
    done = caller(mesh.token(13, 1, 25))[-1]
    assert isinstance(done, Done) and done.metrics["resumed"][0]["replayed_tokens"] == 12
    assert done.metrics["resumed"][0]["worker"] == mesh.tail.name


def test_a_new_route_that_takes_fewer_rows_at_once_gets_even_chunks_of_its_batch(mesh):
    mesh.open(chunk=4)
    mesh.confirm()
    mesh.add("small", 2, 4, n_batch=2)
    mesh.lose(mesh.tail)
    assert pushed(mesh.confirm()) == [(0, [0, 1])]


def test_a_stage_lost_mid_decode_without_a_spare_ends_the_session_with_stage_lost(mesh):
    _decode_two_tokens(mesh)
    (failed,) = caller(mesh.lose(mesh.head))
    assert failed.error.code == E.STAGE_LOST and failed.error.context["stage"] == "[0,2)"
    assert mesh.table.counters["failed_stage_lost"] == 1


def test_a_session_past_its_resumes_ends_with_the_loss():
    mesh = Mesh(max_resumes=1)
    head, tail = mesh.add("head", 0, 2), mesh.add("tail", 2, 4)
    mesh.add("spare", 2, 4)
    mesh.open()
    mesh.confirm()
    mesh.lose(tail)
    assert mesh.table.sessions[1].state is State.OPENING and len(mesh.table.sessions[1].resumes) == 1
    spare = mesh.table.sessions[1].route[1]
    assert [e.error.code for e in caller(mesh.lose(spare))] == [E.STAGE_LOST]


def test_a_replacement_within_the_resume_wait_resumes_the_session_and_none_fails_it_after():
    mesh = Mesh(resume_wait=5.0)
    head, tail = mesh.add("head", 0, 2), mesh.add("tail", 2, 4)
    mesh.open(sid=1)
    mesh.confirm(1)
    mesh.open(sid=2)
    mesh.confirm(2)
    assert caller(mesh.lose(tail)) == []
    assert mesh.table.sessions[1].state is State.LOST
    mesh.clock.t += 2
    assert caller(mesh.table.tick()) == []
    mesh.add("late", 2, 4)
    effects = mesh.table.routes_changed()
    assert requests(effects, RequestKind.OPEN) == [("head", 0), ("late", 1), ("head", 0), ("late", 1)]
    assert mesh.table.sessions[1].state is State.OPENING
    # without a replacement, the wait ends the session with the loss, saying how long it waited
    mesh.lose(mesh.table.sessions[1].route[1])
    mesh.clock.t += 6
    failures = caller(mesh.table.tick())
    assert [f.error.code for f in failures] == [E.STAGE_LOST] * 2
    assert "within --resume-wait 5 s" in failures[0].error.message


def test_a_stage_that_cannot_pass_a_session_on_is_suspect_until_a_loss_explains_it(mesh):
    mesh.open()
    mesh.confirm()
    assert mesh.table.stage_error(1, mesh.head, E.HOP_UNREACHABLE, "cannot reach [2,4)") == []
    mesh.add("spare", 2, 4)
    effects = mesh.lose(mesh.tail)     # within the window: the loss, not the suspicion, decides
    assert requests(effects, RequestKind.OPEN) == [("head", 0), ("spare", 1)] and not caller(effects)
    mesh.clock.t += SUSPECT + 1
    assert caller(mesh.table.tick()) == []


def test_a_suspicion_no_loss_explains_fails_the_session_when_its_window_closes(mesh):
    mesh.open()
    mesh.confirm()
    mesh.table.stage_error(1, mesh.head, E.HOP_UNREACHABLE, "cannot reach [2,4)")
    mesh.clock.t += SUSPECT / 2
    assert mesh.table.tick() == []
    mesh.clock.t += SUSPECT
    (failed,) = caller(mesh.table.tick())
    assert failed.error.code == E.HOP_UNREACHABLE and failed.error.context["stage"] == "[0,2)"


def test_an_error_from_a_worker_outside_the_route_ends_nothing(mesh):
    mesh.open()
    mesh.confirm()
    stranger = mesh.add("stranger", 0, 2)
    assert mesh.table.stage_error(1, stranger, E.INTERNAL, "boom") == []
    assert mesh.table.counters["late_replies"] == 1 and 1 in mesh.table.sessions


def test_a_new_route_whose_context_is_too_small_ends_the_session_with_context_full_in_words(mesh):
    mesh.open(prompt=list(range(100)), max_tokens=100)
    mesh.confirm()
    mesh.add("small", 2, 4, n_ctx=128)
    (failed,) = caller(mesh.lose(mesh.tail))
    assert failed.error.code == E.STAGE_LOST and "context of 128 is too small" in failed.error.message


def test_a_session_whose_worker_dropped_it_is_replayed_on_that_worker_again(mesh):
    mesh.open()
    mesh.confirm()
    effects = mesh.table.sessions_dropped(mesh.tail, "dropped its sessions")
    assert requests(effects, RequestKind.CANCEL) == [("head", 0), ("tail", 1)]
    assert requests(effects, RequestKind.OPEN) == [("head", 0), ("tail", 1)]


def test_no_route_or_too_long_a_request_fails_at_open_with_nothing_sent():
    mesh = Mesh()
    (failed,) = caller(mesh.open())
    assert failed.error.code == E.ROUTE_INCOMPLETE and not of(mesh.open(sid=2), Request)
    mesh.add("whole", 0, 4, n_ctx=16)
    (failed,) = caller(mesh.open(sid=3, max_tokens=10))
    assert failed.error.code == E.CONTEXT_FULL and 3 not in mesh.table.sessions


def test_the_stock_class_feeds_the_prompt_in_batches_of_n_batch_whatever_chunk_was_asked():
    mesh = Mesh()
    mesh.add("whole", 0, 4, n_batch=8, numerics="stock")
    mesh.open(chunk=2)
    assert pushed(mesh.confirm()) == [(0, [0, 1, 2, 3, 4, 5, 6, 7])]


def test_a_push_that_cannot_go_fails_the_session_naming_the_head(mesh):
    mesh.open()
    mesh.confirm()
    (failed,) = caller(mesh.table.push_failed(1))
    assert failed.error.code == E.HOP_UNREACHABLE and failed.error.context["stage"] == "[0,2)"


def _kv_full(mesh, sid: int):
    return mesh.table.stage_error(sid, mesh.tail, E.KV_FULL, "the stage's KV pool of 1024 cells holds 0 free")


def _prefill(mesh, sid: int):
    """Session SID's prompt of 10 through the route (chunks of 4), up to its first token."""
    mesh.confirm(sid)
    mesh.took(0, 4, sid, head=True)
    mesh.took(4, 4, sid, head=True)
    mesh.took(0, 4, sid, tail=True)
    mesh.took(8, 2, sid, head=True)


def test_a_session_a_kv_pool_has_no_room_for_waits_off_its_route_and_is_replayed_exactly_when_another_ends(mesh):
    mesh.open(sid=1, max_tokens=2)
    _prefill(mesh, 1)
    mesh.open(sid=2, max_tokens=5)
    _prefill(mesh, 2)
    mesh.token(8, 2, 21, sid=2)
    effects = _kv_full(mesh, 2)
    assert not caller(effects)   # no error for its caller: it waits
    assert requests(effects, RequestKind.CANCEL) == [("head", 0), ("tail", 1)]   # its cells go back to the pools
    assert mesh.table.sessions[2].state is State.PAUSED and mesh.table.counters["kv_pauses"] == 1
    assert mesh.table.sessions_on(mesh.tail.identity) == 1
    mesh.token(8, 2, 31, sid=1)
    effects = mesh.token(10, 1, 32, sid=1)   # session 1 ends: session 2 is replayed
    assert isinstance(caller(effects)[-1], Done)
    assert requests(effects, RequestKind.RELEASE) == [("head", 0), ("tail", 1)]
    assert requests(effects, RequestKind.OPEN) == [("head", 0), ("tail", 1)]
    opening = of(effects, Request)[-1].fields
    assert opening["prompt_len"] == 11 and opening["max_tokens"] == 4   # the prompt holds its token
    assert pushed(mesh.confirm(2)) == [(0, [0, 1, 2, 3])]
    mesh.took(0, 4, 2, head=True)
    mesh.took(4, 4, 2, head=True)
    mesh.took(0, 4, 2, tail=True)
    mesh.took(4, 4, 2, tail=True)
    assert pushed(mesh.took(8, 2, 2, head=True)) == [(10, [21])]   # each generated token alone, as decoded
    mesh.took(10, 1, 2, head=True)
    assert caller(mesh.token(10, 1, 22, sid=2)) == [TokenEvent(22, b"", None)]   # no token twice
    mesh.token(11, 1, 23, sid=2)
    mesh.token(12, 1, 24, sid=2)
    done = caller(mesh.token(13, 1, 25, sid=2))[-1]
    assert isinstance(done, Done) and done.metrics["kv_pauses"] == 1 and "resumed" not in done.metrics


def test_sessions_wait_for_room_in_age_order_one_let_out_at_a_time_and_the_newest_behind_them(mesh):
    for sid in (1, 2, 3):
        mesh.open(sid=sid, max_tokens=3)
        _prefill(mesh, sid)
    _kv_full(mesh, 3)
    _kv_full(mesh, 2)
    effects = mesh.open(sid=4)   # opened while others wait for room: it waits behind them, never opened
    assert not of(effects, Request) and mesh.table.sessions[4].state is State.PAUSED
    mesh.token(8, 2, 21, sid=1)
    mesh.token(10, 1, 22, sid=1)
    effects = mesh.token(11, 1, 23, sid=1)   # session 1 ends: the oldest in line (2) goes, only it
    assert {e.sid for e in of(effects, Request) if e.kind is RequestKind.OPEN} == {2}
    _prefill(mesh, 2)
    effects = mesh.token(8, 2, 24, sid=2)    # it had room (a token): the next in line (3) goes
    assert {e.sid for e in of(effects, Request) if e.kind is RequestKind.OPEN} == {3}
    _prefill(mesh, 3)
    _kv_full(mesh, 3)                        # no room again: back in line, before the newer 4
    assert mesh.table.sessions[3].state is State.PAUSED and mesh.table.sessions[3].pauses == 2
    mesh.token(10, 1, 25, sid=2)
    effects = mesh.token(11, 1, 26, sid=2)
    assert {e.sid for e in of(effects, Request) if e.kind is RequestKind.OPEN} == {3}
    assert mesh.table.sessions[4].state is State.PAUSED


def test_no_room_with_no_other_session_in_the_pools_ends_the_session_and_a_wait_in_line_is_bounded():
    mesh = Mesh()
    mesh.add("head", 0, 2)
    mesh.tail = mesh.add("tail", 2, 4)
    mesh.open(sid=1)
    _prefill(mesh, 1)
    (alone,) = caller(_kv_full(mesh, 1))   # nobody else will free room: the error, at once
    assert alone.error.code == E.KV_FULL and "1024 cells" in alone.error.message
    mesh.table.pause_wait, mesh.table.request_timeout = 30.0, 100.0
    for sid in (2, 3):
        mesh.open(sid=sid)
        _prefill(mesh, sid)
    _kv_full(mesh, 3)
    mesh.clock.t += 31
    (waited,) = caller(mesh.table.tick())
    assert waited.error.code == E.KV_FULL and "waited 30 s" in waited.error.message
    assert mesh.table.sessions[2].state is State.RUNNING


def test_a_prompt_beside_decoding_sessions_is_fed_in_short_chunks_that_a_replay_feeds_again(mesh):
    long_prompt = tuple(range(40))
    mesh.open(sid=1, prompt=long_prompt, chunk=32)   # alone: chunks of 32
    assert pushed(mesh.confirm(1)) == [(0, list(range(32)))]
    mesh.table.cancel(1)
    mesh.open(sid=2, max_tokens=9)
    _prefill(mesh, 2)
    mesh.token(8, 2, 21, sid=2)                      # session 2 decodes
    held = len(mesh.table.sessions[2].gen.prompt) + len(mesh.table.sessions[2].gen.tokens)
    # the chunk budget's rows for this route (its own unit tests: test_chunk_budget.py)
    first = chunk_rows([held], 2, 0, row_cells(None), share=8.0)
    second = chunk_rows([held], 2, first, row_cells(None), share=8.0)
    assert 1 < second <= first < 32
    mesh.table.chunk_share = 8.0   # (a budget of more than one row: the cut shows)
    mesh.open(sid=3, prompt=long_prompt, chunk=32)
    assert pushed(mesh.confirm(3)) == [(0, list(range(first)))]
    assert pushed(mesh.took(0, first, 3, head=True)) == [(first, list(range(first, first + second)))]
    gen = mesh.table.sessions[3].gen
    assert gen.chunk_ends[:2] == [first, first + second]   # what a replay feeds again
    assert gen.replay().chunk_ends[:2] == [first, first + second]


def test_the_stock_class_feeds_whole_chunks_beside_decoding_sessions():
    mesh = Mesh()
    mesh.add("head", 0, 2, numerics="stock")
    mesh.tail = mesh.add("tail", 2, 4, numerics="stock")
    mesh.open(sid=2, max_tokens=9)
    _prefill(mesh, 2)
    mesh.token(8, 2, 21, sid=2)
    mesh.open(sid=3, prompt=tuple(range(100)))
    assert len(pushed(mesh.confirm(3))[0][1]) == 64   # the route's n_batch, as stock llama.cpp feeds
