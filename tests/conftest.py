"""Shared fixtures: the real models, installed and checked by meshnet.engine.models; and the
command line as a user runs it."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid

import pytest

from meshnet.engine import models

THREADS = 2  # parity is exact for the same thread count

# No coordinator a test starts announces itself by mDNS on this machine's real interfaces:
# the tests of discovery do it inside network namespaces of their own, and say so.
os.environ["MESHNET_ANNOUNCE"] = "0"

# The default run downloads nothing: it runs on the generated models (make test-models).
# Tests of the real models, which come from PyPI, run only when this is set (make test sets it).
REAL_MODELS = os.environ.get("MESHNET_ENABLE_REAL_INFERENCE_TESTS") == "1"


def real_model(name: str) -> str:
    if not REAL_MODELS:
        pytest.skip("a real model from PyPI: set MESHNET_ENABLE_REAL_INFERENCE_TESTS=1 (make test does)")
    return str(models.ensure(name))


@pytest.fixture(scope="session")
def smollm2_path():
    return real_model("smollm2")


@pytest.fixture(scope="session")
def qwen_path():
    return real_model("qwen2.5-coder-1.5b")


@pytest.fixture(scope="session")
def gemma3_path():
    """A real model of an architecture beyond llama and qwen2: Gemma 3 270M (sliding-window
    attention, a 262k vocabulary), from its PyPI chunk packages."""
    return real_model("gemma3-270m")


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The tests interrupt the processes they start (Ctrl-C: SIGINT) and expect them to stop. A
# suite started in the background of a script (`make test &`) inherits SIGINT ignored, and
# an ignored signal stays ignored across exec, in every child: Python's own handler here
# gives each child the default again
signal.signal(signal.SIGINT, signal.default_int_handler)
TEST_MODELS = os.path.join(ROOT, "build", "test-models", "models")
DENSE_ARCHS = ("llama", "qwen2", "qwen3")   # a few generated dense models, for the tests that need one


def read_arch_table():
    """engine_c/architectures.tsv, through tools/arch_table.py (the README's writer)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("arch_table", os.path.join(ROOT, "tools", "arch_table.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("arch_table", module)   # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def generated_models() -> dict:
    """Every random-weight model `make test-models` wrote (the pin's tests/test-llama-archs.cpp
    with 4 layers: F32 weights, a 128-token vocabulary): {file stem, as 'llama-dense': path}."""
    if not os.path.isdir(TEST_MODELS):
        return {}
    return {name[:-len(".gguf")]: os.path.join(TEST_MODELS, name)
            for name in sorted(os.listdir(TEST_MODELS)) if name.endswith(".gguf")}


def generated_model_copy(tmp_path, stem: str = "llama-dense"):
    """A copy of a generated model of the test's own, under TMP_PATH/a: tests that change
    its bytes (a holder's, a liar's) leave the shared one as it is."""
    import shutil

    source = os.path.join(TEST_MODELS, f"{stem}.gguf")
    assert os.path.isfile(source), f"{source} is missing: run `make test-models` (make test does)"
    copy = tmp_path / "a" / f"{stem}.gguf"
    copy.parent.mkdir(parents=True)
    shutil.copyfile(source, copy)
    return copy


def model_arch(stem: str) -> str:
    return re.sub(r"-(dense|moe)$", "", stem)


@pytest.fixture(scope="session")
def arch_models() -> dict:
    """The generated models, by architecture (the dense one where there are both): {arch: path}."""
    found = generated_models()
    assert found, f"no generated models in {TEST_MODELS}: run `make test-models` (make test does)"
    out = {}
    for stem, path in found.items():
        out.setdefault(model_arch(stem), path)
    return out


def meshnet(*args, timeout=300):
    """`meshnet ARGS...` in a process of its own, its output captured (bounded: see run_bounded)."""
    return run_bounded([sys.executable, "-m", "meshnet.cli.main", *args], timeout=timeout)


def last_json_line(stdout):
    return json.loads(stdout.strip().splitlines()[-1])


# every process a test starts ends with it

MARK = "MESHNET_TEST_RUN"   # in the environment of a bounded run and so of everything it starts
_started = []               # the processes the helpers here and in peers.py started, in order


def track(process):
    """Kill PROCESS at the end of the test that started it, if it is still running then."""
    _started.append(process)
    return process


@pytest.fixture(autouse=True)
def _no_process_outlives_the_test_that_started_it():
    before = len(_started)   # those of broader fixtures, set up first, are theirs to stop
    yield
    for process in _started[before:]:
        if process.poll() is None:
            process.kill()
            process.wait(30)
    del _started[before:]


def marked(mark):
    """[(pid, command line)] of the living processes whose environment has MARK=mark."""
    needle = f"{MARK}={mark}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue   # (a zombie's environment is empty)
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                found.append((int(entry), f.read().replace(b"\0", b" ").decode(errors="replace").strip()))
        except OSError:
            continue   # gone meanwhile, or not ours to read
    return found


def left_behind(mark, within):
    """The processes of MARK still living WITHIN seconds from now (at once when none are),
    killed (SIGKILL) if there are any: what a run left behind."""
    deadline = time.monotonic() + within
    while (left := marked(mark)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid, _ in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def stop_group(process, grace=10):
    """SIGTERM to PROCESS's whole process group, SIGKILL to it GRACE s later (sooner once the
    leader is gone, as its children may not be)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            pass
        if sig == signal.SIGTERM:
            try:
                process.wait(grace)
            except subprocess.TimeoutExpired:
                pass
    process.wait()


def run_bounded(args, *, timeout, env=None, grace=30, context=None):
    """ARGS as a process group and session of its own, its output captured, never for
    longer than TIMEOUT s: past it the whole group is stopped (stop_group), every process
    carrying the run's mark killed too, and the test fails with what it had said (and
    CONTEXT(), where given: its logs, say). Ended in time, it must leave no process behind
    (they have GRACE s to go): the test fails naming any that stayed, killed then."""
    mark = uuid.uuid4().hex
    env = {**(os.environ if env is None else env), MARK: mark}
    process = subprocess.Popen(args, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_group(process)
        left = left_behind(mark, 0)
        try:
            stdout, stderr = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:   # something outside the group holds its pipes
            stdout, stderr = "", "(its output could not be read)"
        extra = context() if context else ""
        pytest.fail(f"{args[0]} did not end within {timeout} s: its process group was stopped"
                    + (f", and these processes of it killed: {left}" if left else "")
                    + f"\n--- its stderr:\n{stderr}\n--- its stdout:\n{stdout}" + (f"\n{extra}" if extra else ""),
                    pytrace=False)
    except BaseException:
        stop_group(process)
        left_behind(mark, 0)
        raise
    left = left_behind(mark, grace)
    if left:
        pytest.fail(f"{args[0]} ended (status {process.returncode}) but these processes it started were still "
                    f"running {grace} s later (killed now): {left}\n--- its stderr:\n{stderr}", pytrace=False)
    return subprocess.CompletedProcess(args, process.returncode, stdout, stderr)


@contextlib.contextmanager
def serving(*args, env=None, ready_within=300):
    """`meshnet serve --port 0 ARGS...` in a process group of its own, yielding (its base
    URL, the lines of its stderr so far, its pid) once /health says ready; stopped with Ctrl-C
    after, its group with it, and it must have printed no traceback (no request made it
    fail with a 500)."""
    process = subprocess.Popen([sys.executable, "-m", "meshnet.cli.main", "serve", "--port", "0", *args], env=env,
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    lines, found = [], []

    def read():   # the workers' stderr passes through here too
        for line in process.stderr:
            lines.append(line)
            if not found:
                found.extend(re.findall(r"meshnet serve: \S+ on (http://127\.0\.0\.1:\d+)/v1", line))
    threading.Thread(target=read, daemon=True).start()
    try:
        deadline = time.monotonic() + ready_within
        while not found or not _ready(found[0]):
            assert time.monotonic() < deadline and process.poll() is None, "".join(lines)
            time.sleep(0.1)
        yield found[0], lines, process.pid
    finally:
        process.send_signal(signal.SIGINT)   # Ctrl-C: the server, then its workers, stop cleanly
        try:
            assert process.wait(timeout=120) == 0, "".join(lines)
        finally:
            stop_group(process)
    assert "Traceback" not in "".join(lines), "".join(lines)


def post_json(url, path, body, key=None, timeout=60):
    """POST a body (bytes as they are, or an object as JSON) to a server this test started,
    with KEY as its bearer token: the status and the JSON answer."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url + path, data=data, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _ready(url) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=10) as response:
            return json.loads(response.read())["status"] == "ready"
    except (urllib.error.URLError, OSError, ValueError):   # 503 until a route forms, or not listening yet
        return False


def whole_model_tokens(path, prompt: str, n_tokens: int, n_ctx: int = 1024):
    """(the prompt's tokens, the whole model's greedy continuation of them) in this
    process: what a route of any split must give."""
    from meshnet.engine.gguf_layout import read_layout
    from meshnet.engine.pipeline import LocalPipeline

    with LocalPipeline(path, [(0, read_layout(path).n_layer)], n_ctx=n_ctx, max_sessions=1, n_threads=THREADS) as whole:
        tokens = whole.head.tokenize(prompt)
        return tokens, whole.generate(tokens, n_tokens, stop_at_eog=False).tokens


# The unit layer's promise, held while each test of tests/unit runs: no socket, no thread,
# no ZeroMQ, no engine library. A unit test that reaches for one fails, naming it; such a
# test belongs beside the engine and the processes. (Here, not in a conftest of its own:
# two conftest modules would both be `conftest` to the tests that import its helpers.)
UNIT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "unit")


def _refuse(what: str):
    def refused(*args, **kwargs):
        raise AssertionError(f"a unit test opened {what}: move it out of tests/unit")
    return refused


@pytest.fixture(autouse=True)
def pure_logic_only_in_unit_tests(request, monkeypatch):
    if not str(request.node.path).startswith(UNIT_DIR + os.sep):
        yield
        return
    import socket

    import zmq

    from meshnet.engine import binding

    monkeypatch.setattr(socket, "socket", _refuse("a socket"))
    monkeypatch.setattr(zmq, "Context", _refuse("a ZeroMQ context"))
    monkeypatch.setattr(threading.Thread, "start", _refuse("a thread"))
    monkeypatch.setattr(binding, "library", _refuse("the engine library"))
    yield


# The layers, one folder each, and a marker each, so that `pytest -m "not system"` or
# `pytest -m unit` picks a layer wherever its tests are named
LAYERS = ("unit", "engine", "process", "system")


def pytest_collection_modifyitems(config, items):
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        layer = os.path.relpath(str(item.path), tests_dir).split(os.sep)[0]
        if layer not in LAYERS:
            raise pytest.UsageError(f"{item.nodeid}: every test lives in one of tests/{{{','.join(LAYERS)}}}")
        item.add_marker(getattr(pytest.mark, layer))
