"""The numerics classes (meshnet/core/numerics.py): the invariant class gives every row the
same bits however it is batched; the class is part of a route's compatibility class."""

import os
import subprocess

import gguf
import numpy as np
import pytest

from meshnet.core.errors import MeshnetError
from meshnet.engine.binding import Entry, Stage
from meshnet.engine.gguf_layout import read_layout
from meshnet.route.config import CoordinatorConfig
from meshnet.route.coordinator import Coordinator

from conftest import DENSE_ARCHS, ROOT, THREADS
from peers import start_worker, wait_until

PROMPT = ("The old lighthouse keeper climbed the stairs every night, and on the last night of winter he saw a "
          "ship with no lights at all drifting towards the rocks below")


def feed(stage: Stage, sid: int, tokens: np.ndarray, cuts: list[int]) -> dict[int, np.ndarray]:
    """TOKENS into a fresh session in the chunks CUTS marks; every row the stage gives
    back, by position (a stage before the tail: each row's residual; the tail: the logits
    of each chunk's last row)."""
    stage.open_session(sid)
    rows, start = {}, 0
    for end in cuts + [len(tokens)]:
        out = stage.forward([Entry(sid, start, tokens=tokens[start:end])])
        if stage.is_tail:
            rows[end - 1] = out.logits[0]
        else:
            rows.update(zip(range(start, end), out.residual))
        start = end
    stage.release_session(sid)
    return rows


def chunkings(n: int) -> dict[str, list[int]]:
    return {"one chunk": [], "token by token": list(range(1, n)), "chunks of 5": list(range(5, n, 5)),
            "uneven": [1, 3, 10, 11, 24][: max(0, n - 1)]}


def assert_rows_agree(results: dict[str, dict[int, np.ndarray]]) -> None:
    reference = results["token by token"]
    for name, rows in results.items():
        assert rows, name
        for pos, row in rows.items():
            diff = float(np.abs(row - reference[pos]).max())
            assert diff == 0.0, f"{name}: row {pos} differs from the row fed alone by {diff}"


def invariant_stages(path, n_layer, **options):
    """A head before the tail (every row's residual) and the whole model (logits)."""
    return [Stage(path, (0, n_layer // 2), n_ctx=256, max_sessions=4, n_threads=THREADS, **options),
            Stage(path, n_ctx=256, max_sessions=4, n_threads=THREADS, **options)]


@pytest.mark.parametrize("model", ["smollm2", "qwen"])
def test_invariant_rows_are_bit_identical_however_the_prompt_is_chunked(model, smollm2_path, qwen_path):
    path = smollm2_path if model == "smollm2" else qwen_path
    for stage in invariant_stages(path, read_layout(path).n_layer):
        with stage:
            assert stage.info().numerics == "invariant"
            tokens = np.asarray(stage.tokenize(PROMPT), dtype=np.int32)
            assert len(tokens) > 25
            # (the tail gives logits for the rows that end a chunk: those are compared)
            assert_rows_agree({name: feed(stage, i, tokens, cuts)
                               for i, (name, cuts) in enumerate(chunkings(len(tokens)).items())})


@pytest.mark.parametrize("model", ["smollm2", "qwen"])
def test_invariant_rows_beside_other_sessions_rows_are_what_they_are_alone(model, smollm2_path, qwen_path):
    path = smollm2_path if model == "smollm2" else qwen_path
    with Stage(path, (0, 2), n_ctx=256, max_sessions=4, n_threads=THREADS) as stage:
        tokens = np.asarray(stage.tokenize(PROMPT), dtype=np.int32)
        alone = feed(stage, 0, tokens, list(range(1, len(tokens))))
        # the same prompt as one chunk beside another session's prompt chunk and a third's decode steps
        for sid in (1, 2, 3):
            stage.open_session(sid)
        stage.forward([Entry(3, 0, tokens=tokens[:7])])
        other = np.asarray(stage.tokenize("A different prompt entirely, of another length"), dtype=np.int32)
        out = stage.forward([Entry(2, 0, tokens=other), Entry(1, 0, tokens=tokens), Entry(3, 7, tokens=tokens[7:8])])
        mixed = dict(zip(range(len(tokens)), out.residual[len(other):len(other) + len(tokens)]))
        decode_row = out.residual[-1]
    assert_rows_agree({"token by token": alone, "mixed batch": mixed})
    assert np.array_equal(decode_row, alone[7])


@pytest.mark.parametrize("pool_cells, kv_type", [(0, "f16"), (2048, "f16"), (0, "q8_0"), (2048, "q4_0")])
def test_invariant_rows_with_flash_attention_are_bit_identical_however_batched(pool_cells, kv_type, smollm2_path):
    # the CPU kernel's three paths (a row alone, a tile of rows, one row's cells split over the
    # threads past 512 of them) would each sum a row otherwise: the class runs the first (0016);
    # a quantized cache's cells are each quantized on their own as they are written
    with Stage(smollm2_path, n_ctx=1024, max_sessions=4, n_threads=THREADS, flash_attn=True,
               pool_cells=pool_cells, kv_type=kv_type) as whole:
        tokens = np.asarray(whole.tokenize(PROMPT * 25), dtype=np.int32)[:600]
        assert len(tokens) == 600
        rows = {name: feed(whole, i, tokens, cuts) for i, (name, cuts) in enumerate({
            "token by token": list(range(1, 600)), "two chunks": [512], "chunks of 70": list(range(70, 600, 70)),
            "uneven": [1, 3, 10, 11, 24, 300, 513]}.items())}
        # a prompt chunk beside another session's decode step past 512 cells
        for sid in (5, 6):
            whole.open_session(sid)
        whole.forward([Entry(6, 0, tokens=tokens[:500])])
        whole.forward([Entry(6, 500, tokens=tokens[500:550])])
        mixed = whole.forward([Entry(5, 0, tokens=tokens[:40]), Entry(6, 550, tokens=tokens[550:551])])
    assert_rows_agree(rows)
    assert np.array_equal(mixed.logits[0], rows["token by token"][39])
    assert np.array_equal(mixed.logits[1], rows["token by token"][550])


def test_the_tail_s_logits_beside_other_sessions_rows_are_what_the_rows_give_alone(smollm2_path):
    with Stage(smollm2_path, n_ctx=256, max_sessions=3, n_threads=THREADS) as whole:
        tokens = np.asarray(whole.tokenize(PROMPT), dtype=np.int32)
        alone = feed(whole, 0, tokens, list(range(1, len(tokens))))
        whole.open_session(1)
        whole.forward([Entry(1, 0, tokens=tokens[:20])])
        # a 25-row prompt chunk and another session's decode step in one forward call
        whole.open_session(2)
        batched = whole.forward([Entry(2, 0, tokens=tokens[:25]), Entry(1, 20, tokens=tokens[20:21])])
    assert np.array_equal(batched.logits[0], alone[24])
    assert np.array_equal(batched.logits[1], alone[20])


def assert_invariant_on_generated(path, **options):
    """A generated model's rows (128-token vocabulary) alike however they are chunked, in a
    head and in the whole model, and beside another session's rows."""
    tokens = np.random.default_rng(7).integers(0, 128, size=29).astype(np.int32)
    for stage in invariant_stages(path, read_layout(path).n_layer, **options):
        with stage:
            assert_rows_agree({name: feed(stage, i, tokens, cuts)
                               for i, (name, cuts) in enumerate(chunkings(len(tokens)).items())})
    with Stage(path, (0, 1), n_ctx=256, max_sessions=3, n_threads=THREADS, **options) as head:
        alone = feed(head, 0, tokens, list(range(1, len(tokens))))
        for sid in (1, 2):
            head.open_session(sid)
        head.forward([Entry(2, 0, tokens=tokens[:4])])
        out = head.forward([Entry(1, 0, tokens=tokens), Entry(2, 4, tokens=tokens[4:5])])
    assert_rows_agree({"token by token": alone, "mixed batch": dict(zip(range(len(tokens)), out.residual))})
    assert np.array_equal(out.residual[-1], alone[4])


@pytest.mark.parametrize("arch", DENSE_ARCHS)
def test_invariant_rows_are_bit_identical_on_generated_dense_models(arch, arch_models):
    # F32 weights take llamafile's sgemm from 2 rows up: the class must hold there too
    assert read_layout(arch_models[arch]).arch == arch
    assert_invariant_on_generated(arch_models[arch])


# K alone quantized (no flash attention: V stays f16, transposed), and K and V (flash attention)
KV_TYPES = {"q8_0,f16": False, "q8_0": True, "q4_0": True}


@pytest.mark.parametrize("kv_type", KV_TYPES)
def test_invariant_rows_with_a_quantized_kv_cache_are_bit_identical_however_batched(kv_type, arch_models,
                                                                                   smollm2_path, qwen_path,
                                                                                   gemma3_path):
    options = dict(kv_type=kv_type, flash_attn=KV_TYPES[kv_type])
    for arch in DENSE_ARCHS:
        assert_invariant_on_generated(arch_models[arch], **options)
    for path in (smollm2_path, qwen_path, gemma3_path):
        for stage in invariant_stages(path, read_layout(path).n_layer, **options):
            with stage:
                tokens = np.asarray(stage.tokenize(PROMPT), dtype=np.int32)
                assert_rows_agree({name: feed(stage, i, tokens, cuts)
                                   for i, (name, cuts) in enumerate(chunkings(len(tokens)).items())})


# every weight type people run, each with the kernels this machine picks for it (a plain or
# a repacked layout; vec_dot, sgemm, the tiled K-quant kernel, a gemm and a gemv): the
# generated llama model written in it by llama.cpp's own quantizer (tools/reference/quantize.cpp)
WEIGHT_TYPES = ("f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k",
                "iq4_nl", "iq4_xs")
QUANTIZE = os.path.join(ROOT, "build", "reference", "stock", "meshnet-quantize")


@pytest.fixture(scope="module")
def quantized_models(tmp_path_factory, arch_models):
    assert os.path.isfile(QUANTIZE), f"{QUANTIZE} is missing: run `make reference` (make test does)"
    out = tmp_path_factory.mktemp("types")

    def model(weight_type: str) -> str:
        path = out / f"llama-{weight_type}.gguf"
        if not path.exists():
            done = subprocess.run([QUANTIZE, arch_models["llama"], str(path), weight_type], capture_output=True,
                                  text=True, timeout=120)
            assert done.returncode == 0, done.stderr[-2000:]
        return str(path)
    return model


@pytest.mark.parametrize("weight_type", WEIGHT_TYPES)
def test_invariant_rows_are_bit_identical_in_every_weight_type(weight_type, quantized_models):
    path = quantized_models(weight_type)
    types = {t.tensor_type.name.lower() for t in gguf.GGUFReader(path).tensors if len(t.shape) == 2}
    assert weight_type in types, types   # (llama.cpp falls back to another type where a row is too short)
    assert_invariant_on_generated(path)


def test_the_class_is_reported_and_one_that_is_none_is_refused(smollm2_path):
    with Stage(smollm2_path, (0, 15), n_ctx=64, max_sessions=1, n_threads=THREADS, numerics="stock") as stock:
        assert stock.info().numerics == "stock"
    with pytest.raises(MeshnetError) as err:
        Stage(smollm2_path, n_ctx=64, max_sessions=1, numerics="exact")
    assert err.value.code == "invalid_argument" and "invariant or stock" in err.value.message


def test_a_route_that_mixes_numerics_classes_is_refused_naming_both(smollm2_path):
    with Coordinator(CoordinatorConfig(heartbeat_interval=0.1, heartbeat_liveness=10)) as coordinator:
        workers = [start_worker(smollm2_path, coordinator.endpoint, (0, 15)),
                   start_worker(smollm2_path, coordinator.endpoint, (15, 30), "--numerics", "stock")]
        try:
            assert wait_until(lambda: len([w for w in coordinator.workers_snapshot() if "layers" in w]) == 2,
                              timeout=120)
            with pytest.raises(MeshnetError) as err:
                coordinator.route()
            assert err.value.code == "route_incomplete"
            assert "incompatible class" in err.value.message
            # the class of whichever registered first is the reference the other is named against
            assert ("numerics stock vs invariant" in err.value.message
                    or "numerics invariant vs stock" in err.value.message), err.value.message
        finally:
            for w in workers:
                w.terminate()
            for w in workers:
                w.wait(30)


@pytest.mark.parametrize("numerics", ["stock", "invariant"])
@pytest.mark.parametrize("model", ["smollm2", "qwen"])
def test_a_split_route_gives_the_tokens_of_stock_llama_cpp_built_as_its_class_says(model, numerics, smollm2_path,
                                                                                  qwen_path):
    # stock: the pin's default build; invariant: the pin without llamafile, repacking and
    # the tiled matmul (meshnet/evidence/reference.py). 8 prompts x 32 greedy tokens through 2 workers:
    # one after another in the stock class (batched rows may change its floats), all at once
    # in the invariant class (they must not)
    from meshnet.evidence import prompts, reference
    from meshnet.launch.local_cluster import LocalCluster

    path = smollm2_path if model == "smollm2" else qwen_path
    n_tokens = 32
    expected = reference.greedy(path, prompts.CLASS_CHECK, n_tokens, numerics, threads=THREADS)
    ranges = read_layout(path).balanced_ranges(2)
    together = numerics == "invariant"
    sessions = len(prompts.CLASS_CHECK) if together else 1
    with LocalCluster(path, ranges, threads=THREADS, n_ctx=512, max_sessions=sessions, numerics=numerics) as cluster:
        coordinator = cluster.coordinator
        assert {w["numerics"] for w in coordinator.workers_snapshot()} == {numerics}
        prompt_tokens = [coordinator.tokenize(prompt) for prompt in prompts.CLASS_CHECK]
        assert prompt_tokens == [ref_prompt for ref_prompt, _ in expected]
        if together:
            handles = [coordinator.generate(tokens, n_tokens, stop_at_eog=False) for tokens in prompt_tokens]
            answers = [h.result(600).tokens for h in handles]
        else:
            answers = [coordinator.generate(tokens, n_tokens, stop_at_eog=False).result(600).tokens
                       for tokens in prompt_tokens]
        parted = []
        for prompt, (_, ref_tokens), got in zip(prompts.CLASS_CHECK, expected, answers):
            check = reference.agreement(ref_tokens, got)
            if not check["agrees"]:
                parted.append((prompt[:30], check["first_divergence"]))
    assert max(len(t) for t, _ in expected) > 64   # a prompt longer than the coordinator's usual chunk
    assert not parted, f"{len(parted)} of {len(expected)} prompts part from stock llama.cpp: {parted}"


def test_a_session_that_loses_a_stage_never_resumes_on_a_route_of_the_other_class(smollm2_path):
    from meshnet.core import errors as E

    with Coordinator(CoordinatorConfig(heartbeat_interval=0.1, heartbeat_liveness=10)) as coordinator:
        invariant = [start_worker(smollm2_path, coordinator.endpoint, r) for r in ((0, 15), (15, 30))]
        workers = list(invariant)
        try:
            assert wait_until(lambda: _route_workers(coordinator) == 2, timeout=120)
            workers += [start_worker(smollm2_path, coordinator.endpoint, r, "--numerics", "stock")
                        for r in ((0, 15), (15, 30))]
            assert wait_until(lambda: len([w for w in coordinator.workers_snapshot() if "layers" in w]) == 4,
                              timeout=120)
            tokens = coordinator.tokenize(PROMPT)
            session = coordinator.generate(tokens, 200, stop_at_eog=False)
            for i, _ in enumerate(session):
                if i == 3:
                    break
            invariant[1].kill()
            with pytest.raises(MeshnetError) as err:
                session.result(120)
            # a complete stock route stood ready: the session ended rather than change its kernels
            assert err.value.code == E.STAGE_LOST
            after = coordinator.generate(tokens, 4, stop_at_eog=False).result(120)
            assert after.metrics["numerics"] == "stock" and "resumed" not in after.metrics
        finally:
            for w in workers:
                if w.poll() is None:
                    w.terminate()
            for w in workers:
                w.wait(30)


def _route_workers(coordinator) -> int:
    try:
        return len(coordinator.route())
    except MeshnetError:
        return 0


@pytest.mark.parametrize("numerics, kv_type", [("invariant", "f16"), ("stock", "f16"), ("invariant", "q8_0")])
def test_a_flash_attention_route_gives_the_whole_model_s_tokens_with_flash_attention(numerics, kv_type, smollm2_path):
    # flash attention (llama-server's default on a CPU), and with it a quantized KV cache: a
    # route of two workers with them, over a shared KV pool, gives what the whole model gives
    # with them in one process, fed as stock feeds a prompt; a worker without them is kept out
    from meshnet.engine.pipeline import LocalPipeline
    from meshnet.evidence import prompts
    from meshnet.launch.local_cluster import LocalCluster

    n_tokens = 24
    options = dict(n_ctx=512, max_sessions=1, n_threads=THREADS, numerics=numerics)
    with LocalPipeline(smollm2_path, [(0, 30)], flash_attn=True, kv_type=kv_type, **options) as whole:
        prompt_tokens = [whole.head.tokenize(p) for p in prompts.CLASS_CHECK]
        expected = [whole.generate(t, n_tokens, stop_at_eog=False, keep_logits=True) for t in prompt_tokens]
    with LocalPipeline(smollm2_path, [(0, 30)], **options) as plain:
        without = plain.generate(prompt_tokens[-1], 1, stop_at_eog=False, keep_logits=True)
    # (else the class would hold nothing apart: its sums are not the plain kernels')
    assert not np.array_equal(without.logits[0], expected[-1].logits[0])
    ranges = read_layout(smollm2_path).balanced_ranges(2)
    with LocalCluster(smollm2_path, ranges, threads=THREADS, n_ctx=512, max_sessions=2, kv_pool=1024,
                      numerics=numerics, flash_attn=True, kv_type=kv_type,
                      secure=False) as cluster:   # (plain: the third worker joins)
        coordinator = cluster.coordinator
        assert [w.get("flash_attn") for w in coordinator.workers_snapshot()] == [True, True]
        assert [w.get("kv_type", "f16") for w in coordinator.workers_snapshot()] == [kv_type, kv_type]
        # (the prompt in one chunk, as stock feeds it: flash attention's sums follow the chunks)
        answers = [coordinator.generate(t, n_tokens, stop_at_eog=False, prefill_chunk=512).result(600).tokens
                   for t in prompt_tokens]
        # a worker without flash attention; with it but an f16 cache where the route's is quantized
        other = ("--flash-attn",) if kv_type != "f16" else ()
        plain_worker = start_worker(smollm2_path, coordinator.endpoint, ranges[1].as_tuple(), "--numerics", numerics,
                                    *other)
        difference = "kv type f16 vs q8_0" if other else "flash attn False vs True"
        try:
            def plain_kept_out() -> str:
                stages = coordinator.metrics()["stages"]
                return next((s["kept_out"] or "" for s in stages if s["worker"] not in
                             {w["name"] for w in coordinator.workers_snapshot()
                              if w.get("flash_attn") and w.get("kv_type", "f16") == kv_type}), "")
            assert wait_until(lambda: difference in plain_kept_out(), timeout=120), plain_kept_out()
        finally:
            plain_worker.terminate()
            plain_worker.wait(30)
    assert max(len(t) for t in prompt_tokens) > 64
    assert answers == [e.tokens for e in expected]
