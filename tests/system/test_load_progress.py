"""A worker loading its range says how far it got: in its health (llama.cpp's
progress_callback), so in `meshnet status --json`, in the bars of `meshnet coordinator`,
`meshnet status` and `meshnet run`, and on its stderr. A real load of SmolLM2, slowed by
a test hook (each step of the progress waits), by a worker given its range (`--layers
0:30`, which connects first and offers the range once loaded) or planned for (`--layers
auto`), in front of a real `meshnet coordinator`."""

import json
import os
import subprocess
import sys
import time

import pytest

from conftest import THREADS, meshnet, run_bounded, stop_group, track
from peers import free_port


@pytest.mark.parametrize("layers", [["--layers", "0:30"], ["--layers", "auto", "--mem", "2G"]], ids=["given", "auto"])
def test_a_slow_load_reports_rising_progress_in_status_json_and_on_stderr(smollm2_path, tmp_path, layers):
    port, metrics_port = free_port(), free_port()
    address = f"tcp://127.0.0.1:{port}"
    coordinator = track(subprocess.Popen(
        [sys.executable, "-m", "meshnet.cli.main", "coordinator", "--bind", address, "--metrics-port", str(metrics_port),
         "--insecure"],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "coordinator.err", "w"), start_new_session=True))
    worker_err = tmp_path / "worker.err"
    worker = track(subprocess.Popen(
        [sys.executable, "-m", "meshnet.cli.main", "worker", "--coordinator", address, *layers,
         "--threads", str(THREADS), "--model", smollm2_path],
        env=dict(os.environ, MESHNET_TEST_SLOW_LOAD_MS="40"), stdout=subprocess.DEVNULL, stderr=open(worker_err, "w"),
        start_new_session=True))
    try:
        seen, tables, deadline = [], [], time.monotonic() + 240
        while True:
            assert time.monotonic() < deadline, f"no route after {seen}: {worker_err.read_text()[-2000:]}"
            result = meshnet("status", "--url", f"http://127.0.0.1:{metrics_port}", "--json", timeout=60)
            if result.returncode == 0:
                stages = json.loads(result.stdout)["stages"]
                loading = [s for s in stages if s.get("state") == "loading"]
                if loading and loading[0].get("load_progress") is not None:
                    seen.append(loading[0]["load_progress"])
                    if len(tables) < 2:   # and the table of `meshnet status` draws its bar
                        tables.append(meshnet("status", "--url", f"http://127.0.0.1:{metrics_port}", timeout=60).stdout)
                if stages and all(s.get("in_route") for s in stages):
                    assert stages[0]["load_progress"] == 1.0 and stages[0]["load_seconds"] > 0
                    break
            time.sleep(0.2)
        # rising while it loaded, seen more than once on the way
        assert len(set(seen)) >= 2 and seen == sorted(seen) and 0 <= seen[0] < seen[-1] <= 1, seen
        said = [line for line in worker_err.read_text().splitlines() if "loading layers [0,30)" in line]
        assert said and said[-1].endswith("100%"), said
        bars = [line.strip() for line in (tmp_path / "coordinator.err").read_text().splitlines() if "#" in line]
        assert bars and all(line.startswith("loading [0,30)") and line.endswith("%") for line in bars), bars
        drawn = [line for table in tables for line in table.splitlines() if line.startswith("loading [0,30)")]
        assert any(line.endswith("%") and "[" in line.split(": ", 1)[1] for line in drawn), tables
    finally:
        for process in (worker, coordinator):
            stop_group(process)


def test_meshnet_run_draws_a_bar_per_stage_while_its_workers_load(smollm2_path):
    result = run_bounded([sys.executable, "-m", "meshnet.cli.main", "run", "--model", smollm2_path, "--max-tokens", "4",
                          "--threads", str(THREADS)], env=dict(os.environ, MESHNET_TEST_SLOW_LOAD_MS="10"), timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    bars = [line for line in result.stderr.splitlines() if line.startswith("loading [")]
    for label in ("[0,19)", "[19,30)"):
        mine = [int(line.rsplit(" ", 1)[1].rstrip("%")) for line in bars if line.startswith(f"loading {label}")]
        assert mine and mine == sorted(mine), bars   # the stage's bar, drawn as it rose
    # the workers' own lines of it are not echoed beside the bars; their summaries are
    assert "meshnet worker: loading layers" not in result.stderr
    assert result.stderr.count("meshnet worker: loaded layers") == 2, result.stderr[-2000:]
    assert result.stdout.startswith("The capital of France is"), result.stdout
