"""ACCEPTANCE section D: metrics, `meshnet bench`, and `meshnet accept` evidence."""

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import jsonschema

from meshnet.evidence.bench import format_report
from meshnet.evidence.prompts import PROSE
from meshnet.launch.local_cluster import LocalCluster
from meshnet.net.metrics_server import MetricsServer

from conftest import THREADS

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = json.loads((ROOT / "evidence" / "manifest.schema.json").read_text())


def meshnet(*args, env=None):
    return subprocess.run([sys.executable, "-m", "meshnet.cli.main", *args], capture_output=True, text=True, timeout=600,
                          env=env)


def manifest_in(out_dir: Path) -> dict:
    (run_dir,) = out_dir.iterdir()
    assert (run_dir / "README.md").read_text().startswith("# meshnet acceptance run")
    manifest = json.loads((run_dir / "manifest.json").read_text())
    jsonschema.validate(manifest, SCHEMA)
    return manifest


def test_accept_passes_and_writes_a_manifest_that_matches_the_schema(tmp_path, smollm2_path):
    result = meshnet("accept", "--out", str(tmp_path), "--threads", str(THREADS))
    assert result.returncode == 0, result.stdout + result.stderr
    manifest = manifest_in(tmp_path)
    assert manifest["passed"]
    checks = {c["name"]: c for c in manifest["checks"]}
    # the schema allows entries from its list: each check must be there, once
    assert len(manifest["checks"]) == 10 and set(checks) == {
        "whole_model_parity", "greedy_decode_32", "four_session_isolation", "cancellation", "cleanup", "kill_worker",
        "planned_route", "standby_replaces_lost_stage", "stock_llama_cpp_invariant", "stock_llama_cpp_stock"}
    assert all(c["status"] == "passed" for c in checks.values())
    assert manifest["numerics"] == "invariant"
    for name in ("stock_llama_cpp_invariant", "stock_llama_cpp_stock"):
        assert checks[name]["agreed"] == "8 of 8" and len(checks[name]["per_prompt"]) == 8
    assert checks["whole_model_parity"]["tokens_equal"] and len(checks["whole_model_parity"]["tokens"]) == 32
    assert checks["whole_model_parity"]["max_abs_logit_diff"] == 0.0
    assert checks["kill_worker"]["error"]["code"] == "stage_lost"
    assert checks["kill_worker"]["seconds_to_error"] <= checks["kill_worker"]["bound_seconds"]
    planned = checks["planned_route"]
    assert planned["one_node_refused"]["refused"] and planned["one_node_refused"]["shortfall_bytes"] > 0
    assert len(planned["route"]) == 2 and all(n <= planned["budget_bytes"] for n in planned["rss_bytes"].values())
    assert checks["standby_replaces_lost_stage"]["new_session_ok"]
    assert manifest["identity"]["model"]["sha256"] == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert manifest["metrics"]["session"]["decode_tok_s"] > 0
    assert all(s["rss_bytes"] > 0 and s["vram_bytes"] == 0 for s in manifest["metrics"]["stages"])   # CPU stages
    (run_dir,) = tmp_path.iterdir()
    assert "Memory per stage at the end of the run: [0,19) RSS" in (run_dir / "README.md").read_text()


def test_accept_reports_a_corrupted_check_as_failed_and_exits_nonzero(tmp_path, smollm2_path):
    env = dict(os.environ, MESHNET_TEST_FAULT="wrong_logits")  # test-only: the tail worker corrupts its logits
    # (the parity check alone: the full run is the test above)
    result = meshnet("accept", "--out", str(tmp_path), "--threads", str(THREADS), "--only", "whole_model_parity",
                     env=env)
    assert result.returncode == 1
    assert "failed  whole_model_parity" in result.stdout
    manifest = manifest_in(tmp_path)
    assert not manifest["passed"] and manifest["only"] == ["whole_model_parity"]
    parity = next(c for c in manifest["checks"] if c["name"] == "whole_model_parity")
    assert parity["status"] == "failed" and parity["max_abs_logit_diff"] > 0
    others = [c for c in manifest["checks"] if c["name"] != "whole_model_parity"]
    assert len(others) == 9 and all(c["status"] == "not_run" and c.get("not_asked") for c in others)


def test_accept_refuses_a_check_it_does_not_have(tmp_path):
    result = meshnet("accept", "--out", str(tmp_path), "--only", "whole_model_parity", "--only", "speed")
    assert result.returncode != 0 and "no check named speed" in result.stderr
    assert not any(tmp_path.iterdir())


def test_bench_prints_every_configuration_with_spread_and_the_cost_of_keys(arch_models):
    result = meshnet("bench", "--model", arch_models["llama"], "--repeats", "1", "--decode", "8", "--threads",
                     str(THREADS), "--json")
    assert result.returncode == 0, result.stderr
    (report,) = json.loads(result.stdout.strip().splitlines()[-1])
    configs = report["configs"]
    assert set(configs) == {"whole", "stages", "workers", "plain"}
    assert report["keys_over_plain_decode_tok_s"] > 0   # keyed and plain workers, side by side in one run
    for entry in configs.values():
        assert entry["decode_tok_s"]["median"] > 0 and entry["decode_tok_s"]["n"] == len(PROSE)
        assert entry["decode_tok_s"]["min"] <= entry["decode_tok_s"]["median"] <= entry["decode_tok_s"]["max"]
    assert configs["whole"]["decode_tok_s_ratio"] == 1.0
    assert configs["workers"]["hop_us_p50"]["median"] > 0
    row = report["n_embd"] * 4
    assert configs["stages"]["seam_bytes_per_token"]["median"] == row
    # through workers: one crossing of each seam per decode token, the rows and a header of at most 128 bytes
    assert configs["workers"]["decode_crossings_per_token"]["median"] == 1.0
    assert row < configs["workers"]["decode_seam_bytes_per_token"]["median"] <= row + 128
    assert len(configs["workers"]["rss_bytes"]) == 2
    # what a person reads: each configuration on its line with median [min-max]
    text = format_report(report)
    for entry in configs.values():
        decode = entry["decode_tok_s"]
        line = next(line for line in text.splitlines() if line.startswith(entry["label"]))
        assert f"{decode['median']:.1f} [{decode['min']:.1f}-{decode['max']:.1f}]" in line
    assert f"workers with CURVE keys (the default) / without, one session: {report['keys_over_plain_decode_tok_s']:.3f}" in text
    # the ratio as the median of the runs side by side: the i-th runs of both, one prompt, seconds apart
    paired, medians = report["workers_over_stages_paired_decode_tok_s"], report["workers_over_stages_decode_tok_s"]
    assert paired > 0 and f"one session: {medians:.3f} (median of the runs side by side: {paired:.3f})" in text


def test_metrics_are_served_as_prometheus_text_and_json(smollm2_path):
    with LocalCluster(smollm2_path, [(0, 15), (15, 30)], threads=THREADS, n_ctx=256, max_sessions=1) as cluster:
        coordinator = cluster.coordinator
        prompt = coordinator.tokenize("Hello there")
        coordinator.generate(prompt, 4, stop_at_eog=False).result()
        server = MetricsServer(coordinator.metrics, 0)
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics").read().decode()
            status = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{server.port}/status").read())
        finally:
            server.close()
    assert 'meshnet_stage_rss_bytes{stage="[0,15)"' in text
    assert 'meshnet_stage_vram_bytes{stage="[0,15)"' in text and status["stages"][0]["vram_bytes"] == 0   # CPU
    assert "meshnet_hop_latency_us_p50" in text and 'meshnet_sessions_total{outcome="completed"} 1' in text
    tail = status["stages"][1]
    assert tail["stage"] == "[15,30)"
    # the prompt, then 3 decode steps: f32 rows and a header of at most 128 bytes each
    assert 0 < tail["seam_bytes"] - (len(prompt) + 3) * 576 * 4 <= 4 * 128
    assert tail["model_bytes"] > 0 and tail["forwards"] == 4 and tail["rss_bytes"] > tail["model_bytes"]


def test_bench_trace_tells_where_each_decode_token_s_time_goes_on_every_process(arch_models, tmp_path):
    result = meshnet("bench", "--model", arch_models["llama"], "--configs", "workers", "--repeats", "1", "--decode", "8",
                     "--threads", "1", "--trace", str(tmp_path), "--json")
    assert result.returncode == 0, result.stderr
    (report,) = json.loads(result.stdout.strip().splitlines()[-1])
    table = report["timeline"]
    rows = {(r["where"], r["span"]): r for r in table["rows"]}
    route = [f"[{a},{b})" for a, b in report["stages"]]
    decode_steps = len(PROSE) * 8   # every prompt decodes 8 tokens after its first
    for where in route:
        for span in ("receive", "decode", "wait", "forward", "send_next"):
            assert rows[(where, span)]["n"] >= decode_steps and rows[(where, span)]["us"] >= 0, (where, span)
    assert rows[(route[0], f"hop in (from {route[-1]})")]["us"] > 0    # the ring: the tail feeds the head
    assert rows[(route[1], f"hop in (from {route[0]})")]["us"] > 0
    assert rows[("coordinator", "coordinator")]["n"] >= decode_steps
    assert 0 < table["critical_us"] and table["period_us"] > 0
    assert all(len(cpus) >= 1 for cpus in table["forward_cpus"].values())
    saved = json.loads((tmp_path / "timeline.json").read_text())
    assert [t["where"] for t in saved["timelines"]] == [*route, "coordinator"]
    assert "<rect" in (tmp_path / "timeline.svg").read_text()
    assert "unexplained" in (tmp_path / "timeline.txt").read_text()


def test_bench_measures_each_numerics_class_side_by_side_against_the_engine_before_them(arch_models):
    model = ("--model", arch_models["llama"])   # the classes' figures side by side: any model shows them
    result = meshnet("bench", *model, "--configs", "workers", "--numerics", "invariant,stock,baseline", "--repeats",
                     "1", "--decode", "8", "--threads", str(THREADS), "--json")
    assert result.returncode == 0, result.stderr
    (report,) = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(report["configs"]) == {"workers", "workers-stock", "workers-baseline"}
    assert report["numerics"] == ["invariant", "stock", "baseline"]
    for pair in ("invariant/baseline", "stock/baseline", "invariant/stock"):
        assert report["numerics_ratios"][pair]["decode_tok_s"] > 0
        assert report["numerics_ratios"][pair]["prefill_tok_s"] > 0
    printed = meshnet("bench", *model, "--configs", "workers", "--numerics", "stock,baseline", "--repeats", "1",
                      "--decode", "4", "--threads", str(THREADS))
    assert printed.returncode == 0, printed.stderr
    assert "workers, numerics stock / baseline: prefill" in printed.stdout
    refused = meshnet("bench", *model, "--numerics", "baseline,stock")
    assert refused.returncode == 2 and "baseline not first" in refused.stderr
