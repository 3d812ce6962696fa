"""Which files a Hugging Face name picks among a repository's, and what an Ollama name
stands for (pure logic: names)."""

import pytest

from meshnet.core.errors import MeshnetError
from meshnet.engine import hub, ollama_store

FILES = ["README.md", "Qwen3-8B-Q4_K_M.gguf", "Qwen3-8B-Q8_0.gguf", "Qwen3-8B-IQ4_XS.gguf", "mmproj-Qwen3-8B-F16.gguf",
         "Q6_K/Qwen3-8B-Q6_K-00001-of-00002.gguf", "Q6_K/Qwen3-8B-Q6_K-00002-of-00002.gguf"]


@pytest.mark.parametrize("selector, picked", [
    (None, ["Qwen3-8B-Q4_K_M.gguf"]),                      # llama.cpp's default
    ("q8_0", ["Qwen3-8B-Q8_0.gguf"]),                       # any case
    ("IQ4_XS", ["Qwen3-8B-IQ4_XS.gguf"]),
    ("Q6_K", ["Q6_K/Qwen3-8B-Q6_K-00001-of-00002.gguf", "Q6_K/Qwen3-8B-Q6_K-00002-of-00002.gguf"]),   # every split
    ("Qwen3-8B-Q8_0.gguf", ["Qwen3-8B-Q8_0.gguf"]),         # a file by name
    ("Q4_K", []),                                           # not a prefix of Q4_K_M
    ("F16", []),                                            # a projector is not the model
])
def test_a_selector_picks_the_files_of_one_model(selector, picked):
    assert hub.choose(FILES, selector) == picked


def test_no_q4_k_m_takes_the_first_gguf_and_no_gguf_takes_nothing():
    assert hub.choose(["b-Q8_0.gguf", "a-F16.gguf"], None) == ["a-F16.gguf"]
    assert hub.choose(["README.md", "model.safetensors"], None) == []


@pytest.mark.parametrize("spec, parsed", [
    ("hf:bartowski/Qwen2.5-Coder-1.5B-Instruct-GGUF", ("bartowski/Qwen2.5-Coder-1.5B-Instruct-GGUF", None)),
    ("hf:org/repo:Q4_K_M", ("org/repo", "Q4_K_M")),
    ("hf:org/repo:sub/model-Q4_K_M.gguf", ("org/repo", "sub/model-Q4_K_M.gguf")),
])
def test_hugging_face_names(spec, parsed):
    assert hub.parse(spec) == parsed


@pytest.mark.parametrize("spec", ["hf:repo", "hf:org/../x", "hf:/org/repo", "hf:org/repo/extra"])
def test_a_hugging_face_name_that_is_not_one_is_refused(spec):
    with pytest.raises(MeshnetError) as refused:
        hub.parse(spec)
    assert refused.value.code == "model_not_found"


@pytest.mark.parametrize("spec, parsed", [
    ("ollama:qwen2.5-coder:1.5b", ("registry.ollama.ai", "library", "qwen2.5-coder", "1.5b")),
    ("ollama:llama3.2", ("registry.ollama.ai", "library", "llama3.2", "latest")),
    ("ollama:someone/model:q4", ("registry.ollama.ai", "someone", "model", "q4")),
    ("ollama:hf.co/org/model:Q4_K_M", ("hf.co", "org", "model", "Q4_K_M")),
])
def test_ollama_names_are_filled_in_as_ollama_fills_them(spec, parsed):
    assert ollama_store.parse(spec) == parsed


@pytest.mark.parametrize("spec", ["ollama:", "ollama:../x", "ollama:a/b/c/d", "ollama:m:..", "ollama:m:a/b"])
def test_an_ollama_name_that_would_leave_the_store_is_refused(spec):
    with pytest.raises(MeshnetError) as refused:
        ollama_store.parse(spec)
    assert refused.value.code == "model_not_found"
