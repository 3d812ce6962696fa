"""The endpoints meshnet is given, checked before libzmq sees them (net/addresses.py)."""

import pytest

from meshnet.core import errors as E
from meshnet.core.errors import MeshnetError
from meshnet.net.addresses import checked, reachable, same_host_any_port


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:5555", "tcp://0.0.0.0:0", "tcp://*:*", "tcp://[::1]:7",
                                      "ipc:///tmp/meshnet.sock", "inproc://stage"])
def test_a_well_formed_endpoint_is_returned_as_given(endpoint):
    assert checked(endpoint, "--bind") == endpoint


@pytest.mark.parametrize("endpoint, why", [
    ("nonsense", "names no transport"),
    ("127.0.0.1:5555", "names no transport"),
    ("tcp://127.0.0.1", "has no port"),
    ("tcp://:5555", "has no port"),
    ("tcp://127.0.0.1:notaport", "the port must be 0..65535"),
    ("tcp://127.0.0.1:65536", "the port must be 0..65535"),
])
def test_a_malformed_endpoint_is_a_bad_address_naming_the_option(endpoint, why):
    with pytest.raises(MeshnetError) as err:
        checked(endpoint, "--coordinator")
    assert err.value.code == E.BAD_ADDRESS
    assert why in err.value.message and "--coordinator" in err.value.message and repr(endpoint) in err.value.message


def test_a_wildcard_data_endpoint_is_reached_on_the_coordinator_s_host():
    assert reachable("tcp://0.0.0.0:6001", "tcp://10.0.0.2:5555") == "tcp://10.0.0.2:6001"
    assert reachable("tcp://10.0.0.3:6001", "tcp://10.0.0.2:5555") == "tcp://10.0.0.3:6001"
    assert same_host_any_port("tcp://10.0.0.2:5555") == "tcp://10.0.0.2:0"
