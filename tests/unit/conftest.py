"""The unit layer's promise, held while each test runs: no socket, no thread, no engine
library. A test here that reaches for one fails, naming what it reached for; such a test
belongs in tests/ beside the engine and the processes."""

import socket
import threading

import pytest
import zmq


def _refuse(what: str):
    def refused(*args, **kwargs):
        raise AssertionError(f"a unit test opened {what}: move it out of tests/unit")
    return refused


@pytest.fixture(autouse=True)
def pure_logic_only(monkeypatch):
    from meshnet.engine import binding

    monkeypatch.setattr(socket, "socket", _refuse("a socket"))
    monkeypatch.setattr(zmq, "Context", _refuse("a ZeroMQ context"))
    monkeypatch.setattr(threading.Thread, "start", _refuse("a thread"))
    monkeypatch.setattr(binding, "library", _refuse("the engine library"))
    yield
