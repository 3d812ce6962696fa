"""`meshnet serve --coordinator ... --mem` on one "machine" and `MESHNET_JOIN=TOKEN meshnet worker`
on another (a MESHNET_HOME of its own, no model file), as the README's two commands: serve
prints the join line, its own worker takes what --mem holds, the joined worker fetches
the rest, and a completion through the real OpenAI client is the whole model's."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.request

import openai

from meshnet.core.planner import ModelCost, stage_need, worker_settings
from meshnet.engine.binding import layer_memory
from meshnet.engine.gguf_layout import read_layout
from meshnet.engine.pipeline import LocalPipeline

from conftest import THREADS, stop_group, track, whole_model_tokens
from peers import free_port, wait_until

PROMPT = "The capital of France is"


def test_serve_prints_the_join_line_and_a_machine_without_the_model_joins_with_it(smollm2_path, tmp_path):
    layout = read_layout(smollm2_path)
    half = layout.n_layer // 2
    # what the first half of the layers needs, as the planner counts it for a worker's defaults
    # (its KV pool at the floor it may shrink to): serve's worker takes those
    mem = stage_need(ModelCost.from_layout(layout, layer_memory(smollm2_path)), 0, half,
                     worker_settings(layout.n_ctx_train))
    serve = track(subprocess.Popen(
        [sys.executable, "-m", "meshnet.cli.main", "serve", "--port", "0", "--model", smollm2_path,
         "--coordinator", f"tcp://127.0.0.1:{free_port()}", "--mem", str(mem)],
        env={**os.environ, "MESHNET_HOME": str(tmp_path / "a")}, stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True))
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(serve.stderr), daemon=True).start()
    joined = None
    try:
        assert wait_until(lambda: any(line.startswith("MESHNET_JOIN=") for line in lines), 120), lines
        join_line = next(line for line in lines if line.startswith("MESHNET_JOIN="))
        printed = re.fullmatch(r"MESHNET_JOIN=(mnj1-[\w-]+) meshnet (worker --mem 8G)\n", join_line)
        assert printed, join_line
        urls = lambda: [m for line in lines for m in re.findall(r"on (http://127\.0\.0\.1:\d+)/v1", line)]  # noqa: E731
        assert wait_until(urls, 120), lines
        url = urls()[0]
        # serve's own worker registered first (the console's state lists it), so the plan gives it the first half
        def registered():
            try:
                with urllib.request.urlopen(url + "/console/state", timeout=10) as response:
                    return len(json.loads(response.read())["stages"]) == 1
            except (OSError, ValueError):
                return False
        assert wait_until(registered, 120), lines
        # the other machine: the printed line, run as it is (its MESHNET_HOME holds no model)
        joined = track(subprocess.Popen(
            [sys.executable, "-m", "meshnet.cli.main", *printed.group(2).split(), "--threads", str(THREADS)],
            env={**os.environ, "MESHNET_HOME": str(tmp_path / "b"), "MESHNET_JOIN": printed.group(1)},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "b.log", "w"), start_new_session=True))
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)

        def answered():
            try:
                return client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT,
                                                 max_tokens=12, temperature=0)
            except (openai.APIStatusError, openai.APIConnectionError):
                return None   # 503 until the route covers the model
        assert wait_until(answered, 300), "".join(lines) + (tmp_path / "b.log").read_text()
        answer = answered()
        _, want = whole_model_tokens(smollm2_path, PROMPT, 12)
        with LocalPipeline(smollm2_path, [(0, layout.n_layer)], n_ctx=256, max_sessions=1, n_threads=THREADS) as whole:
            assert answer.choices[0].text == whole.head.detokenize(want)
        log = (tmp_path / "b.log").read_text()
        assert f"fetched layers [{half},{layout.n_layer})" in log, log   # its share, not the model
        assert not list((tmp_path / "b").glob("models/*.gguf"))   # no model file of its own: only the fetched share
    finally:
        if joined is not None:
            stop_group(joined)
        serve.send_signal(signal.SIGINT)
        try:
            serve.wait(60)
        finally:
            stop_group(serve)
