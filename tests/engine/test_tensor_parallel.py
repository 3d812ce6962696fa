"""Exact tensor parallelism (engine_c/patches/0019): a group of members, each holding its
share of every layer's heads and rows, gives the whole model's logits bit for bit."""

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import zmq

from meshnet.core.errors import MeshnetError
from meshnet.engine.binding import Entry, Stage
from meshnet.engine.tensor_parallel import LocalGroup

from conftest import TEST_MODELS

TP_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
OPTIONS = dict(n_ctx=128, max_sessions=4, n_threads=1)


def generated(arch: str) -> str:
    path = os.path.join(TEST_MODELS, f"{arch}-dense.gguf")
    assert os.path.isfile(path), f"{path} is missing: run `make test-models` (make test does)"
    return path


def passes(stage, prompts: dict[int, list[int]], steps: int) -> list[np.ndarray]:
    """Every session's prompt in two chunks, then STEPS greedy steps of all sessions in one
    call each: the logits of every call, in order."""
    logits = []
    for sid in prompts:
        stage.open_session(sid)
    for sid, prompt in prompts.items():
        cut = len(prompt) // 2
        stage.forward([Entry(sid, 0, tokens=np.array(prompt[:cut], dtype=np.int32))])
        out = stage.forward([Entry(sid, cut, tokens=np.array(prompt[cut:], dtype=np.int32))])
        logits.append(out.logits.copy())
    last = {sid: int(np.argmax(logits[i][0])) for i, sid in enumerate(prompts)}
    pos = {sid: len(prompt) for sid, prompt in prompts.items()}
    for _ in range(steps):
        entries = [Entry(sid, pos[sid], tokens=np.array([last[sid]], dtype=np.int32)) for sid in prompts]
        out = stage.forward(entries)
        logits.append(out.logits.copy())
        for e, sid in enumerate(prompts):
            last[sid], pos[sid] = int(out.token[e]), pos[sid] + 1
    for sid in prompts:
        stage.release_session(sid)
    return logits


def assert_same(whole: list[np.ndarray], group: list[np.ndarray]) -> None:
    assert len(whole) == len(group)
    for step, (a, b) in enumerate(zip(whole, group)):
        assert a.shape == b.shape
        diff = float(np.max(np.abs(a - b)))
        assert diff == 0.0, f"call {step}: max |logit diff| {diff}"


def whole_and_group(path: str, size: int, prompts: dict, steps: int, **options):
    options = {**OPTIONS, **options}
    with Stage(path, **options) as whole:
        expected = passes(whole, prompts, steps)
        whole_bytes = whole.info().model_bytes
    with LocalGroup(path, size, **options) as group:
        got = passes(group, prompts, steps)
        member_bytes = [m.info().model_bytes for m in group.members]
        assert [(m.info().tp_rank, m.info().tp_size) for m in group.members] == [(r, size) for r in range(size)]
    return expected, got, whole_bytes, member_bytes


@pytest.mark.parametrize("arch", TP_ARCHS)
def test_a_group_of_two_gives_the_whole_models_logits_for_four_concurrent_sessions(arch):
    prompts = {1: [1, 5, 9, 13, 17], 2: [2, 4, 8], 3: [7, 7, 7, 7, 7, 7, 7], 4: [3, 30, 60, 90]}
    expected, got, whole_bytes, member_bytes = whole_and_group(generated(arch), 2, prompts, steps=4)
    assert_same(expected, got)
    # each member holds about half of the layers' weights (the embeddings are whole)
    assert all(b < 0.75 * whole_bytes for b in member_bytes), (member_bytes, whole_bytes)


@pytest.mark.parametrize("numerics", ["stock", "invariant"])
def test_the_group_is_exact_in_either_numerics_class(numerics):
    expected, got, _, _ = whole_and_group(generated("llama"), 2, {1: [1, 2, 3, 4, 5, 6]}, steps=3, numerics=numerics)
    assert_same(expected, got)


def test_a_group_of_a_layer_range_passes_the_whole_models_residual():
    path = generated("qwen3")
    entries = [Entry(1, 0, tokens=np.array([4, 8, 15, 16, 23, 42], dtype=np.int32))]
    with Stage(path, (0, 2), **OPTIONS) as head:
        head.open_session(1)
        expected = head.forward(entries).residual.copy()
    with LocalGroup(path, 2, (0, 2), **OPTIONS) as group:
        group.open_session(1)
        got = group.forward(entries).residual
    assert float(np.max(np.abs(expected - got))) == 0.0


def test_a_group_of_three_splits_rows_in_blocks_of_eight_and_stays_exact(gemma3_path):
    # Gemma 3 270M (Q4_K, one KV head): 640 embedding rows over 3 members as 208/216/216,
    # whose rows take the repacked layout where the whole model's do
    expected, got, _, _ = whole_and_group(gemma3_path, 3, {1: [1, 100, 200, 300]}, steps=3)
    assert_same(expected, got)


@pytest.mark.parametrize("model", ["smollm2", "gemma3", "qwen"])
def test_real_models_in_a_group_of_two_give_the_whole_models_logits(model, request):
    # SmolLM2: 9 heads over 3 KV heads (members of 1 and 2 KV groups); Gemma 3 270M: one KV
    # head, computed by both; Qwen2.5-Coder-1.5B: its own output matrix, split by rows
    path = request.getfixturevalue({"smollm2": "smollm2_path", "gemma3": "gemma3_path", "qwen": "qwen_path"}[model])
    expected, got, whole_bytes, member_bytes = whole_and_group(path, 2, {1: [1, 100, 200, 300], 2: [5, 6, 7]}, steps=3)
    assert_same(expected, got)
    assert all(b < whole_bytes for b in member_bytes)


def test_what_cannot_be_split_is_refused_with_the_reason():
    with pytest.raises(MeshnetError, match="not built for a 'gpt2' model") as e:
        LocalGroup(os.path.join(TEST_MODELS, "gpt2-dense.gguf"), 2, **OPTIONS)
    assert e.value.code == "model_load"
    # more members than a model's KV heads (the generated llama has 2 KV heads of 4 heads)
    with pytest.raises(MeshnetError, match="at most that many members"):
        LocalGroup(generated("llama"), 3, **OPTIONS)
    with pytest.raises(MeshnetError, match="mixture of experts"):
        LocalGroup(os.path.join(TEST_MODELS, "llama-moe.gguf"), 2, **OPTIONS)
    with pytest.raises(MeshnetError, match="tp_gather") as e:
        Stage(generated("llama"), tp=(0, 2), **OPTIONS)
    assert e.value.code == "invalid_argument"
    with pytest.raises(MeshnetError, match="rank below its size"):
        Stage(generated("llama"), tp=(2, 2), tp_gather=lambda *a: None, **OPTIONS)


def test_a_failed_exchange_stops_the_pass_with_its_cause():
    def lost(layer, point, local, offset, whole):
        raise ConnectionError("the peer went away")
    with Stage(generated("llama"), tp=(0, 2), tp_gather=lost, **OPTIONS) as member:
        member.open_session(1)
        with pytest.raises(MeshnetError) as e:
            member.forward([Entry(1, 0, tokens=np.array([1, 2, 3], dtype=np.int32))])
    assert e.value.code == "tp_exchange"
    assert "the peer went away" in e.value.message


def test_a_group_whose_member_is_lost_fails_every_member_at_once_and_the_next_pass_starts_afresh():
    path = generated("llama")
    with Stage(path, **OPTIONS) as whole:
        expected = passes(whole, {2: [4, 5, 6]}, steps=2)
    with LocalGroup(path, 2, **OPTIONS) as group:
        group.open_session(1)
        group.exchange.timeout = 600   # (a wait for the lost member would be this one's message)
        group.exchange.break_("member 1 was lost")
        with pytest.raises(MeshnetError) as e:
            group.forward([Entry(1, 0, tokens=np.array([1, 2, 3], dtype=np.int32))])
        assert e.value.code == "tp_exchange"
        assert "member 1 was lost" in e.value.message
        # an error every member raises before any gather leaves the group as it was
        with pytest.raises(MeshnetError) as e:
            group.forward([Entry(9, 0, tokens=np.array([1], dtype=np.int32))])
        assert e.value.code == "unknown_session"
        group.release_session(1)
        assert_same(expected, passes(group, {2: [4, 5, 6]}, steps=2))


def linked_pair(ctx, curve: bool = True, timeout_ms: int = 30_000):
    """Two members' links over loopback TCP, member 0 binding for member 1."""
    from meshnet.stage.tp_group import GroupLink
    from meshnet.net.security import KeyPair
    keys = [KeyPair(*zmq.curve_keypair()) if curve else None for _ in range(2)]
    links = [GroupLink(ctx, rank, 2, keys[rank], timeout_ms) for rank in range(2)]
    endpoint = links[0].bind_for(1)
    links[1].connect_to(0, endpoint, keys[0].public if curve else None)
    return links


def test_members_linked_over_zeromq_sockets_exchange_in_the_engine_and_give_the_whole_models_logits():
    path = generated("qwen2")
    prompts = {1: [1, 5, 9, 13, 17], 2: [2, 4, 8]}
    with Stage(path, **OPTIONS) as whole:
        expected = passes(whole, prompts, steps=3)
    ctx = zmq.Context()
    links = linked_pair(ctx)
    members = [Stage(path, tp=(rank, 2), tp_link=links[rank].engine_link(), **OPTIONS) for rank in range(2)]
    try:
        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(lambda m: passes(m, prompts, steps=3), members))
        for logits in got:
            assert_same(expected, logits)
        assert all(link.sockets[1 - link.rank].getsockopt(zmq.MECHANISM) == zmq.CURVE for link in links)
    finally:
        for m in members:
            m.close()
        for link in links:
            link.close()
        ctx.term()


@pytest.mark.parametrize("answer, why", [
    ("another gather", "with another gather's rows"),
    ("short rows", "bytes, not"),
    ("overlap", "overlap another member's"),
    ("silence", "sent nothing"),
])
def test_a_member_refuses_a_peers_wrong_or_missing_rows_with_a_clear_error(answer, why):
    """Member 1's socket held by the test, answering as a broken or hostile peer would."""
    import struct
    path = generated("llama")
    ctx = zmq.Context()
    links = linked_pair(ctx, curve=False, timeout_ms=2_000)
    peer = links[1].sockets[0]
    try:
        with Stage(path, tp=(0, 2), tp_link=links[0].engine_link(), **OPTIONS) as member:
            member.open_session(1)
            with ThreadPoolExecutor(1) as pool:
                pending = pool.submit(member.forward, [Entry(1, 0, tokens=np.array([1, 2, 3], dtype=np.int32))])
                header = peer.recv()
                rows = peer.recv()
                layer, point, n_rows, n_local, offset = struct.unpack("iiqqq", header)
                if answer == "another gather":
                    peer.send_multipart([struct.pack("iiqqq", layer + 1, point, n_rows, n_local, n_local), rows])
                elif answer == "short rows":
                    peer.send_multipart([struct.pack("iiqqq", layer, point, n_rows, n_local, n_local), rows[:-4]])
                elif answer == "overlap":   # member 0's own columns
                    peer.send_multipart([struct.pack("iiqqq", layer, point, n_rows, n_local, offset), rows])
                with pytest.raises(MeshnetError) as e:
                    pending.result(timeout=120)
            assert e.value.code == "tp_exchange"
            assert why in e.value.message
            # the sockets may be out of step now: every later pass fails at once, saying why
            with pytest.raises(MeshnetError) as again:
                member.forward([Entry(1, 0, tokens=np.array([1, 2, 3], dtype=np.int32))])
            assert again.value.code == "tp_exchange" and why in again.value.message
    finally:
        for link in links:
            link.close()
        ctx.term()
