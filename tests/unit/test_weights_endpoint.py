"""Where a worker says it serves its model's bytes (the capability's `weights`): the
coordinator connects to it and prints it, so it is a printable tcp://HOST:PORT or the
worker is refused, with plain data."""

import pytest

from meshnet.net.capability import Capability
from meshnet.net.fields import ProtocolError

from fakes import fake_wire_capability


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:5555", "tcp://0.0.0.0:40000", "tcp://[::1]:7",
                                      "tcp://[::]:7", "tcp://holder-3.lan:65535", "tcp://a_b.example:1"])
def test_a_tcp_host_and_port_is_taken(endpoint):
    assert Capability.parse({**fake_wire_capability("w1", 0, 2), "weights": endpoint}).weights == endpoint


@pytest.mark.parametrize("endpoint", [
    "tcp://bad host:1",                   # libzmq raises at connect
    "foo://x",                            # ... and for a transport it does not know
    "ipc:///tmp/holder",                  # names nothing beyond the worker's host
    "tcp://*:5",                          # a bind address, not one to connect to
    "tcp://127.0.0.1:0", "tcp://127.0.0.1:65536", "tcp://127.0.0.1", "tcp://:5", "tcp://127.0.0.1:x",
    "tcp://eth0;127.0.0.1:5",             # a source address: libzmq's syntax, not a peer's
    "tcp://127.0.0.1:5\x1b[2K\rmeshnet worker: ok",   # an escape and a carriage return for the log lines
    "tcp://h\n:5",
    "tcp://" + "h" * 251 + ":5",          # past the 256 characters a field may take
])
def test_anything_else_refuses_the_worker(endpoint):
    with pytest.raises(ProtocolError) as refused:
        Capability.parse({**fake_wire_capability("w1", 0, 2), "weights": endpoint})
    assert "field 'weights' has a bad value" in refused.value.message
