"""Join tokens and the weights manifest as plain data: a token round-trips, and anything
that is not one this mesh made is refused with join_refused saying what is wrong; a
manifest from the wire is refused whole when any field is off, and a stage's spans follow
the engine's rule for which tensors a range holds."""

import base64

import msgpack
import pytest
import zmq.utils.z85

from meshnet.core import errors as E
from meshnet.core.errors import MeshnetError
from meshnet.core.layers import LayerRange
from meshnet.net import join
from meshnet.weights.manifest import HEADER, Manifest, Span

# fixed z85 keys, as plain data (no key generation here: it needs libsodium's random source)
COORDINATOR_KEY = zmq.utils.z85.encode(bytes(range(32)))
JOIN_SECRET = zmq.utils.z85.encode(bytes(range(32, 64)))


def token(addresses=("tcp://10.0.0.1:5555",)):
    return join.Token(tuple(addresses), COORDINATOR_KEY, JOIN_SECRET)


def test_a_token_round_trips_and_its_line_is_the_one_to_run():
    t = token(("tcp://10.0.0.1:5555", "tcp://192.168.1.4:5555"))
    text = t.encode()
    assert text.startswith(join.PREFIX) and " " not in text
    assert join.parse_token(text) == t
    assert join.parse_token(f"  {text}\n") == t   # as pasted
    assert join.join_line(t, "8G") == f"MESHNET_JOIN={text} meshnet worker --mem 8G"   # in no process's argv
    assert join.parse_token(t.without_addresses().encode()).addresses == ()


@pytest.mark.parametrize("text, why", [
    ("", "is not a meshnet join token"),
    ("hello", "is not a meshnet join token"),
    (join.PREFIX + "!!!!", "damaged"),
    (join.PREFIX + base64.urlsafe_b64encode(b"\xc1").decode(), "damaged"),
    (join.PREFIX + "x" * 5000, "is not a meshnet join token"),
])
def test_what_is_not_a_token_is_refused_saying_so(text, why):
    with pytest.raises(MeshnetError) as refused:
        join.parse_token(text)
    assert refused.value.code == E.JOIN_REFUSED and why in refused.value.message


def encoded(fields) -> str:
    return join.PREFIX + base64.urlsafe_b64encode(msgpack.packb(fields)).decode().rstrip("=")


@pytest.mark.parametrize("fields, why", [
    ({"a": [], "c": COORDINATOR_KEY.decode()}, "not one this version"),
    ({"a": [], "c": COORDINATOR_KEY.decode(), "j": JOIN_SECRET.decode(), "x": 1}, "not one this version"),
    ({"a": "tcp://10.0.0.1:5555", "c": COORDINATOR_KEY.decode(), "j": JOIN_SECRET.decode()}, "addresses"),
    ({"a": ["tcp://10.0.0.1:99999"], "c": COORDINATOR_KEY.decode(), "j": JOIN_SECRET.decode()}, "port"),
    ({"a": ["udp://10.0.0.1:5555"], "c": COORDINATOR_KEY.decode(), "j": JOIN_SECRET.decode()}, "not a TCP address"),
    ({"a": ["ipc:///tmp/c.sock"], "c": COORDINATOR_KEY.decode(), "j": JOIN_SECRET.decode()}, "not a TCP address"),
    ({"a": ["inproc://c"], "c": COORDINATOR_KEY.decode(), "j": JOIN_SECRET.decode()}, "not a TCP address"),
    ({"a": ["tcp://10.0.0.1:0"], "c": COORDINATOR_KEY.decode(), "j": JOIN_SECRET.decode()}, "no port to connect to"),
    ({"a": [], "c": "short", "j": JOIN_SECRET.decode()}, "coordinator key"),
    ({"a": [], "c": COORDINATOR_KEY.decode(), "j": "~" * 40}, "join key"),
])
def test_a_token_with_a_bad_field_is_refused_naming_it(fields, why):
    with pytest.raises(MeshnetError) as refused:
        join.parse_token(encoded(fields))
    assert why in refused.value.message
    assert refused.value.code in (E.JOIN_REFUSED, E.BAD_ADDRESS)


def manifest(tied: bool = False) -> Manifest:
    sha = "ab" * 32
    names = ["token_embd.weight", "blk.0.attn_q.weight", "blk.0.ffn_up.weight", "blk.1.attn_q.weight",
             "blk.2.attn_q.weight", "rope_freqs.weight", "output_norm.weight"] + ([] if tied else ["output.weight"])
    spans = tuple(Span(name, 1000 + 100 * i, 100, sha) for i, name in enumerate(names))
    return Manifest(sha256=sha, file_bytes=1000 + 100 * len(names), filename="m.gguf", n_layer=3,
                    tied_embeddings=tied, header=Span(HEADER, 0, 1000, sha), tensors=spans)


def names(spans):
    return [s.name for s in spans]


def test_a_stage_fetches_its_layers_and_the_head_s_or_tail_s_tensors_as_the_engine_holds_them():
    m = manifest()
    assert names(m.spans_for(LayerRange(0, 1))) == [HEADER, "token_embd.weight", "blk.0.attn_q.weight",
                                                    "blk.0.ffn_up.weight", "rope_freqs.weight"]
    assert names(m.spans_for(LayerRange(1, 2))) == [HEADER, "blk.1.attn_q.weight", "rope_freqs.weight"]
    assert names(m.spans_for(LayerRange(2, 3))) == [HEADER, "blk.2.attn_q.weight", "rope_freqs.weight",
                                                    "output_norm.weight", "output.weight"]
    # tied embeddings: the tail's output matrix is token_embd
    assert "token_embd.weight" in names(manifest(tied=True).spans_for(LayerRange(2, 3)))
    assert "token_embd.weight" not in names(manifest(tied=True).spans_for(LayerRange(1, 2)))


def test_a_manifest_round_trips_and_a_bad_one_is_refused_whole():
    m = manifest()
    assert Manifest.from_wire(m.to_wire()) == m
    body = msgpack.unpackb(m.to_wire())
    for bad in ({**body, "filename": "../../etc/passwd"}, {**body, "sha256": "zz" * 32},
                {**body, "file_bytes": 10}, {**body, "tensors": [["x", 0, -1, "ab" * 32]]},
                {**body, "tensors": "nope"}, {k: v for k, v in body.items() if k != "header"}):
        with pytest.raises(MeshnetError) as refused:
            Manifest.from_wire(msgpack.packb(bad))
        assert refused.value.code == E.FETCH_FAILED
    with pytest.raises(MeshnetError):
        Manifest.from_wire(b"\xc1 not msgpack")
