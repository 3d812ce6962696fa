"""LAN discovery (meshnet.net.discovery) between two network namespaces this test makes,
joined by a veth pair: A announces, B browses and finds.

Every announce and browse runs inside those namespaces, never in this process: the
multicast must not reach this machine's real interfaces (nor would a test of it on them
say anything about a LAN)."""

import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time

import pytest

from meshnet.net.discovery import announceable

from conftest import run_bounded, stop_group
from peers import alive

PID = os.getpid()
NS_A, NS_B = f"mdns-a-{PID}", f"mdns-b-{PID}"
LINK_A, LINK_B = f"mdA{PID}", f"mdB{PID}"     # an interface name has at most 15 characters
ADDR_A, ADDR_B = "10.78.0.1", "10.78.0.2"
NAME = f"meshnet-test-{PID}"
PORT = 5555
KEY = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"   # a CURVE public key's z85 shape (40 characters)
OTHER_KEY = "Yne@$w-vo<fVvi]a<NY6T1ed:M$fCG*[IaLV{hID"
PROPERTIES = {"key": KEY, "v": "9"}
BOUND_S = 120   # any one process here, on a loaded 2-core machine

ANNOUNCER = """
import json, sys
from meshnet.net.discovery import Announcement
name, port, address, properties = json.loads(sys.argv[1])
with Announcement(name, port, [address], properties):
    print("ready", flush=True)
    sys.stdin.read()   # until the test closes it: then the goodbye goes out
"""

# in B: MODE and its argument; one JSON line out
BROWSER = """
import json, sys, time
from meshnet.core.errors import MeshnetError
from meshnet.net.discovery import Announcement, browse, find

mode, arg = sys.argv[1], json.loads(sys.argv[2])
def seen(f):
    return {"name": f.name, "addresses": list(f.addresses), "port": f.port, "properties": f.properties,
            "endpoints": list(f.endpoints)}
if mode == "browse":    # until ARG is seen, or 30 s pass
    deadline = time.monotonic() + 30
    while True:
        found = browse(timeout=2)
        if any(f.name == arg for f in found) or time.monotonic() > deadline:
            break
    print(json.dumps([seen(f) for f in found]))
elif mode == "find":    # ARG: [key or None, timeout]
    start = time.monotonic()
    try:
        out = {"found": seen(find(arg[0], timeout=arg[1]))}
    except MeshnetError as e:
        out = {"code": e.code, "message": e.message}
    print(json.dumps({**out, "elapsed": time.monotonic() - start}))
elif mode == "announce":   # ARG: addresses, which must be refused before anything is sent
    try:
        Announcement("refused", 5555, arg, {}).close()
        print(json.dumps({"announced": True}))
    except MeshnetError as e:
        print(json.dumps({"code": e.code, "message": e.message}))
"""


def ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=60, check=check)


def remove_namespace(name):
    """NAME with whatever runs in it (its veth end, and so the pair, goes with it)."""
    for pid in ip("netns", "pids", name, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    ip("netns", "del", name, check=False)


def remove_leaked_namespaces():
    """Those of earlier runs killed before their clean-up (mdns-a-PID of a PID now gone)."""
    for name in ip("netns", "list", check=False).stdout.split():
        found = re.fullmatch(r"mdns-[ab]-(\d+)", name)
        if found and not alive(int(found.group(1))):
            remove_namespace(name)


def in_b(mode, arg):
    result = run_bounded(["ip", "netns", "exec", NS_B, sys.executable, "-c", BROWSER, mode, json.dumps(arg)],
                         timeout=BOUND_S)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def announced():
    """NS_A announcing NAME on ADDR_A (and only on the link to NS_B) while the tests run."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if not shutil.which("ip"):
        pytest.skip("no 'ip' command (iproute2)")
    remove_leaked_namespaces()
    announcer = None
    try:
        for ns in (NS_A, NS_B):
            made = ip("netns", "add", ns, check=False)
            if made.returncode != 0:
                pytest.skip(f"'ip netns add' failed: {made.stderr.strip()}")
        # made inside the namespaces: the pair never exists in this one, not even for a moment
        made = ip("link", "add", LINK_A, "netns", NS_A, "type", "veth", "peer", "name", LINK_B, "netns", NS_B,
                  check=False)
        if made.returncode != 0:
            pytest.skip(f"no veth pair: {made.stderr.strip()}")
        for ns, link, address in ((NS_A, LINK_A, ADDR_A), (NS_B, LINK_B, ADDR_B)):
            ip("-n", ns, "addr", "add", f"{address}/24", "dev", link)
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "link", "set", link, "up")
            # a real host's default route covers multicast; these have none
            ip("-n", ns, "route", "add", "224.0.0.0/4", "dev", link)
        announcer = subprocess.Popen(
            ["ip", "netns", "exec", NS_A, sys.executable, "-c", ANNOUNCER, json.dumps([NAME, PORT, ADDR_A, PROPERTIES])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        deadline = time.monotonic() + BOUND_S
        while True:   # its first line, once registered (zeroconf probes the name first)
            left = deadline - time.monotonic()
            assert left > 0, f"the announcer did not say ready within {BOUND_S} s"
            if select.select([announcer.stdout], [], [], left)[0]:
                line = announcer.stdout.readline()   # "" if it ended
                assert line.strip() == "ready", line + announcer.stderr.read()
                break
        yield
        announcer.stdin.close()
        announcer.wait(30)
        assert announcer.returncode == 0, announcer.stderr.read()
    finally:
        if announcer is not None and announcer.poll() is None:
            stop_group(announcer)
        for ns in (NS_A, NS_B):
            remove_namespace(ns)
        assert not {NS_A, NS_B} & set(ip("netns", "list", check=False).stdout.split())


def test_a_browser_in_b_sees_the_announcement_of_a_with_its_address_port_and_properties(announced):
    found = {f["name"]: f for f in in_b("browse", NAME)}
    assert NAME in found, found
    assert found[NAME]["addresses"] == [ADDR_A]
    assert found[NAME]["port"] == PORT
    assert found[NAME]["endpoints"] == [f"tcp://{ADDR_A}:{PORT}"]
    assert found[NAME]["properties"]["key"] == KEY


def test_find_returns_the_coordinator_of_its_key_at_once_and_refuses_another_key_within_its_timeout(announced):
    hit = in_b("find", [KEY, 60])
    assert hit["found"]["name"] == NAME and hit["found"]["endpoints"] == [f"tcp://{ADDR_A}:{PORT}"], hit
    assert hit["elapsed"] < 60, hit     # as soon as seen, not at the timeout

    miss = in_b("find", [OTHER_KEY, 3])
    assert miss.get("code") == "unreachable", miss
    assert (f"no meshnet coordinator with public key {OTHER_KEY} announced itself on the LAN within 3 s"
            in miss["message"]), miss
    assert "give its address, or check that multicast (UDP 5353) passes between the hosts" in miss["message"]
    assert NAME in miss["message"]      # what was seen instead
    assert 3 <= miss["elapsed"] < 3 + 1 + 5, miss   # the timeout, one bounded resolve, closing

    alone = in_b("find", [None, 3])     # the only one there is
    assert alone["found"]["name"] == NAME, alone


def test_the_announcement_carries_exactly_the_properties_given_and_nothing_else(announced):
    found = in_b("browse", NAME)
    assert [f["name"] for f in found] == [NAME]
    assert found[0]["properties"] == PROPERTIES


def test_loopback_only_addresses_are_refused_and_announceable_drops_them(announced):
    assert announceable(["127.0.0.1", "::1", "localhost", ADDR_A, "0.0.0.0"]) == [ADDR_A, "0.0.0.0"]
    assert announceable(["127.0.0.1", "::1"]) == []
    refused = in_b("announce", ["127.0.0.1", "::1"])
    assert refused.get("code") == "bad_address", refused
    assert "loopback addresses only" in refused["message"]
