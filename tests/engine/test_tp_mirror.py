"""A tensor-parallel group behind one route stage (stage/tp_mirror.py): the leader's engine
calls, mirrored to a follower member, keep the two in step, so the leader's logits are the
whole model's; a follower given what it cannot follow stops with the reason."""

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import msgpack
import numpy as np
import pytest
import zmq

from meshnet.core.errors import MeshnetError
from meshnet.core.sampling import Sampling
from meshnet.engine.binding import Entry, Stage
from meshnet.engine.tensor_parallel import LocalExchange
from meshnet.net import protocol as P
from meshnet.stage.tp_mirror import GroupStage, follow

from conftest import TEST_MODELS

OPTIONS = dict(n_ctx=128, max_sessions=4, n_threads=1)
MAX_PAYLOAD = 1 << 20


class Pair:
    """Member 0 as a GroupStage, member 1 following it on a thread, over an inproc PAIR."""

    def __init__(self, path: str, layers=None, timeout: float = 60.0):
        self.ctx = zmq.Context()
        self.exchange = LocalExchange(2, timeout=timeout)
        self.stages = [Stage(path, layers, tp=(rank, 2), tp_gather=self.exchange.gather_for(rank), **OPTIONS)
                       for rank in range(2)]
        self.leader_sock, self.follower_sock = self.ctx.socket(zmq.PAIR), self.ctx.socket(zmq.PAIR)
        self.leader_sock.bind("inproc://mirror")
        self.follower_sock.connect("inproc://mirror")
        self.leader = GroupStage(self.stages[0], [self.leader_sock])
        self.stop = threading.Event()
        self.pool = ThreadPoolExecutor(1)
        self.following = self.pool.submit(follow, self.stages[1], self.follower_sock, self.stop, MAX_PAYLOAD)

    def close(self):
        """The follower's result: it ends at the stop flag once its calls are done; one left
        waiting at a gather the leader never reached is let go by breaking the exchange."""
        import concurrent.futures
        self.stop.set()
        try:
            result = self.following.result(timeout=10)
        except concurrent.futures.TimeoutError:
            self.exchange.break_("the test is over")
            result = self.following.result(timeout=60)
        self.pool.shutdown()
        for sock in (self.leader_sock, self.follower_sock):
            sock.close(linger=0)
        for stage in self.stages:
            stage.close()
        self.ctx.term()
        return result


def session_calls(stage, sampled: bool) -> list[np.ndarray]:
    """What a route stage's loop does with a tail: open, sampling, a prompt in 2 chunks, a
    trim (a refused draft's rows), decode steps of 2 sessions together, release."""
    logits = []
    prompts = {1: [1, 5, 9, 13, 17, 21], 2: [2, 4, 8]}
    for sid in prompts:
        stage.open_session(sid)
    if sampled:   # session 2 draws with a seeded sampler; session 1 greedily
        stage.set_sampling(2, Sampling(temperature=0.8, top_k=20, seed=7), history=prompts[2])
    last = {}
    for sid, prompt in prompts.items():
        stage.forward([Entry(sid, 0, tokens=np.array(prompt[:2], dtype=np.int32))])
        out = stage.forward([Entry(sid, 2, tokens=np.array(prompt[2:], dtype=np.int32))])
        logits.append(out.logits.copy())
        last[sid] = int(out.token[0])
    stage.truncate_session(1, 5)   # its last row dropped (as a refused draft's): fed again
    out = stage.forward([Entry(1, 5, tokens=np.array([21], dtype=np.int32))])
    logits.append(out.logits.copy())
    last[1] = int(out.token[0])
    pos = {1: 6, 2: 3}
    for _ in range(3):
        out = stage.forward([Entry(sid, pos[sid], tokens=np.array([last[sid]], dtype=np.int32)) for sid in prompts])
        logits.append(out.logits.copy())
        for e, sid in enumerate(prompts):
            last[sid], pos[sid] = int(out.token[e]), pos[sid] + 1
        logits.append(out.token.astype(np.float32))
    for sid in prompts:
        stage.release_session(sid)
    return logits


@pytest.mark.parametrize("arch", ["llama-dense", "qwen3moe-moe"])
def test_a_leader_whose_calls_a_follower_mirrors_gives_the_whole_models_logits_and_draws(arch):
    path = os.path.join(TEST_MODELS, f"{arch}.gguf")
    with Stage(path, **OPTIONS) as whole:
        expected = session_calls(whole, sampled=True)
    pair = Pair(path)
    try:
        got = session_calls(pair.leader, sampled=True)
    finally:
        stopped = pair.close()
    assert stopped is None   # it followed every call
    assert len(got) == len(expected)
    for a, b in zip(expected, got):
        assert float(np.max(np.abs(a - b))) == 0.0


def test_a_middle_stage_groups_residual_rows_are_mirrored_too():
    path = os.path.join(TEST_MODELS, "qwen3-dense.gguf")
    rows = np.random.default_rng(3).standard_normal((4, 128)).astype(np.float32)
    with Stage(path, (1, 3), **OPTIONS) as whole:
        whole.open_session(1)
        width = whole.seam_width
        rows = np.random.default_rng(3).standard_normal((4, width)).astype(np.float32)
        expected = whole.forward([Entry(1, 0, residual=rows)]).residual.copy()
    pair = Pair(path, (1, 3))
    try:
        pair.leader.open_session(1)
        got = pair.leader.forward([Entry(1, 0, residual=rows)]).residual.copy()
    finally:
        stopped = pair.close()
    assert stopped is None
    assert float(np.max(np.abs(expected - got))) == 0.0


def test_a_head_groups_verify_steps_and_a_pass_both_refuse_keep_the_members_in_step():
    """A speculating session's verify step at the head (its tokens, no rows), and a pass the
    leader and the follower both refuse before any gather (an unknown session): the next
    passes are still the whole model's."""
    path = os.path.join(TEST_MODELS, "llama-dense.gguf")
    layers = (0, 2)
    steps = [[Entry(1, 0, tokens=np.array([1, 2, 3], dtype=np.int32))],
             [Entry(1, 3, tokens=np.array([4, 5], dtype=np.int32), verify=True)],
             [Entry(1, 5, tokens=np.array([6], dtype=np.int32))]]
    with Stage(path, layers, **OPTIONS) as whole:
        whole.open_session(1)
        expected = [whole.forward(s).residual.copy() for s in steps]
    pair = Pair(path, layers)
    try:
        pair.leader.open_session(1)
        got = [pair.leader.forward(steps[0]).residual.copy()]
        with pytest.raises(MeshnetError) as e:
            pair.leader.forward([Entry(9, 0, tokens=np.array([1], dtype=np.int32))])
        assert e.value.code == "unknown_session"
        got += [pair.leader.forward(s).residual.copy() for s in steps[1:]]
    finally:
        stopped = pair.close()
    assert stopped is None
    for a, b in zip(expected, got):
        assert float(np.max(np.abs(a - b))) == 0.0


def header(rid=1, **fields):
    return msgpack.packb({"v": P.VERSION, "type": P.MIRROR, "rid": rid, **fields})


@pytest.mark.parametrize("frames, code", [
    ([b"\xc1 not msgpack"], "malformed"),
    (P.encode(P.HEARTBEAT, 1), "unknown_type"),
    ([header(op="reboot")], "bad_field"),
    ([header(op="truncate", sid=1)], "bad_field"),
    ([header(rid=2, op="open", sid=1)], "bad_field"),                      # call 1 missing
    ([header(op="forward", entries=[[1, 0, 2, False, None, True]]), b"\0" * 12], "bad_payload"),
    ([header(op="forward", entries=[[1, 0, 2, False, [1], False]])], "bad_field"),
    ([header(op="forward", entries=[[1, 0, 2, False, None, False]])], "bad_field"),   # no tokens, no rows
    ([header(op="forward", entries=[[1, 1 << 40, 1, False, [1], False]])], "bad_field"),
    ([header(op="release", sid=99)], "unknown_session"),
])
def test_a_follower_given_what_it_cannot_follow_stops_with_the_reason(frames, code):
    pair = Pair(os.path.join(TEST_MODELS, "llama-dense.gguf"), timeout=5.0)
    try:
        pair.leader_sock.send_multipart(frames)
        error = pair.following.result(timeout=60)
    finally:
        pair.close()
    assert isinstance(error, MeshnetError) and error.code == code


def test_a_leader_whose_follower_has_stopped_fails_its_pass_at_the_first_gather():
    pair = Pair(os.path.join(TEST_MODELS, "llama-dense.gguf"), timeout=2.0)
    try:
        pair.stop.set()
        assert pair.following.result(timeout=60) is None
        pair.leader.open_session(1)
        with pytest.raises(MeshnetError) as e:
            pair.leader.forward([Entry(1, 0, tokens=np.array([1, 2, 3], dtype=np.int32))])
        assert e.value.code == "tp_exchange"
        with pytest.raises(MeshnetError) as e:
            pair.leader.save_session(1)
        assert e.value.code == "invalid_argument"
    finally:
        pair.close()


def test_a_leader_that_cannot_send_to_a_follower_refuses_every_later_call():
    pair = Pair(os.path.join(TEST_MODELS, "llama-dense.gguf"), timeout=2.0)
    try:
        pair.stop.set()   # the follower reads no more: its queue fills
        assert pair.following.result(timeout=60) is None
        with pytest.raises(MeshnetError) as e:
            for sid in range(1, 100_000):
                pair.leader.open_session(sid)
                pair.leader.release_session(sid)
        assert e.value.code == "tp_exchange" and "out of step" in e.value.message
        with pytest.raises(MeshnetError) as again:
            pair.leader.open_session(1)
        assert again.value.message == e.value.message
    finally:
        pair.close()
