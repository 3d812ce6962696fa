"""A manifest's bounds and the GGUF header reader the coordinator runs on bytes it has not
checked yet, with plain data: a manifest the coordinator would vouch for is one every
worker takes (Manifest.check holds the header bound, the tensor cap and the name rules),
and a header of any shape is read in memory and time bounded by its bytes."""

import dataclasses
import struct
import time
import tracemalloc

import gguf
import numpy as np
import pytest

from meshnet.core import errors as E
from meshnet.core.errors import MeshnetError
from meshnet.core.layers import LayerRange
from meshnet.weights import manifest as manifests
from meshnet.weights.manifest import HEADER, MAX_HEADER_BYTES, MAX_NAME, MAX_TENSORS, Manifest, Span

SHA = "ab" * 32


def plain(n_tensors: int = 3, header: int = 1000) -> Manifest:
    spans = tuple(Span(f"blk.{i}.ffn_up.weight", header + 100 * i, 100, SHA) for i in range(n_tensors))
    return Manifest(sha256=SHA, file_bytes=header + 100 * n_tensors, filename="m.gguf", n_layer=n_tensors,
                    tied_embeddings=True, header=Span(HEADER, 0, header, SHA), tensors=spans)


def refused(manifest: Manifest) -> str:
    with pytest.raises(MeshnetError) as failed:
        manifest.check()
    assert failed.value.code == E.FETCH_FAILED
    return failed.value.message


def test_a_plain_manifest_passes_its_own_check():
    plain().check()


def split3(header: int = 1000) -> Manifest:
    """A model of 3 files of 1300 bytes (a header, then tensors), as their concatenation."""
    spans = []
    for i in range(3):
        base = 1300 * i
        if i:
            spans.append(Span(f"<header {i + 1}>", base, header, SHA))
        spans += [Span(f"blk.{i}.ffn_{w}.weight", base + header + 150 * j, 150, SHA) for j, w in enumerate("ud")]
    return Manifest(sha256=SHA, file_bytes=3900, filename="m-00001-of-00003.gguf", n_layer=3, tied_embeddings=True,
                    header=Span(HEADER, 0, header, SHA), tensors=tuple(spans), splits=(1300, 1300, 1300))


def test_a_split_model_s_manifest_names_its_files_and_every_stage_takes_every_header():
    m = split3()
    m.check()
    assert Manifest.from_wire(m.to_wire()) == m
    assert m.files() == [("m-00001-of-00003.gguf", 0, 1300), ("m-00002-of-00003.gguf", 1300, 1300),
                         ("m-00003-of-00003.gguf", 2600, 1300)]
    assert [s.name for s in m.headers()] == [HEADER, "<header 2>", "<header 3>"]
    assert [s.name for s in m.spans_for(LayerRange(2, 3))] == [HEADER, "<header 2>", "<header 3>",
                                                                "blk.2.ffn_u.weight", "blk.2.ffn_d.weight"]


def test_a_split_model_s_manifest_that_breaks_the_splits_rules_is_refused():
    m = split3()
    assert "add up" in refused(dataclasses.replace(m, splits=(1300, 1300, 1299)))
    assert "first of" in refused(dataclasses.replace(m, filename="m.gguf"))
    assert "first of" in refused(dataclasses.replace(m, filename="m-00002-of-00003.gguf"))
    assert "first of" in refused(dataclasses.replace(m, splits=(1300, 2600), filename="m-00001-of-00003.gguf"))
    # a span across the end of a split, a header that is not at its split's start, one missing
    across = tuple(dataclasses.replace(s, size=300) if s.name == "blk.0.ffn_d.weight" else s for s in m.tensors)
    assert "runs over the end of its file" in refused(dataclasses.replace(m, tensors=across))
    moved = tuple(dataclasses.replace(s, name="<header 3>") if s.name == "<header 2>" else
                  dataclasses.replace(s, name="<header 2>") if s.name == "<header 3>" else s for s in m.tensors)
    assert "not the header at the start of its split" in refused(dataclasses.replace(m, tensors=moved))
    dropped = tuple(s for s in m.tensors if s.name != "<header 3>")
    assert "<header 3>" in refused(dataclasses.replace(m, tensors=dropped))
    big = MAX_HEADER_BYTES + 1   # the second split's header: the coordinator would hold it in memory
    assert "bound" in refused(dataclasses.replace(
        m, file_bytes=1300 + big, splits=(1300, big),
        filename="m-00001-of-00002.gguf", tensors=(*m.tensors[:2], Span("<header 2>", 1300, big, SHA))))
    # a later split's header in a manifest of one file
    one = plain()
    assert "not the header at the start" in refused(dataclasses.replace(
        one, tensors=(Span("<header 2>", one.tensors[0].offset, 100, SHA), *one.tensors[1:])))


def test_a_manifest_whose_header_is_over_the_bound_of_a_gguf_header_is_refused():
    m = plain(header=MAX_HEADER_BYTES + 1)
    assert "header" in refused(m) and str(MAX_HEADER_BYTES) in refused(m)


def test_a_manifest_of_more_tensors_than_the_cap_is_refused():
    m = plain()
    many = tuple(Span(f"t{i}", 1000 + i, 1, SHA) for i in range(MAX_TENSORS + 1))
    assert "tensors" in refused(dataclasses.replace(m, file_bytes=1000 + len(many), tensors=many))


@pytest.mark.parametrize("name", ["", "blk.0.\x1b[2Kffn", "blk.0.ffn\nmeshnet worker: ok", "x" * (MAX_NAME + 1)])
def test_a_manifest_with_a_tensor_name_that_is_not_plain_printable_text_is_refused(name):
    m = plain()
    m = dataclasses.replace(m, tensors=(dataclasses.replace(m.tensors[0], name=name), *m.tensors[1:]))
    assert "printable" in refused(m)


@pytest.mark.parametrize("filename", ["", "../m.gguf", "a/m.gguf", ".hidden", "m\x1b[1A.gguf", "m\n.gguf"])
def test_a_manifest_whose_file_name_is_a_path_or_not_printable_is_refused(filename):
    assert "file name" in refused(dataclasses.replace(plain(), filename=filename))


# ---- the header reader --------------------------------------------------------------


def gguf_string(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


def kv(key: str, vtype: int, value: bytes) -> bytes:
    return gguf_string(key.encode()) + struct.pack("<I", vtype) + value


def crafted_header(kvs: list[bytes], tensors: list[tuple[str, list[int], int, int]], n_tensors: int | None = None,
                   alignment: int = 32) -> bytes:
    """A GGUF v3 header: KVS (kv()), then TENSORS as (name, dims, ggml type, offset), padded to ALIGNMENT."""
    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors) if n_tensors is None else n_tensors, len(kvs)) + b"".join(kvs)
    for name, dims, ggml_type, offset in tensors:
        out += gguf_string(name.encode()) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims) \
            + struct.pack("<IQ", ggml_type, offset)
    return out + bytes(-len(out) % alignment)


LLAMA = [kv("general.architecture", 8, gguf_string(b"llama")), kv("llama.block_count", 4, struct.pack("<I", 2))]


def test_the_header_reader_reads_what_the_gguf_package_reads(tmp_path):
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_custom_alignment(64)
    writer.add_token_list([f"tok{i}" for i in range(300)])
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_string("tokenizer.chat_template", "{{ messages }}")
    rng = np.random.default_rng(0)
    for name, shape in [("token_embd.weight", (7, 64)), ("blk.0.attn_q.weight", (64, 64)),
                        ("blk.1.attn_q.weight", (64, 64)), ("output_norm.weight", (64,))]:
        writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    writer.add_tensor("blk.0.ffn_up.weight", rng.standard_normal((32, 64)).astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = gguf.GGUFReader(str(path))
    want = sorted(((t.name, int(t.data_offset), int(t.n_bytes)) for t in reader.tensors), key=lambda t: t[1])
    found = manifests.layout(path)
    assert found.tensors == tuple(want)
    assert found.data_start == want[0][1] and found.n_layer == 2 and found.tied_embeddings
    assert manifests.layout_of(path.read_bytes()[:found.data_start], path.stat().st_size) == found


def test_a_header_of_a_million_empty_strings_is_read_in_memory_and_time_bounded_by_its_bytes():
    # the header the review measured: 22 s of CPU and 1.5 GiB in the gguf package's reader
    strings = kv("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 1 << 20) + bytes(8 << 20))
    header = crafted_header([*LLAMA, strings], [("token_embd.weight", [4], 0, 0)])
    tracemalloc.start()
    began = time.process_time()
    try:
        found = manifests.layout_of(header, len(header) + 16)
        spent = time.process_time() - began
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert found.tensors == (("token_embd.weight", len(header), 16),)
    assert peak < 4 << 20, peak
    assert spent < 10, spent


@pytest.mark.parametrize("case, header", [
    ("more tensors than the cap", crafted_header(LLAMA, [], n_tensors=MAX_TENSORS + 1)),
    ("2^63 tensors", crafted_header(LLAMA, [], n_tensors=1 << 63)),
    ("a count of 2^64-1 strings", crafted_header([*LLAMA, kv("t", 9, struct.pack("<IQ", 8, (1 << 64) - 1))], [])),
    ("a string longer than the header", crafted_header([kv("general.architecture", 8, struct.pack("<Q", 1 << 40))],
                                                       [])),
    ("arrays nested past any GGUF", crafted_header([*LLAMA, kv("t", 9, struct.pack("<IQ", 9, 1) * 200
                                                                + struct.pack("<IQ", 4, 0))], [])),
    ("an unknown value type", crafted_header([*LLAMA, kv("t", 99, b"")], [])),
    ("an unknown tensor type", crafted_header(LLAMA, [("token_embd.weight", [4], 9999, 0)])),
    ("five dimensions", crafted_header(LLAMA, [("token_embd.weight", [1, 1, 1, 1, 4], 0, 0)])),
    ("no architecture", crafted_header([kv("llama.block_count", 4, struct.pack("<I", 2))], [])),
    ("a name that is not UTF-8", crafted_header(LLAMA, [("x", [4], 0, 0)]).replace(b"\x01\x00\x00\x00\x00\x00\x00\x00x",
                                                                                      b"\x01\x00\x00\x00\x00\x00\x00\x00\xff")),
    ("not a GGUF", b"GGML" + bytes(60)),
    ("a header cut short", crafted_header(LLAMA, [("token_embd.weight", [4], 0, 0)])[:-40]),
])
def test_a_header_that_is_not_a_gguf_header_within_the_bounds_is_not_gguf_at_once(case, header):
    began = time.process_time()
    with pytest.raises(MeshnetError) as failed:
        manifests.layout_of(header, len(header) + 16)
    assert failed.value.code == E.NOT_GGUF, (case, failed.value)
    assert time.process_time() - began < 1, case
