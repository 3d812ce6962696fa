"""Which GPU engine a GPU stage loads: the one MESHNET_GPU_ENGINE names, else the first
built, CUDA before Vulkan (plain data: paths laid out by the test, no library loaded)."""

import pytest

from meshnet.core.errors import MeshnetError
from meshnet.engine import binding


@pytest.fixture
def engines(tmp_path, monkeypatch):
    paths = {name: tmp_path / name / "libmeshnet_engine.so" for name in ("cuda", "vulkan")}
    monkeypatch.setattr(binding, "GPU_LIBRARIES", paths)
    monkeypatch.delenv("MESHNET_GPU_ENGINE", raising=False)
    return paths


def build(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")


def test_with_none_built_the_cuda_path_is_named_and_with_one_built_that_one(engines):
    assert binding.gpu_library() == engines["cuda"]
    build(engines["vulkan"])
    assert binding.gpu_library() == engines["vulkan"]
    build(engines["cuda"])
    assert binding.gpu_library() == engines["cuda"]


def test_the_environment_names_one_and_a_wrong_name_is_refused(engines, monkeypatch):
    build(engines["cuda"])
    monkeypatch.setenv("MESHNET_GPU_ENGINE", "vulkan")
    assert binding.gpu_library() == engines["vulkan"]   # named, built or not: the load then says it is missing
    monkeypatch.setenv("MESHNET_GPU_ENGINE", "rocm")
    with pytest.raises(MeshnetError) as refused:
        binding.gpu_library()
    assert refused.value.code == "invalid_argument" and "cuda, vulkan" in refused.value.message
