"""Weights over the mesh against hostile peers and a full disk (issue 46, item 3), on
loopback with real worker processes, real holders and real coordinators. The hostile
parties are a worker that serves a changed copy under the model's sha256, a coordinator
that vouches for one, a token holder that floods a holder and never reads, a holder that
stops answering, and a coordinator that sends manifests past every bound; each speaks the
real protocol. What they may no longer do: give a fetching worker the hashes it checks
against (only the coordinator it authenticated vouches for them, having hashed the file
itself), make a later fetch reuse bytes checked against other hashes, grow a holder
without bound or silence it, stay listed when silent, make a worker write past a disk's
room or leave what it wrote, print forged lines, or fetch a byte twice. Nor may a holder
stop the coordinator's probing (at an endpoint libzmq refuses, or slow while its copy is
hashed), cost it more than its header's bytes to read that header, hold its hashing below
1 MiB/s, or be asked again at each worker's question after it failed; and without a token
a worker fetches nothing. A worker that joins before any holder waits for one, for a
bounded time, however long the coordinator's hashing."""

import collections
import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from meshnet.core import errors as E
from meshnet.core.errors import MeshnetError
from meshnet.engine import models
from meshnet.engine.gguf_layout import read_layout
from meshnet.engine.pipeline import LocalPipeline
from meshnet.launch.joining import join_mesh
from meshnet.launch.mesh_host import MeshHost
from meshnet.net import join
from meshnet.net import protocol as P
from meshnet.net import security
from meshnet.route.config import CoordinatorConfig
from meshnet.core.layers import LayerRange
from meshnet.route.coordinator import Coordinator
from meshnet.weights import manifest as manifests
from meshnet.weights import vouch
from meshnet.weights.fetch import Fetch, HolderAddress, HolderFailed
from meshnet.weights.holder import Holder
from meshnet.weights.manifest import HEADER, Manifest, Span, compute, remember
from meshnet.weights.vouch import Voucher, check_holder

from conftest import TEST_MODELS, THREADS, generated_model_copy, track
from peers import capability, free_port, rss_kib, wait_until

MODEL = "llama-dense"     # a generated model of 4 layers (make test-models), 9 MB
PROMPT = [1, 5, 9, 13, 17, 21, 25, 29]
N_TOKENS = 12


@pytest.fixture
def model_file(tmp_path):
    return generated_model_copy(tmp_path, MODEL)


class Mesh:
    """A coordinator in this process with this test's keys; with MODEL_FILE it holds the
    model's bytes, without one only the workers that join with the file do."""

    def __init__(self, tmp_path: Path, model_file: Path | None = None):
        held = (model_file, models.resolve(str(model_file))[1]) if model_file is not None else None
        self.host = MeshHost("tcp://127.0.0.1:0", model=held, keys_dir=tmp_path / "coordinator-keys")
        self.coordinator = Coordinator(CoordinatorConfig("tcp://127.0.0.1:0", **self.host.coordinator_options()))
        self.host.started(self.coordinator.endpoint, announce=False)

    def token(self) -> join.Token:
        return self.host.token()

    def close(self):
        self.coordinator.close()
        self.host.close()


@pytest.fixture
def meshes(tmp_path, monkeypatch):
    # the coordinators in this process keep what they vouched for in a MESHNET_HOME of the test's
    monkeypatch.setenv("MESHNET_HOME", str(tmp_path / "coordinator-home"))
    made = []
    yield lambda *args: made.append(Mesh(*args)) or made[-1]
    for mesh in reversed(made):
        mesh.close()


def worker(home: Path, token: join.Token, *args, log: Path, prefix: tuple = ()) -> subprocess.Popen:
    """`meshnet worker` with the token in its environment and a MESHNET_HOME of its own."""
    home.mkdir(parents=True, exist_ok=True)
    return track(subprocess.Popen(
        [*prefix, sys.executable, "-m", "meshnet.cli.main", "worker", "--threads", str(THREADS), "--ctx", "256",
         "--max-sessions", "2", *args],
        env={**os.environ, "MESHNET_HOME": str(home), "MESHNET_JOIN": token.encode()}, stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=open(log, "w"), start_new_session=True))


def text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def stop(process):
    """SIGTERM, then SIGKILL to every process of its group: each is started in a session of
    its own, and under unshare (on_a_small_disk) the process tracked is a shell whose child
    is the worker, which a SIGKILL of the shell alone would leave running."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            pass
    kill_group(process)


def kill_group(process):
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(30)


def whole_model(path):
    with LocalPipeline(str(path), [(0, read_layout(str(path)).n_layer)], n_ctx=256, max_sessions=1,
                       n_threads=THREADS) as whole:
        done = whole.generate(PROMPT, N_TOKENS, stop_at_eog=False, keep_logits=True)
        return done.tokens, done.logits


def same_as_whole_model(coordinator, path) -> None:
    session = coordinator.generate(PROMPT, N_TOKENS, stop_at_eog=False, want_logits=True).result(120)
    want_tokens, want_logits = whole_model(path)
    assert session.tokens == want_tokens
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(session.logits, want_logits)) == 0.0


def fetched_file(home: Path, sha256: str, name: str) -> Path:
    return home / "models" / "mesh" / sha256 / name


def changed_copy(model_file: Path, path: Path, tensor_prefix: str) -> Span:
    """A copy of the model with one byte of a tensor of TENSOR_PREFIX flipped: a valid GGUF of
    the same shape, another file. The tensor is returned."""
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(model_file, path)
    victim = next(s for s in compute(model_file, "0" * 64).tensors if s.name.startswith(tensor_prefix) and s.size)
    with open(path, "r+b") as f:
        f.seek(victim.offset + victim.size // 2)
        byte = f.read(1)
        f.seek(victim.offset + victim.size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    return victim


def claim_sha256(home: Path, path: Path, sha256: str) -> None:
    """A hostile machine's own record (its MESHNET_HOME/hashes) says the file at PATH has
    SHA256: meshnet on that machine then believes it, as it believes its own records."""
    st = path.stat()
    entry = home / "hashes" / f"{hashlib.sha256(str(path.resolve()).encode()).hexdigest()}.json"
    entry.parent.mkdir(parents=True, exist_ok=True)
    entry.write_text(json.dumps({"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                                 "ctime_ns": st.st_ctime_ns, "sha256": sha256}))


def holders_info(coordinator_endpoint: str, token: join.Token) -> dict:
    """The coordinator's answer to HOLDERS (its info), asked as a joining worker asks."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    security.client(sock, token.keys, token.coordinator_key)
    sock.connect(coordinator_endpoint)
    try:
        sock.send_multipart(P.encode(P.HOLDERS, 1))
        assert sock.poll(15_000), "the coordinator did not answer HOLDERS"
        return P.decode(sock.recv_multipart(), 64 << 20)["info"]
    finally:
        sock.close()
        ctx.term()


def listed_holders(coordinator_endpoint: str, token: join.Token) -> list[str]:
    """The endpoints the coordinator's answer to HOLDERS lists."""
    return [endpoint for endpoint, _ in holders_info(coordinator_endpoint, token)["holders"]]


@functools.cache
def user_namespaces() -> bool:
    """Whether unshare(1) exists and may make the namespaces on_a_small_disk needs: where
    unprivileged user namespaces are off it exists and fails."""
    try:
        return subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], stdin=subprocess.DEVNULL,
                              capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def on_a_small_disk(home: Path, size: str, listing: Path) -> tuple:
    """A command prefix: what follows runs with HOME on a tmpfs of SIZE of its own (a mount
    namespace of its own), and the files left there afterwards are written to LISTING as
    'SIZE BLOCKS PATH' lines."""
    if not user_namespaces():
        pytest.skip("needs unprivileged user and mount namespaces (unshare --user --map-root-user --mount) for a "
                    "small filesystem of the test's own")
    home.mkdir(parents=True, exist_ok=True)
    # the command runs as a child, so that a SIGTERM to this shell stops it and the listing is still made
    script = ('mount -t tmpfs -o size="$1" meshnet-test "$2" || exit 99; home=$2; listing=$3; shift 3; '
              '"$@" & child=$!; trap \'kill -TERM $child\' TERM; wait $child; rc=$?; '
              'while kill -0 $child 2>/dev/null; do wait $child; rc=$?; done; '
              'find "$home" -type f -printf "%s %b %p\\n" > "$listing"; exit $rc')
    return ("unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, "sh", size, str(home),
            str(listing))


# ---- W1: the hashes a worker checks against come from the coordinator, never a holder ----


def test_a_holder_serving_a_changed_copy_under_the_model_s_sha256_is_refused_and_never_believed(
        tmp_path, model_file, meshes):
    n_layer = read_layout(str(model_file)).n_layer
    half = n_layer // 2
    sha256 = models.resolve(str(model_file))[1]
    # the hostile holder: a changed tensor of the range the fetching worker will take, and its
    # own record claiming the model's sha256 for it (so it publishes its own hashes under it)
    changed = tmp_path / "hostile" / "model" / model_file.name
    victim = changed_copy(model_file, changed, f"blk.{half}.")
    claim_sha256(tmp_path / "hostile", changed, sha256)
    mesh = meshes(tmp_path)   # a coordinator without the file: only the workers hold it
    token = mesh.token()
    hostile = worker(tmp_path / "hostile", token, "--model", str(changed), "--layers", f"0:{half}",
                     log=tmp_path / "hostile.log")
    assert wait_until(lambda: len(mesh.coordinator.workers_snapshot()) == 1, 120), text(tmp_path / "hostile.log")
    honest = worker(tmp_path / "honest", token, "--model", str(model_file), "--layers", f"0:{half}",
                    log=tmp_path / "honest.log")
    assert wait_until(lambda: len(mesh.coordinator.workers_snapshot()) == 2, 120), text(tmp_path / "honest.log")
    fetcher = worker(tmp_path / "b", token, "--mem", "1G", log=tmp_path / "b.log")
    try:
        route = mesh.coordinator.wait_for_route(180, n_stages=2)
        assert route[1].layers.as_tuple() == (half, n_layer), text(tmp_path / "b.log")
        # every byte the worker fetched is the model's: the changed tensor too
        original, fetched = model_file.read_bytes(), fetched_file(tmp_path / "b", sha256, model_file.name).read_bytes()
        assert fetched[victim.offset:victim.offset + victim.size] == original[victim.offset:victim.offset + victim.size]
        holder_of = {w["pid"]: w["weights"] for w in mesh.coordinator.workers_snapshot() if "weights" in w}
        # the coordinator hashed the hostile copy, found it is not the model, and lists only the honest holder
        assert listed_holders(mesh.coordinator.endpoint, token) == [holder_of[honest.pid]]
        assert "does not have the manifest's sha256" not in text(tmp_path / "b.log")   # never asked the other
    finally:
        stop(fetcher)
        stop(honest)
        stop(hostile)


def test_a_resumed_fetch_fetches_again_what_was_checked_against_another_coordinator_s_hashes(
        tmp_path, model_file, meshes):
    n_layer = read_layout(str(model_file)).n_layer
    sha256 = models.resolve(str(model_file))[1]
    # a hostile coordinator: its record claims the model's sha256 for a changed copy, so it
    # vouches for that copy's hashes
    liar = tmp_path / "liar"
    changed = liar / "model" / model_file.name
    victim = changed_copy(model_file, changed, "blk.1.")
    claim_sha256(liar, changed, sha256)
    port = free_port()
    liar_token = join.make_token([f"tcp://127.0.0.1:{port}"], join.coordinator_keys(liar / "keys"),
                                 join.JoinKey(liar / "keys").pair())
    lying = track(subprocess.Popen(
        [sys.executable, "-m", "meshnet.cli.main", "coordinator", "--bind", f"tcp://127.0.0.1:{port}",
         "--model", str(changed)], env={**os.environ, "MESHNET_HOME": str(liar)}, stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "liar.log", "w"), start_new_session=True))
    first = None
    try:
        listening = wait_until(lambda: "coordinator listening" in text(tmp_path / "liar.log"), 60)
        assert listening, text(tmp_path / "liar.log")
        first = worker(tmp_path / "b", liar_token, "--mem", "1G", log=tmp_path / "b-first.log")
        assert wait_until(lambda: f"fetched layers [0,{n_layer})" in text(tmp_path / "b-first.log"), 180), \
            text(tmp_path / "b-first.log")
    finally:
        if first is not None:
            stop(first)
        stop(lying)
    # the same machine joins an honest mesh: what it checked against the liar's hashes is not reused
    mesh = meshes(tmp_path, model_file)
    again = worker(tmp_path / "b", mesh.token(), "--mem", "1G", log=tmp_path / "b-again.log")
    try:
        mesh.coordinator.wait_for_route(180, n_stages=1)
        assert f"fetched layers [0,{n_layer}): {victim.size} bytes" in text(tmp_path / "b-again.log"), \
            text(tmp_path / "b-again.log")
        same_as_whole_model(mesh.coordinator, model_file)
    finally:
        stop(again)


# ---- W2: a holder bounds what one peer holds in it, survives, and is unlisted when silent ----

HOLDER = """
import json, sys, time
from pathlib import Path
from meshnet.net import join
from meshnet.weights.holder import Holder

path, sha256, keys = sys.argv[1], sys.argv[2], Path(sys.argv[3])
holder = Holder(path, sha256, "tcp://127.0.0.1:0", join.coordinator_keys(keys), join_key=join.JoinKey(keys).public)
print(holder.endpoint, flush=True)
while True:
    print(json.dumps(dict(holder.counters)), flush=True)
    time.sleep(0.05)
"""
HOLDER_AS_BYTES = 3 << 30   # the holder's address space: enough for it, far below 3,000 answers of 4 MiB
FLOOD = 3000


def fetch_once(endpoint: str, key: bytes, keys, offset: int, length: int) -> bytes:
    """One FETCH on a connection of its own, as a fetching worker asks: the bytes answered."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    security.client(sock, keys, key)
    sock.connect(endpoint)
    try:
        sock.send_multipart(P.encode(P.FETCH, 1, offset=offset, length=length))
        assert sock.poll(30_000), "the holder did not answer"
        msg = P.decode(sock.recv_multipart(), P.MAX_FETCH_BYTES)
        assert msg.type == P.OK and msg["offset"] == offset, msg
        return bytes(msg.payload)
    finally:
        sock.close()
        ctx.term()


def vm_hwm_kib(pid) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))


def test_a_peer_that_floods_a_holder_and_never_reads_leaves_it_bounded_and_answering(tmp_path, model_file):
    keys = tmp_path / "keys"
    coordinator = join.coordinator_keys(keys)
    token_keys = join.make_token([], coordinator, join.JoinKey(keys).pair()).keys
    sha256 = models.resolve(str(model_file))[1]
    holder = track(subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(model_file), sha256, str(keys)], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "MESHNET_HOME": str(tmp_path / "home")}, start_new_session=True,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (HOLDER_AS_BYTES, HOLDER_AS_BYTES))))
    endpoint = holder.stdout.readline().strip()
    assert endpoint.startswith("tcp://"), endpoint
    counters: dict = {}
    threading.Thread(target=lambda: [counters.update(json.loads(line)) for line in holder.stdout],
                     daemon=True).start()
    before = rss_kib(holder.pid)
    ctx = zmq.Context()
    flood = ctx.socket(zmq.DEALER)
    flood.setsockopt(zmq.LINGER, 0)
    flood.setsockopt(zmq.RCVHWM, 1)     # it reads nothing: what it is sent backs up to the holder
    flood.setsockopt(zmq.RCVBUF, 4096)
    security.client(flood, token_keys, coordinator.public)
    flood.connect(endpoint)
    try:
        sent = 0
        deadline = time.monotonic() + 120
        while sent < FLOOD and time.monotonic() < deadline:
            try:
                flood.send_multipart(P.encode(P.FETCH, sent + 1, offset=0, length=P.MAX_FETCH_BYTES),
                                     flags=zmq.NOBLOCK)
                sent += 1
            except zmq.Again:
                time.sleep(0.01)
        assert sent == FLOOD, f"the holder took {sent} of {FLOOD} requests ({counters}, exit {holder.poll()})"
        assert wait_until(lambda: counters.get("fetches", 0) >= FLOOD, 120), (counters, holder.poll())
        # it read and answered every request, holding at most a few answers for the peer
        assert vm_hwm_kib(holder.pid) - before < 256 << 10, (vm_hwm_kib(holder.pid), before, counters)
        assert counters.get("unsent", 0) > 0
        # and it serves a fetcher meanwhile, the flood's connection still open and unread
        assert fetch_once(endpoint, coordinator.public, token_keys, 1 << 20, 1 << 20) == \
            model_file.read_bytes()[1 << 20:2 << 20]
    finally:
        flood.close()
        ctx.term()
        holder.kill()
        holder.wait(30)


class KeyedFakeWorker:
    """A joined machine's control connection (the token's CURVE key) that registers a
    capability of the test's choosing and heartbeats, and does nothing else."""

    def __init__(self, endpoint: str, token: join.Token, cap: dict):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        security.client(self.sock, token.keys, token.coordinator_key)
        self.sock.connect(endpoint)
        self.sock.send_multipart(P.encode(P.READY, 1, capability=cap))
        self._beating = True
        self._thread = threading.Thread(target=self._beat, daemon=True)
        self._thread.start()

    def _beat(self):
        while self._beating:
            self.sock.send_multipart(P.encode(P.HEARTBEAT, 0))
            while self.sock.poll(0):
                self.sock.recv_multipart()
            time.sleep(0.1)

    def close(self):
        self._beating = False
        self._thread.join(10)
        self.sock.close()
        self.ctx.term()


def test_a_holder_that_stops_answering_is_not_listed_until_it_answers_again(tmp_path, model_file, meshes):
    mesh = meshes(tmp_path, model_file)
    token = mesh.token()
    own = mesh.host.holder.endpoint
    # a joined worker's holder socket whose serving thread is gone: connections are taken, nothing is answered
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    security.serve(silent, token.keys)
    silent.bind("tcp://127.0.0.1:0")
    silent_endpoint = silent.getsockopt_string(zmq.LAST_ENDPOINT)
    layout = read_layout(str(model_file))
    fake = KeyedFakeWorker(mesh.coordinator.endpoint, token, capability(
        model_sha256=mesh.host.model_sha256, n_layer=layout.n_layer, layers=[0, layout.n_layer],
        weights=silent_endpoint))
    answering = threading.Event()

    def answer():
        while answering.is_set():
            if silent.poll(50):
                identity, *frames = silent.recv_multipart()
                silent.send_multipart([identity, *P.encode(P.OK, P.decode(frames, 0).rid)])
    responder = threading.Thread(target=answer, daemon=True)
    try:
        assert wait_until(lambda: len(mesh.coordinator.workers_snapshot()) == 1, 30)
        assert wait_until(lambda: listed_holders(mesh.coordinator.endpoint, token) == [own], 60), \
            listed_holders(mesh.coordinator.endpoint, token)
        assert len(mesh.coordinator.workers_snapshot()) == 1   # still registered: only its holder is silent
        # it answers again: it is listed again
        answering.set()
        responder.start()
        assert wait_until(lambda: listed_holders(mesh.coordinator.endpoint, token) == [own, silent_endpoint], 60), \
            listed_holders(mesh.coordinator.endpoint, token)
    finally:
        answering.clear()
        if responder.is_alive():
            responder.join(10)
        fake.close()
        silent.close()
        ctx.term()


# ---- W3: a full disk is a clean fetch_failed that removes what the fetch wrote ----------


def test_a_disk_too_small_for_the_fetch_is_a_clean_fetch_failed_that_leaves_nothing(tmp_path, model_file, meshes):
    mesh = meshes(tmp_path, model_file)
    listing = tmp_path / "left.txt"
    home = tmp_path / "b"
    # a disk of 16 KiB: not room for the model's header (26 KiB)
    process = worker(home, mesh.token(), "--mem", "1G", log=tmp_path / "b.log",
                     prefix=on_a_small_disk(home, "16k", listing))
    try:
        assert process.wait(120) == 4, text(tmp_path / "b.log")
    finally:
        stop(process)
    log = text(tmp_path / "b.log")
    assert "[fetch_failed]" in log and "free" in log and "Traceback" not in log, log
    assert text(listing) == "", text(listing)   # nothing left behind on it


FILLED = """
import json, os, sys
from pathlib import Path
from meshnet.core.errors import MeshnetError
from meshnet.core.layers import LayerRange
from meshnet.net import join
from meshnet.weights.fetch import Fetch, HolderAddress
from meshnet.weights.manifest import Manifest

home, manifest, holder, key, token = Path(sys.argv[1]), Manifest.from_wire(Path(sys.argv[2]).read_bytes()), \\
    sys.argv[3], sys.argv[4].encode(), join.parse_token(sys.argv[5])
fetch = Fetch(manifest, [HolderAddress(holder, key)], token.keys)
fetch.run([manifest.header])
header_bytes = fetch.disk_bytes()

def another_writer_fills_the_disk(done, total):
    with open(home / "filler", "ab") as f:
        try:
            while True:
                f.write(bytes(1 << 16))
                f.flush()
        except OSError:
            pass

try:
    fetch.run(manifest.spans_for(LayerRange(0, manifest.n_layer)), another_writer_fills_the_disk)
    outcome = "fetched"
except MeshnetError as e:
    outcome = str(e)
except OSError as e:
    outcome = f"OSError: {e}"
os.unlink(home / "filler")
print(json.dumps({"outcome": outcome, "header_bytes": header_bytes, "disk_bytes": fetch.disk_bytes(),
                  "have": sorted(fetch.have)}))
"""


def test_a_disk_that_fills_during_a_fetch_ends_it_with_fetch_failed_and_what_it_wrote_is_removed(
        tmp_path, model_file, meshes):
    mesh = meshes(tmp_path, model_file)
    manifest = mesh.host.holder.manifest
    (tmp_path / "manifest").write_bytes(manifest.to_wire())
    home = tmp_path / "b"
    listing = tmp_path / "left.txt"
    # room for the whole model, until another writer takes it in the middle of the fetch
    process = track(subprocess.Popen(
        [*on_a_small_disk(home, "32m", listing), sys.executable, "-c", FILLED, str(home), str(tmp_path / "manifest"),
         mesh.host.holder.endpoint, mesh.host.holder.public_key, mesh.token().encode()],
        env={**os.environ, "MESHNET_HOME": str(home)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True))
    try:
        stdout, stderr = process.communicate(timeout=300)
    finally:
        kill_group(process)
    assert process.returncode == 0, stderr
    result = json.loads(stdout.strip().splitlines()[-1])
    assert result["outcome"].startswith("[fetch_failed]") and "what this fetch wrote is removed" in result["outcome"], \
        result
    # what was there before this fetch (the header) is kept; the rest it wrote is holes again
    assert result["have"] == ["<header>"]
    assert result["disk_bytes"] == result["header_bytes"], result


# ---- W3-W6: a manifest is bounded by its file, its spans do not overlap, its names are plain ----


def crafted(manifest, case: str):
    """The real manifest of the model, changed as CASE says (a coordinator that lies)."""
    if case == "a 4 EiB file":
        return dataclasses.replace(manifest, file_bytes=(1 << 62) - (1 << 20))
    if case == "an escape and a newline in the file name":
        return dataclasses.replace(manifest, filename="m\x1b[1A\x1b[2K\rmeshnet worker: fetched layers [0,4) OK\n.gguf")
    if case == "1,000 spans of one 1 MiB region":
        region = manifest.tensors[0]
        return dataclasses.replace(manifest, tensors=tuple(Span(f"blk.0.ffn_up.weight.{i}", region.offset, 1 << 20,
                                                                 region.sha256) for i in range(1000)))
    if case == "a header of 1 TiB":
        return dataclasses.replace(manifest, file_bytes=(1 << 40) + manifest.file_bytes,
                                   header=dataclasses.replace(manifest.header, size=1 << 40),
                                   tensors=tuple(dataclasses.replace(t, offset=t.offset + (1 << 40))
                                                 for t in manifest.tensors))
    raise AssertionError(case)


class Liar:
    """A coordinator and a holder, both CURVE servers with KEYS, that answer HOLDERS and
    MANIFEST with a crafted MANIFEST (the coordinator listing its holder), and FETCH with the
    model's bytes (zeros past its end), counting the bytes fetched."""

    def __init__(self, model_file: Path, manifest, keys):
        self.wire, self.sha256, self.keys = manifest.to_wire(), manifest.sha256, keys
        self.data = model_file.read_bytes()
        self.fetched = 0
        self.ctx = zmq.Context()
        self.coordinator, self.coordinator_endpoint = self._router()
        self.holder, self.holder_endpoint = self._router()
        self._running = True
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _router(self):
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        security.serve(sock, self.keys)
        sock.bind("tcp://127.0.0.1:0")
        return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def _serve(self):
        poller = zmq.Poller()
        poller.register(self.coordinator, zmq.POLLIN)
        poller.register(self.holder, zmq.POLLIN)
        while self._running:
            for sock, _ in poller.poll(50):
                identity, *frames = sock.recv_multipart()
                try:
                    msg = P.decode(frames, 0)
                except P.ProtocolError:
                    continue
                if msg.type == P.HOLDERS:
                    reply = P.encode(P.OK, msg.rid, self.wire, info={
                        "model_sha256": self.sha256, "holders": [[self.holder_endpoint, self.keys.public.decode()]]})
                elif msg.type == P.MANIFEST:
                    reply = P.encode(P.OK, msg.rid, self.wire)
                elif msg.type == P.FETCH:
                    self.fetched += msg["length"]
                    data = self.data[msg["offset"]:msg["offset"] + msg["length"]]
                    reply = P.encode(P.OK, msg.rid, data + bytes(msg["length"] - len(data)), offset=msg["offset"])
                elif msg.type == P.HEARTBEAT:
                    reply = P.encode(P.OK, msg.rid)
                else:
                    continue
                sock.send_multipart([identity, *reply])

    def close(self):
        self._running = False
        self._thread.join(10)
        self.coordinator.close()
        self.holder.close()
        self.ctx.term()


# each case, and the word the refusal names it by (a header past a GGUF header's bound is the
# manifest's own rule: it never reaches the disk's)
CRAFTED = [("a 4 EiB file", "bound"),                                     # W4
           ("an escape and a newline in the file name", "plain printable"),  # W5
           ("1,000 spans of one 1 MiB region", "overlaps"),                  # W6
           ("a header of 1 TiB", "bound")]                                   # W3


@pytest.mark.parametrize("case, why", CRAFTED)
def test_a_holder_s_manifest_past_the_bounds_is_refused_by_the_coordinator_and_reaches_no_worker(
        tmp_path, model_file, meshes, case, why):
    mesh = meshes(tmp_path)   # no model file of its own: the lying holder is the only one
    token = mesh.token()
    sha256 = models.resolve(str(model_file))[1]
    # a joined machine that serves its file under the join key, and whose holder lies
    liar = Liar(model_file, crafted(compute(model_file, sha256), case), token.keys)
    layout = read_layout(str(model_file))
    fake = KeyedFakeWorker(mesh.coordinator.endpoint, token, capability(
        model_sha256=sha256, n_layer=layout.n_layer, layers=[0, layout.n_layer], weights=liar.holder_endpoint))
    home, listing, log = tmp_path / "b", tmp_path / "left.txt", tmp_path / "b.log"
    process = worker(home, token, "--mem", "1G", log=log, prefix=on_a_small_disk(home, "64m", listing))
    try:
        # the coordinator read the holder's manifest, refused it, and says so to the waiting worker
        assert wait_until(lambda: "the coordinator refused" in text(log) and why in text(log), 60), text(log)
        assert process.poll() is None, text(log)
        assert liar.fetched == 0      # not a byte asked of it: by the coordinator or the worker
        assert "\x1b" not in text(log) and "fetched layers" not in text(log), text(log)
    finally:
        stop(process)
        fake.close()
        liar.close()
    assert text(listing) == "", text(listing)   # the worker wrote nothing


@pytest.mark.parametrize("case, why", CRAFTED)
def test_a_coordinator_s_manifest_past_the_bounds_is_refused_before_a_byte_is_fetched_or_written(
        tmp_path, model_file, case, why):
    keys = tmp_path / "liar-keys"
    liar = Liar(model_file, crafted(compute(model_file, models.resolve(str(model_file))[1]), case),
                join.coordinator_keys(keys))
    token = join.make_token([liar.coordinator_endpoint], liar.keys, join.JoinKey(keys).pair())
    home, listing, log = tmp_path / "b", tmp_path / "left.txt", tmp_path / "b.log"
    process = worker(home, token, "--mem", "1G", log=log, prefix=on_a_small_disk(home, "64m", listing))
    try:
        assert wait_until(lambda: process.poll() is not None, 60), text(log)
        assert process.returncode == 4 and "[fetch_failed]" in text(log) and why in text(log), text(log)
        assert "\x1b" not in text(log) and "fetched layers" not in text(log), text(log)
        assert liar.fetched == 0
    finally:
        stop(process)
        liar.close()
    assert text(listing) == "", text(listing)


# ---- J6: a worker that finds no holder yet waits for one, for a bounded time --------------


def test_a_worker_that_joins_before_any_holder_waits_for_one_and_fetches_from_it(tmp_path, model_file, meshes):
    n_layer = read_layout(str(model_file)).n_layer
    half = n_layer // 2
    mesh = meshes(tmp_path)   # no model file of its own: the holder is a worker that joins after
    fetcher = worker(tmp_path / "b", mesh.token(), "--mem", "1G", log=tmp_path / "b.log")
    assert wait_until(lambda: "no holder of the model's bytes yet" in text(tmp_path / "b.log"), 60), \
        text(tmp_path / "b.log")
    assert fetcher.poll() is None
    holder = worker(tmp_path / "holder", mesh.token(), "--model", str(model_file), "--layers", f"0:{half}",
                    log=tmp_path / "holder.log")
    try:
        route = mesh.coordinator.wait_for_route(180, n_stages=2)
        assert [o.layers.as_tuple() for o in route] == [(0, half), (half, n_layer)]
        assert f"fetched layers [{half},{n_layer})" in text(tmp_path / "b.log")
        same_as_whole_model(mesh.coordinator, model_file)
    finally:
        stop(fetcher)
        stop(holder)


def test_a_worker_that_finds_no_holder_gives_up_after_a_bounded_wait_saying_why(tmp_path, meshes):
    mesh = meshes(tmp_path)
    said: list[str] = []
    began = time.monotonic()
    with pytest.raises(MeshnetError) as failed:
        join_mesh(mesh.token().encode(), None, False, None, "tcp://127.0.0.1:0", echo=said.append, holder_wait=2)
    assert failed.value.code == E.FETCH_FAILED
    assert "within 2 s" in failed.value.message and "--model" in failed.value.message
    assert said and "waiting up to 2 s" in said[0], said
    assert 2 <= time.monotonic() - began < 30


# ---- a holder the test controls: silent, slow, failing, or at an endpoint libzmq refuses ----


class FakeHolder:
    """A holder's socket (plain, or a CURVE server with KEYS) that answers HEARTBEAT at once,
    MANIFEST with WIRE, and FETCH with DATA's bytes, one request each FETCH_EVERY seconds
    (never with None, an ERROR at once with FAIL); while `silent` is set it reads and answers
    nothing. It counts what it was asked, by type."""

    def __init__(self, data: bytes = b"", wire: bytes | None = None, keys=None, fetch_every: float | None = 0.0,
                 fail: bool = False, silent: bool = False):
        self.data, self.wire, self.fetch_every, self.fail = data, wire, fetch_every, fail
        self.asked: collections.Counter = collections.Counter()
        self.silent = threading.Event()
        if silent:
            self.silent.set()
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            security.serve(self.sock, keys)
        self.sock.bind("tcp://127.0.0.1:0")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._running = True
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        queued: collections.deque = collections.deque()
        next_at = 0.0
        while self._running:
            if self.sock.poll(10):
                identity, *frames = self.sock.recv_multipart()
                try:
                    msg = P.decode(frames, 0)
                except P.ProtocolError:
                    continue
                self.asked[msg.type] += 1
                if self.silent.is_set():
                    continue
                if msg.type == P.HEARTBEAT:
                    self.sock.send_multipart([identity, *P.encode(P.OK, msg.rid)])
                elif msg.type == P.MANIFEST and self.wire is not None:
                    self.sock.send_multipart([identity, *P.encode(P.OK, msg.rid, self.wire)])
                elif msg.type == P.FETCH and self.fail:
                    self.sock.send_multipart([identity, *P.error_frames(msg.rid, E.INTERNAL, "a disk error")])
                elif msg.type == P.FETCH:
                    queued.append((identity, msg))
            if queued and self.fetch_every is not None and time.monotonic() >= next_at:
                identity, msg = queued.popleft()
                data = self.data[msg["offset"]:msg["offset"] + msg["length"]]
                self.sock.send_multipart([identity, *P.encode(P.OK, msg.rid, data, offset=msg["offset"])])
                next_at = time.monotonic() + self.fetch_every

    def close(self):
        self._running = False
        self._thread.join(10)
        self.sock.close()
        self.ctx.term()


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A MESHNET_HOME of the test's for what runs in this process (a voucher keeps the manifests it vouched for)."""
    monkeypatch.setenv("MESHNET_HOME", str(tmp_path / "coordinator-home"))
    return tmp_path / "coordinator-home"


@pytest.fixture
def vouchers():
    made = []
    yield lambda *args, **kwargs: made.append(Voucher(*args, **kwargs)) or made[-1]
    for voucher in made:
        voucher.close()


def listed(voucher, registered) -> list[str]:
    return [endpoint for endpoint, _ in voucher.answer(b"worker", registered)[0]["holders"]]


# ---- S2: an endpoint libzmq refuses fails that holder only -------------------------------


def test_a_holder_at_an_endpoint_libzmq_refuses_is_not_listed_and_the_others_are_still_probed(
        model_file, home, vouchers):
    sha256 = models.resolve(str(model_file))[1]
    remember(compute(model_file, sha256))   # vouched for already: the voucher's thread only probes
    answering = FakeHolder()
    registered = [("tcp://bad host:1", None, sha256), ("foo://x", None, sha256)]
    voucher = vouchers(None, sha256, (answering.endpoint, None), probe_s=0.2, probe_timeout_s=1.0)
    try:
        # each probe reaches the holder that answers: the one that could not be connected to did not stop them
        assert wait_until(lambda: listed(voucher, registered) == [answering.endpoint]
                          and answering.asked[P.HEARTBEAT] >= 3, 30), \
            (listed(voucher, registered), answering.asked)
    finally:
        voucher.close()
        answering.close()


def test_a_fetch_given_a_holder_libzmq_refuses_fetches_from_the_next(tmp_path, model_file):
    sha256 = models.resolve(str(model_file))[1]
    with Holder(model_file, sha256, "tcp://127.0.0.1:0") as holder:
        fetch = Fetch(holder.manifest, [HolderAddress("tcp://bad host:1", None), HolderAddress(holder.endpoint, None)],
                      None, path=tmp_path / "b" / model_file.name)
        fetch.run(holder.manifest.spans_for(LayerRange(0, holder.manifest.n_layer)))
    assert fetch.path.read_bytes() == model_file.read_bytes()
    assert len(fetch.failures) == 1 and fetch.failures[0].startswith("tcp://bad host:1: "), fetch.failures


# ---- C1: an empty list from the coordinator keeps the holders known ----------------------


def test_a_fetch_keeps_the_holders_it_knew_when_the_coordinator_lists_none_for_a_moment(tmp_path, model_file):
    sha256 = models.resolve(str(model_file))[1]
    with Holder(model_file, sha256, "tcp://127.0.0.1:0") as holder:
        # the coordinator's probe timed out on a busy holder: its list is empty for a moment
        fetch = Fetch(holder.manifest, [HolderAddress(holder.endpoint, None)], None,
                      path=tmp_path / "b" / model_file.name, refresh=lambda: [])
        fetch.run(holder.manifest.spans_for(LayerRange(0, holder.manifest.n_layer)))
    assert fetch.path.read_bytes() == model_file.read_bytes()


# ---- S1, S8: a holder's header is read within bounds, and only a bad one refuses it -------


def hostile_header_file(path: Path, n_strings: int) -> tuple[int, int]:
    """A GGUF whose header holds an array of N_STRINGS empty strings and whose one tensor is 16
    bytes: (where its data start, its length)."""
    def string(s: bytes) -> bytes:
        return len(s).to_bytes(8, "little") + s

    def kv(key: str, vtype: int, value: bytes) -> bytes:
        return string(key.encode()) + vtype.to_bytes(4, "little") + value
    header = b"GGUF" + (3).to_bytes(4, "little") + (1).to_bytes(8, "little") + (3).to_bytes(8, "little")
    header += kv("general.architecture", 8, string(b"llama")) + kv("llama.block_count", 4, (4).to_bytes(4, "little"))
    header += kv("tokenizer.ggml.tokens", 9, (8).to_bytes(4, "little") + n_strings.to_bytes(8, "little")
                 + bytes(8 * n_strings))
    header += string(b"token_embd.weight") + (1).to_bytes(4, "little") + (4).to_bytes(8, "little") \
        + (0).to_bytes(4, "little") + (0).to_bytes(8, "little")
    header += bytes(-len(header) % 32)
    path.write_bytes(header + bytes(range(16)))
    return len(header), len(header) + 16


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime + stime, the process's own



def test_a_holder_s_hostile_gguf_header_costs_the_coordinator_bounded_cpu_and_memory(tmp_path, model_file):
    sha256 = models.resolve(str(model_file))[1]
    # the header the review measured: a million empty strings, 8 MiB, 22 s of CPU and 1.5 GiB to read
    hostile = tmp_path / "hostile" / model_file.name
    hostile.parent.mkdir()
    data_start, file_bytes = hostile_header_file(hostile, 1 << 20)
    raw = hostile.read_bytes()
    hint = Manifest(sha256=sha256, file_bytes=file_bytes, filename=model_file.name, n_layer=4, tied_embeddings=True,
                    header=Span(HEADER, 0, data_start, hashlib.sha256(raw[:data_start]).hexdigest()),
                    tensors=(Span("token_embd.weight", data_start, 16, hashlib.sha256(raw[data_start:]).hexdigest()),))
    port = free_port()
    coordinator_home = tmp_path / "coordinator"
    token = join.make_token([f"tcp://127.0.0.1:{port}"], join.coordinator_keys(coordinator_home / "keys"),
                            join.JoinKey(coordinator_home / "keys").pair())
    coordinator = track(subprocess.Popen(
        [sys.executable, "-m", "meshnet.cli.main", "coordinator", "--bind", f"tcp://127.0.0.1:{port}"],
        env={**os.environ, "MESHNET_HOME": str(coordinator_home)}, stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "coordinator.log", "w"), start_new_session=True))
    holder = fake = None
    try:
        assert wait_until(lambda: "coordinator listening" in text(tmp_path / "coordinator.log"), 60), \
            text(tmp_path / "coordinator.log")
        before_cpu, before_hwm = cpu_seconds(coordinator.pid), vm_hwm_kib(coordinator.pid)
        holder = FakeHolder(raw, hint.to_wire(), token.keys)
        layout = read_layout(str(model_file))
        fake = KeyedFakeWorker(f"tcp://127.0.0.1:{port}", token, capability(
            model_sha256=sha256, n_layer=layout.n_layer, layers=[0, layout.n_layer], weights=holder.endpoint))
        # it reads the header, hashes the file whole, finds it is not the model's and refuses the holder
        assert wait_until(lambda: "changed copy" in (holders_info(f"tcp://127.0.0.1:{port}", token).get("why") or ""),
                          120), (holders_info(f"tcp://127.0.0.1:{port}", token), text(tmp_path / "coordinator.log"))
        assert cpu_seconds(coordinator.pid) - before_cpu < 5, cpu_seconds(coordinator.pid) - before_cpu
        assert vm_hwm_kib(coordinator.pid) - before_hwm < 128 << 10, (vm_hwm_kib(coordinator.pid), before_hwm)
    finally:
        if fake is not None:
            fake.close()
        if holder is not None:
            holder.close()
        stop(coordinator)


def test_a_holder_whose_header_cannot_be_read_for_want_of_memory_is_not_refused_for_good(
        model_file, home, monkeypatch):
    sha256 = models.resolve(str(model_file))[1]

    def exhausted(*args):
        raise MemoryError()
    with Holder(model_file, sha256, "tcp://127.0.0.1:0") as holder:
        # the coordinator's machine is short of memory: the holder's bytes may still be the model's
        monkeypatch.setattr(manifests, "layout", exhausted)
        monkeypatch.setattr(manifests, "layout_of", exhausted, raising=False)
        with pytest.raises(HolderFailed):
            check_holder(HolderAddress(holder.endpoint, None), None, sha256, holder.manifest)


# ---- S3, S4, C4: vouching is bounded in time, probing goes on meanwhile, a failure backs off ----


def test_probing_goes_on_while_the_coordinator_hashes_a_slow_holder_s_copy(model_file, home, vouchers):
    sha256 = models.resolve(str(model_file))[1]
    # a holder that streams about 0.7 MiB/s (the 9 MB model takes some 14 s) and one that answers nothing
    slow = FakeHolder(model_file.read_bytes(), compute(model_file, sha256).to_wire(), fetch_every=1.5)
    silent = FakeHolder(silent=True)
    registered = [(slow.endpoint, None, sha256), (silent.endpoint, None, sha256)]
    voucher = vouchers(None, None, None, probe_s=0.5, probe_timeout_s=1.5)
    try:
        voucher.answer(b"worker", registered)
        assert wait_until(lambda: listed(voucher, registered) == [slow.endpoint], 10), listed(voucher, registered)
        silent.silent.clear()   # it answers again: it is listed again, while the slow copy is still being hashed
        assert wait_until(lambda: listed(voucher, registered) == [slow.endpoint, silent.endpoint], 5), \
            listed(voucher, registered)
        info, manifest = voucher.answer(b"a worker that never asked", registered)
        assert manifest is None and "checking" in info, info
    finally:
        voucher.close()
        slow.close()
        silent.close()


def test_a_holder_that_streams_below_the_minimum_rate_is_given_up_saying_so(model_file, home, vouchers, monkeypatch):
    sha256 = models.resolve(str(model_file))[1]
    # a holder that answers each MiB just in time, 1.5 s apart: below the 1 MiB/s a holder must keep,
    # with a slack of 2 s (30 by default) so that it shows within seconds
    monkeypatch.setattr(vouch, "PACE_SLACK_S", 2.0, raising=False)
    slow = FakeHolder(model_file.read_bytes(), compute(model_file, sha256).to_wire(), fetch_every=1.5)
    registered = [(slow.endpoint, None, sha256)]
    voucher = vouchers(None, None, None, probe_s=0.5, probe_timeout_s=1.5)
    try:
        voucher.answer(b"worker", registered)
        # given up before its copy is whole (it would be after some 14 s), and not vouched for
        assert wait_until(lambda: "under the 1 MiB/s a holder keeps" in
                          (voucher.answer(b"worker", registered)[0].get("why") or ""), 12), \
            voucher.answer(b"worker", registered)
        assert voucher.answer(b"a worker that never asked", registered)[1] is None
    finally:
        voucher.close()
        slow.close()


def test_a_holder_that_failed_is_asked_again_only_after_a_back_off_however_often_workers_ask(
        model_file, home, vouchers):
    sha256 = models.resolve(str(model_file))[1]
    failing = FakeHolder(model_file.read_bytes(), compute(model_file, sha256).to_wire(), fail=True)
    registered = [(failing.endpoint, None, sha256)]
    voucher = vouchers(None, None, None, probe_s=0.5, probe_timeout_s=1.5)
    try:
        began = time.monotonic()
        while time.monotonic() - began < 6:   # workers waiting for a holder ask every 20 ms
            voucher.answer(b"worker", registered)
            time.sleep(0.02)
        assert 1 <= failing.asked[P.MANIFEST] <= 3, failing.asked
    finally:
        voucher.close()
        failing.close()


def test_a_coordinator_closes_at_once_while_a_holder_is_silent_in_the_middle_of_its_stream(
        model_file, home, vouchers):
    sha256 = models.resolve(str(model_file))[1]
    # it gives its manifest, then answers no FETCH
    mute = FakeHolder(model_file.read_bytes(), compute(model_file, sha256).to_wire(), fetch_every=None)
    voucher = vouchers(None, None, None, probe_s=0.5, probe_timeout_s=1.5)
    try:
        voucher.answer(b"worker", [(mute.endpoint, None, sha256)])
        assert wait_until(lambda: mute.asked[P.FETCH] > 0, 15), mute.asked
        began = time.monotonic()
        voucher.close()
        assert time.monotonic() - began < 3
        assert not any(t.is_alive() for t in threading.enumerate() if t.name.startswith("meshnet-vouch"))
    finally:
        mute.close()


class Hashing:
    """A coordinator (CURVE server with KEYS) whose answer to HOLDERS says, each time, that it
    hashes a holder's copy one more byte along, and never vouches."""

    def __init__(self, keys, sha256: str, total: int):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        security.serve(self.sock, keys)
        self.sock.bind("tcp://127.0.0.1:0")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.sha256, self.total, self.done = sha256, total, 0
        self._running = True
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        while self._running:
            if self.sock.poll(20):
                identity, *frames = self.sock.recv_multipart()
                msg = P.decode(frames, 0)
                self.done += 1
                self.sock.send_multipart([identity, *P.encode(P.OK, msg.rid, info={
                    "model_sha256": self.sha256, "holders": [], "checking": [self.done, self.total]})])

    def close(self):
        self._running = False
        self._thread.join(10)
        self.sock.close()
        self.ctx.term()


def test_a_worker_waits_for_a_hashing_coordinator_at_most_a_ceiling_it_names(tmp_path):
    keys = tmp_path / "keys"
    coordinator = Hashing(join.coordinator_keys(keys), "ab" * 32, 1 << 20)
    token = join.make_token([coordinator.endpoint], join.coordinator_keys(keys), join.JoinKey(keys).pair())
    outcome: list = []

    def joining():
        try:
            join_mesh(token.encode(), None, False, None, "tcp://127.0.0.1:0", echo=lambda line: None, holder_wait=2)
        except MeshnetError as e:
            outcome.append(e)
    thread = threading.Thread(target=joining, daemon=True)
    try:
        thread.start()
        thread.join(30)   # the hashing advances at each ask: the wait is 2 s and the 1 MiB at 1 MiB/s
        assert not thread.is_alive(), f"still waiting after 30 s ({coordinator.done} asks)"
        assert outcome and outcome[0].code == E.FETCH_FAILED, outcome
        assert "at most" in outcome[0].message, outcome[0].message
    finally:
        coordinator.close()


# ---- S7: without a token a worker fetches no weights, unless --insecure -----------------


def test_a_worker_without_a_token_fetches_no_weights_unless_insecure(tmp_path, model_file):
    sha256 = models.resolve(str(model_file))[1]
    # a coordinator any LAN host could be: no keys, and the model's bytes
    host = MeshHost("tcp://127.0.0.1:0", secure=False, model=(model_file, sha256))
    coordinator = Coordinator(CoordinatorConfig("tcp://127.0.0.1:0", **host.coordinator_options()))
    env = {k: v for k, v in os.environ.items() if k != "MESHNET_JOIN"}

    def unauthenticated(name: str, *args) -> subprocess.Popen:
        (tmp_path / name).mkdir()
        return track(subprocess.Popen(
            [sys.executable, "-m", "meshnet.cli.main", "worker", "--coordinator", coordinator.endpoint, "--discover",
             "--layers", "auto", "--mem", "1G", "--threads", str(THREADS), "--ctx", "256", *args],
            env={**env, "MESHNET_HOME": str(tmp_path / name)}, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=open(tmp_path / f"{name}.log", "w"), start_new_session=True))
    refused = unauthenticated("b")
    insecure = None
    try:
        assert wait_until(lambda: refused.poll() is not None, 60), text(tmp_path / "b.log")
        log = text(tmp_path / "b.log")
        assert refused.returncode == 4 and "[fetch_failed]" in log and "--join" in log, log
        assert "from the mesh" not in log and not (tmp_path / "b" / "models").exists(), log
        insecure = unauthenticated("c", "--insecure")
        coordinator.wait_for_route(180, n_stages=1)
        assert "from the mesh" in text(tmp_path / "c.log"), text(tmp_path / "c.log")
    finally:
        stop(refused)
        if insecure is not None:
            stop(insecure)
        coordinator.close()
        host.close()
