"""cffi (ABI mode) binding of the meshnet engine: one pipeline stage of a GGUF model.

This module knows nothing of sockets or routes; it turns token ids or residual rows
into residual rows or logits, with numpy arrays in and out and no needless copies.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
from cffi import FFI

from meshnet.core import defaults
from meshnet.core import errors
from meshnet.core import kv_cache
from meshnet.core import numerics as numerics_classes
from meshnet.core.errors import MeshnetError
from meshnet.core.layers import LayerRange
from meshnet.core.sampling import Sampling
from meshnet.core.text import utf8_or_error

REPO_ROOT = Path(__file__).resolve().parents[2]
HEADER = REPO_ROOT / "engine_c" / "meshnet_engine.h"
DEFAULT_LIBRARY = REPO_ROOT / "build" / "libmeshnet_engine.so"
# the GPU engines `make GPU=...` builds, in the order a GPU stage takes the first built;
# MESHNET_GPU_ENGINE=cuda or vulkan names one
GPU_LIBRARIES = {"cuda": REPO_ROOT / "build" / "cuda" / "libmeshnet_engine.so",
                 "vulkan": REPO_ROOT / "build" / "vulkan" / "libmeshnet_engine.so"}
ABI_VERSION = 18

# meshnet_status -> the code every layer of meshnet uses (core/errors.py gives each its status)
STATUS_CODES = errors.BY_ENGINE_STATUS


def _cdef_from_header(text: str) -> str:
    """The header is the one definition of the ABI: feed it to cffi without the
    compiler-specific blocks (extern "C", the visibility macro) that cffi does not parse."""
    out, skip_depth, depth = [], None, 0
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#if"):
            depth += 1
            if skip_depth is None and ("__cplusplus" in stripped or "__GNUC__" in stripped):
                skip_depth = depth
            continue
        if stripped.startswith("#endif"):
            if skip_depth == depth:
                skip_depth = None
            depth -= 1
            continue
        if skip_depth is not None:
            continue
        if stripped.startswith("#") and not stripped.startswith("#define MESHNET_ENGINE_ABI_VERSION"):
            continue
        out.append(re.sub(r"\bMESHNET_API\s+", "", line))
    return "\n".join(out)


_ffi = FFI()
_ffi.cdef(_cdef_from_header(HEADER.read_text()))
_lib = None
_lib_path: Path | None = None


def library(gpu: bool = False):
    """The loaded engine library: the CPU build, or for a GPU stage the GPU build, which
    runs CPU stages too; MESHNET_ENGINE_LIB overrides both. A process loads one: a GPU
    stage in a process that has the CPU build loaded is refused, not silently run on the CPU."""
    global _lib, _lib_path
    if _lib is None:
        override = os.environ.get("MESHNET_ENGINE_LIB")
        path = Path(override or (gpu_library() if gpu else DEFAULT_LIBRARY))
        if not path.exists():
            if gpu and not override:
                raise MeshnetError(errors.ENGINE_MISSING, f"a GPU stage needs a GPU engine, and {path} is not built: "
                                   "`make GPU=cuda` builds one (it needs CUDA's compiler, nvcc), `make GPU=vulkan` "
                                   "another (glslc and the Vulkan headers)")
            raise MeshnetError(errors.ENGINE_MISSING, f"the engine library {path} does not exist: run `make` first")
        lib = _ffi.dlopen(str(path))
        if lib.meshnet_engine_abi_version() != ABI_VERSION:
            raise MeshnetError(
                errors.ENGINE_MISMATCH,
                f"{path} speaks engine ABI {lib.meshnet_engine_abi_version()}, this package needs {ABI_VERSION}: run `make`",
            )
        _lib, _lib_path = lib, path
    elif gpu and _lib_path == DEFAULT_LIBRARY and not os.environ.get("MESHNET_ENGINE_LIB"):
        raise MeshnetError(errors.NO_GPU, f"this process already runs the CPU engine ({_lib_path}); a GPU stage runs "
                           "in a process of its own (meshnet worker --gpu)")
    return _lib


def gpu_library() -> Path:
    """The GPU engine a GPU stage loads: the one MESHNET_GPU_ENGINE names, else the first
    built (CUDA before Vulkan: on an NVIDIA GPU the CUDA build is the faster)."""
    named = os.environ.get("MESHNET_GPU_ENGINE")
    if named:
        if named not in GPU_LIBRARIES:
            raise MeshnetError(errors.INVALID_ARGUMENT, f"MESHNET_GPU_ENGINE={named!r}: it names one of "
                               f"{', '.join(GPU_LIBRARIES)}")
        return GPU_LIBRARIES[named]
    return next((p for p in GPU_LIBRARIES.values() if p.exists()), GPU_LIBRARIES["cuda"])


def engine_pin(gpu: bool = False) -> str:
    return _ffi.string(library(gpu).meshnet_engine_pin()).decode()


def default_threads(gpu: bool = False) -> int:
    """The compute threads a stage runs unless told: llama.cpp's default (a thread per
    physical core), at most the CPUs this process may run on."""
    return int(library(gpu).meshnet_default_threads())


def json_schema_grammar(schema: str) -> str:
    """llama.cpp's GBNF for a JSON schema (its text), as llama-server builds it."""
    lib = library()
    schema_c = _ffi.new("char[]", schema.encode())
    n_out = _ffi.new("size_t *")
    err = _ffi.new("char[]", 1024)
    status = lib.meshnet_json_schema_grammar(schema_c, _ffi.NULL, 0, n_out, err, len(err))
    if status == lib.MESHNET_ERR_BUFFER_TOO_SMALL:
        text = _ffi.new("char[]", n_out[0])
        status = lib.meshnet_json_schema_grammar(schema_c, text, n_out[0], n_out, err, len(err))
    if status != 0:
        raise MeshnetError(errors.INVALID_ARGUMENT, f"the JSON schema has no grammar: {_ffi.string(err).decode(errors='replace')}")
    return _ffi.string(text).decode()


def chat_parse(chat: dict, text: str, partial: bool = False) -> dict:
    """TEXT, an answer to a Stage.chat_apply's prompt, as OpenAI's message (content,
    tool_calls), by llama.cpp's common chat parser for CHAT's format; PARTIAL: the text may
    go on (a stream). Needs no stage: the process serving the API parses the tail's text."""
    lib = library()
    keys = ("format", "generation_prompt", "parser")
    chat_c = _ffi.new("char[]", json.dumps({k: chat[k] for k in keys if k in chat}).encode())
    text_c = _ffi.new("char[]", text.encode(errors="replace"))
    n_out, err, capacity = _ffi.new("size_t *"), _ffi.new("char[]", 1024), 1 << 12
    while True:
        buf = _ffi.new("char[]", capacity)
        status = lib.meshnet_chat_parse(chat_c, text_c, int(partial), buf, capacity, n_out, err, len(err))
        if status == lib.MESHNET_ERR_BUFFER_TOO_SMALL and n_out[0] > capacity:
            capacity = n_out[0]
            continue
        if status != 0:
            raise MeshnetError(errors.INVALID_ARGUMENT, _ffi.string(err).decode(errors="replace"))
        return json.loads(_ffi.string(buf).decode(errors="replace"))


@dataclass(frozen=True)
class LayerMemory:
    """What one layer keeps per session beside its weights (meshnet_layer_memory)."""
    kv_bytes_per_cell: int   # K and V of one token; 0: no KV
    window: int              # 0: full attention; else a sliding window (its cache still spans the context)
    state_bytes: int         # recurrent state; 0: none


def layer_memory(model_path: str | os.PathLike, kv_type: str = kv_cache.DEFAULT) -> list[LayerMemory]:
    """Each layer's memory, as llama.cpp sizes it with KV cells of KV_TYPE, from the model's
    hyperparameters (no weights read): what the planner counts per layer type."""
    lib = library()
    err = _ffi.new("char[]", 1024)
    n_layer = _ffi.new("int32_t *")
    capacity = 1024   # room for any model there is, so the file is read once
    raw = _ffi.new("meshnet_layer_memory[]", capacity)
    type_k, type_v = kv_cache.codes(kv_type)
    status = lib.meshnet_layer_memory_of(str(model_path).encode(), type_k, type_v, raw, capacity, n_layer, err, 1024)
    if status == 0 and n_layer[0] > capacity:
        raw = _ffi.new("meshnet_layer_memory[]", n_layer[0])
        status = lib.meshnet_layer_memory_of(str(model_path).encode(), type_k, type_v, raw, n_layer[0], n_layer,
                                             err, 1024)
    if status != 0:
        raise MeshnetError(STATUS_CODES.get(status, errors.INTERNAL), _ffi.string(err).decode(errors="replace"))
    return [LayerMemory(int(r.kv_bytes_per_cell), int(r.window), int(r.state_bytes))
            for r in raw[0:n_layer[0]]]


ARCH_SUPPORT = {0: "splits", 1: "whole", 2: "not-text", -1: "unknown"}


def arch_support(arch: str) -> tuple[str, str]:
    """The engine's support table line for a GGUF architecture name (engine_c/architectures.tsv):
    ("splits" | "whole" | "not-text" | "unknown", the reason; empty when it splits)."""
    reason = _ffi.new("const char **")
    status = library().meshnet_arch_support_of(arch.encode(), reason)
    return ARCH_SUPPORT[int(status)], _ffi.string(reason[0]).decode()


@dataclass(frozen=True)
class StageInfo:
    arch: str
    n_layer: int
    n_embd: int
    n_vocab: int
    layer_start: int
    layer_end: int
    is_head: bool
    is_tail: bool
    n_ctx: int
    max_sessions: int
    n_batch: int
    n_sessions: int
    model_bytes: int
    kv_bytes: int
    kv_bytes_used: int
    compute_bytes: int
    device_bytes: int     # of the above, in the GPU's memory (VRAM)
    device_total: int     # the GPU's memory; 0 on the CPU
    backend: str          # "CPU" or "CUDA"
    device: str           # the GPU's or the CPU's name
    engine_pin: str
    numerics: str         # the numerics class (meshnet/core/numerics.py)
    seam_width: int       # floats per residual row between stages: n_embd, or more where state
                          # beside the residual crosses too (RWKV-7's first-layer value, Gemma 4's
                          # per-layer inputs)
    pool_cells: int       # the KV pool's cells, which the sessions share; 0: a stream of n_ctx per session
    n_threads: int        # the compute threads it runs
    tp_rank: int          # its place in a tensor-parallel group (tp_size 0: whole layers)
    tp_size: int


@dataclass
class Entry:
    """One session's input to a forward call: token ids on the head, residual rows elsewhere."""

    session_id: int
    pos: int
    tokens: np.ndarray | None = None
    residual: np.ndarray | None = None
    # the tail: the rows are the last drawn token and drafts (their ids in tokens, beside
    # the residual past the head): keep those that match its own draws (meshnet_entry.verify)
    verify: bool = False

    @property
    def n_tokens(self) -> int:
        return len(self.residual) if self.residual is not None else len(self.tokens)


@dataclass
class Output:
    """A stage before the tail gives residual rows (entries' rows concatenated in order);
    the tail gives each entry's next token (the most likely, or its session's sampler's
    choice) and, when asked, its last-row logits."""

    residual: np.ndarray | None = None
    token: np.ndarray | None = None
    logits: np.ndarray | None = None
    drawn: np.ndarray | None = None        # verify entries: the draw after each row (rows in entry order)
    n_accepted: np.ndarray | None = None   # ... and the drafts each kept

    def draws(self, entries: Sequence[Entry], e: int) -> list[int]:
        """Entry E's tokens from this call: its next token, or a verify entry's draws kept."""
        if not entries[e].verify:
            return [int(self.token[e])]
        first = sum(entry.n_tokens for entry in entries[:e])
        return self.drawn[first:first + int(self.n_accepted[e]) + 1].tolist()


class Stage:
    """A contiguous layer range [start, end) of a GGUF model; None = the whole model.

    A plain (start, end) is taken too; the engine checks either against the model it loads."""

    def __init__(
        self,
        model_path: str | os.PathLike,
        layers: LayerRange | tuple[int, int] | None = None,
        *,
        n_ctx: int = defaults.N_CTX,
        max_sessions: int = defaults.LIBRARY_SESSIONS,
        n_batch: int = defaults.N_BATCH,
        n_ubatch: int = 0,
        n_threads: int = 0,
        flash_attn: bool = False,
        gpu: bool = False,
        numerics: str | None = None,
        progress: Callable[[float], None] | None = None,
        pool_cells: int = 0,
        kv_type: str = kv_cache.DEFAULT,
        thread_poll: int = 0,
        tp: tuple[int, int] | None = None,
        tp_gather: Callable[[int, int, np.ndarray, int, np.ndarray], None] | None = None,
        tp_link=None,
    ):
        """PROGRESS: called from the loading thread with the fraction of the weights read (0 to 1).
        POOL_CELLS: one KV pool of that many cells that the sessions share, each up to n_ctx
        (meshnet_engine.h); 0: a KV stream of n_ctx cells per session. KV_TYPE: the cache's
        element types (core/kv_cache.py). THREAD_POLL: 0..100, the compute threads' polling for
        the next forward pass before they sleep (meshnet_engine.h): for a stage with cores of its own.
        TP: (rank, size), this stage one member of a tensor-parallel group, which holds its share
        of every layer's heads and rows; TP_GATHER(layer, point, local, offset, whole) then
        fills WHOLE (rows x the whole width) with every member's columns in member order, this
        member's LOCAL (rows x its width) at column OFFSET, on a compute thread inside forward();
        what it raises stops the forward pass (tp_exchange) and is kept in tp_error. Or TP_LINK,
        the engine's own exchange over the group's sockets (engine/tp_link.py's EngineLink, which
        keeps them open as long as this stage holds it), without Python."""
        lib = library(gpu)
        self._lib = lib
        self._path = _ffi.new("char[]", os.fsencode(model_path))
        start, end = layers if layers is not None else (0, 0)
        params = _ffi.new(
            "meshnet_stage_params *",
            {
                "model_path": self._path,
                "layer_start": start,
                "layer_end": end,
                "n_ctx": n_ctx,
                "max_sessions": max_sessions,
                "n_batch": n_batch,
                "n_ubatch": n_ubatch,
                "n_threads": n_threads,
                "flash_attn": flash_attn,
                "gpu": gpu,
                "numerics": numerics_classes.code(numerics or numerics_classes.default_for(gpu)),
                "pool_cells": pool_cells,
                **dict(zip(("type_k", "type_v"), kv_cache.codes(kv_type))),
                "thread_poll": thread_poll,
                **({"tp_rank": tp[0], "tp_size": tp[1]} if tp else {}),
            },
        )
        self.tp_error: BaseException | None = None
        self._tp_link = tp_link   # (held: the engine uses it in every forward pass)
        if tp and tp_link is not None:
            params.tp_gather = lib.meshnet_tp_link_gather
            params.tp_gather_user = tp_link.cdata
        elif tp:
            if tp_gather is None:
                raise MeshnetError(errors.INVALID_ARGUMENT, "a tensor-parallel member needs its group's exchange (tp_gather)")

            def on_gather(_user, layer, point, local, n_local, offset, whole, n_whole, n_rows):
                try:
                    mine = np.frombuffer(_ffi.buffer(local, 4 * n_local * n_rows), dtype=np.float32).reshape(n_rows, n_local)
                    out = np.frombuffer(_ffi.buffer(whole, 4 * n_whole * n_rows), dtype=np.float32).reshape(n_rows, n_whole)
                    tp_gather(layer, point, mine, offset, out)
                    return 0
                except BaseException as e:   # (nothing may cross the engine's compute thread)
                    self.tp_error = e
                    return 1
            # (held by the stage: the engine calls it in every forward pass)
            params.tp_gather = self._tp_callback = _ffi.callback(
                "int32_t(void *, int32_t, int32_t, const float *, int64_t, int64_t, float *, int64_t, int64_t)", on_gather)
        if progress is not None:
            def on_progress(fraction, _user):
                try:
                    progress(float(fraction))
                except Exception:   # (a watcher's failure is not the load's)
                    pass
                return 1
            # (held by the stage: the engine calls it only while it loads, but cffi frees it with the last reference)
            params.progress = self._progress_callback = _ffi.callback("int32_t(float, void *)", on_progress)
        out = _ffi.new("meshnet_stage **")
        err = _ffi.new("char[]", 2048)
        status = lib.meshnet_stage_open(params, out, err, len(err))
        if status != 0:
            raise MeshnetError(STATUS_CODES.get(status, errors.INTERNAL), _ffi.string(err).decode(errors="replace"))
        self._stage = out[0]
        self.info_static = self.info()
        if isinstance(layers, LayerRange) and layers.n_layer not in (None, self.info_static.n_layer):
            self.close()
            raise MeshnetError(errors.BAD_RANGE, f"layers {layers.label} were given for a model of {layers.n_layer} "
                               f"layers; {model_path} has {self.info_static.n_layer}")

    # lifecycle

    def close(self) -> None:
        if getattr(self, "_stage", None) is not None:
            self._lib.meshnet_stage_close(self._stage)
            self._stage = None

    def __enter__(self) -> "Stage":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        self.close()

    def _check(self, status: int) -> None:
        if status != 0:
            message = _ffi.string(self._lib.meshnet_stage_last_error(self._stage)).decode(errors="replace")
            cause, self.tp_error = getattr(self, "tp_error", None), None
            if cause is not None:
                message += f": {cause}"
            elif status == self._lib.MESHNET_ERR_TP_EXCHANGE and getattr(self, "_tp_link", None) is not None:
                message += ": " + _ffi.string(self._lib.meshnet_tp_link_error(self._tp_link.cdata)).decode(errors="replace")
            raise MeshnetError(STATUS_CODES.get(status, errors.INTERNAL), message) from cause

    def _live(self):
        if self._stage is None:
            raise MeshnetError(errors.CLOSED, "this stage has been closed")
        return self._stage

    # description

    def info(self) -> StageInfo:
        raw = _ffi.new("meshnet_stage_info *")
        self._check(self._lib.meshnet_stage_info_get(self._live(), raw))
        fields = {name: getattr(raw, name) for name in StageInfo.__dataclass_fields__}
        fields["is_head"], fields["is_tail"] = bool(raw.is_head), bool(raw.is_tail)
        for name in ("arch", "engine_pin", "backend", "device"):
            fields[name] = _ffi.string(getattr(raw, name)).decode(errors="replace")
        fields["numerics"] = numerics_classes.name(raw.numerics)
        return StageInfo(**fields)

    @property
    def n_embd(self) -> int:
        return self.info_static.n_embd

    @property
    def seam_width(self) -> int:
        return self.info_static.seam_width

    @property
    def n_vocab(self) -> int:
        return self.info_static.n_vocab

    @property
    def is_head(self) -> bool:
        return self.info_static.is_head

    @property
    def is_tail(self) -> bool:
        return self.info_static.is_tail

    # sessions

    def open_session(self, session_id: int) -> None:
        self._check(self._lib.meshnet_session_open(self._live(), session_id))

    def release_session(self, session_id: int) -> None:
        self._check(self._lib.meshnet_session_release(self._live(), session_id))

    def truncate_session(self, session_id: int, n_keep: int) -> None:
        self._check(self._lib.meshnet_session_truncate(self._live(), session_id, n_keep))

    def session_length(self, session_id: int) -> int:
        n = _ffi.new("int32_t *")
        self._check(self._lib.meshnet_session_length(self._live(), session_id, n))
        return n[0]

    def save_session(self, session_id: int) -> bytes:
        """The session's memory on this stage, for restore_session."""
        stage, n = self._live(), _ffi.new("size_t *")
        status = self._lib.meshnet_session_save(stage, session_id, _ffi.NULL, 0, n)
        if STATUS_CODES.get(status) != errors.BUFFER_TOO_SMALL:   # n holds the size needed
            self._check(status)
        buf = bytearray(n[0])
        self._check(self._lib.meshnet_session_save(stage, session_id, _ffi.from_buffer(buf), len(buf), n))
        return bytes(memoryview(buf)[: n[0]])

    def restore_session(self, session_id: int, memory: bytes, n_tokens: int) -> None:
        """An empty open session takes memory saved from one of N_TOKENS tokens."""
        self._check(self._lib.meshnet_session_restore(self._live(), session_id, _ffi.from_buffer(memory),
                                                      len(memory), n_tokens))

    def set_sampling(self, session_id: int, sampling: Sampling | None, history: Sequence[int] = (),
                     grammar_from: int | None = None) -> None:
        """The tail samples the session's tokens with these parameters from now on (None or
        greedy: the most likely token); history is the session's tokens so far, of which the
        grammar, if any, takes those from grammar_from on (default: after the history)."""
        if sampling is None or sampling.greedy:
            self._check(self._lib.meshnet_session_sampling(self._live(), session_id, _ffi.NULL, _ffi.NULL, 0))
            return
        grammar = _ffi.new("char[]", sampling.grammar.encode()) if sampling.grammar else _ffi.NULL
        raw = _ffi.new("meshnet_sampling *", {f: getattr(sampling, f) for f in (
            "temperature", "top_k", "top_p", "min_p", "repeat_penalty", "penalty_last_n", "frequency_penalty",
            "presence_penalty", "seed")})
        raw.grammar = grammar
        raw.grammar_from = len(history) if grammar_from is None else grammar_from
        patterns = [_ffi.new("char[]", p.encode()) for p in sampling.trigger_patterns]
        patterns_c = _ffi.new("char *[]", patterns) if patterns else _ffi.NULL
        trigger_tokens = _ffi.new("int32_t[]", list(sampling.trigger_tokens)) if sampling.trigger_tokens else _ffi.NULL
        raw.grammar_lazy = sampling.grammar_lazy
        raw.trigger_patterns, raw.n_trigger_patterns = patterns_c, len(patterns)
        raw.trigger_tokens, raw.n_trigger_tokens = trigger_tokens, len(sampling.trigger_tokens)
        tokens = np.ascontiguousarray(history, dtype=np.int32)
        self._check(self._lib.meshnet_session_sampling(self._live(), session_id, raw,
                                                       _ffi.from_buffer("int32_t[]", tokens), len(tokens)))

    # compute

    def forward(self, entries: Sequence[Entry], want_logits: bool = True) -> Output:
        stage = self._live()
        n_entries = len(entries)
        raw = _ffi.new("meshnet_entry[]", max(n_entries, 1))
        keep = []  # the arrays whose buffers the C entries point into
        n_rows = 0
        for raw_entry, entry in zip(raw, entries):
            raw_entry.session_id = entry.session_id
            raw_entry.pos = entry.pos
            raw_entry.verify = entry.verify
            if entry.tokens is not None:
                tokens = np.ascontiguousarray(entry.tokens, dtype=np.int32).reshape(-1)
                keep.append(tokens)
                raw_entry.n_tokens = len(tokens)
                raw_entry.tokens = _ffi.from_buffer("int32_t[]", tokens)
            if entry.residual is not None:
                residual = np.ascontiguousarray(entry.residual, dtype=np.float32)
                if residual.ndim != 2:
                    raise MeshnetError(errors.BAD_WIDTH, f"residual must be 2-D (n_tokens, seam_width), got shape {residual.shape}")
                keep.append(residual)
                raw_entry.n_tokens = residual.shape[0]
                raw_entry.embd_width = residual.shape[1]
                raw_entry.embd = _ffi.from_buffer("float[]", residual)
            n_rows += max(raw_entry.n_tokens, 0)

        out = Output()
        raw_out = _ffi.new("meshnet_output *")
        if self.is_tail:
            out.token = np.zeros(max(n_entries, 1), dtype=np.int32)
            raw_out.token = _ffi.from_buffer("int32_t[]", out.token)
            if want_logits:
                out.logits = np.empty((max(n_entries, 1), self.n_vocab), dtype=np.float32)
                raw_out.logits = _ffi.from_buffer("float[]", out.logits)
            if any(entry.verify for entry in entries):
                out.drawn = np.full(max(n_rows, 1), -1, dtype=np.int32)
                out.n_accepted = np.zeros(max(n_entries, 1), dtype=np.int32)
                raw_out.drawn = _ffi.from_buffer("int32_t[]", out.drawn)
                raw_out.n_accepted = _ffi.from_buffer("int32_t[]", out.n_accepted)
        else:
            out.residual = np.empty((max(n_rows, 1), self.seam_width), dtype=np.float32)
            raw_out.residual = _ffi.from_buffer("float[]", out.residual)
        self._check(self._lib.meshnet_stage_forward(stage, raw, n_entries, raw_out))
        if out.residual is not None:
            out.residual = out.residual[:n_rows]
        return out

    def abort(self) -> None:
        """Stop the forward pass running now; safe from any thread."""
        if self._stage is not None:
            self._lib.meshnet_stage_abort(self._stage)

    # tokens

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        data = utf8_or_error(text, "the text")
        n = _ffi.new("int32_t *")
        capacity = len(data) + 8
        while True:
            buf = _ffi.new("int32_t[]", capacity)
            status = self._lib.meshnet_tokenize(self._live(), data, len(data), add_special, parse_special, buf, capacity, n)
            if STATUS_CODES.get(status) == errors.BUFFER_TOO_SMALL:  # n holds the size needed
                capacity = n[0]
                continue
            self._check(status)
            return list(buf[0 : n[0]])

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self.detokenize_bytes(tokens).decode(errors="replace")

    def detokenize_bytes(self, tokens: Sequence[int]) -> bytes:
        """The raw text bytes: one token may end in the middle of a UTF-8 character."""
        arr = np.ascontiguousarray(tokens, dtype=np.int32)
        n = _ffi.new("int32_t *")
        capacity = 16 * len(arr) + 16
        while True:
            buf = _ffi.new("char[]", capacity)
            status = self._lib.meshnet_detokenize(self._live(), _ffi.from_buffer("int32_t[]", arr), len(arr), buf, capacity, n)
            if STATUS_CODES.get(status) == errors.BUFFER_TOO_SMALL:
                capacity = n[0] + 1
                continue
            self._check(status)
            return _ffi.buffer(buf, n[0])[:]

    def is_eog(self, token: int) -> bool:
        return bool(self._lib.meshnet_token_is_eog(self._live(), token))

    def _json_call(self, call, *args) -> dict:
        """An engine call that answers JSON text into a buffer of ours, sized as it says."""
        n_out, capacity = _ffi.new("size_t *"), 1 << 16
        while True:
            buf = _ffi.new("char[]", capacity)
            status = call(self._live(), *args, buf, capacity, n_out)
            if STATUS_CODES.get(status) == errors.BUFFER_TOO_SMALL and n_out[0] > capacity:
                capacity = n_out[0]
                continue
            self._check(status)
            return json.loads(_ffi.string(buf).decode(errors="replace"))

    def chat_apply(self, request: dict) -> dict:
        """The model's Jinja chat template over OpenAI's messages and tools, by llama.cpp's
        common chat code (meshnet_chat_apply): the prompt, and the grammar and format its
        answer is taken in."""
        return self._json_call(self._lib.meshnet_chat_apply, _ffi.new("char[]", json.dumps(request).encode()))

    def chat_template(self, messages: Sequence[dict], add_assistant: bool = True) -> str:
        """The model's own chat template (from the GGUF, applied by llama.cpp) over
        [{"role": ..., "content": ...}, ...]."""
        keep, raw = [], _ffi.new("meshnet_chat_message[]", max(len(messages), 1))
        for i, message in enumerate(messages):
            for field in ("role", "content"):
                value = message.get(field) if isinstance(message, dict) else None
                if not isinstance(value, str):
                    raise MeshnetError(errors.INVALID_ARGUMENT, f"message {i} has no {field} text")
                keep.append(_ffi.new("char[]", utf8_or_error(value, f"message {i}'s {field}")))
                setattr(raw[i], field, keep[-1])
        n = _ffi.new("int32_t *")
        capacity = 2 * sum(len(m["content"]) + len(m["role"]) for m in messages) + 256
        while True:
            buf = _ffi.new("char[]", capacity)
            status = self._lib.meshnet_chat_template(self._live(), raw, len(messages), add_assistant, buf, capacity, n)
            if STATUS_CODES.get(status) == errors.BUFFER_TOO_SMALL:
                capacity = n[0]
                continue
            self._check(status)
            return _ffi.buffer(buf, n[0])[:].decode(errors="replace")
