"""GPU stages on every machine: the Vulkan engine (make GPU=vulkan) over Mesa's lavapipe, a
Vulkan device that runs on the CPU (mesa-vulkan-drivers; ggml takes it only where
GGML_VK_VISIBLE_DEVICES names it). Its speed means nothing; the GPU stage's path does: a
ranged graph on a non-CPU backend, the residual across the host, VRAM accounting, mixed
routes refused unless allowed, concurrent sessions, a GPU worker lost to a GPU spare, and
the drift from the CPU's whole model. Real worker processes on loopback, on a generated
model (the per-architecture table is tools/gpu_arch_drift.py's; a sample runs here)."""

import json
import os
import re
import signal
import sys
from pathlib import Path

import numpy as np
import pytest

from meshnet.core.metrics import prometheus_text
from meshnet.engine.binding import GPU_LIBRARIES
from meshnet.launch.local_cluster import LocalCluster

from conftest import generated_models, run_bounded
from streams import follow_while

ROOT = Path(__file__).resolve().parents[2]
VULKAN = GPU_LIBRARIES["vulkan"]
IN_CI = os.environ.get("CI", "").lower() in ("true", "1", "yes")
LAVAPIPE = {"GGML_VK_VISIBLE_DEVICES": "0", "MESHNET_GPU_ENGINE": "vulkan"}
MODEL = "llama-dense"
HALVES = [(0, 2), (2, 4)]
MAX_TOKENS = 64
# this model's rows on lavapipe differ from the CPU's, and from their own in another
# batching, by under 1e-4 (measured: tools/gpu_arch_drift.py); a token whose top-1 lead is
# over this cannot be flipped by that
SAFE_LEAD = 1e-3
BOUND_S = 300


@pytest.fixture(scope="module", autouse=True)
def lavapipe():
    # CI (.ci/run installs Debian's Vulkan packages and builds the engine) must run these;
    # a user's machine without the Vulkan engine skips them, saying how to get it
    if not VULKAN.exists():
        why = ("the Vulkan engine is not built: `make GPU=vulkan` (Debian: apt-get install glslc libvulkan-dev "
               "spirv-headers mesa-vulkan-drivers)")
        if IN_CI:
            pytest.fail(f"{why}; CI=true: required here")
        pytest.skip(why)
    with pytest.MonkeyPatch.context() as mp:
        for k, v in LAVAPIPE.items():
            mp.setenv(k, v)
        yield


@pytest.fixture(scope="module")
def model():
    path = generated_models().get(MODEL)
    if path is None:
        pytest.skip("no generated models: make test-models")
    return path


def drift(model, *args):
    done = run_bounded([sys.executable, "-m", "meshnet.cli.main", "drift", "--model", model, "--tokens", "8",
                        "--threads", "1", "--json", *args], timeout=BOUND_S)
    report = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else None
    return done, report


def test_a_whole_model_gpu_stage_reports_vulkan_its_device_and_memory_and_agrees_with_the_cpu(model):
    done, report = drift(model, "--stages", "1", "--gpu", "0")
    assert done.returncode == 0, done.stderr[-3000:]
    [stage] = report["route"]
    assert stage["backend"] == "Vulkan" and stage["device"], stage   # lavapipe here: llvmpipe
    assert stage["vram_bytes"] >= stage["model_bytes"] > 0
    assert report["top1_agreement"] == 1.0 and report["first_divergence"] is None
    assert report["max_abs_logit_diff"] < 1e-3 and report["max_kl"] < 1e-6   # another backend: close
    assert all(p["runs_agree"] for p in report["prompts"])


def test_without_gpu_visible_devices_a_software_device_is_not_taken_and_the_error_says_how(model, monkeypatch):
    monkeypatch.delenv("GGML_VK_VISIBLE_DEVICES")
    done, report = drift(model, "--stages", "1", "--gpu", "0")
    if report is not None:   # a machine with a real GPU runs it there
        assert "llvmpipe" not in report["route"][0]["device"]
        return
    assert "[no_gpu] this engine has a GPU backend but it finds no GPU" in done.stderr, done.stderr[-3000:]
    assert "GGML_VK_VISIBLE_DEVICES names it" in done.stderr


@pytest.mark.parametrize("gpu", ["0", "1"], ids=["gpu head", "gpu tail"])
def test_a_gpu_stage_beside_a_cpu_one_runs_only_with_allow_mixed(model, gpu):
    refused, _ = drift(model, "--stages", "2", "--gpu", gpu)
    assert refused.returncode != 0, refused.stderr[-3000:]
    assert re.search(r"incompatible class: .* backend (CPU vs Vulkan|Vulkan vs CPU)", refused.stderr), refused.stderr[-3000:]
    done, report = drift(model, "--stages", "2", "--gpu", gpu, "--allow-mixed")
    assert done.returncode == 0, done.stderr[-3000:]
    assert [s["backend"] for s in report["route"]] == (["Vulkan", "CPU"] if gpu == "0" else ["CPU", "Vulkan"])
    assert report["mixed"] and report["top1_agreement"] == 1.0 and report["max_abs_logit_diff"] < 1e-3


def test_two_gpu_stages_are_one_class_and_agree_with_the_cpu(model):
    done, report = drift(model, "--stages", "2", "--gpu", "all")
    assert done.returncode == 0, done.stderr[-3000:]
    assert [s["backend"] for s in report["route"]] == ["Vulkan", "Vulkan"] and not report["mixed"]
    assert all(s["vram_bytes"] > 0 for s in report["route"])
    assert report["top1_agreement"] == 1.0 and report["max_abs_logit_diff"] < 1e-3


# ---- a route of two GPU workers under a coordinator ----------------------------------------

PROMPTS = [np.random.default_rng(seed).integers(0, 128, 40 + 9 * seed).tolist() for seed in range(4)]


@pytest.fixture(scope="module")
def cluster(model):
    # the invariant class on the GPU (Vulkan's row-invariant mode, patch 0018): a session's
    # rows do not depend on the company they are computed in, so a replay is exact
    with LocalCluster(model, HALVES, threads=1, n_ctx=256, max_sessions=4, gpu_stages=[0, 1], prefill_chunk=16,
                      heartbeat_interval=0.1, heartbeat_liveness=10, prefix_cache_mib=0, numerics="invariant") as c:
        spares = []
        try:
            yield c, spares
        finally:
            for p in spares:
                if p.poll() is None:
                    p.kill()
                    p.wait()


@pytest.fixture(scope="module")
def alone(cluster, model):
    """Each prompt's tokens run alone, and a check that none of them is a near tie on the
    CPU's whole model (so a batching difference cannot flip it: the sessions' isolation
    is then seen in their tokens)."""
    from meshnet.evidence import parity
    from meshnet.evidence.gpu_drift import forced

    coordinator = cluster[0].coordinator
    tokens = [coordinator.generate(p, MAX_TOKENS, stop_at_eog=False).result(BOUND_S).tokens for p in PROMPTS]
    with parity.route(model, None, n_ctx=256, max_sessions=1, n_threads=1) as cpu:
        for prompt, got in zip(PROMPTS, tokens):
            rows = forced(cpu, np.array(prompt, dtype=np.int32), got)
            assert [int(np.argmax(r)) for r in rows[:-1]] == got   # the GPU route picks the CPU's tokens
            leads = [float(np.sort(r)[-1] - np.sort(r)[-2]) for r in rows[:-1]]
            assert min(leads) > SAFE_LEAD, leads
    return tokens


def together(coordinator):
    handles = [coordinator.generate(p, MAX_TOKENS, stop_at_eog=False) for p in PROMPTS]
    return handles


def test_four_concurrent_sessions_on_gpu_stages_each_get_what_they_get_alone(cluster, alone):
    workers = cluster[0].coordinator.workers_snapshot()
    assert {(w["backend"], w["numerics"]) for w in workers} == {("Vulkan", "invariant")}, workers
    handles = together(cluster[0].coordinator)
    assert [h.result(BOUND_S).tokens for h in handles] == alone


def test_the_metrics_name_each_gpu_stage_s_vram(cluster, alone):
    snapshot = cluster[0].coordinator.metrics()
    text = prometheus_text(snapshot)
    lines = [line for line in text.splitlines() if line.startswith("meshnet_stage_vram_bytes{")]
    assert len(lines) == 2 and all(float(line.split()[-1]) > 0 for line in lines), lines


def test_a_killed_gpu_worker_is_replaced_by_a_gpu_spare_and_no_session_is_lost(cluster, alone):
    c, spares = cluster
    layers = HALVES[1]
    in_route = c.processes[layers]
    spare = c.spawn_worker(layers)   # (now the cluster's process for those layers)
    spares.append(spare)
    c.wait_offered(spare, timeout=BOUND_S)
    handles = together(c.coordinator)
    got, failures = follow_while(handles, lambda: os.kill(in_route.pid, signal.SIGKILL), after_tokens=3,
                                 timeout=BOUND_S)
    in_route.wait(30)
    assert failures == [None] * 4
    assert got == alone   # the replay on the spare, in the GPU's invariant class, gives the same tokens
    for h in handles:
        [resumed] = h.metrics["resumed"]
        assert resumed["stage"] == "[2,4)" and resumed["generated_before"] >= 3


def test_a_sample_of_architectures_on_a_gpu_stage_drifts_little_from_the_cpu(tmp_path):
    """The per-architecture table (tools/gpu_arch_drift.py) on a sample here: a dense, a
    mixture of experts, a recurrent, a hybrid and a sliding-window model, each on a
    GPU stage alone and beside a CPU one."""
    sample = r"^(llama-dense|qwen3moe-moe|mamba2-dense|granitehybrid-dense|gemma3-dense)\.gguf$"
    done = run_bounded([sys.executable, str(ROOT / "tools" / "gpu_arch_drift.py"), "--only", sample,
                        "--json", str(tmp_path / "drift.json")], timeout=BOUND_S * 3)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "drift.json").read_text())
    assert len(results) == 5, done.stdout
    for name, r in results.items():
        assert "error" not in r, (name, r)
        assert r["splits"] and set(r["routes"]) == {"GPU whole", "GPU head, CPU tail", "CPU head, GPU tail"}, name
        for route, d in r["routes"].items():
            assert d["top1_agreement"] == 1.0 and d["max_abs_logit_diff"] < 1e-2, (name, route, d)
        assert max(r["batching"].values()) > 0, name   # the stock class's GPU rows change with the batching
    # in the invariant class (Vulkan's row-invariant mode) they do not, on the architectures
    # that the table (tools/gpu_arch_drift.py) gives as exact: a dense and a mixture of experts
    for name in ("llama-dense", "qwen3moe-moe"):
        assert set(results[name]["batching_invariant"].values()) == {0.0}, results[name]
