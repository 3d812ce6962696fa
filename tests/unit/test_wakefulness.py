"""Pure logic of the heartbeat clocks: a stop of this process itself is told apart from a
peer's silence. The clock is a fake (a list of readings), named as such."""

import pytest

from meshnet.net import heartbeat
from meshnet.net.heartbeat import Liveness, Wakefulness


@pytest.fixture
def fake_clock(monkeypatch):
    readings = [100.0]
    monkeypatch.setattr(heartbeat, "now", lambda: readings[0])

    def advance(seconds: float) -> None:
        readings[0] += seconds
    return advance


def test_looks_close_together_are_not_a_stop(fake_clock):
    awake = Wakefulness(interval=0.25)
    for _ in range(20):
        fake_clock(0.2)
        assert awake.stopped_for() == 0.0


def test_a_gap_longer_than_four_intervals_is_a_stop_and_is_reported_once(fake_clock):
    awake = Wakefulness(interval=0.25)
    fake_clock(3.0)
    assert awake.stopped_for() == pytest.approx(3.0)
    fake_clock(0.1)
    assert awake.stopped_for() == 0.0


def test_a_stop_between_finding_a_peer_silent_and_acting_is_seen(fake_clock):
    """The race CI found: the stop lands after the loop's look after poll, so the peer is
    found silent; the second look, before the peer is blamed, sees the stop."""
    awake, peer = Wakefulness(interval=0.25), Liveness(interval=0.25, liveness=8)
    fake_clock(0.1)
    assert awake.stopped_for() == 0.0     # the look after poll
    fake_clock(3.0)                       # stopped here, while handling messages
    assert peer.dead()
    assert awake.stopped_for() == pytest.approx(3.0)   # the look before blaming the peer
