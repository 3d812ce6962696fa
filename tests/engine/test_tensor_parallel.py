"""Exact tensor parallelism (engine_c/patches/0019): a group of members, each holding its
share of every layer's heads and rows, gives the whole model's logits bit for bit."""

import os
import socket
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import zmq

from meshnet.core.errors import MeshnetError
from meshnet.engine.binding import Entry, Stage
from meshnet.engine.tensor_parallel import LocalGroup
from meshnet.net.security import KeyPair

from conftest import TEST_MODELS

# the generated models of the architectures a group is built for (qwen3moe: each expert's rows
# split, its 2 experts both used for every token)
TP_MODELS = {"llama": "llama-dense", "qwen2": "qwen2-dense", "qwen3": "qwen3-dense", "gemma3": "gemma3-dense",
             "qwen3moe": "qwen3moe-moe"}
TP_ARCHS = tuple(TP_MODELS)
OPTIONS = dict(n_ctx=128, max_sessions=4, n_threads=1)


def generated(arch: str) -> str:
    path = os.path.join(TEST_MODELS, f"{TP_MODELS[arch]}.gguf")
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


@pytest.mark.parametrize("arch", ["qwen3", "qwen3moe"])
def test_a_group_of_a_layer_range_passes_the_whole_models_residual(arch):
    path = generated(arch)
    entries = [Entry(1, 0, tokens=np.array([4, 8, 15, 16, 23, 42], dtype=np.int32))]
    with Stage(path, (0, 2), **OPTIONS) as head:
        head.open_session(1)
        expected = head.forward(entries).residual.copy()
    with LocalGroup(path, 2, (0, 2), **OPTIONS) as group:
        group.open_session(1)
        got = group.forward(entries).residual
    assert float(np.max(np.abs(expected - got))) == 0.0


class Route:
    """Stages in a route, each a layer range (a group or a whole stage), in one process: each
    stage's residual rows go to the next as the route's seam carries them."""

    def __init__(self, *stages):
        self.stages = stages

    def open_session(self, sid: int) -> None:
        for stage in self.stages:
            stage.open_session(sid)

    def release_session(self, sid: int) -> None:
        for stage in self.stages:
            stage.release_session(sid)

    def forward(self, entries):
        out = self.stages[0].forward(entries)
        for stage in self.stages[1:]:
            rows, at = [], 0
            for e in entries:
                rows.append(Entry(e.session_id, e.pos, residual=out.residual[at:at + e.n_tokens].copy()))
                at += e.n_tokens
            out = stage.forward(rows)
        return out


@pytest.mark.parametrize("arch", TP_ARCHS + ("smollm2", "gemma3 270M", "qwen 1.5B"))
def test_a_route_of_two_groups_of_two_gives_the_whole_models_logits(arch, request):
    real = {"smollm2": "smollm2_path", "gemma3 270M": "gemma3_path", "qwen 1.5B": "qwen_path"}
    path = request.getfixturevalue(real[arch]) if arch in real else generated(arch)
    prompts = {1: [1, 5, 9, 13, 17], 2: [2, 4, 8], 3: [7, 7, 7, 7, 7, 7, 7], 4: [3, 30, 60, 90]}
    with Stage(path, **OPTIONS) as whole:
        expected = passes(whole, prompts, steps=3)
        n_layer = whole.info().n_layer
    cut = n_layer // 2
    with LocalGroup(path, 2, (0, cut), **OPTIONS) as head, LocalGroup(path, 2, (cut, n_layer), **OPTIONS) as tail:
        got = passes(Route(head, tail), prompts, steps=3)
    assert_same(expected, got)


def test_a_route_may_mix_a_pipeline_stage_and_a_group():
    path = generated("gemma3")
    prompts = {1: [1, 5, 9, 13, 17], 2: [2, 4, 8]}
    with Stage(path, **OPTIONS) as whole:
        expected = passes(whole, prompts, steps=3)
        n_layer = whole.info().n_layer
    with Stage(path, (0, 1), **OPTIONS) as head, LocalGroup(path, 2, (1, n_layer), **OPTIONS) as tail:
        got = passes(Route(head, tail), prompts, steps=3)
    assert_same(expected, got)


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
    with pytest.raises(MeshnetError, match="mixture of experts but qwen3moe's"):
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


def linked_pair(sealed: bool = True, timeout_ms: int = 30_000):
    """Two members' links over loopback TCP, member 0 listening for member 1."""
    from meshnet.stage.tp_group import GroupLink
    keys = [KeyPair(*zmq.curve_keypair()) if sealed else None for _ in range(2)]
    links = [GroupLink(rank, 2, keys[rank], timeout_ms) for rank in range(2)]
    endpoint = links[0].bind_for(1, peer_public=keys[1].public if sealed else None)
    with ThreadPoolExecutor(1) as pool:
        connecting = pool.submit(links[1].connect_to, 0, endpoint, keys[0].public if sealed else None)
        links[0].accept_all()
        connecting.result(timeout=60)
    return links


def test_members_linked_over_keyed_streams_exchange_in_the_engine_and_give_the_whole_models_logits():
    path = generated("qwen2")
    prompts = {1: [1, 5, 9, 13, 17], 2: [2, 4, 8]}
    with Stage(path, **OPTIONS) as whole:
        expected = passes(whole, prompts, steps=3)
    links = linked_pair()
    assert links[0].link_keys[1] == links[1].link_keys[0] and len(links[0].link_keys[1]) == 32
    # the cost model's figures, measured through the engine's gather by both at once
    with ThreadPoolExecutor(2) as pool:
        figures = list(pool.map(lambda link: link.measure(), links))
    assert all(0 < f.gather_us < 1e6 and f.bandwidth > 0 for f in figures)
    members = [Stage(path, tp=(rank, 2), tp_link=links[rank].engine_link(), **OPTIONS) for rank in range(2)]
    try:
        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(lambda m: passes(m, prompts, steps=3), members))
        for logits in got:
            assert_same(expected, logits)
    finally:
        for m in members:
            m.close()
        for link in links:
            link.close()


def test_a_listening_member_refuses_a_peer_without_the_expected_key_and_waits_for_the_right_one():
    from meshnet.net import member_link
    from meshnet.stage.tp_group import GroupLink
    keys = [KeyPair(*zmq.curve_keypair()) for _ in range(3)]
    binder, member, impostor = (GroupLink(0, 2, keys[0], group=b"qwen 0:28"), GroupLink(1, 2, keys[1], group=b"qwen 0:28"),
                                GroupLink(1, 2, keys[2], group=b"qwen 0:28"))
    elsewhere = GroupLink(1, 2, keys[1], group=b"qwen 0:14")   # member 1's keys, another group
    endpoint = binder.bind_for(1, peer_public=keys[1].public)
    try:
        with ThreadPoolExecutor(1) as pool:
            accepting = pool.submit(binder.accept_all)
            # it knows the binder's key, not member 1's secret
            with pytest.raises(MeshnetError) as e:
                impostor.connect_to(0, endpoint, keys[0].public)
            assert e.value.code == "bad_key" and "refused the link" in e.value.message
            with pytest.raises(MeshnetError) as e:
                elsewhere.connect_to(0, endpoint, keys[0].public)
            assert e.value.code == "bad_key"
            host, port = member_link.split_endpoint(endpoint)
            # a stranger's low-order ephemeral key (one that would make the link's key known)
            with socket.create_connection((host, port)) as stranger:
                stranger.sendall(member_link.HELLO.pack(member_link.MAGIC, 1, bytes(32)))
                try:
                    assert stranger.recv(member_link.HELLO.size + 64, socket.MSG_WAITALL) is not None
                except ConnectionResetError:
                    pass
            # a peer that is not a member at all, speaking nonsense, is closed too
            with socket.create_connection((host, port)) as stranger:
                stranger.sendall(b"GET / HTTP/1.1\r\n\r\n" + bytes(64))
                try:
                    assert stranger.recv(64) == b""
                except ConnectionResetError:
                    pass   # (closed with its bytes unread)
            member.connect_to(0, endpoint, keys[0].public)
            accepting.result(timeout=60)
        assert binder.link_keys[1] == member.link_keys[0]
    finally:
        for link in (binder, member, impostor, elsewhere):
            link.close()


def answer_as_peer(peer: socket.socket, answer: str, key: bytes | None) -> None:
    """Member 1's side of member 0's first gather, as a broken or hostile peer would give it."""
    import struct
    from meshnet.net import member_link
    header = peer.recv(32, socket.MSG_WAITALL)
    layer, point, n_rows, n_local, offset = struct.unpack("<iiqqq", header)
    size = 4 * n_rows * n_local + (member_link.TAG_BYTES if key else 0)
    sealed = peer.recv(size, socket.MSG_WAITALL)
    theirs = struct.pack("<iiqqq", layer, point, n_rows, n_local, n_local)
    rows = bytes(4 * n_rows * n_local)
    if answer == "another gather":
        peer.sendall(struct.pack("<iiqqq", layer + 1, point, n_rows, n_local, n_local) + rows)
    elif answer == "overlap":   # member 0's own columns
        peer.sendall(struct.pack("<iiqqq", layer, point, n_rows, n_local, offset) + rows)
    elif answer == "no columns":
        peer.sendall(struct.pack("<iiqqq", layer, point, n_rows, 0, n_local))
    elif answer == "columns past the row":
        peer.sendall(struct.pack("<iiqqq", layer, point, n_rows, 2**62, n_local) + rows)
    elif answer == "a negative offset":
        peer.sendall(struct.pack("<iiqqq", layer, point, n_rows, n_local, -n_local) + rows)
    elif answer == "other rows":
        peer.sendall(struct.pack("<iiqqq", layer, point, n_rows + 1, n_local, n_local) + rows)
    elif answer == "cut off":
        peer.sendall(theirs + rows[:-4])
        peer.shutdown(socket.SHUT_WR)
    elif answer == "unsealed":   # the right gather, rows not sealed with the group's key
        peer.sendall(theirs + rows + bytes(member_link.TAG_BYTES))
    elif answer == "reflected":   # member 0's own sealed rows sent back to it
        peer.sendall(theirs + sealed)
    elif answer == "sealed right, then a nonce again":
        peer.sendall(theirs + member_link.seal(key, 1, 0, rows, theirs))
        layer, point, n_rows, n_local, offset = struct.unpack("<iiqqq", peer.recv(32, socket.MSG_WAITALL))
        peer.recv(4 * n_rows * n_local + member_link.TAG_BYTES, socket.MSG_WAITALL)
        theirs = struct.pack("<iiqqq", layer, point, n_rows, n_local, n_local)
        peer.sendall(theirs + member_link.seal(key, 1, 0, bytes(4 * n_rows * n_local), theirs))


@pytest.mark.parametrize("answer, sealed, why", [
    ("another gather", False, "with another gather's rows"),
    ("overlap", False, "overlap another member's"),
    ("no columns", False, "with another gather's rows"),
    ("columns past the row", False, "with another gather's rows"),
    ("a negative offset", False, "with another gather's rows"),
    ("other rows", True, "with another gather's rows"),
    ("cut off", False, "closed its link"),
    ("silence", False, "sent nothing"),
    ("unsealed", True, "do not open with the group's key"),
    ("reflected", True, "do not open with the group's key"),
    ("sealed right, then a nonce again", True, "do not open with the group's key"),
])
def test_a_member_refuses_a_peers_wrong_or_missing_rows_with_a_clear_error(answer, sealed, why):
    """Member 1's stream held by the test."""
    path = generated("llama")
    links = linked_pair(sealed=sealed, timeout_ms=2_000)
    peer = links[1].sockets[0]
    try:
        with Stage(path, tp=(0, 2), tp_link=links[0].engine_link(), **OPTIONS) as member:
            member.open_session(1)
            with ThreadPoolExecutor(1) as pool:
                pending = pool.submit(member.forward, [Entry(1, 0, tokens=np.array([1, 2, 3], dtype=np.int32))])
                answer_as_peer(peer, answer, links[1].link_keys[0])
                with pytest.raises(MeshnetError) as e:
                    pending.result(timeout=120)
            assert e.value.code == "tp_exchange"
            assert why in e.value.message
            # the streams may be out of step now: every later pass fails at once, saying why
            with pytest.raises(MeshnetError) as again:
                member.forward([Entry(1, 0, tokens=np.array([1, 2, 3], dtype=np.int32))])
            assert again.value.code == "tp_exchange" and why in again.value.message
    finally:
        for link in links:
            link.close()
