"""The coordinator's other plain tables with plain data: the requests in flight, the
registry's admission of a READY, and the standby plan. The capabilities are fakes
(named as such), as in test_sessions.py."""

from __future__ import annotations

import dataclasses

from meshnet.core.planner import ModelCost
from meshnet.net.capability import Capability
from meshnet.net.heartbeat import Liveness
from meshnet.route.registry import Registry
from meshnet.route.requests import Pending, RequestKind, Requests
from meshnet.route.standby import gaps, plan_standby

from fakes import fake_capability, fake_wire_capability

MIB = 1 << 20


def pending(worker: bytes, sid: int | None = None, deadline: float = 10.0) -> Pending:
    return Pending(RequestKind.OPEN if sid else RequestKind.QUERY, sid, worker, 0, deadline)


def test_a_reply_settles_only_its_own_workers_request():
    table = Requests(first_rid=100)
    rid = table.next_rid()
    table.add(rid, pending(b"a", sid=1))
    assert table.take(rid, b"b") is None and len(table) == 1   # another worker cannot answer it
    assert table.take(rid, b"a").sid == 1 and table.take(rid, b"a") is None


def test_requests_expire_at_their_deadline_and_go_with_their_session_or_worker():
    table = Requests(first_rid=0)
    for rid, p in enumerate([pending(b"a", 1, 5.0), pending(b"a", 2, 20.0), pending(b"b", 1, 20.0),
                             pending(b"b", None, 30.0)]):
        table.add(rid, p)
    assert [p.sid for p in table.expired(10.0)] == [1] and len(table) == 3
    table.drop_session(1)
    assert len(table) == 2
    assert [p.sid for p in table.drop_worker(b"a")] == [2] and len(table) == 1


def _registry_with(*workers):
    registry = Registry()
    for worker_id, start, end in workers:
        registry.add(worker_id.encode(), fake_capability(worker_id, start, end), Liveness(1.0, 3), None, 0)
    return registry


def test_the_same_ready_again_is_heard_and_a_higher_epoch_says_the_sessions_were_dropped():
    registry = _registry_with(("w1", 0, 4))
    same = fake_capability("w1", 0, 4)
    assert registry.admit(b"w1", same, 0).outcome == "again"
    admission = registry.admit(b"w1", same, 3)
    assert admission.outcome == "again" and admission.dropped and registry.get(b"w1").epoch == 3
    assert not registry.admit(b"w1", same, 3).dropped


def test_a_worker_claiming_another_shape_for_a_known_model_is_refused_in_words():
    registry = _registry_with(("w1", 0, 2))
    liar = dataclasses.replace(fake_capability("w2", 2, 4), n_embd=16)
    admission = registry.admit(b"w2", liar, 0)
    assert admission.outcome == "refused" and "n_embd" in admission.why and "w1" in admission.detail


def test_a_worker_connecting_again_replaces_its_old_connection():
    registry = _registry_with(("w1", 0, 4))
    admission = registry.admit(b"w1-new-connection", fake_capability("w1", 0, 4), 0)
    assert admission.outcome == "new" and [(w.name.split(".")[0], why) for w, why in admission.lose] == \
        [("w1", "connected again")]


def test_an_unreachable_worker_is_left_out_of_the_route():
    registry = _registry_with(("w1", 0, 4), ("w2", 0, 4))
    first = registry.route()[0]
    first.unreachable = True
    assert registry.route()[0] is not first


def _standby(registry, worker_id: str, mem_mib: int, cost: ModelCost):
    wire = {k: v for k, v in fake_wire_capability(worker_id, 0, 1).items() if k not in ("layers", "data_endpoint")}
    wire.update(cost=cost.to_dict(), mem_bytes=mem_mib * MIB, max_sessions=1, n_embd=cost.n_embd, n_vocab=cost.n_vocab)
    return registry.add(worker_id.encode(), Capability.parse(wire), Liveness(1.0, 3), None, 0)


FAKE_MODEL = ModelCost(n_layer=4, layer_bytes=(10 * MIB,) * 4, input_bytes=5 * MIB, output_bytes=5 * MIB,
                       shared_bytes=0, tied_embeddings=False, token_embd_bytes=5 * MIB, kv_bytes_per_cell=0,
                       n_embd=1, n_ff=1, n_head=1, n_vocab=1)


def test_standby_workers_are_planned_over_the_layers_nobody_holds_in_the_order_they_registered():
    registry = _registry_with(("held", 0, 2))
    held = registry.get(b"held")
    held.capability = dataclasses.replace(held.capability, cost=FAKE_MODEL)
    a, b = _standby(registry, "a", 10_000, FAKE_MODEL), _standby(registry, "b", 10_000, FAKE_MODEL)
    assignments, note = plan_standby(registry.all(), overhead=0)
    assert [(x.worker, x.layers.start, x.layers.end) for x in assignments] == [(a, 2, 4)] and note is None
    a.assigning = assignments[0].layers
    assert plan_standby(registry.all(), overhead=0) == ([], None)   # b waits: nothing is left to hold
    assert b.assigning is None


def test_a_gap_that_does_not_fit_waits_and_the_note_says_which_layers():
    registry = Registry()
    _standby(registry, "small", 1, FAKE_MODEL)
    assignments, note = plan_standby(registry.all(), overhead=0)
    assert assignments == [] and note.startswith("layers 0..3 wait for more memory")


def test_gaps_are_the_half_open_runs_nobody_covers():
    assert gaps([1, 0, 0, 1, 0]) == [(1, 3), (4, 5)] and gaps([1, 1]) == [] and gaps([0]) == [(0, 1)]
