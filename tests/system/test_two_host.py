"""tools/two-host.sh: the commands it runs on two hosts over ssh (--dry-run), what it
refuses, and one run through an ssh stand-in that runs each command on this machine."""

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from meshnet.engine.gguf_layout import read_layout

from conftest import MARK, left_behind, marked, run_bounded, stop_group
from peers import free_port

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "two-host.sh"
SSH = "ssh -o BatchMode=yes -o ConnectTimeout=10"
RUN_ID = re.compile(r"meshnet-two-host-\d{8}-\d{6}-\d+")
# bounds for a loaded 2-core machine, where a run that takes 10 s alone has taken minutes;
# a run that hits one is stopped, with everything it started, and its progress is shown
RUN_BOUND_S = 900        # the script, its two workers and the coordinator, start to end
ROUTE_WAIT_S = 780       # the coordinator's --wait for the route, inside the bound: it says why first
STOPPED_BOUND_S = 120    # from SIGTERM to nothing of the run left, on every "host"
# given, the ranges spare a dry run the model it would split otherwise (a plain pytest installs none)
LAYERS = "0:19,19:30"


def environment(**env):
    kept = {k: v for k, v in os.environ.items()
            if k not in ("HOST_A", "HOST_B", "ADDR_A", "ADDR_B", "MESHNET", "MESHNET_B", "MODEL", "LAYERS",
                         "PORT", "DATA_PORT", "THREADS", "PROMPT", "MAX_TOKENS", "WAIT", "REMOTE_DIR", "SSH",
                         "INSECURE")}
    # keyless runs on a trusted network: the script says so only when told (see the test below)
    return {**kept, "PYTHON": sys.executable, "INSECURE": "1", **env}


def two_host(*args, timeout=300, logs=None, **env):
    """The script, bounded (conftest.run_bounded: in a process group of its own, stopped
    whole past TIMEOUT s, and no process of it may be left once it ends); on a timeout the
    failure shows its progress and the last lines of the *.log files in LOGS."""
    def tails():
        return "\n".join(f"--- {log}:\n" + "".join(log.read_text(errors="replace").splitlines(True)[-20:])
                         for log in sorted(Path(logs).glob("*.log"))) if logs else ""
    return run_bounded([str(SCRIPT), *args], env=environment(**env), timeout=timeout, context=tails)


def dry_run(*args, **env):
    result = two_host(*args, "--dry-run", **env)
    assert result.returncode == 0, result.stderr
    return [RUN_ID.sub("RUN", line) for line in result.stdout.splitlines()]


def remote(line):
    """The command a dry-run line runs on its host: ssh's last argument."""
    return shlex.split(line)[-1]


def guarded(pidfile, command):
    """COMMAND as the script runs it on a host: under a guard that records its pid in
    PIDFILE and stops it (SIGTERM, SIGKILL 10 s later) when the ssh session's stdin closes
    or the guard is signalled (the guard itself is tested by the runs below)."""
    return (f"f={pidfile}; p= w=; h() {{ kill $p 2>/dev/null; i=0; while kill -0 $p 2>/dev/null && [ $i -lt 20 ]; "
            f"do sleep 0.5; i=$((i+1)); done; kill -9 $p 2>/dev/null; }}; "
            f"trap 'h; kill $w 2>/dev/null; rm -f \"$f\"' EXIT; trap 'exit 129' HUP; trap 'exit 130' INT; "
            f"trap 'exit 143' TERM; exec 3<&0 < /dev/null; {command} 3<&- & p=$!; echo $p > \"$f\"; "
            f"{{ while read -r _; do :; done <&3; h; }} > /dev/null 2>&1 & w=$!; exec 3<&-; wait $p")


def test_dry_run_prints_every_command_checks_first_then_workers_coordinator_report_and_stop(smollm2_path):
    first, second = (f"{r.start}:{r.end}" for r in read_layout(smollm2_path).balanced_ranges(2))
    lines = dry_run("--host-a", "alice@10.0.0.1", "--host-b", "bob@10.0.0.2", "--meshnet", "/opt/mn/bin/meshnet",
                    "--port", "6000", "--data-port", "6001", "--threads", "2", "--prompt", "It's a test",
                    "--max-tokens", "8")
    model_test = 'test -f "${MESHNET_HOME:-$HOME/.cache/meshnet}/models"/SmolLM2-135M-Instruct.Q4_1.gguf'
    stop = ('rm -rf /tmp/RUN-keys; for f in {}; do p=$(cat "$f" 2>/dev/null) || continue; kill "$p" 2>/dev/null; i=0; while kill -0 "$p" '
            '2>/dev/null && [ $i -lt 20 ]; do sleep 0.5; i=$((i+1)); done; kill -0 "$p" 2>/dev/null && kill -9 "$p"; '
            'rm -f "$f"; done; true')
    report = 'ps -o pid=,rss=,time= -p "$(cat /tmp/RUN-worker-{0}.pid 2>/dev/null)" 2>/dev/null; tail -n 20 /tmp/RUN-worker-{0}.log 2>/dev/null; true'
    worker = ("/opt/mn/bin/meshnet worker --coordinator tcp://10.0.0.1:6000 --model smollm2 --layers {} "
              "--data-bind tcp://{}:6001 --threads 2 --insecure > /tmp/RUN-worker-{}.log 2>&1")
    expected = [
        ("alice@10.0.0.1", "/opt/mn/bin/meshnet --version"),
        ("alice@10.0.0.1", model_test),
        ("bob@10.0.0.2", "/opt/mn/bin/meshnet --version"),
        ("bob@10.0.0.2", model_test),
        ("bob@10.0.0.2", guarded("/tmp/RUN-worker-b.pid", worker.format(second, "10.0.0.2", "b"))),
        ("alice@10.0.0.1", guarded("/tmp/RUN-worker-a.pid", worker.format(first, "10.0.0.1", "a"))),
        ("alice@10.0.0.1", guarded("/tmp/RUN-coordinator.pid", "/opt/mn/bin/meshnet coordinator --bind tcp://10.0.0.1:6000 "
                                   "--prompt 'It'\\''s a test' --max-tokens 8 --wait 120 --json --insecure")),
        ("alice@10.0.0.1", report.format("a")),
        ("bob@10.0.0.2", report.format("b")),
        ("alice@10.0.0.1", stop.format("/tmp/RUN-coordinator.pid /tmp/RUN-worker-a.pid")),
        ("bob@10.0.0.2", stop.format("/tmp/RUN-worker-b.pid")),
    ]
    assert len(lines) == len(expected)
    for line, (host, command) in zip(lines, expected):
        assert line.startswith(f"{SSH} {host} "), line
        assert remote(line) == command, line
    # nothing is installed anywhere: no package manager, no model download, no copying
    assert not [line for line in lines if re.search(r"\b(pip|apt|apt-get|install|ensure|curl|wget|scp|rsync)\b", line)]


def test_given_layers_a_model_path_the_environment_and_one_address_for_both_hosts():
    lines = dry_run(HOST_A="me@box", HOST_B="me@box", ADDR_A="192.168.1.5", ADDR_B="192.168.1.5",
                    MODEL="/models/my model.gguf", LAYERS="0:12,12:24", MESHNET_B="/other/meshnet", REMOTE_DIR="/var/tmp")
    commands = [remote(line) for line in lines]
    assert commands[1] == commands[3] == "test -f '/models/my model.gguf'"
    assert commands[2] == "/other/meshnet --version"
    # the same address twice: the second worker takes the next data port
    assert "--model '/models/my model.gguf' --layers 12:24 --data-bind tcp://192.168.1.5:5557" in commands[4]
    assert "; exec 3<&0 < /dev/null; /other/meshnet worker --coordinator tcp://192.168.1.5:5555 " in commands[4]
    assert commands[4].startswith("f=/var/tmp/RUN-worker-b.pid; ")
    assert "--layers 0:12 --data-bind tcp://192.168.1.5:5556" in commands[5]
    assert "> /var/tmp/RUN-worker-a.log 2>&1" in commands[5]
    assert "--prompt 'The capital of France is' --max-tokens 48" in commands[6]


def test_missing_or_bad_flags_are_refused_before_anything_runs():
    cases = [
        (["--host-b", "b@h"], "--host-a (or HOST_A) is missing"),
        (["--host-a", "a@h"], "--host-b (or HOST_B) is missing"),
        (["--host-a", "a@h", "--host-b", "b@h", "--port"], "--port needs a value"),
        (["--host-a", "a@h", "--host-b", "b@h", "--port", "x"], "--port must be a number, not 'x'"),
        (["--host-a", "a@h", "--host-b", "b@h", "--frobnicate"], "unknown argument '--frobnicate'"),
        (["--host-a", "a@h", "--host-b", "b@h", "--layers", "0:10,12:30"], "is not two ranges that meet"),
        (["--host-a", "a@h", "--host-b", "b@h", "--model", "/no/such.gguf"], "--layers (or LAYERS) is missing"),
    ]
    for args, message in cases:
        result = two_host("--dry-run", *args)
        assert result.returncode == 2, (args, result.stderr)
        assert message in result.stderr and result.stdout == "", (args, result.stderr)


def test_by_default_b_joins_with_a_s_token_without_the_model_and_the_token_is_never_on_a_command_line():
    lines = dry_run("--host-a", "a@10.0.0.1", "--host-b", "b@10.0.0.2", "--layers", LAYERS, INSECURE="0")
    commands = [(shlex.split(line)[-2], remote(line)) for line in lines if "cat > " not in line]
    # the model is looked for on A only: B fetches its layers' bytes from A
    assert [c for host, c in commands if c.startswith("test -f")] == [commands[1][1]] and commands[1][0] == "a@10.0.0.1"
    # the join line comes from A's own keys, for A's address
    assert ("a@10.0.0.1", "meshnet keys join-token --address tcp://10.0.0.1:5555") in commands
    sent = {}   # host -> {name there: file here}, each sent over ssh's stdin, never on a command line
    for line in lines:
        if "cat > " in line:
            command, source = line.rsplit(" < ", 1)
            host, there = shlex.split(command)[-2:]
            assert there.startswith("umask 077 && mkdir -p /tmp/RUN-keys"), there
            sent.setdefault(host, {})[there.rsplit("cat > /tmp/RUN-keys/", 1)[1]] = source
    assert set(sent) == {"a@10.0.0.1", "b@10.0.0.2"}
    assert all(names == {"join-token": sent["a@10.0.0.1"]["join-token"]} for names in sent.values())
    assert not [c for _, c in commands if "--insecure" in c or "mnj1-" in c or "--join" in c]
    worker_b, worker_a, coordinator = (c for _, c in commands if " worker " in c or " coordinator " in c)
    read_token = 'MESHNET_JOIN="$(cat /tmp/RUN-keys/join-token)" meshnet worker --coordinator tcp://10.0.0.1:5555 '
    assert read_token + "--layers 19:30 " in worker_b and "--model" not in worker_b
    assert read_token + "--model smollm2 --layers 0:19 " in worker_a
    assert "--json --model smollm2 3<&- &" in coordinator   # with its keys, serving the model's bytes
    assert all(c.startswith("rm -rf /tmp/RUN-keys; ") for _, c in commands[-2:])   # the token goes with the processes


def test_without_keys_only_when_told_the_network_is_trusted_and_said_out_loud():
    told = two_host("--host-a", "a@h", "--host-b", "b@h", "--layers", LAYERS, "--dry-run", "--insecure", INSECURE="0")
    assert told.returncode == 0 and all("--insecure" in line for line in told.stdout.splitlines()
                                        if " worker " in line or " coordinator " in line)
    assert "cat > " not in told.stdout and "join-token" not in told.stdout


def test_the_layers_must_cover_the_model_it_has_here(smollm2_path):
    n_layer = read_layout(smollm2_path).n_layer
    result = two_host("--host-a", "a@h", "--host-b", "b@h", "--layers", f"0:10,10:{n_layer - 1}", "--dry-run")
    assert result.returncode == 2 and f"does not end at the model's {n_layer} layers" in result.stderr


# through an ssh stand-in: each "host" is this machine


def fake_ssh(tmp_path):
    ssh = tmp_path / "ssh"
    ssh.write_text('#!/bin/sh\n# drops the options and the destination, runs the command here\n'
                   'while [ "$1" = -o ]; do shift 2; done\nshift\nexec sh -c "$*"\n')
    ssh.chmod(0o755)
    return str(ssh)


def hosts(tmp_path, **flags):
    args = ["--host-a", "a@127.0.0.1", "--host-b", "b@127.0.0.1", "--threads", "1", "--remote-dir", str(tmp_path),
            "--meshnet", str(Path(sys.executable).with_name("meshnet"))]
    for flag, value in flags.items():
        args += [f"--{flag.replace('_', '-')}", str(value)]
    return args


def test_a_run_through_an_ssh_stand_in_joins_b_by_token_generates_over_curve_reports_and_stops_everything(tmp_path,
                                                                                                          smollm2_path):
    local = tmp_path / "here"
    local.mkdir()
    home = tmp_path / "home"   # both "hosts" keep their keys and B's fetched bytes here
    result = two_host(*hosts(tmp_path, port=free_port(), data_port=free_port(width=2), max_tokens=12, wait=ROUTE_WAIT_S,
                             model=smollm2_path),
                      SSH=fake_ssh(tmp_path), INSECURE="0", TMPDIR=str(local), MESHNET_HOME=str(home),
                      timeout=RUN_BOUND_S, logs=tmp_path)
    assert result.returncode == 0, result.stderr
    # (two_host has checked that no process of the run is left, on either "host")
    output = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(output["tokens"]) == 12 and output["metrics"]["stages"] == [
        [r.start, r.end] for r in read_layout(smollm2_path).balanced_ranges(2)]
    # every link as ZeroMQ reports it: the coordinator's two sockets, each stage's control,
    # data and the pushes it opened for the session (to the next stage, the coordinator and,
    # from the tail, the head), closed since
    links = [output["mechanisms"]["control"], output["mechanisms"]["data"]]
    for stage in output["stages"]:
        mechanisms = stage["mechanisms"]
        assert set(mechanisms["pushes_opened"]) == {"CURVE"}, mechanisms
        links += [mechanisms["control"], mechanisms["data"]]
        links += [m for m, count in mechanisms["pushes_opened"].items() for _ in range(count)]
    assert len(links) >= 8 and set(links) == {"CURVE"}, output["stages"]
    assert f"two-host: links: CURVE on all {len(links)}" in result.stderr
    assert not list(local.iterdir()) and not list(tmp_path.glob("*-keys"))   # the token, here and there, is gone
    # B fetched its layers' bytes (the tail's), not the file
    fetched = next((home / "models" / "mesh").glob("*/*.gguf"))
    assert fetched.stat().st_blocks * 512 < 0.9 * Path(smollm2_path).stat().st_size
    assert re.search(r"two-host: 12 tokens after a \d+-token prompt; .* decode [\d.]+ tok/s, hop p50 \d+ us",
                     result.stderr)
    pids = [int(m) for m in re.findall(r"^ *(\d+) +\d+ +[\d:-]+$", result.stderr, re.M)]
    if shutil.which("ps"):
        assert len(pids) == 2, result.stderr   # each worker's pid, RSS and CPU time
    for pid in pids:   # stopped, and their pid files gone
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
    assert not list(tmp_path.glob("*.pid"))


def test_a_host_without_meshnet_or_the_model_stops_the_run_before_anything_starts(tmp_path, smollm2_path):
    result = two_host(*hosts(tmp_path, meshnet="/no/meshnet"), SSH=fake_ssh(tmp_path), timeout=RUN_BOUND_S)
    assert result.returncode == 3
    assert "no meshnet at '/no/meshnet' on a@127.0.0.1" in result.stderr and "installs nothing" in result.stderr
    empty = tmp_path / "home"
    empty.mkdir()
    layers = ",".join(f"{r.start}:{r.end}" for r in read_layout(smollm2_path).balanced_ranges(2))
    result = two_host(*hosts(tmp_path, layers=layers), SSH=fake_ssh(tmp_path), MESHNET_HOME=str(empty),
                      timeout=RUN_BOUND_S)
    assert result.returncode == 3
    assert "model 'smollm2' is not on a@127.0.0.1" in result.stderr and "installs nothing" in result.stderr
    assert not list(tmp_path.glob("*.log")) and not list(tmp_path.glob("*.pid"))


def test_a_run_stopped_with_sigterm_mid_run_leaves_no_process_on_any_host_and_no_key(tmp_path, smollm2_path):
    """SIGTERM to the script alone while its coordinator waits: everything it started, on
    both "hosts", is gone within a bound (and its keys, here and there), where it used to
    act only once the coordinator had ended and leave the workers behind when killed."""
    local = tmp_path / "here"
    local.mkdir()
    head = read_layout(smollm2_path).balanced_ranges(2)[0]
    first = f"{head.start}:{head.end}"
    # host B's worker cannot bind its address and ends: the route never forms and the
    # coordinator waits, with host A's worker registered, until it is stopped
    args = hosts(tmp_path, port=free_port(), data_port=free_port(), addr_b="192.0.2.1", wait=ROUTE_WAIT_S)
    mark = uuid.uuid4().hex
    env = environment(SSH=fake_ssh(tmp_path), INSECURE="0", TMPDIR=str(local), **{MARK: mark})

    def said():
        logs = "".join(f"--- {log.name}:\n{log.read_text(errors='replace')}" for log in tmp_path.glob("*.log"))
        return f"--- its stderr:\n{(tmp_path / 'stderr').read_text()}{logs}"

    def running(*words):   # the process itself, not the shell (its guard) that names it
        return [pid for pid, command in marked(mark)
                if all(w in command for w in words) and not command.startswith(("sh ", "/bin/sh "))]
    with open(tmp_path / "stdout", "w") as out, open(tmp_path / "stderr", "w") as err:
        script = subprocess.Popen([str(SCRIPT), *args], env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                  start_new_session=True)
        try:
            deadline = time.monotonic() + RUN_BOUND_S
            while not (running(" worker ", f"--layers {first} ") and running(" coordinator --bind ")):
                assert script.poll() is None, f"the script ended ({script.returncode}) before its worker started\n{said()}"
                assert time.monotonic() < deadline, f"the worker and coordinator never started\n{said()}"
                time.sleep(0.2)
            while not (list(tmp_path.glob("*-worker-a.pid")) and list(tmp_path.glob("*-coordinator.pid"))):
                assert time.monotonic() < deadline, f"their pids were never recorded\n{said()}"
                time.sleep(0.2)
            started = marked(mark)
            os.kill(script.pid, signal.SIGTERM)
            stopped = time.monotonic()
            while (script.poll() is None or marked(mark)) and time.monotonic() - stopped < STOPPED_BOUND_S:
                time.sleep(0.2)
            left = marked(mark)
            assert script.poll() is not None and not left, (
                f"{STOPPED_BOUND_S} s after SIGTERM the script is {'gone' if script.poll() is not None else 'running'} "
                f"and these processes of its run are left: {left} (of {started})\n{said()}")
        finally:
            if script.poll() is None:
                stop_group(script)
            left_behind(mark, 0)
    assert script.returncode == 143, said()
    assert "two-host: stopping what this run started" in said()
    assert not list(local.iterdir()) and not list(tmp_path.glob("*-keys"))   # the token, here and there, is gone
    assert not list(tmp_path.glob("*.pid"))
