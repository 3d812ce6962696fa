"""ACCEPTANCE C.3 (for now: run and inspect): the command line a user types."""

import json
import subprocess
import sys

from meshnet.engine import engine_pin  # noqa: F401  (fails early when the engine is not built)
from meshnet.gguf_layout import read_layout
from meshnet.pipeline import LocalPipeline

from conftest import THREADS


def meshnet(*args):
    return subprocess.run([sys.executable, "-m", "meshnet.cli", *args], capture_output=True, text=True, timeout=300)


def last_json_line(stdout):
    return json.loads(stdout.strip().splitlines()[-1])


def test_run_with_no_arguments_splits_the_default_model_and_continues_the_prompt():
    result = meshnet("run")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("The capital of France is")
    assert len(result.stdout.strip()) > len("The capital of France is") + 10
    assert "2 stages [0,15) [15,30)" in result.stderr
    assert "decode" in result.stderr and "tok/s" in result.stderr


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


def test_run_stages_flag_splits_evenly():
    result = meshnet("run", "--json", "--stages", "3", "--max-tokens", "4")
    assert result.returncode == 0, result.stderr
    assert last_json_line(result.stdout)["metrics"]["stages"] == [[0, 10], [10, 20], [20, 30]]


def test_run_refuses_a_split_outside_the_model():
    result = meshnet("run", "--split", "40")
    assert result.returncode == 1
    assert "error: [bad_range]" in result.stderr


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
