"""Two hosts out of two network namespaces on this machine (tools/netns-two-host.sh):
the route across them gives the whole model's tokens, and 4 concurrent sessions each
their own, with and without a delay on the link between them."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from meshnet.gguf_layout import read_layout

SCRIPT = Path(__file__).resolve().parent.parent / "tools" / "netns-two-host.sh"
CANNOT = 77   # the script's "no namespaces here", with the reason on stderr


def run_script(**env):
    result = subprocess.run([str(SCRIPT)], env={**os.environ, "PYTHON": sys.executable, **env},
                            capture_output=True, text=True, timeout=180)
    if result.returncode == CANNOT:
        pytest.skip(result.stderr.strip())
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_two_namespaces_give_the_whole_model_tokens_and_isolated_sessions(smollm2_path):
    report = run_script()
    assert report["ok"] and report["parity"] and report["isolation"], report
    assert report["route"] == [r.label for r in read_layout(smollm2_path).balanced_ranges(2)]
    assert report["route_decode_tok_s"] > 0 and report["whole_decode_tok_s"] > 0


def test_a_2ms_link_delays_each_way_and_changes_nothing_else(smollm2_path):
    report = run_script(DELAY="2ms")
    assert report["ok"] and report["parity"] and report["isolation"], report
    assert report["delay_us"] == 2000
    assert report["rtt_ms"]["median"] >= 4.0   # the wire delays each direction
    assert report["hop_us_p50"] >= 2000        # and every activation crosses it


def test_without_root_the_script_says_why_and_exits_77_never_0():
    command = [str(SCRIPT)]
    if os.geteuid() == 0:
        if not shutil.which("setpriv"):
            pytest.skip("no setpriv to drop root with")
        # a copy everybody can read: the checkout may sit in a directory only root can enter
        # (mktemp -d is 0700), and the script says why before it needs anything beside it
        scratch = tempfile.mkdtemp()
        copy = Path(scratch) / "tools" / SCRIPT.name
        copy.parent.mkdir()
        shutil.copy(SCRIPT, copy)
        for path in (copy, copy.parent, copy.parent.parent):
            path.chmod(0o755)
        command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", str(copy)]
    try:
        result = subprocess.run(command, env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True,
                                timeout=60)
    finally:
        if command[0] == "setpriv":
            shutil.rmtree(scratch)
    assert result.returncode == CANNOT, result.stdout + result.stderr
    assert "cannot build two hosts here: network namespaces need root" in result.stderr


def test_with_curve_on_every_link_the_route_across_namespaces_is_as_exact(smollm2_path):
    report = run_script(SECURE="1")
    assert report["ok"] and report["parity"] and report["isolation"], report
    assert report["curve"] is True     # each link's mechanism, as ZeroMQ reports it
