"""Joining a mesh without handing the token to every local user, and with addresses a
worker can only connect to: a real `meshnet coordinator` with its keys (a MESHNET_HOME of
its own) and real `meshnet worker`s. The join line it prints puts the token in the
worker's environment, and run as printed (or with --join-file) no process has the token
in its command line, which `ps` shows every user; --join on a command line says so. A
token's addresses are tcp:// only: anything else is a bad_address at once, when the
token is made and when it is read. A token's addresses are tried all at once, so dead
ones cost one silence, not one each."""

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest
import zmq.utils.z85

from meshnet.net import join
from meshnet.net.join import MAX_ADDRESSES

from conftest import MARK, TEST_MODELS, THREADS, marked, run_bounded, stop_group, track
from peers import free_port, wait_until

MODEL = os.path.join(TEST_MODELS, "llama-dense.gguf")   # a generated model of 4 layers (make test-models)
PROBE_S = 3.0    # how long a worker waits on each address of a token naming several (launch/joining.py)
WAIT_S = 60.0    # a loaded 2-core machine's bound for a process to start and say what it does


def env_with(**extra) -> dict:
    # the venv's `meshnet` script, as the printed line names it
    path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    return {**os.environ, "PATH": path, **extra}


class Coordinator:
    """`meshnet coordinator` on loopback with keys under HOME, its stderr's lines kept."""

    def __init__(self, home):
        self.address = f"tcp://127.0.0.1:{free_port()}"
        self.process = track(subprocess.Popen(
            [sys.executable, "-m", "meshnet.cli.main", "coordinator", "--bind", self.address],
            env=env_with(MESHNET_HOME=str(home)), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True, start_new_session=True))
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.process.stderr), daemon=True).start()
        assert wait_until(lambda: any("meshnet worker" in line for line in self.lines), WAIT_S), self.lines
        self.join_line = next(line for line in self.lines if "meshnet worker" in line).strip()

    def routes(self) -> int:
        return sum(line.startswith("route ") for line in self.lines)

    def close(self):
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(30)
        finally:
            stop_group(self.process)


@pytest.fixture
def coordinator(tmp_path):
    assert os.path.isfile(MODEL), f"{MODEL} is missing: run `make test-models` (make test does)"
    c = Coordinator(tmp_path / "a")
    yield c
    c.close()


WORKER_ARGS = ["--layers", "0:4", "--model", MODEL, "--threads", str(THREADS), "--ctx", "256"]


def start(args, log, **env):
    """A worker process, its stderr in LOG, carrying a mark of its own in its environment:
    (process, mark). ARGS: its argv, or a line typed into a shell (sh reads it from its
    input, as from a terminal, so the line is no process's argument)."""
    mark = uuid.uuid4().hex
    typed = isinstance(args, str)
    process = track(subprocess.Popen(["sh"] if typed else args, env=env_with(**{MARK: mark}, **env),
                                     stdin=subprocess.PIPE if typed else subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=open(log, "w"), start_new_session=True))
    if typed:
        process.stdin.write(f"{args}\n".encode())
        process.stdin.close()
    return process, mark


def joined(coordinator, routes_before, process, log) -> None:
    """The worker registered with the coordinator: a route line more than before."""
    assert wait_until(lambda: coordinator.routes() > routes_before or process.poll() is not None, WAIT_S)
    assert process.poll() is None and coordinator.routes() > routes_before, (log.read_text(), coordinator.lines)


def environ(pid: int) -> list[bytes]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return f.read().split(b"\0")


def test_the_printed_join_line_keeps_the_token_off_every_command_line_and_joins(coordinator, tmp_path):
    line = coordinator.join_line
    found = re.fullmatch(r"MESHNET_JOIN=(mnj1-[\w-]+) meshnet worker --mem 8G", line)
    assert found and "--join" not in line, line
    token = found.group(1)
    assert join.parse_token(token).addresses == (coordinator.address,)

    # the line run as printed, on a machine of its own (an empty MESHNET_HOME; the model given)
    log = tmp_path / "printed.log"
    before = coordinator.routes()
    process, mark = start(f"{line} {' '.join(WORKER_ARGS)}", log, MESHNET_HOME=str(tmp_path / "b"))
    try:
        joined(coordinator, before, process, log)
        processes = marked(mark)
        assert any(" worker " in command for _, command in processes), processes
        # what `ps` shows every user holds no token; the worker's own environment, readable by its user alone, does
        assert not [command for _, command in processes if "mnj1-" in command], processes
        assert any(f"MESHNET_JOIN={token}".encode() in environ(pid) for pid, command in processes
                   if " worker " in command)
        assert "WARNING" not in log.read_text()
    finally:
        stop_group(process)

    # from a file: --join-file
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    log = tmp_path / "file.log"
    before = coordinator.routes()
    process, mark = start([sys.executable, "-m", "meshnet.cli.main", "worker", "--join-file", str(token_file),
                           *WORKER_ARGS], log, MESHNET_HOME=str(tmp_path / "c"))
    try:
        joined(coordinator, before, process, log)
        assert not [command for _, command in marked(mark) if "mnj1-" in command]
        assert "WARNING" not in log.read_text()
    finally:
        stop_group(process)

    # on the command line it still joins, and says who else can read it
    log = tmp_path / "argv.log"
    before = coordinator.routes()
    process, _ = start([sys.executable, "-m", "meshnet.cli.main", "worker", "--join", token, *WORKER_ARGS], log,
                       MESHNET_HOME=str(tmp_path / "d"))
    try:
        joined(coordinator, before, process, log)
        warning = next(line for line in log.read_text().splitlines() if line.startswith("WARNING"))
        assert "--join on the command line" in warning and "MESHNET_JOIN" in warning and "--join-file" in warning
    finally:
        stop_group(process)


def keys_join_token(*args, home):
    return run_bounded([sys.executable, "-m", "meshnet.cli.main", "keys", "join-token", *args], timeout=WAIT_S,
                       env=env_with(MESHNET_HOME=str(home)))


def test_keys_join_token_prints_the_environment_line(tmp_path):
    made = keys_join_token("--address", "tcp://10.0.0.1:5555", home=tmp_path)
    assert made.returncode == 0, made.stderr
    assert re.fullmatch(r"MESHNET_JOIN=mnj1-[\w-]+ meshnet worker --mem 8G\n", made.stdout), made.stdout


NOT_TCP = ["udp://127.0.0.1:5555", "ipc:///tmp/meshnet-join.sock", "inproc://join", "tcp://127.0.0.1:0"]


@pytest.mark.parametrize("address", NOT_TCP)
def test_a_token_is_not_made_with_an_address_that_is_not_a_tcp_host_and_port(address, tmp_path):
    made = keys_join_token("--address", address, home=tmp_path)
    assert made.returncode == 2 and f"error: [bad_address] --address {address!r}" in made.stderr, made.stderr
    assert "Traceback" not in made.stderr and "mnj1-" not in made.stdout


@pytest.mark.parametrize("address", NOT_TCP)
def test_a_worker_refuses_a_token_naming_an_address_that_is_not_a_tcp_host_and_port(address, tmp_path):
    # a token made elsewhere (by another version, or by hand): refused as read, before any connection is tried
    forged = join.Token((address,), zmq.utils.z85.encode(bytes(range(32))),
                        zmq.utils.z85.encode(bytes(range(32, 64)))).encode()
    run = run_bounded([sys.executable, "-m", "meshnet.cli.main", "worker", *WORKER_ARGS], timeout=WAIT_S,
                      env=env_with(MESHNET_HOME=str(tmp_path), MESHNET_JOIN=forged))
    assert run.returncode == 2, run.stderr
    assert f"error: [bad_address] the join token's address {address!r}" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr


def dead_addresses(n: int) -> list[str]:
    """N loopback addresses where nothing listens: a connection to each is refused, and a
    ZeroMQ peer there never answers."""
    return [f"tcp://127.0.0.1:{free_port()}" for _ in range(n)]


def test_a_token_s_addresses_are_tried_at_once_so_dead_ones_cost_one_silence(coordinator, tmp_path):
    real = join.parse_token(coordinator.join_line.split()[0].split("=", 1)[1])
    # the most a token names, the live one last: one after another, it would be tried 45 s in
    many = join.Token((*dead_addresses(MAX_ADDRESSES - 1), coordinator.address), real.coordinator_key,
                      real.join_secret)
    log = tmp_path / "b.log"
    before = coordinator.routes()
    started = time.monotonic()
    process, _ = start([sys.executable, "-m", "meshnet.cli.main", "worker", *WORKER_ARGS], log,
                       MESHNET_HOME=str(tmp_path / "b"), MESHNET_JOIN=many.encode())
    try:
        # it loads its layers once it found the coordinator: before the dead addresses in turn could have gone by
        serial = (MAX_ADDRESSES - 1) * PROBE_S
        assert wait_until(lambda: "loading layers" in log.read_text() or process.poll() is not None, serial)
        assert "loading layers" in log.read_text(), (time.monotonic() - started, log.read_text())
        joined(coordinator, before, process, log)
    finally:
        stop_group(process)

    # none alive: the worker says so after one silence, not sixteen (48 s)
    dead = join.Token(tuple(dead_addresses(MAX_ADDRESSES)), real.coordinator_key, real.join_secret)
    run = run_bounded([sys.executable, "-m", "meshnet.cli.main", "worker", *WORKER_ARGS],
                      timeout=(MAX_ADDRESSES - 1) * PROBE_S,
                      env=env_with(MESHNET_HOME=str(tmp_path / "c"), MESHNET_JOIN=dead.encode()))
    assert run.returncode == 4 and "error: [unreachable] no coordinator answered at" in run.stderr, run.stderr
    assert all(address in run.stderr for address in dead.addresses)
