"""`meshnet drift`: a route against the whole model, step by step; on one backend every
figure is exactly 0 (issue 13's CPU half). KL as plain data first."""

import json
import subprocess
import sys

import numpy as np
import pytest

from meshnet.evidence.drift import kl_divergence

from conftest import THREADS


def test_kl_is_zero_for_equal_logits_and_the_textbook_value_otherwise():
    whole = np.array([2.0, 1.0, 0.0, -1.0], dtype=np.float32)
    assert kl_divergence(whole, whole.copy()) == 0.0
    assert kl_divergence(whole, whole + 3.0) < 1e-12          # a shift is the same distribution
    route = np.array([1.0, 2.0, 0.0, -1.0], dtype=np.float32)
    w, r = whole.astype(np.float64), route.astype(np.float64)
    p, q = np.exp(w) / np.exp(w).sum(), np.exp(r) / np.exp(r).sum()
    assert abs(kl_divergence(whole, route) - float(np.sum(p * np.log(p / q)))) < 1e-9
    assert kl_divergence(whole, route) > 0


def test_a_cpu_route_drifts_by_exactly_nothing(smollm2_path):
    result = subprocess.run([sys.executable, "-m", "meshnet.cli.main", "drift", "--model", smollm2_path, "--split", "11,22",
                             "--tokens", "12", "--threads", str(THREADS), "--json"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert [s["layers"] for s in report["route"]] == ["[0,11)", "[11,22)", "[22,30)"] and report["against"] == "whole"
    assert all(s["backend"] == "CPU" and s["rss_bytes"] > 0 and s["vram_bytes"] == 0 for s in report["route"])
    assert not report["mixed"] and len(report["prompts"]) == 4
    assert report["top1_agreement"] == 1.0 and report["max_abs_logit_diff"] == 0.0 and report["max_kl"] == 0.0
    assert report["first_divergence"] is None
    assert all(p["runs_agree"] for p in report["prompts"])      # the timed run gave the same tokens
    assert report["route_decode_tok_s"] > 0 and report["whole_decode_tok_s"] > 0


def test_a_gpu_stage_without_a_gpu_engine_is_refused_with_a_clear_error(smollm2_path):
    # no GPU engine built (this machine has no GPU): the worker names the make target
    from meshnet.engine.binding import GPU_LIBRARIES
    if not any(p.exists() for p in GPU_LIBRARIES.values()):
        result = subprocess.run([sys.executable, "-m", "meshnet.cli.main", "drift", "--model", smollm2_path, "--stages", "2",
                                 "--gpu", "0", "--tokens", "2", "--threads", str(THREADS)],
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 4 and "worker for layers [0,19) exited" in result.stderr
        assert "[engine_missing] a GPU stage needs a GPU engine" in result.stderr and "make GPU=vulkan" in result.stderr
    # a process running the CPU engine is not given a GPU stage quietly on the CPU
    from meshnet.core import errors
    from meshnet.core.errors import MeshnetError
    from meshnet.engine import binding as engine

    if engine.library() is not None and engine._lib_path == engine.DEFAULT_LIBRARY:
        with pytest.raises(MeshnetError) as refused:
            engine.Stage(smollm2_path, (0, 10), n_ctx=64, max_sessions=1, gpu=True)
        assert refused.value.code == errors.NO_GPU and "a GPU stage runs in a process of its own" in refused.value.message


def test_the_cpu_engine_refuses_a_gpu_stage_in_its_own_words(smollm2_path):
    from meshnet.core import errors
    from meshnet.engine import binding as engine

    lib = engine._ffi.dlopen(str(engine.DEFAULT_LIBRARY))
    path = engine._ffi.new("char[]", smollm2_path.encode())
    params = engine._ffi.new("meshnet_stage_params *", {"model_path": path, "layer_start": 0, "layer_end": 10,
                                                        "n_ctx": 64, "max_sessions": 1, "n_batch": 8, "gpu": 1,
                                                        "numerics": 1})   # a GPU stage runs stock
    out, err = engine._ffi.new("meshnet_stage **"), engine._ffi.new("char[]", 512)
    status = lib.meshnet_stage_open(params, out, err, len(err))
    assert engine.STATUS_CODES[status] == errors.NO_GPU and out[0] == engine._ffi.NULL
    assert "built for the CPU alone" in engine._ffi.string(err).decode() and "make GPU=vulkan" in engine._ffi.string(err).decode()


def test_drift_takes_gpu_positions_inside_the_route():
    result = subprocess.run([sys.executable, "-m", "meshnet.cli.main", "drift", "--stages", "2", "--gpu", "2"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "positions 0 to 1" in result.stderr
    result = subprocess.run([sys.executable, "-m", "meshnet.cli.main", "drift", "--gpu", "head"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--gpu takes stage positions" in result.stderr
