"""Models by name from where people keep them, without the internet: `hf:ORG/REPO[:QUANT|:FILE]`
against a hub of our own on loopback (tests/hub_server.py, HF_ENDPOINT), and
`ollama:NAME[:TAG]` from an Ollama store the test lays out. Downloads are checked against
the hub's sha256, a corrupt one is refused and deleted, a stopped one resumes; an Ollama
model runs from its blob, not a copy."""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from meshnet.core.errors import MeshnetError
from meshnet.engine import models

from conftest import generated_models, last_json_line, meshnet, track
from hub_server import Hub
from peers import wait_for
from split_model import write_splits

REPO = "meshnet-test/tiny-GGUF"
PROMPT = "the quick brown fox"
CHUNK = 10 << 20   # huggingface_hub writes a download in pieces of this size


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A MESHNET_HOME and a Hugging Face cache of the test's own."""
    values = {"MESHNET_HOME": str(tmp_path / "home"), "HF_HOME": str(tmp_path / "hf"),
              "HF_HUB_DISABLE_TELEMETRY": "1"}
    for k, v in values.items():
        monkeypatch.setenv(k, v)
    return values


@pytest.fixture
def hub(env, monkeypatch):
    models_by_stem = generated_models()
    files = {"tiny-Q4_K_M.gguf": Path(models_by_stem["llama-dense"]).read_bytes(),
             "tiny-F32.gguf": Path(models_by_stem["qwen2-dense"]).read_bytes(),
             "mmproj-tiny-F16.gguf": b"not the language model", "README.md": b"# tiny\n"}
    server = Hub(REPO, files)
    monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
    env["HF_ENDPOINT"] = server.endpoint
    yield server
    server.close()


def run_tokens(model: str, env: dict) -> list[int]:
    done = meshnet("run", "--model", model, "--prompt", PROMPT, "--max-tokens", "8", "--threads", "1", "--ctx", "128",
                   "--json", "--stages", "2", timeout=300)   # the test's environment: its hub, caches, store
    assert done.returncode == 0, done.stderr[-3000:]
    return last_json_line(done.stdout)["tokens"]


def test_meshnet_run_takes_a_model_by_its_hugging_face_name_and_runs_what_it_downloaded(hub, env):
    tokens = run_tokens(f"hf:{REPO}", env)   # Q4_K_M when none is named, as llama.cpp
    assert tokens == run_tokens(generated_models()["llama-dense"], env)
    path, sha = models.resolve(f"hf:{REPO}")   # from the cache now: no second download
    assert path.name == "tiny-Q4_K_M.gguf" and str(env["HF_HOME"]) in str(path)
    assert sha == hashlib.sha256(hub.files["tiny-Q4_K_M.gguf"]).hexdigest()
    assert hub.served == {"tiny-Q4_K_M.gguf": len(hub.files["tiny-Q4_K_M.gguf"])}
    assert models.resolve(f"hf:{REPO}:f32")[0].name == "tiny-F32.gguf"
    assert models.resolve(f"hf:{REPO}:tiny-F32.gguf")[0].name == "tiny-F32.gguf"


def test_a_model_of_split_files_on_the_hub_is_found_by_pattern_and_downloaded_whole(hub, env, tmp_path):
    (tmp_path / "s").mkdir()
    for p in write_splits(generated_models()["llama-dense"], tmp_path / "s", 3):
        hub.files["Q8_0/" + p.name.replace("llama-dense", "tiny-Q8_0")] = p.read_bytes()
    path, sha = models.resolve(f"hf:{REPO}:Q8_0")
    assert path.name == "tiny-Q8_0-00001-of-00003.gguf"
    assert sorted(p.name for p in path.parent.iterdir()) == [f"tiny-Q8_0-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert sha == models.resolve(str(path))[1] != models.resolve(generated_models()["llama-dense"])[1]


def test_a_corrupt_download_is_refused_and_deleted_and_a_good_one_then_taken(hub, env):
    hub.corrupt.add("tiny-F32.gguf")
    with pytest.raises(MeshnetError) as refused:
        models.resolve(f"hf:{REPO}:F32")
    assert refused.value.code == "model_checksum" and "not the hub's" in refused.value.message
    assert not [p for p in Path(env["HF_HOME"]).rglob("*") if p.is_file() and p.stat().st_size > 1 << 20]
    hub.corrupt.clear()
    assert models.resolve(f"hf:{REPO}:F32")[1] == hashlib.sha256(hub.files["tiny-F32.gguf"]).hexdigest()


def test_a_download_whose_connection_drops_resumes_where_it_stopped(hub, env):
    big = Path(generated_models()["hy_v3-moe"]).read_bytes()
    assert len(big) > 2 * CHUNK
    hub.files["big-Q4_K_M.gguf"] = big
    del hub.files["tiny-Q4_K_M.gguf"]
    hub.cuts["big-Q4_K_M.gguf"] = [CHUNK + (1 << 20)]   # the connection drops a piece and a bit in
    path, sha = models.resolve(f"hf:{REPO}")
    assert sha == hashlib.sha256(big).hexdigest() and path.read_bytes() == big
    ranges = [r for method, p, r in hub.requests if method == "GET" and p.endswith("big-Q4_K_M.gguf")]
    assert ranges == [None, f"bytes={CHUNK}-"]
    assert hub.served["big-Q4_K_M.gguf"] == len(big) + (1 << 20)   # the drop cost only the piece it cut


def parts(env) -> list[Path]:
    return [p for p in Path(env["HF_HOME"]).rglob("*.meshnet-part")]


def test_a_download_that_cannot_finish_keeps_what_it_had_and_the_next_run_goes_on_from_there(hub, env):
    big = Path(generated_models()["hy_v3-moe"]).read_bytes()
    hub.files["big-Q4_K_M.gguf"] = big
    del hub.files["tiny-Q4_K_M.gguf"]
    # a piece arrives, then no try gets a whole piece more: huggingface_hub's retries give up
    hub.cuts["big-Q4_K_M.gguf"] = [CHUNK + (1 << 20)] + [1 << 20] * 6
    with pytest.raises(MeshnetError) as stopped:
        models.resolve(f"hf:{REPO}")
    assert stopped.value.code == "model_source" and "run it again to resume" in stopped.value.message
    assert [p.stat().st_size for p in parts(env)] == [CHUNK]
    hub.cuts.clear()
    hub.requests.clear()
    assert models.resolve(f"hf:{REPO}")[1] == hashlib.sha256(big).hexdigest()
    assert [r for method, p, r in hub.requests if method == "GET" and p.endswith("big-Q4_K_M.gguf")] == [f"bytes={CHUNK}-"]
    assert parts(env) == []


def test_a_run_killed_mid_download_is_resumed_by_the_next_and_its_bytes_are_not_fetched_again(hub, env):
    big = Path(generated_models()["hy_v3-moe"]).read_bytes()
    hub.files["big-Q4_K_M.gguf"] = big
    del hub.files["tiny-Q4_K_M.gguf"]
    hub.stalls["big-Q4_K_M.gguf"] = 2 * CHUNK + 4096   # then the hub holds the line open
    run = track(subprocess.Popen([sys.executable, "-m", "meshnet.cli.main", "run", "--model", f"hf:{REPO}",
                                  "--prompt", PROMPT, "--max-tokens", "2", "--threads", "1"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
    wait_for(lambda: [p.stat().st_size for p in parts(env)], lambda sizes: sizes == [2 * CHUNK],
             "the killed run's part of the download", timeout=120)
    os.killpg(run.pid, signal.SIGKILL)
    run.wait(timeout=60)
    del hub.stalls["big-Q4_K_M.gguf"]
    hub.requests.clear()
    path, sha = models.resolve(f"hf:{REPO}")
    assert sha == hashlib.sha256(big).hexdigest() and path.read_bytes() == big
    assert [r for method, p, r in hub.requests if method == "GET" and p.endswith("big-Q4_K_M.gguf")] == [f"bytes={2 * CHUNK}-"]
    assert hub.served["big-Q4_K_M.gguf"] == len(big) + 4096   # the killed run's unwritten tail, nothing more


def test_a_quantization_the_repository_does_not_have_is_refused_naming_what_it_has(hub, env):
    with pytest.raises(MeshnetError) as refused:
        models.resolve(f"hf:{REPO}:Q2_K")
    assert refused.value.code == "model_not_found"
    assert "tiny-F32.gguf" in refused.value.message and "mmproj" not in refused.value.message


def lay_out_ollama_store(root: Path, name: str, tag: str, gguf: Path) -> Path:
    """A store as `ollama pull` leaves it: the GGUF as a blob named by its sha256, and the
    manifest naming it beside a template layer."""
    data = gguf.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    blob = root / "blobs" / f"sha256-{digest}"
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    template = b"{{ .Prompt }}"
    (root / "blobs" / f"sha256-{hashlib.sha256(template).hexdigest()}").write_bytes(template)
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                           "digest": "sha256:" + "0" * 64, "size": 2},
                "layers": [{"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}",
                            "size": len(data)},
                           {"mediaType": "application/vnd.ollama.image.template",
                            "digest": f"sha256:{hashlib.sha256(template).hexdigest()}", "size": len(template)}]}
    path = root / "manifests" / "registry.ollama.ai" / "library" / name / tag
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest))
    return blob


def test_an_ollama_model_runs_from_its_blob_in_the_store_without_a_copy(env, tmp_path, monkeypatch):
    store = tmp_path / "ollama-models"
    blob = lay_out_ollama_store(store, "tiny", "1b", Path(generated_models()["llama-dense"]))
    env["OLLAMA_MODELS"] = str(store)
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    before = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    path, sha = models.resolve("ollama:tiny:1b")
    assert path == blob and sha == blob.name[len("sha256-"):]
    assert run_tokens("ollama:tiny:1b", env) == run_tokens(generated_models()["llama-dense"], env)
    # nothing was copied: the only new files are the hash records under MESHNET_HOME
    new = [p for p in sorted(p for p in tmp_path.rglob("*") if p.is_file()) if p not in before]
    assert all(Path(env["MESHNET_HOME"]) in p.parents for p in new)
    assert all(p.stat().st_size < 1 << 16 for p in new)


def test_an_ollama_name_not_in_the_store_or_a_damaged_blob_is_refused(env, tmp_path, monkeypatch):
    store = tmp_path / "ollama-models"
    blob = lay_out_ollama_store(store, "tiny", "latest", Path(generated_models()["llama-dense"]))
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    with pytest.raises(MeshnetError) as missing:
        models.resolve("ollama:other")
    assert missing.value.code == "model_not_found" and "tiny:latest" in missing.value.message
    with open(blob, "r+b") as f:
        f.seek(-1, 2)
        f.write(b"\x01")
    with pytest.raises(MeshnetError) as damaged:
        models.resolve("ollama:tiny")
    assert damaged.value.code == "model_checksum"
    shutil.rmtree(store / "blobs")
    with pytest.raises(MeshnetError) as gone:
        models.resolve("ollama:tiny")
    assert gone.value.code == "model_source"


def test_with_the_hub_away_the_cached_copy_runs_and_a_damaged_one_is_refused(hub, env):
    path, sha = models.resolve(f"hf:{REPO}")
    hub.close()   # no hub now: its address refuses connections
    assert models.resolve(f"hf:{REPO}") == (path, sha)
    with pytest.raises(MeshnetError) as nothing:
        models.resolve(f"hf:{REPO}:F32")   # never downloaded
    assert nothing.value.code == "model_source" and "no copy of it is in the cache" in nothing.value.message
    blob = path.resolve()
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    with pytest.raises(MeshnetError) as damaged:
        models.resolve(f"hf:{REPO}")
    assert damaged.value.code == "model_checksum"
