"""ACCEPTANCE section A: the engine runs a layer range of the real model, exactly."""

import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from meshnet.core.errors import MeshnetError
from meshnet.core.layers import ranges_from_seams
from meshnet.engine.binding import Entry, Stage, default_threads
from meshnet.engine.gguf_layout import read_layout
from meshnet.engine.pipeline import LocalPipeline

from conftest import THREADS

PROMPT = "The old lighthouse keeper climbed the stairs every night, and on the last night of winter he saw"
N_NEW = 32


def generate(path, seams, prompt=PROMPT, **options):
    layout = read_layout(path)
    options.setdefault("n_threads", THREADS)
    options.setdefault("n_ctx", 256)
    with LocalPipeline(path, ranges_from_seams(layout.n_layer, seams), **options) as pipe:
        tokens = pipe.head.tokenize(prompt)
        return pipe.generate(tokens, N_NEW, keep_logits=True, stop_at_eog=False)


def max_logit_diff(a, b):
    return max(float(np.abs(x - y).max()) for x, y in zip(a.logits, b.logits))


@pytest.fixture(scope="module")
def smollm2_whole(smollm2_path):
    return generate(smollm2_path, [])


def assert_split_matches_whole(path, seams, whole):
    split = generate(path, seams)
    assert len(split.tokens) == N_NEW
    # zip() in max_logit_diff would quietly compare fewer steps
    assert len(split.logits) == len(whole.logits) == N_NEW
    assert split.tokens == whole.tokens
    diff = max_logit_diff(split, whole)
    print(f"seams {seams}: max |dlogit| over {N_NEW} steps = {diff}")
    assert diff == 0.0


@pytest.mark.parametrize("prompt,continuation", [
    ("The capital of France is", " Paris"),
    ("1, 2, 3, 4, 5, 6,", " 7, 8, 9, 10"),   # four numbers on: each decode step reads the KV of the last
])
def test_whole_model_continues_prompts_as_the_model_does(smollm2_path, prompt, continuation):
    # the parity tests compare the engine with itself; this holds it to the model's known behaviour,
    # so that an engine wrong the same way split and whole (lost KV, garbage logits) cannot pass
    with LocalPipeline(smollm2_path, [(0, 30)], n_ctx=256, max_sessions=1, n_threads=THREADS) as whole:
        gen = whole.generate(whole.head.tokenize(prompt), 12, keep_logits=True, stop_at_eog=False)
        text = whole.tail.detokenize(gen.tokens)
    assert text.startswith(continuation), text
    assert all(int(np.argmax(row)) == token for row, token in zip(gen.logits, gen.tokens))  # greedy is the argmax
    assert all(np.isfinite(row).all() for row in gen.logits)


@pytest.mark.parametrize("seams", [[1], [15], [29], [10, 20]], ids=lambda s: "seams" + "-".join(map(str, s)))
def test_split_gives_whole_model_tokens_and_logits_smollm2(smollm2_path, smollm2_whole, seams):
    assert_split_matches_whole(smollm2_path, seams, smollm2_whole)


def test_split_gives_whole_model_tokens_and_logits_qwen2(qwen_path):
    assert_split_matches_whole(qwen_path, [14], generate(qwen_path, []))


def test_head_holds_only_embeddings_and_its_layers(smollm2_path):
    layout = read_layout(smollm2_path)
    expected = layout.token_embd_bytes + sum(layout.layer_bytes[:15])
    with Stage(smollm2_path, n_ctx=512, max_sessions=2) as whole, Stage(smollm2_path, (0, 15), n_ctx=512, max_sessions=2) as head:
        info = head.info()
        assert abs(info.model_bytes - expected) <= 0.05 * expected
        assert info.model_bytes < 0.7 * layout.file_bytes
        assert info.kv_bytes * 2 == whole.info().kv_bytes


def test_middle_stage_holds_no_embeddings_or_output(smollm2_path):
    layout = read_layout(smollm2_path)
    with Stage(smollm2_path, (10, 20), n_ctx=512, max_sessions=1) as middle:
        info = middle.info()
        expected = sum(layout.layer_bytes[10:20])
        assert abs(info.model_bytes - expected) <= 0.05 * expected
        assert not info.is_head and not info.is_tail


def test_tail_with_tied_embeddings_holds_token_embd_as_output(smollm2_path):
    layout = read_layout(smollm2_path)
    assert layout.tied_embeddings
    with Stage(smollm2_path, (15, 30), n_ctx=512, max_sessions=1) as tail:
        assert tail.info().model_bytes == layout.stage_bytes(15, 30)


def _step(pipe, session, pos, tokens):
    out = pipe.forward([Entry(session, pos, tokens=np.asarray(tokens, dtype=np.int32))])
    return int(out.token[0]), out.logits[0].copy()


def test_interleaved_sessions_match_each_alone_and_release_frees_kv(smollm2_path):
    prompts = ["Once upon a time", "The recipe for bread needs flour, water and"]
    with LocalPipeline(smollm2_path, [(0, 15), (15, 30)], n_ctx=128, max_sessions=2, n_threads=THREADS) as pipe:
        alone = [pipe.generate(pipe.head.tokenize(p), 12, stop_at_eog=False) for p in prompts]

        sessions = {1: pipe.head.tokenize(prompts[0]), 2: pipe.head.tokenize(prompts[1])}
        got = {1: [], 2: []}
        pos = {}
        for sid in sessions:
            pipe.open_session(sid)
        for sid, toks in sessions.items():
            token, _ = _step(pipe, sid, 0, toks)
            got[sid].append(token)
            pos[sid] = len(toks)
        for _ in range(11):
            for sid in sessions:  # strictly alternating steps
                token, _ = _step(pipe, sid, pos[sid], [got[sid][-1]])
                got[sid].append(token)
                pos[sid] += 1
        assert alone[0].tokens != alone[1].tokens  # else a mix-up of the two sessions could not show
        assert got[1] == alone[0].tokens
        assert got[2] == alone[1].tokens

        for stage in pipe.stages:
            info = stage.info()
            assert info.n_sessions == 2 and info.kv_bytes_used > 0
        pipe.release_session(1)
        for stage in pipe.stages:
            assert stage.info().n_sessions == 1
        pipe.release_session(2)
        for stage in pipe.stages:
            info = stage.info()
            assert info.n_sessions == 0 and info.kv_bytes_used == 0


def test_sessions_batched_in_one_forward_call_match_each_alone(smollm2_path):
    prompts = ["Once upon a time", "The recipe for bread needs", "In 1969 the first man", "Python is a"]
    with LocalPipeline(smollm2_path, [(0, 15), (15, 30)], n_ctx=128, max_sessions=4, n_threads=THREADS) as pipe:
        alone = [pipe.generate(pipe.head.tokenize(p), 10, stop_at_eog=False, keep_logits=True) for p in prompts]
        prompt_tokens = [pipe.head.tokenize(p) for p in prompts]
        for sid in range(4):
            pipe.open_session(sid)
        out = pipe.forward([Entry(sid, 0, tokens=np.array(prompt_tokens[sid])) for sid in range(4)])
        got = [[int(g)] for g in out.token]
        diffs = [float(np.abs(out.logits[sid] - alone[sid].logits[0]).max()) for sid in range(4)]
        pos = [len(t) for t in prompt_tokens]
        for step in range(1, 10):
            out = pipe.forward([Entry(sid, pos[sid], tokens=np.array([got[sid][-1]])) for sid in range(4)])
            for sid in range(4):
                diffs.append(float(np.abs(out.logits[sid] - alone[sid].logits[step]).max()))
                got[sid].append(int(out.token[sid]))
                pos[sid] += 1
        assert got == [a.tokens for a in alone]
        assert max(diffs) == 0.0
        for sid in range(4):
            pipe.release_session(sid)


def test_a_prompt_chunk_beside_other_sessions_decode_steps_gives_what_it_gives_alone(smollm2_path):
    """llama.cpp would cut a chunk batched with one-row steps into micro-batches of equal
    rows per session (1 + n-1), whose floats differ; the engine runs the chunk apart."""
    long_text = "The capital of France is a city that many people visit every year. " * 10
    with Stage(smollm2_path, None, n_ctx=1024, max_sessions=4, n_threads=THREADS) as stage:
        a, b = stage.tokenize(long_text)[:133], stage.tokenize(long_text[::-1])[:144]

        def chunk_logits(with_decode_steps: bool) -> np.ndarray:
            for sid in (1, 2, 3):
                stage.open_session(sid)
            stage.forward([Entry(1, 0, tokens=np.array(a)), Entry(3, 0, tokens=np.array(a[:50]))])
            stage.forward([Entry(2, 0, tokens=np.array(b[:128]))])
            entries = [Entry(2, 128, tokens=np.array(b[128:]))]
            if with_decode_steps:   # sessions 1 and 3 (lower sequence ids) decode beside the chunk
                entries += [Entry(1, len(a), tokens=np.array([5])), Entry(3, 50, tokens=np.array([9]))]
            out = stage.forward(entries)
            for sid in (1, 2, 3):
                stage.release_session(sid)
            return out.logits[0].copy()

        assert float(np.abs(chunk_logits(True) - chunk_logits(False)).max()) == 0.0


def test_truncate_forgets_the_cut_tokens_exactly(smollm2_path):
    with LocalPipeline(smollm2_path, [(0, 15), (15, 30)], n_ctx=128, max_sessions=2, n_threads=THREADS) as pipe:
        prompt = pipe.head.tokenize(PROMPT)
        pipe.open_session(3)
        first, _ = _step(pipe, 3, 0, prompt)
        tokens, pos = [first], len(prompt)
        for _ in range(8):
            token, _ = _step(pipe, 3, pos, [tokens[-1]])
            tokens.append(token)
            pos += 1
        keep = len(prompt) + 2
        for stage in pipe.stages:
            stage.truncate_session(3, keep)
            assert stage.session_length(3) == keep
        # after the cut, a token other than the one generated there: had the cut tokens stayed
        # in the KV (only the length reset), attention at `keep` would still see them
        other = 11 if tokens[2] != 11 else 12
        after_cut = [_step(pipe, 3, keep, [other])]
        after_cut.append(_step(pipe, 3, keep + 1, [after_cut[-1][0]]))

        # the same steps in a session that never held the cut tokens
        pipe.open_session(4)
        _step(pipe, 4, 0, prompt)
        _step(pipe, 4, len(prompt), [tokens[0]])
        _step(pipe, 4, len(prompt) + 1, [tokens[1]])
        fresh = [_step(pipe, 4, keep, [other])]
        fresh.append(_step(pipe, 4, keep + 1, [fresh[-1][0]]))
        assert [t for t, _ in after_cut] == [t for t, _ in fresh]
        assert max(float(np.abs(a - b).max()) for (_, a), (_, b) in zip(after_cut, fresh)) == 0.0
        pipe.release_session(3)
        pipe.release_session(4)


def test_prompt_longer_than_physical_batch_runs_in_chunks_identically(smollm2_path):
    long_prompt = " ".join([PROMPT] * 6)
    reference = generate(smollm2_path, [15], long_prompt, n_ctx=512)
    assert len(reference.prompt_tokens) > 100
    # llama.cpp splits each call into physical batches of 16 rows; the smaller scratch
    # buffer shows that the option reached llama.cpp (else this would compare a run with itself)
    with Stage(smollm2_path, (0, 15), n_ctx=512, max_sessions=1) as default, \
            Stage(smollm2_path, (0, 15), n_ctx=512, max_sessions=1, n_ubatch=16) as small:
        assert small.info().compute_bytes < default.info().compute_bytes / 4
    in_engine = generate(smollm2_path, [15], long_prompt, n_ctx=512, n_ubatch=16)
    assert in_engine.tokens == reference.tokens
    assert max_logit_diff(in_engine, reference) == 0.0
    # the caller sends the prompt in forward calls of 16 tokens
    layout = read_layout(smollm2_path)
    halves = ranges_from_seams(layout.n_layer, [15])  # tuples until LocalPipeline takes LayerRange
    with LocalPipeline(smollm2_path, halves, n_ctx=512, n_batch=16, n_threads=THREADS) as pipe:
        assert pipe.head.info().n_batch == 16
        chunked = pipe.generate(reference.prompt_tokens, N_NEW, keep_logits=True, stop_at_eog=False, prefill_chunk=16)
    assert chunked.tokens == reference.tokens
    assert max_logit_diff(chunked, reference) == 0.0


# bad input: a clear error, never a crash, and the stage keeps working afterwards


@pytest.fixture(scope="module")
def split_stages(smollm2_path):
    head = Stage(smollm2_path, (0, 15), n_ctx=32, max_sessions=2, n_threads=THREADS)
    tail = Stage(smollm2_path, (15, 30), n_ctx=32, max_sessions=2, n_threads=THREADS)
    yield head, tail
    head.close()
    tail.close()


def _still_works(head, tail):
    head.open_session(99)
    tail.open_session(99)
    residual = head.forward([Entry(99, 0, tokens=np.array([1, 2, 3]))]).residual
    out = tail.forward([Entry(99, 0, residual=residual)])
    head.release_session(99)
    tail.release_session(99)
    return int(out.token[0])


def _expect(code, fn, *args, **kwargs):
    with pytest.raises(MeshnetError) as err:
        fn(*args, **kwargs)
    assert err.value.code == code, err.value
    assert err.value.message
    return err.value


@pytest.mark.parametrize("layers,code", [((0, 31), "bad_range"), ((5, 5), "bad_range"), ((-1, 4), "bad_range"), ((20, 10), "bad_range")])
def test_bad_range_is_refused(smollm2_path, layers, code):
    error = _expect(code, Stage, smollm2_path, layers)
    assert "30 layers" in error.message


def test_bad_forward_inputs_are_refused_and_the_stage_keeps_working(split_stages):
    head, tail = split_stages
    expected = _still_works(head, tail)
    head.open_session(5)
    tail.open_session(5)
    try:
        _expect("bad_token", head.forward, [Entry(5, 0, tokens=np.array([1, head.n_vocab]))])
        _expect("bad_token", head.forward, [Entry(5, 0, tokens=np.array([-3]))])
        _expect("bad_width", tail.forward, [Entry(5, 0, residual=np.zeros((2, tail.n_embd - 1), np.float32))])
        _expect("invalid_argument", tail.forward, [Entry(5, 0, tokens=np.array([1, 2]))])
        _expect("invalid_argument", head.forward, [Entry(5, 0, residual=np.zeros((1, head.n_embd), np.float32))])
        _expect("context_full", head.forward, [Entry(5, 0, tokens=np.arange(40) + 10)])
        _expect("unknown_session", head.forward, [Entry(12345, 0, tokens=np.array([1]))])
        _expect("invalid_argument", head.forward, [Entry(5, 3, tokens=np.array([1]))])  # skips positions
        _expect("unknown_session", head.release_session, 12345)
        _expect("invalid_argument", head.truncate_session, 5, 1)  # holds 0 tokens
        assert head.session_length(5) == 0 and tail.session_length(5) == 0
    finally:
        head.release_session(5)
        tail.release_session(5)
    assert _still_works(head, tail) == expected


def test_more_sessions_than_the_maximum_are_refused(split_stages):
    head, _ = split_stages
    head.open_session(1)
    head.open_session(2)
    try:
        _expect("too_many_sessions", head.open_session, 3)
        _expect("invalid_argument", head.open_session, 2)  # already open
    finally:
        head.release_session(1)
        head.release_session(2)
    head.open_session(3)
    head.release_session(3)


def test_non_gguf_and_missing_files_are_refused(tmp_path):
    text = tmp_path / "notes.gguf"
    text.write_text("this is not a model\n" * 100)
    assert "not a GGUF" in _expect("not_gguf", Stage, text).message
    _expect("not_gguf", Stage, tmp_path / "missing.gguf")


@pytest.mark.parametrize("arch, why", [("hrm_text", "its layers run in cycles"),
                                       ("no-such-arch", "not one the pinned llama.cpp knows")])
def test_unsplittable_architecture_with_a_range_names_the_architecture_and_why(tmp_path, arch, why):
    # refused from the header alone, before llama.cpp reads a tensor
    path = tmp_path / f"tiny-{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(4)
    writer.add_embedding_length(8)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    error = _expect("unsupported_arch", Stage, path, (0, 2))
    assert arch in error.message and "cannot be split" in error.message and why in error.message


# a row's result never depends on the rows beside it: on K-quant weights ggml has kernels
# that switch with the batch's size (repacked gemm/gemv, the tiled matmul from 8 rows)


def test_a_k_quant_model_gives_each_row_the_same_result_whatever_the_number_of_rows_in_the_call(qwen_path):
    prompt = list(range(1000, 1016))
    with Stage(qwen_path, (0, 2), n_ctx=256, max_sessions=8, n_threads=THREADS) as stage:
        first_rows = {}
        for sid, n in enumerate((1, 2, 4, 8, 12, 16)):
            stage.open_session(sid)
            first_rows[n] = stage.forward([Entry(sid, 0, tokens=np.asarray(prompt[:n], dtype=np.int32))], False).residual
        for n, rows in first_rows.items():
            assert np.array_equal(rows[0], first_rows[1][0]), n
            assert np.array_equal(rows, first_rows[16][:n]), n


def test_a_k_quant_model_batches_sessions_bit_exactly(qwen_path):
    from meshnet.engine.pipeline import Request

    prompts = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number, counting from zero.\"\"\"\n",
               "SELECT name, email FROM users WHERE created_at > '2024-01-01' AND",
               "# Sort a list of dictionaries in place by the value of their 'age' key\n",
               "import numpy as np\nimport pandas as pd\n\n# load the measurements and"]
    with LocalPipeline(qwen_path, [(0, 12), (12, 28)], n_ctx=256, max_sessions=4, n_threads=THREADS) as pipe:
        tokens = [pipe.head.tokenize(p) for p in prompts]
        alone = [pipe.generate(t, 12, keep_logits=True, stop_at_eog=False) for t in tokens]
        together = pipe.generate_many([Request(t, 12, True, False, None) for t in tokens])
    for a, b in zip(alone, together):
        assert b.tokens == a.tokens
        assert all(np.array_equal(x, y) for x, y in zip(a.logits, b.logits))


def test_a_stage_left_to_its_default_threads_takes_one_per_physical_core_of_the_cpus_it_may_use():
    # llama.cpp's own default (common_cpu_get_num_math: a core's SMT siblings share one
    # thread), at most the CPUs this process is allowed: a worker pinned to one CPU computes
    # on one thread instead of several that take turns on it
    siblings = {Path(p).read_text() for p in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/topology/thread_siblings")}
    allowed = os.sched_getaffinity(0)
    assert default_threads() == min(len(siblings), len(allowed))
    pinned = subprocess.run(
        [sys.executable, "-c", "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
                               "from meshnet.engine.binding import default_threads; print(default_threads())"],
        capture_output=True, text=True, timeout=60, check=True)
    assert pinned.stdout.strip() == "1"
