"""A model written as split GGUF files (llama.cpp's gguf-split, here the gguf package's
writer): read, hashed, planned and run as one model, given by any of its files; the files
a stage needs named; a missing or mismatched split refused before the engine loads."""

import hashlib
import json
import shutil

import numpy as np
import pytest

from meshnet.core.errors import MeshnetError
from meshnet.engine import models
from meshnet.engine.gguf_layout import read_layout
from meshnet.engine.pipeline import LocalPipeline

from conftest import THREADS, generated_models, meshnet
from split_model import write_splits

PROMPT = [1, 5, 9, 13, 17, 21, 25, 29]


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHNET_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture(scope="module")
def whole():
    return generated_models()["llama-dense"]


@pytest.fixture
def splits(tmp_path, whole):
    return write_splits(whole, tmp_path, 3)


def test_the_splits_read_as_the_single_file_with_each_file_s_layers(splits, whole):
    split, single = read_layout(splits[0]), read_layout(whole)
    # everything the planner sizes stages by is the single file's
    for name in ("arch", "n_layer", "n_embd", "n_vocab", "layer_bytes", "input_bytes", "output_bytes",
                 "shared_bytes", "tied_embeddings", "token_embd_bytes", "quant_types", "layer_weights",
                 "output_weights", "kv_bytes_per_cell", "n_ctx_train"):
        assert getattr(split, name) == getattr(single, name), name
    assert split.file_bytes == sum(p.stat().st_size for p in splits)
    assert [f.path for f in split.files] == [str(p) for p in splits]
    assert sum(f.tensors for f in split.files) == single.files[0].tensors
    assert [f.layers for f in split.files] == [(0, 2), (1, 3), (2, 4)]   # cut by count: layers straddle files
    assert "input" in split.files[0].roles and not split.files[2].roles


def test_any_split_resolves_to_the_first_and_one_identity_over_the_splits_hashes(splits, home):
    want = hashlib.sha256(b"meshnet gguf splits 1\n" + b"".join(
        hashlib.sha256(p.read_bytes()).hexdigest().encode() + b"\n" for p in splits)).hexdigest()
    for given in (splits[2], splits[0], splits[1]):
        path, sha = models.resolve(str(given))
        assert (path, sha) == (splits[0], want)
    # a split whose bytes change is another model, remembered hash or not
    with open(splits[2], "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    assert models.resolve(str(splits[0]))[1] not in (want, None)


def test_a_missing_or_renamed_split_is_refused_naming_it(splits, tmp_path, home):
    splits[1].unlink()
    with pytest.raises(MeshnetError) as missing:
        models.resolve(str(splits[0]))
    assert missing.value.code == "model_not_found" and splits[1].name in missing.value.message
    # another model's split under this one's name: its split.no says so
    (tmp_path / "other").mkdir()
    other = write_splits(generated_models()["qwen2-dense"], tmp_path / "other", 3)
    shutil.copyfile(other[2], splits[1])
    with pytest.raises(MeshnetError) as wrong:
        read_layout(splits[0])
    assert wrong.value.code == "not_gguf" and "split 2 of 3" in wrong.value.message


def run(path, ranges):
    with LocalPipeline(str(path), ranges, n_ctx=256, max_sessions=1, n_threads=THREADS) as pipeline:
        done = pipeline.generate(PROMPT, 8, stop_at_eog=False, keep_logits=True)
        return done.tokens, done.logits


def test_the_split_model_gives_the_single_file_s_logits_whole_and_over_stages(splits, whole):
    tokens, logits = run(whole, [(0, 4)])
    for ranges in ([(0, 4)], [(0, 2), (2, 4)], [(0, 1), (1, 3), (3, 4)]):
        got_tokens, got_logits = run(splits[0], ranges)
        assert got_tokens == tokens
        assert max(float(np.abs(a - b).max()) for a, b in zip(got_logits, logits)) == 0.0


def test_inspect_names_each_split_and_what_it_holds(splits, home):
    shown = meshnet("inspect", str(splits[1]), timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert "in 3 files (gguf-split)" in shown.stdout
    assert f"{splits[1].name}: layers 1-2" in shown.stdout
    info = json.loads(meshnet("inspect", "--json", str(splits[0]), timeout=120).stdout)
    assert [f["layers"] for f in info["files"]] == [[0, 2], [1, 3], [2, 4]]
    assert info["sha256"] == models.resolve(str(splits[0]))[1]


def test_plan_sizes_the_split_model_as_the_single_file(splits, whole, home):
    plans = [meshnet("plan", "--node", "a=145M", "--node", "b=145M", "--ctx", "64", str(p), timeout=120)
             for p in (splits[0], whole)]
    assert plans[0].returncode == plans[1].returncode == 0, plans[0].stderr
    assert plans[0].stdout.replace(str(splits[0]), "M") == plans[1].stdout.replace(str(whole), "M")
