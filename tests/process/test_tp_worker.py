"""Tensor-parallel groups as route stages, in worker processes (meshnet worker --tp): a leader
that is the route's stage and a follower that mirrors it give the whole model's tokens; a
follower's end takes its leader out of the route with the reason."""

import signal
import subprocess
import sys
import time

from meshnet.engine.binding import Stage
from meshnet.engine.pipeline import LocalPipeline

from conftest import THREADS, last_json_line, track
from peers import free_port


def member(*args):
    return track(subprocess.Popen([sys.executable, "-m", "meshnet.cli.main", "worker", "--threads", str(THREADS),
                                   *args], stderr=subprocess.PIPE, text=True))


def said_within(proc, words: str, timeout: float) -> str:
    """PROC's stderr up to the line with WORDS, or all it said in TIMEOUT seconds."""
    import selectors
    said, deadline = "", time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stderr, selectors.EVENT_READ)
        while words not in said and time.monotonic() < deadline:
            if sel.select(timeout=max(0.0, deadline - time.monotonic())):
                line = proc.stderr.readline()
                if not line:
                    break
                said += line
    return said


def test_a_route_whose_first_stage_is_a_group_of_two_gives_the_whole_models_tokens(smollm2_path):
    prompt = "The capital of France is"
    port = free_port(3)
    address, data, group = (f"tcp://127.0.0.1:{port + i}" for i in range(3))
    coordinator = track(subprocess.Popen(
        [sys.executable, "-m", "meshnet.cli.main", "coordinator", "--bind", address, "--prompt", prompt,
         "--max-tokens", "12", "--json", "--wait", "120", "--data-bind", data, "--insecure"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    leader = member("--coordinator", address, "--layers", "0:15", "--tp", "0/2", "--tp-bind", group)
    follower = member("--tp", "1/2", "--tp-leader", group)
    tail = member("--coordinator", address, "--layers", "15:30")
    workers = (leader, follower, tail)
    try:
        out, err = coordinator.communicate(timeout=240)
        assert coordinator.returncode == 0, err[-2000:]
        report = last_json_line(out)
        with LocalPipeline(smollm2_path, [(0, 30)], n_ctx=2048, max_sessions=1, n_threads=THREADS) as whole:
            assert report["tokens"] == whole.generate(whole.head.tokenize(prompt), 12).tokens
        assert [s["stage"] for s in report["stages"]] == ["[0,15)", "[15,30)"]
        # the leader holds its half of each layer's weights (the token embeddings whole)
        with Stage(smollm2_path, (0, 15), n_ctx=256, max_sessions=1) as alone:
            assert report["stages"][0]["model_bytes"] < 0.75 * alone.info().model_bytes, report["stages"]
        # the follower goes when its leader does, saying why
        leader.send_signal(signal.SIGTERM)
        assert leader.wait(timeout=60) == 0
        assert follower.wait(timeout=60) != 0
        assert "leader is gone" in follower.stderr.read()
    finally:
        for proc in workers:
            if proc.poll() is None:
                proc.kill()


def test_a_leader_whose_follower_ends_leaves_the_route_with_the_reason(smollm2_path):
    port = free_port(2)
    address, group = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}"
    # a coordinator's address nobody answers: the leader keeps trying it, and keeps its group
    leader = member("--coordinator", address, "--layers", "0:30", "--tp", "0/2", "--tp-bind", group)
    follower = member("--tp", "1/2", "--tp-leader", group)
    try:
        said = said_within(leader, "member 1 linked", 120)
        assert "member 1 linked" in said, said[-2000:]
        follower.kill()   # (the leader may still be loading its share: it notices once it serves)
        assert leader.wait(timeout=60) != 0
        rest = leader.stderr.read()
        # (killed while it loads its share, or once both serve: the leader says which)
        assert "tp_exchange" in rest and "member 1" in rest and "closed its stream" in rest, rest[-2000:]
    finally:
        for proc in (leader, follower):
            if proc.poll() is None:
                proc.kill()


def test_a_keyed_group_admits_only_its_members_key_and_gives_the_whole_models_tokens(smollm2_path, tmp_path):
    from meshnet.net import security
    for name in ("coordinator", "leader", "follower", "tail", "stranger"):
        security.generate(tmp_path, name)
    (tmp_path / "allowed").mkdir()
    for name in ("leader", "tail"):
        (tmp_path / "allowed" / f"{name}.key").write_bytes((tmp_path / f"{name}.key").read_bytes())
    key = lambda name, secret=False: str(tmp_path / f"{name}.key{'_secret' if secret else ''}")
    prompt = "Water boils at a temperature of"
    port = free_port(3)
    address, data, group = (f"tcp://127.0.0.1:{port + i}" for i in range(3))
    coordinator = track(subprocess.Popen(
        [sys.executable, "-m", "meshnet.cli.main", "coordinator", "--bind", address, "--prompt", prompt,
         "--max-tokens", "8", "--json", "--wait", "120", "--data-bind", data, "--secret", key("coordinator", True),
         "--allow", str(tmp_path / "allowed")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    keyed = lambda name: ("--secret", key(name, True), "--coordinator-key", key("coordinator"))
    leader = member("--coordinator", address, "--layers", "0:15", *keyed("leader"), "--tp", "0/2", "--tp-bind", group,
                    "--tp-peer-key", key("follower"))
    # a member with the leader's address and key, but not the key the leader admits: refused
    stranger = member("--tp", "1/2", "--tp-leader", group, "--secret", key("stranger", True),
                      "--tp-peer-key", key("leader"))
    follower = member("--tp", "1/2", "--tp-leader", group, "--secret", key("follower", True),
                      "--tp-peer-key", key("leader"))
    tail = member("--coordinator", address, "--layers", "15:30", *keyed("tail"))
    try:
        out, err = coordinator.communicate(timeout=240)
        assert coordinator.returncode == 0, err[-2000:]
        with LocalPipeline(smollm2_path, [(0, 30)], n_ctx=2048, max_sessions=1, n_threads=THREADS) as whole:
            assert last_json_line(out)["tokens"] == whole.generate(whole.head.tokenize(prompt), 8).tokens
        assert stranger.poll() is None   # still waiting for a welcome that never comes
        assert "following the leader" in said_within(follower, "following the leader", 60)
        stranger.kill()
        assert "following the leader" not in stranger.communicate(timeout=30)[1]
    finally:
        for proc in (leader, stranger, follower, tail):
            if proc.poll() is None:
                proc.kill()


def test_what_a_group_cannot_be_is_a_usage_error_before_anything_loads():
    group = "tcp://127.0.0.1:9"
    for args, why in [
        (["--coordinator", "tcp://127.0.0.1:9", "--layers", "0:15", "--tp", "0/3", "--tp-bind", group], "0/2"),
        (["--coordinator", "tcp://127.0.0.1:9", "--layers", "0:15", "--tp", "0/2"], "--tp-bind"),
        (["--tp", "1/2", "--tp-bind", group], "--tp-leader"),
        (["--coordinator", "tcp://127.0.0.1:9", "--layers", "auto", "--mem", "1G", "--tp", "0/2", "--tp-bind", group],
         "not auto"),
        (["--coordinator", "tcp://127.0.0.1:9", "--layers", "0:15", "--gpu", "--tp", "0/2", "--tp-bind", group],
         "on the CPU"),
        (["--tp", "1/2", "--tp-leader", group, "--tp-peer-key", "a.key"], "go together"),
        (["--tp", "1/2", "--tp-leader", "tcp://10.0.0.1:9"], "--insecure"),
    ]:
        result = subprocess.run([sys.executable, "-m", "meshnet.cli.main", "worker", *args], capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 2 and why in result.stderr, (args, result.stderr[-1000:])
