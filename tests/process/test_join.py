"""Joining a mesh with a token, on loopback with real worker processes: a worker without the
model file fetches only its range's bytes and the route gives the whole model's tokens
and logits; a rotated, forged or damaged token is refused with join_refused; a tensor
corrupted on one holder is refused by its hash and fetched from another, or with no other
holder the worker stays out of the route saying why; a fetch stopped halfway resumes."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from meshnet.core.errors import MeshnetError
from meshnet.core.layers import LayerRange
from meshnet.engine import models
from meshnet.engine.gguf_layout import read_layout
from meshnet.engine.pipeline import LocalPipeline
from meshnet.launch.mesh_host import MeshHost
from meshnet.launch.progress import load_bars
from meshnet.net import join
from meshnet.route.config import CoordinatorConfig
from meshnet.route.coordinator import Coordinator
from meshnet.weights.fetch import STATE_SUFFIX

from conftest import TEST_MODELS, THREADS, generated_model_copy, track
from peers import wait_until

MODEL = "llama-dense"     # a generated model of 4 layers (make test-models)
PROMPT = [1, 5, 9, 13, 17, 21, 25, 29]
N_TOKENS = 12


@pytest.fixture
def model_file(tmp_path):
    """A copy of the generated model of our own: the tests change bytes of it."""
    return generated_model_copy(tmp_path, MODEL)


class Mesh:
    """A coordinator that holds the model's bytes, with this test's keys, and the workers
    the test starts, each with a MESHNET_HOME of its own (no model file there)."""

    def __init__(self, tmp_path: Path, model_file: Path):
        self.tmp_path = tmp_path
        self.model_file = model_file
        self.sha256 = models.resolve(str(model_file))[1]
        self.host = MeshHost("tcp://127.0.0.1:0", model=(model_file, self.sha256), keys_dir=tmp_path / "a" / "keys")
        self.coordinator = Coordinator(CoordinatorConfig("tcp://127.0.0.1:0", **self.host.coordinator_options()))
        self.host.started(self.coordinator.endpoint, announce=False)
        self.logs: dict[str, Path] = {}

    def token(self) -> str:
        return self.host.token().encode()

    def worker(self, name: str, *args, token: str | None = None, env: dict | None = None) -> subprocess.Popen:
        home = self.tmp_path / name
        home.mkdir(exist_ok=True)
        self.logs[name] = home / "stderr.log"
        return track(subprocess.Popen(
            [sys.executable, "-m", "meshnet.cli.main", "worker",
             "--threads", str(THREADS), "--ctx", "256", "--max-sessions", "2", *args],
            # the token as the join line gives it: in the environment, not on the command line
            env={**os.environ, "MESHNET_HOME": str(home), "MESHNET_JOIN": token or self.token(), **(env or {})},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=open(self.logs[name], "w"), start_new_session=True))

    def log(self, name: str) -> str:
        return self.logs[name].read_text()

    def fetched_file(self, name: str) -> Path:
        return self.tmp_path / name / "models" / "mesh" / self.sha256 / self.model_file.name

    def close(self):
        self.coordinator.close()
        self.host.close()


@pytest.fixture
def mesh(tmp_path, model_file):
    m = Mesh(tmp_path, model_file)
    yield m
    m.close()


def whole_model(path, n_tokens=N_TOKENS):
    with LocalPipeline(str(path), [(0, read_layout(str(path)).n_layer)], n_ctx=256, max_sessions=1,
                       n_threads=THREADS) as whole:
        done = whole.generate(PROMPT, n_tokens, stop_at_eog=False, keep_logits=True)
        return done.tokens, done.logits


def route_output(coordinator, n_tokens=N_TOKENS):
    session = coordinator.generate(PROMPT, n_tokens, stop_at_eog=False, want_logits=True).result(120)
    return session.tokens, session.logits


def stop(process):
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(30)


def flip_a_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_worker_without_the_file_fetches_only_its_range_and_the_route_gives_the_whole_model(mesh):
    n_layer = read_layout(str(mesh.model_file)).n_layer
    holder = mesh.worker("holder", "--model", str(mesh.model_file), "--layers", f"0:{n_layer // 2}")
    # registered first, so that the planner gives the fetching worker only the rest
    assert wait_until(lambda: len(mesh.coordinator.workers_snapshot()) == 1, 120), mesh.log("holder")
    fetcher = mesh.worker("b", "--mem", "1G")
    try:
        route = mesh.coordinator.wait_for_route(180, n_stages=2)
        assert [o.layers.as_tuple() for o in route] == [(0, n_layer // 2), (n_layer // 2, n_layer)]
        tokens, logits = route_output(mesh.coordinator)
        want_tokens, want_logits = whole_model(mesh.model_file)
        assert tokens == want_tokens
        assert max(float(np.max(np.abs(a - b))) for a, b in zip(logits, want_logits)) == 0.0
        # only the tail's share is on B's disk, with the original's layout: those bytes are the file's
        manifest = mesh.host.holder.manifest
        spans = manifest.spans_for(LayerRange(n_layer // 2, n_layer))
        fetched = mesh.fetched_file("b")
        assert fetched.stat().st_size == manifest.file_bytes
        share = sum(s.size for s in spans)
        assert fetched.stat().st_blocks * 512 <= share + 4096 * len(spans)   # blocks round each span up
        original, copy = mesh.model_file.read_bytes(), fetched.read_bytes()
        for span in spans:
            assert copy[span.offset:span.offset + span.size] == original[span.offset:span.offset + span.size]
        assert f"fetched layers [{n_layer // 2},{n_layer}): {share} bytes" in mesh.log("b")
        # the holder worker was asked nothing: the coordinator's host came first
        assert mesh.host.holder.counters["bytes"] == share
    finally:
        stop(fetcher)
        stop(holder)


def test_a_rotated_forged_or_damaged_token_is_refused_with_join_refused(mesh, tmp_path):
    old = mesh.token()
    # `meshnet keys rotate-join` on the coordinator's host (its MESHNET_HOME holds the keys)
    rotated = subprocess.run([sys.executable, "-m", "meshnet.cli.main", "keys", "rotate-join"], capture_output=True,
                             text=True, timeout=60, env={**os.environ, "MESHNET_HOME": str(tmp_path / "a")})
    assert rotated.returncode == 0, rotated.stderr
    assert mesh.token() != old
    forged = join.Token(join.parse_token(old).addresses, join.parse_token(old).coordinator_key,
                        join.parse_token(join.make_token([], mesh.host.keys, join.JoinKey(tmp_path / "x").pair())
                                         .encode()).join_secret).encode()
    for name, token, why in (("rotated", old, "refused this worker's key"), ("forged", forged, "refused this worker's key"),
                             ("damaged", old[:-12], "damaged")):
        worker = mesh.worker(name, "--mem", "1G", token=token)
        assert worker.wait(60) == 4, mesh.log(name)
        assert "[join_refused]" in mesh.log(name) and why in mesh.log(name), mesh.log(name)
    assert mesh.coordinator.counters()["registrations"] == 0
    # the new token is admitted
    admitted = mesh.worker("admitted", "--mem", "1G")
    try:
        mesh.coordinator.wait_for_route(180, n_stages=1)
    finally:
        stop(admitted)


def test_a_tensor_corrupted_on_a_holder_is_refused_by_its_hash_and_fetched_from_another(mesh, tmp_path):
    layout = read_layout(str(mesh.model_file))
    half = layout.n_layer // 2
    second_copy = tmp_path / "holder-copy" / mesh.model_file.name
    second_copy.parent.mkdir()
    shutil.copyfile(mesh.model_file, second_copy)
    holder = mesh.worker("holder", "--model", str(second_copy), "--layers", f"0:{half}")
    try:
        wait_until(lambda: len(mesh.coordinator.workers_snapshot()) == 1, 120)
        # one byte of a tensor of the tail's, flipped on the coordinator's host after it published its hashes
        victim = next(s for s in mesh.host.holder.manifest.tensors if s.name.startswith(f"blk.{half}."))
        flip_a_byte(mesh.model_file, victim.offset + victim.size // 2)
        fetcher = mesh.worker("b", "--mem", "1G")
        try:
            mesh.coordinator.wait_for_route(180, n_stages=2)
            log = mesh.log("b")
            assert f"{victim.name} does not have the manifest's sha256" in log, log
            second_copy_bytes = second_copy.read_bytes()
            assert mesh.fetched_file("b").read_bytes()[victim.offset:victim.offset + victim.size] == \
                second_copy_bytes[victim.offset:victim.offset + victim.size]
            flip_a_byte(mesh.model_file, victim.offset + victim.size // 2)   # the whole model, as it was
            assert route_output(mesh.coordinator)[0] == whole_model(mesh.model_file)[0]
        finally:
            stop(fetcher)
    finally:
        stop(holder)


def test_with_no_other_holder_a_corrupt_tensor_keeps_the_worker_out_of_the_route_saying_why(mesh):
    victim = mesh.host.holder.manifest.tensors[-1]
    flip_a_byte(mesh.model_file, victim.offset)
    fetcher = mesh.worker("b", "--mem", "1G")
    try:
        assert wait_until(lambda: "[fetch_failed]" in mesh.log("b"), 120), mesh.log("b")
        assert "does not have the manifest's sha256" in mesh.log("b")
        report = mesh.coordinator.route_report()
        assert not report["route"]
        assert any("fetch_failed" in str(why) for why in {**report["kept_out"], **report["standby"]}.values()), report
    finally:
        stop(fetcher)


def test_a_fetch_stopped_halfway_resumes_where_it_was(mesh):
    n_layer = read_layout(str(mesh.model_file)).n_layer
    state = mesh.fetched_file("b").with_name(mesh.model_file.name + STATE_SUFFIX)
    spans = mesh.host.holder.manifest.spans_for(LayerRange(0, n_layer))

    def have():
        try:
            return set(json.loads(state.read_text())["have"])
        except (OSError, ValueError, KeyError):
            return set()
    # slowed, so that it can be stopped with part of the model checked and part not
    fetcher = mesh.worker("b", "--mem", "1G", env={"MESHNET_TEST_SLOW_FETCH_MS": "150"})
    # meanwhile its health says how far the fetch is, and the coordinator's status draws a bar of it
    assert wait_until(lambda: any(s.get("state") == "fetching" and 0 < s.get("fetch_progress", 0) < 1
                                  for s in mesh.coordinator.metrics(timeout=5)["stages"]), 120), mesh.log("b")
    assert any(": fetching [" in line for line in load_bars(mesh.coordinator.metrics(timeout=5)))
    assert wait_until(lambda: len(have()) >= len(spans) // 3, 120), mesh.log("b")
    fetcher.send_signal(signal.SIGKILL)
    fetcher.wait(30)
    before = have()
    assert 1 < len(before) < len(spans)
    again = mesh.worker("b", "--mem", "1G")
    try:
        mesh.coordinator.wait_for_route(180, n_stages=1)
        missing = sum(s.size for s in spans if s.name not in before)
        assert f"fetched layers [0,{n_layer}): {missing} bytes" in mesh.log("b"), mesh.log("b")
        assert route_output(mesh.coordinator)[0] == whole_model(mesh.model_file)[0]
    finally:
        stop(again)


def test_a_spare_without_the_file_fetches_what_it_lacks_when_it_takes_a_lost_stage(mesh):
    n_layer = read_layout(str(mesh.model_file)).n_layer
    half = n_layer // 2
    holder = mesh.worker("holder", "--model", str(mesh.model_file), "--layers", f"0:{half}")
    assert wait_until(lambda: len(mesh.coordinator.workers_snapshot()) == 1, 120), mesh.log("holder")
    tail = mesh.worker("b", "--mem", "1G")
    try:
        lost = mesh.coordinator.wait_for_route(180, n_stages=2)[1].worker
        want = route_output(mesh.coordinator)[0]
        # a spare: it waits with the model's header only, nothing of any range yet
        spare = mesh.worker("c", "--mem", "1G")
        assert wait_until(lambda: len(mesh.coordinator.workers_snapshot()) == 3, 120), mesh.log("c")
        header = mesh.host.holder.manifest.header.size
        assert mesh.fetched_file("c").stat().st_blocks * 512 <= header + 4096
        tail.kill()
        tail.wait(30)

        def new_tail():
            try:
                route = mesh.coordinator.route()
            except MeshnetError:
                return None
            return route[1] if len(route) == 2 and route[1].worker != lost else None
        assert wait_until(new_tail, 180), mesh.log("c")
        assert new_tail().layers.as_tuple() == (half, n_layer)
        # (what the worker fetched in all: the header when it joined, and now its range)
        share = sum(s.size for s in mesh.host.holder.manifest.spans_for(LayerRange(half, n_layer)))
        assert f"fetched layers [{half},{n_layer}): {share} bytes" in mesh.log("c"), mesh.log("c")
        assert route_output(mesh.coordinator)[0] == want
        stop(spare)
    finally:
        stop(tail)
        stop(holder)
