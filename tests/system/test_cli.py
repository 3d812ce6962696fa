"""ACCEPTANCE C.3 (for now: run and inspect): the command line a user types."""

import fcntl
import json
import os
import signal
import subprocess
import sys
import time

from meshnet.launch.local_cluster import children_of
from meshnet.engine.binding import engine_pin  # noqa: F401  (fails early when the engine is not built)
from meshnet.engine.gguf_layout import read_layout
from meshnet.engine.pipeline import LocalPipeline

from conftest import THREADS, last_json_line, meshnet
from peers import alive


def test_run_with_no_arguments_splits_the_default_model_and_continues_the_prompt(smollm2_path):
    result = meshnet("run")
    assert result.returncode == 0, result.stderr
    assert "2 stages [0,19) [19,30) as worker processes" in result.stderr  # even shares of the work
    assert "decode" in result.stderr and "tok/s" in result.stderr
    # the continuation is the whole model's, streamed piece by piece (the same default
    # thread count, one per core, gives the same floats); not just any text
    prompt = "The capital of France is"
    with LocalPipeline(smollm2_path, [(0, 30)], n_ctx=2048, max_sessions=1) as whole:
        expected = whole.generate(whole.head.tokenize(prompt), 48)
        pieces = b"".join(whole.tail.detokenize_bytes([t]) for t in expected.tokens)
    assert result.stdout == prompt + pieces.decode(errors="replace") + "\n"


def test_run_json_gives_the_whole_model_tokens(smollm2_path):
    prompt = "Water boils at a temperature of"
    result = meshnet("run", "--json", "--split", "10,20", "--max-tokens", "16", "--threads", str(THREADS), "--prompt", prompt)
    assert result.returncode == 0, result.stderr
    report = last_json_line(result.stdout)
    assert report["metrics"]["stages"] == [[0, 10], [10, 20], [20, 30]]
    with LocalPipeline(smollm2_path, [(0, 30)], n_ctx=2048, max_sessions=1, n_threads=THREADS) as whole:
        expected = whole.generate(whole.head.tokenize(prompt), 16)
        assert report["tokens"] == expected.tokens
        assert report["text"] == whole.tail.detokenize(expected.tokens)
    for key in ("ttft_ms", "prefill_tok_s", "decode_tok_s", "seam_bytes"):
        assert report["metrics"][key] > 0


def test_run_stages_flag_splits_the_work_evenly(smollm2_path):
    result = meshnet("run", "--json", "--stages", "3", "--max-tokens", "4")
    assert result.returncode == 0, result.stderr
    # SmolLM2's output matrix (tied to its 49152 x 576 embeddings) is worth 8 of its layers:
    # the tail holds fewer layers
    assert last_json_line(result.stdout)["metrics"]["stages"] == [[0, 12], [12, 25], [25, 30]]


def test_run_refuses_a_split_outside_the_model_with_the_code_and_its_exit_status(arch_models):
    result = meshnet("run", "--model", arch_models["llama"], "--split", "6")   # a 4-layer generated model
    assert result.returncode == 3  # a problem with the model or its range
    assert "error: [bad_range]" in result.stderr
    missing = meshnet("run", "--model", "/nonexistent/model.gguf")
    assert missing.returncode == 3 and "[model_not_found]" in missing.stderr


def test_inspect_reports_the_layout_from_the_gguf(smollm2_path):
    result = meshnet("inspect", "--json")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert (info["arch"], info["n_layer"], info["n_embd"], info["n_vocab"]) == ("llama", 30, 576, 49152)
    assert info["sha256"] == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    layout = read_layout(smollm2_path)
    assert info["layer_bytes"] == layout.layer_bytes and len(info["layer_bytes"]) == 30
    assert sum(info["layer_bytes"]) + info["input_bytes"] + info["output_bytes"] < info["file_bytes"]
    assert "Q4_1" in info["quant_types"]
    text = meshnet("inspect")
    assert "layer 29" in text.stdout and "tied" in text.stdout


def test_run_in_process_and_on_workers_give_the_same_tokens(arch_models):
    args = ("run", "--model", arch_models["llama"], "--json", "--max-tokens", "12", "--threads", str(THREADS),
            "--prompt", "A good breakfast is")
    on_workers, in_process = meshnet(*args), meshnet(*args, "--in-process")
    assert on_workers.returncode == 0 and in_process.returncode == 0, on_workers.stderr + in_process.stderr
    a, b = last_json_line(on_workers.stdout), last_json_line(in_process.stdout)
    assert a["tokens"] and a["tokens"] == b["tokens"] and a["text"] == b["text"]
    # `workers` only echoes the flag; hops are measured only where a coordinator sent something
    assert a["metrics"]["workers"] and not b["metrics"]["workers"]
    assert a["metrics"]["hop_us_p50"] > 0 and "hop_us_p50" not in b["metrics"]


def test_ctrl_c_during_run_leaves_no_worker_processes(smollm2_path):
    # SmolLM2 for a run that lasts: a generated model gives its 1500 tokens in a few seconds
    prompt = "Count from one to one thousand: one, two, three,"
    run = subprocess.Popen([sys.executable, "-m", "meshnet.cli.main", "run", "--max-tokens", "1500", "--ctx", "2048",
                            "--prompt", prompt], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    # its output into a pipe of one page (1500 tokens are more): once this test stops reading,
    # the run waits to write, so it cannot end on its own before the interrupt, however late
    # the interrupt comes
    fcntl.fcntl(run.stdout.fileno(), fcntl.F_SETPIPE_SZ, 4096)
    children = []
    try:
        deadline = time.monotonic() + 60
        while len(children) < 2 and time.monotonic() < deadline:
            children = children_of(run.pid)
            time.sleep(0.1)
        assert len(children) == 2, "meshnet run did not start its two workers"
        # generating: the prompt is echoed with the first token, so wait for more than the prompt
        out = b""
        while len(out) <= len(prompt):
            chunk = run.stdout.read1(64)
            assert chunk, f"meshnet run ended before generating: {run.wait()} {run.stderr.read().decode()[-500:]}"
            out += chunk
        assert all(alive(pid) for pid in children) and run.poll() is None  # so the interrupt is what ends them
        run.send_signal(signal.SIGINT)
        rest, err = run.communicate(timeout=30)   # (read: what it had still to write must not hold it)
        assert run.returncode != 0 and "Aborted!" in err.decode(), err.decode()[-2000:]
        assert "tokens (length)" not in err.decode()   # interrupted: it never came to its summary of 1500 tokens
        assert "Traceback" not in err.decode()
        deadline = time.monotonic() + 5
        while any(alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(alive(pid) for pid in children)
    finally:
        if run.poll() is None:
            run.kill()
        for pid in children:  # a failed run must not leave them to the next test
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_coordinator_and_worker_commands_serve_a_prompt(smollm2_path):
    prompt = "The capital of France is"
    port = 20000 + os.getpid() % 20000
    address = f"tcp://127.0.0.1:{port}"
    data_address = f"tcp://127.0.0.1:{port + 1}"
    coordinator = subprocess.Popen([sys.executable, "-m", "meshnet.cli.main", "coordinator", "--bind", address, "--prompt", prompt,
                                    "--max-tokens", "12", "--json", "--wait", "60", "--data-bind", data_address,
                                    "--insecure"],
                                   stdout=subprocess.PIPE, text=True)
    workers = [subprocess.Popen([sys.executable, "-m", "meshnet.cli.main", "worker", "--coordinator", address,
                                 "--layers", layers, "--threads", str(THREADS)]) for layers in ("0:15", "15:30")]
    try:
        out, _ = coordinator.communicate(timeout=120)
        assert coordinator.returncode == 0
        report = last_json_line(out)
        with LocalPipeline(smollm2_path, [(0, 30)], n_ctx=2048, max_sessions=1, n_threads=THREADS) as whole:
            assert report["tokens"] == whole.generate(whole.head.tokenize(prompt), 12).tokens
        # every stage's own numbers come with the run, from the workers themselves
        assert [s["stage"] for s in report["stages"]] == ["[0,15)", "[15,30)"]
        assert all(s["rss_bytes"] > 0 and s["model_bytes"] > 0 for s in report["stages"])
    finally:
        for w in workers:
            w.terminate()
        assert [w.wait(timeout=30) for w in workers] == [0, 0]


def test_plan_splits_qwen_over_two_nodes_that_cannot_hold_it_alone_and_refuses_one_with_the_shortfall(qwen_path):
    nodes = ["--node", "laptop=1G", "--node", "mini=1G", "--ctx", "512", "--sessions", "2"]
    result = meshnet("plan", qwen_path, *nodes, "--json")
    assert result.returncode == 0, result.stderr
    stages = json.loads(result.stdout)["stages"]
    assert [s["node"] for s in stages] == ["laptop", "mini"]
    assert stages[0]["layers"][0] == 0 and stages[0]["layers"][1] == stages[1]["layers"][0] and stages[1]["layers"][1] == 28
    assert all(0 < s["bytes"] <= 1 << 30 for s in stages)

    table = meshnet("plan", qwen_path, *nodes)
    assert table.returncode == 0 and "laptop" in table.stdout and f"[0,{stages[0]['layers'][1]})" in table.stdout

    alone = meshnet("plan", qwen_path, "--node", "laptop=1G", "--ctx", "512", "--sessions", "2")
    assert alone.returncode == 3
    assert "model_does_not_fit" in alone.stderr and "bytes" in alone.stderr and "short" in alone.stderr

    bad = meshnet("plan", qwen_path, "--node", "laptop")
    assert bad.returncode == 2 and "NAME=MEM" in bad.stderr


def test_plan_says_what_a_tensor_parallel_group_would_give_from_figures_it_measures(qwen_path):
    result = meshnet("plan", qwen_path, "--node", "laptop=2G", "--node", "mini=2G", "--ctx", "512", "--tp", "2", "--json")
    assert result.returncode == 0, result.stderr
    group = json.loads(result.stdout)["tensor_parallel"]
    # Qwen2.5-Coder-1.5B: 28 layers x 4 gathers and the logits; half of each gathered row sent
    assert group["members"] == 2 and group["gathers_per_token"] == 113
    assert round(group["sent_bytes_per_token"] / 1e3) == 1069
    assert group["whole_ms"] > 0 and group["loopback_gather_us"] > 0 and group["loopback_bandwidth"] > 0
    assert group["member_ms"] == group["whole_ms"] * group["member_share"]
    # a faster link leaves more time for each gather
    at = group["break_even_gather_us"]
    assert at["1 GbE"] < at["2.5 GbE"] < at["10 GbE"]
    table = meshnet("plan", qwen_path, "--node", "laptop=2G", "--node", "mini=2G", "--ctx", "512", "--tp", "2")
    assert table.returncode == 0 and "a tensor-parallel group of 2: 113 gathers a token" in table.stdout
