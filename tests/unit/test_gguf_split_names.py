"""The names of a split GGUF's files, as llama.cpp makes and finds them, and the one
identity of a model over its files (pure logic: names and hashes)."""

import hashlib

import pytest

from meshnet.core.errors import MeshnetError
from meshnet.engine.gguf_splits import model_identity, named_splits, split_name


def test_split_names_are_llama_cpp_s():
    assert split_name("Qwen3-235B-Q4_K_M", 0, 5) == "Qwen3-235B-Q4_K_M-00001-of-00005.gguf"
    assert split_name("m", 4, 5) == "m-00005-of-00005.gguf"


def test_any_split_names_every_file_first_first(tmp_path):
    files = [tmp_path / split_name("m", i, 3) for i in range(3)]
    for f in files:
        f.write_bytes(b"")
    assert named_splits(files[1]) == files
    assert named_splits(files[2]) == files


@pytest.mark.parametrize("name", ["m.gguf", "m-00001-of-00001.gguf", "m-1-of-3.gguf", "m-00004-of-00003.gguf"])
def test_a_name_that_is_not_a_split_s_is_the_one_file(tmp_path, name):
    assert named_splits(tmp_path / name) == [tmp_path / name]


def test_a_missing_split_is_refused_naming_it(tmp_path):
    (tmp_path / split_name("m", 0, 3)).write_bytes(b"")
    (tmp_path / split_name("m", 2, 3)).write_bytes(b"")
    with pytest.raises(MeshnetError) as refused:
        named_splits(tmp_path / split_name("m", 0, 3))
    assert refused.value.code == "model_not_found" and "m-00002-of-00003.gguf" in refused.value.message


def test_the_identity_is_the_file_s_own_hash_or_one_over_the_splits_in_order():
    a, b = hashlib.sha256(b"a").hexdigest(), hashlib.sha256(b"b").hexdigest()
    assert model_identity([a]) == a
    both = model_identity([a, b])
    assert both == hashlib.sha256(b"meshnet gguf splits 1\n" + a.encode() + b"\n" + b.encode() + b"\n").hexdigest()
    assert model_identity([b, a]) != both and model_identity([a, b, a]) != both
