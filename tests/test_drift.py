"""`meshnet drift`: a route against the whole model, step by step; on one backend every
figure is exactly 0 (issue 13's CPU half). KL as plain data first."""

import json
import subprocess
import sys

import numpy as np

from meshnet.drift import kl_divergence

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
    result = subprocess.run([sys.executable, "-m", "meshnet.cli", "drift", "--model", smollm2_path, "--split", "11,22",
                             "--tokens", "12", "--threads", str(THREADS), "--json"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["route"] == ["[0,11)", "[11,22)", "[22,30)"] and report["against"] == "whole"
    assert len(report["prompts"]) == 4
    assert report["top1_agreement"] == 1.0 and report["max_abs_logit_diff"] == 0.0 and report["max_kl"] == 0.0
    assert report["first_divergence"] is None
