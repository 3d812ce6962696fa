"""Two hosts out of two network namespaces on this machine (tools/netns-two-host.sh):
the route across them gives the whole model's tokens, and 4 concurrent sessions each
their own, with and without a delay on the link between them."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from meshnet.engine.gguf_layout import read_layout

from conftest import MARK, left_behind, marked, run_bounded, stop_group
from peers import alive

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "netns-two-host.sh"
CANNOT = 77   # the script's "no namespaces here", with the reason on stderr
# a bound for a loaded 2-core machine (a run takes 15 s alone): one that hits it is stopped
# with everything it started, and its progress is shown
RUN_BOUND_S = 900


def leaked_namespaces():
    """Remove the namespaces of runs whose script is gone (meshnet-a-PID, meshnet-b-PID: it
    removes its own unless killed outright), with what runs in them; their names."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        return []
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=60).stdout
    leaked = []
    for name in (line.split()[0] for line in listed.splitlines() if line.strip()):
        found = re.fullmatch(r"meshnet-[ab]-(\d+)", name)
        if not found or alive(int(found.group(1))):
            continue
        pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, timeout=60).stdout
        for pid in pids.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=60)
        leaked.append(name)
    return leaked


def run_script(script=SCRIPT, **env):
    """The script's JSON report (skipped where no namespaces can be made), with no namespace left behind."""
    try:
        result = run_bounded([str(script)], env={**os.environ, "PYTHON": sys.executable, "ROUNDS": "1", **env},
                             timeout=RUN_BOUND_S)
    finally:
        leaked = leaked_namespaces()
    assert not leaked, f"the run left its namespaces behind: {leaked}"
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
        result = run_bounded(command, env={**os.environ, "PYTHON": sys.executable}, timeout=300)
    finally:
        if command[0] == "setpriv":
            shutil.rmtree(scratch)
    assert result.returncode == CANNOT, result.stdout + result.stderr
    assert "cannot build two hosts here: network namespaces need root" in result.stderr


def test_with_curve_on_every_link_the_route_across_namespaces_is_as_exact(smollm2_path):
    report = run_script(SECURE="1")
    assert report["ok"] and report["parity"] and report["isolation"], report
    assert report["curve"] is True     # each link's mechanism, as ZeroMQ reports it


def _started_all(processes) -> bool:
    """The checker and both workers run Python: each is past `setpriv --pdeathsig`, whose
    tie to the script holds only once setpriv has set it (a script killed before that
    leaves its child untied, through no fault of the script's cleanup)."""
    ours = [command for _, command in processes if "netns_check.py" in command or "meshnet.cli.main worker" in command]
    return len(ours) == 3 and all(os.path.basename(command.split()[0]).startswith("python") for command in ours)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_run_stopped_mid_check_leaves_no_process_and_removes_its_namespaces_unless_killed_outright(tmp_path, sig,
                                                                                                       arch_models):
    """The script alone is signalled while its checker runs: within a bound none of its
    processes is left; SIGTERM also removes its namespaces (SIGKILL leaves only those).
    Any model does for that: a generated one, so that a plain pytest installs none."""
    mark = uuid.uuid4().hex
    err = tmp_path / "stderr"
    with open(err, "w") as stderr:
        script = subprocess.Popen([str(SCRIPT), arch_models["llama"]],
                                  env={**os.environ, "PYTHON": sys.executable, MARK: mark},
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr,
                                  start_new_session=True)
    try:
        deadline = time.monotonic() + RUN_BOUND_S
        while not _started_all(marked(mark)):
            if script.poll() == CANNOT:
                pytest.skip(err.read_text().strip())
            assert script.poll() is None and time.monotonic() < deadline, err.read_text()
            time.sleep(0.2)
        started = marked(mark)
        os.kill(script.pid, sig)
        stopped = time.monotonic()
        while (script.poll() is None or marked(mark)) and time.monotonic() - stopped < 120:
            time.sleep(0.2)
        assert script.poll() is not None and not marked(mark), (
            f"120 s after {sig.name} these processes of the run are left: {marked(mark)} (of {started})\n"
            + err.read_text())
    finally:
        if script.poll() is None:
            stop_group(script)
        left_behind(mark, 0)
        leaked = leaked_namespaces()
    assert script.returncode == (143 if sig == signal.SIGTERM else -signal.SIGKILL)
    # SIGKILL: nothing of the script runs, so its namespaces are left (and removed here)
    ours = [] if sig == signal.SIGTERM else sorted(f"meshnet-{side}-{script.pid}" for side in "ab")
    assert sorted(leaked) == ours, leaked
