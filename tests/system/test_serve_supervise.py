"""A crashed or wedged local worker is not the end of a local route (issue 46, item 2):
`meshnet serve` starts its stage workers itself, so one that dies is started again, the
sessions it had in flight resume on it with exactly the tokens they give alone, and the
next request is answered without restarting serve; a stage stuck in one step is reported
by /health, not "ready". Real workers (SmolLM2) and the real `openai` client."""

import json
import os
import re
import signal
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai

from conftest import serving
from meshnet.launch.local_cluster import children_of

MODEL = "smollm2"
SEEDED = dict(model=MODEL, prompt="The old lighthouse keeper climbed the stairs and", max_tokens=120,
              temperature=0.7, seed=5)


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")
    except OSError:
        return []


def workers_of(pid: int) -> dict[int, int]:
    """serve's stage workers: layer start -> pid."""
    found = {}
    for child in children_of(pid):
        args = _cmdline(child)
        if "worker" in args and "--layers" in args:
            found[int(args[args.index("--layers") + 1].split(":")[0])] = child
    return found


def test_a_killed_worker_is_started_again_and_its_stream_keeps_its_tokens(smollm2_path):
    with serving("--ctx", "1024", "--max-sessions", "4") as (url, lines, pid):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        alone = "".join(c.choices[0].text for c in client.completions.create(stream=True, **SEEDED) if c.choices)
        before = workers_of(pid)
        assert len(before) == 2, before
        tail_start = max(before)

        chunks = iter(client.completions.create(stream=True, **SEEDED))
        text = next(chunks).choices[0].text     # under way: the tail has drawn a token
        os.kill(before[tail_start], signal.SIGKILL)
        text += "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == alone                    # replayed onto the new tail, token for token
        with urllib.request.urlopen(url.rsplit("/v1", 1)[0] + "/metrics", timeout=10) as response:
            resumes = re.search(r"^meshnet_resumes_total\{\} (\d+)", response.read().decode(), re.M)
        assert resumes and int(resumes.group(1)) == 1   # the stream was under way when its tail died

        deadline = time.monotonic() + 120
        while workers_of(pid).get(tail_start) in (None, before[tail_start]):
            assert time.monotonic() < deadline, "".join(lines)
            time.sleep(0.1)
        assert any("starting it again" in line for line in lines), "".join(lines)
        after = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3)
        assert after.usage.completion_tokens == 3


def health(url) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url.rsplit("/v1", 1)[0] + "/health", timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_stage_stuck_in_one_step_is_reported_by_health_not_ready(smollm2_path):
    # test-only fault: each stage's step sleeps 4 s before it runs, as a wedged call would
    env = dict(os.environ, MESHNET_TEST_FAULT="stall:4")
    with serving("--ctx", "256", "--stuck-after", "1", env=env) as (url, lines, pid):
        code, body = health(url)
        assert code == 200 and body["status"] == "ready" and all(s["step_s"] < 1 for s in body["stages"]), body
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(client.completions.create, model=MODEL, prompt="Hi", max_tokens=1)
            deadline = time.monotonic() + 60
            while True:
                code, body = health(url)
                if body["status"] == "stage_stuck":
                    break
                assert not answer.done() and time.monotonic() < deadline, body
                time.sleep(0.1)
            assert code == 503 and "has run one step for" in body["error"], body
            assert answer.result(timeout=120).usage.completion_tokens == 1
        assert health(url)[1]["status"] == "ready"   # the step ended: the stage is not stuck
