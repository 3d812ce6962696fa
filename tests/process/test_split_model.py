"""A model in split GGUF files (gguf-split) over worker processes and over the mesh: the
route gives the single file's tokens and logits, max |diff| 0; a worker that joins without
the model fetches only its range's bytes of each split (and every split's header), into
files laid out as the splits; a coordinator without the files vouches for a holder's
splits by hashing them, and refuses a holder whose one split is changed."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from meshnet.core.layers import LayerRange
from meshnet.engine import models
from meshnet.engine.pipeline import LocalPipeline
from meshnet.launch.local_cluster import LocalCluster
from meshnet.launch.mesh_host import MeshHost
from meshnet.route.config import CoordinatorConfig
from meshnet.route.coordinator import Coordinator
from meshnet.weights import manifest as manifests
from meshnet.weights.fetch import HolderAddress
from meshnet.weights.holder import Holder
from meshnet.weights.vouch import NotTheModel, check_holder

from conftest import THREADS, generated_models, stop_group, track
from peers import wait_until
from split_model import write_splits

PROMPT = [1, 5, 9, 13, 17, 21, 25, 29]
N_TOKENS = 12


@pytest.fixture(scope="module")
def single():
    """The single-file model and its tokens and logits, whole in this process."""
    path = generated_models()["llama-dense"]
    with LocalPipeline(path, [(0, 4)], n_ctx=256, max_sessions=1, n_threads=THREADS) as whole:
        done = whole.generate(PROMPT, N_TOKENS, stop_at_eog=False, keep_logits=True)
    return path, done.tokens, done.logits


@pytest.fixture
def splits(tmp_path, single):
    (tmp_path / "splits").mkdir()
    return write_splits(single[0], tmp_path / "splits", 3)


def same_output(got, single):
    _, tokens, logits = single
    return got.tokens == tokens and max(float(np.abs(a - b).max()) for a, b in zip(got.logits, logits)) == 0.0


def test_two_workers_on_a_model_of_three_splits_give_the_single_file_s_logits(splits, single):
    with LocalCluster(str(splits[0]), [(0, 2), (2, 4)], threads=THREADS, n_ctx=256, max_sessions=2) as cluster:
        got = cluster.coordinator.generate(PROMPT, N_TOKENS, stop_at_eog=False, want_logits=True).result(120)
    assert same_output(got, single)


class Mesh:
    """A coordinator in this process with this test's keys, holding the split model's files or
    (MODEL None) not; and the workers the test starts, each with a MESHNET_HOME of its own."""

    def __init__(self, tmp_path: Path, model: Path | None, sha256: str):
        self.tmp_path, self.sha256 = tmp_path, sha256
        self.host = MeshHost("tcp://127.0.0.1:0", model=(model, sha256) if model else None,
                             keys_dir=tmp_path / "coordinator-keys")
        self.coordinator = Coordinator(CoordinatorConfig("tcp://127.0.0.1:0", **self.host.coordinator_options()))
        self.host.started(self.coordinator.endpoint, announce=False)
        self.started: list[subprocess.Popen] = []

    def worker(self, name: str, *args) -> subprocess.Popen:
        home = self.tmp_path / name
        home.mkdir(exist_ok=True)
        process = track(subprocess.Popen(
            [sys.executable, "-m", "meshnet.cli.main", "worker", "--threads", str(THREADS), "--ctx", "256",
             "--max-sessions", "2", *args],
            env={**os.environ, "MESHNET_HOME": str(home), "MESHNET_JOIN": self.host.token().encode()},
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=open(home / "stderr.log", "w"),
            start_new_session=True))
        self.started.append(process)
        return process

    def log(self, name: str) -> str:
        return (self.tmp_path / name / "stderr.log").read_text(errors="replace")

    def fetched(self, name: str) -> Path:
        return self.tmp_path / name / "models" / "mesh" / self.sha256

    def close(self):
        for process in reversed(self.started):
            stop_group(process, grace=30)
        self.coordinator.close()
        self.host.close()


@pytest.fixture
def mesh_of(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHNET_HOME", str(tmp_path / "coordinator-home"))
    made = []
    yield lambda *args: made.append(Mesh(tmp_path, *args)) or made[-1]
    for mesh in reversed(made):
        mesh.close()


def join_and_route(mesh: Mesh, holder_model: Path):
    """A holder worker of the head's layers, then a worker with no model file: the route."""
    mesh.worker("holder", "--model", str(holder_model), "--layers", "0:2")
    # registered first, so that the planner gives the fetching worker only the rest
    assert wait_until(lambda: len(mesh.coordinator.workers_snapshot()) == 1, 120), mesh.log("holder")
    mesh.worker("b", "--mem", "1G")
    route = mesh.coordinator.wait_for_route(180, n_stages=2)
    assert [o.layers.as_tuple() for o in route] == [(0, 2), (2, 4)], mesh.log("b")
    return mesh.coordinator.generate(PROMPT, N_TOKENS, stop_at_eog=False, want_logits=True).result(120)


def test_a_joined_worker_fetches_only_its_share_of_each_split_and_gives_the_single_file_s_logits(
        splits, single, mesh_of):
    sha256 = models.resolve(str(splits[0]))[1]
    mesh = mesh_of(splits[0], sha256)
    assert same_output(join_and_route(mesh, splits[0]), single)
    manifest = mesh.host.holder.manifest
    assert manifest.splits == tuple(p.stat().st_size for p in splits)
    # the fetched files are laid out as the splits, each as long as its original, and hold
    # only the tail's spans and every split's header, byte for byte the originals'
    fetched = mesh.fetched("b")
    assert sorted(p.name for p in fetched.glob("*.gguf")) == [p.name for p in splits]
    spans = manifest.spans_for(LayerRange(2, 4))
    assert sum(manifests.is_header(s.name) for s in spans) == 3
    share = sum(s.size for s in spans)
    on_disk = 0
    for (name, start, size), original in zip(manifest.files(), splits):
        copy, want = (fetched / name).read_bytes(), original.read_bytes()
        assert len(copy) == size == len(want)
        for s in spans:
            if start <= s.offset < start + size:
                assert copy[s.offset - start:s.offset - start + s.size] == want[s.offset - start:s.offset - start + s.size]
        on_disk += (fetched / name).stat().st_blocks * 512
    assert on_disk <= share + 4096 * len(spans)   # blocks round each span up
    assert share < manifest.file_bytes * 0.75
    assert f"fetched layers [2,4): {share} bytes" in mesh.log("b")


def test_a_coordinator_without_the_files_vouches_for_a_holder_s_splits_by_hashing_them(splits, single, mesh_of):
    sha256 = models.resolve(str(splits[0]))[1]
    mesh = mesh_of(None, sha256)   # only the holder worker has the files
    assert same_output(join_and_route(mesh, splits[0]), single)
    assert sum(1 for _ in mesh.fetched("b").glob("*.gguf")) == 3


def test_a_holder_whose_one_split_is_changed_is_not_the_model(splits, tmp_path, monkeypatch):
    monkeypatch.setenv("MESHNET_HOME", str(tmp_path / "home"))
    sha256 = models.resolve(str(splits[0]))[1]
    with Holder(splits[0], sha256, "tcp://127.0.0.1:0") as holder:
        hint = holder.manifest
        assert check_holder(HolderAddress(holder.endpoint, None), None, sha256, hint) == hint
        victim = next(s for s in hint.tensors if s.name.startswith("blk.3."))   # in the third split
        third = hint.files()[2]
        assert third[1] <= victim.offset < third[1] + third[2]
        with open(splits[2], "r+b") as f:
            f.seek(victim.offset - third[1])
            byte = f.read(1)
            f.seek(victim.offset - third[1])
            f.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(NotTheModel, match="do not have the model's sha256"):
            check_holder(HolderAddress(holder.endpoint, None), None, sha256, hint)
