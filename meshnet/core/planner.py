"""How to split a model over nodes by the memory each admits.

Pure arithmetic on numbers read from the GGUF (gguf_layout): what a stage [a, b) needs
is its weights (the token embedding on the head, the output norm and matrix on the
tail), the KV cache or recurrent state of its layers for the context and sessions asked
for (per layer type: engine.layer_memory), the engine's
compute buffers and a stated per-process overhead. Nodes are filled in route order,
each stage as large as its budget allows; a model that does not fit is refused with the
shortfall in bytes. Nothing here opens a file or a socket, so it is tested with plain
numbers.
"""

from __future__ import annotations

import dataclasses

import functools
import itertools
from dataclasses import asdict, dataclass, field

from meshnet.core import defaults
from meshnet.core import errors as E
from meshnet.core.errors import MeshnetError
from meshnet.core.layers import LayerRange

# Per worker process, beside what the engine allocates: Python, numpy, ZeroMQ, the engine
# library and the stage loop's buffers. Peak RSS less the engine's share measured 92-101 MiB
# (tools/plan_rss.py at 16k context: SmolLM2, generated jamba, qwen3moe and nemotron_h models);
# a Qwen2.5-Coder-1.5B head of 26 layers (estimated 998 MiB with 96 of overhead) held
# 1021-1026 MiB, over its 1 GiB node by up to 2 MiB. A stage that does not fit is a machine
# that swaps or kills the worker: this keeps a layer's room (26 MiB there) beside the largest
# overhead measured, as `meshnet plan --overhead` always said (128M).
OVERHEAD = 128 << 20
# the graph's own bookkeeping beside its tensors; with it the estimate of weights + KV +
# compute is within 2% of what the engine reports (SmolLM2 and Qwen2.5-1.5B, head/tail)
COMPUTE_SLACK = 4 << 20
# a KV pool (engine_c/stage.cpp): its unit, and the rows of a pooled stage's physical batch
POOL_BLOCK = 256
POOL_ROWS = 64

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """'800M', '1.5G', '512MiB', '1048576' -> bytes (binary units, as free(1) counts)."""
    raw = str(text).strip().lower()
    for suffix in ("ib", "b"):
        if raw.endswith(suffix) and raw[:-len(suffix)][-1:].isalpha():
            raw = raw[:-len(suffix)]
            break
    number, unit = raw, ""
    if raw and raw[-1] in _UNITS and raw[-1].isalpha():
        number, unit = raw[:-1], raw[-1]
    try:
        value = float(number)
    except ValueError:
        raise MeshnetError(E.INVALID_ARGUMENT, f"'{text}' is not a memory size such as 800M, 1.5G or 1048576") from None
    if not value > 0 or value != value:
        raise MeshnetError(E.INVALID_ARGUMENT, f"a memory size must be positive, not '{text}'")
    return int(value * _UNITS[unit])


def format_size(n: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}iB"
    return f"{n} B"


@dataclass(frozen=True)
class ModelCost:
    """What a model's stages cost, from its GGUF. Plain numbers: a worker sends them in
    its capability, so a coordinator without the model file can plan."""
    n_layer: int
    layer_bytes: tuple[int, ...]
    input_bytes: int          # token embedding: the head's
    output_bytes: int         # output norm + matrix: the tail's
    shared_bytes: int         # tensors every stage loads (rope factors)
    tied_embeddings: bool     # the tail multiplies by token_embd: it loads it too
    token_embd_bytes: int
    kv_bytes_per_cell: int    # one layer's K and V for one token
    n_embd: int
    n_ff: int
    n_head: int
    n_vocab: int
    # per layer, as llama.cpp sizes its memory (engine.layer_memory): K and V of one token
    # (0 for a recurrent layer), the sliding window (0: none; it adds a mask, not cells) and
    # the recurrent state of one session. Empty: every layer keeps kv_bytes_per_cell over the context.
    layer_kv_bytes: tuple[int, ...] = ()
    layer_window: tuple[int, ...] = ()
    layer_state_bytes: tuple[int, ...] = ()

    @classmethod
    def from_layout(cls, layout, memory=None) -> "ModelCost":
        """From the GGUF's layout and, when the engine is there to read it, each layer's
        memory (a list of engine.LayerMemory): without it every layer is counted as a
        full-context attention layer, too much for sliding-window, recurrent and hybrid models."""
        per_layer = {}
        if memory is not None and len(memory) == layout.n_layer:
            per_layer = dict(layer_kv_bytes=tuple(m.kv_bytes_per_cell for m in memory),
                             layer_window=tuple(m.window for m in memory),
                             layer_state_bytes=tuple(m.state_bytes for m in memory))
        return cls(layout.n_layer, tuple(layout.layer_bytes), layout.input_bytes, layout.output_bytes,
                   layout.shared_bytes, layout.tied_embeddings, layout.token_embd_bytes, layout.kv_bytes_per_cell,
                   layout.n_embd, layout.n_ff, layout.n_head, layout.n_vocab, **per_layer)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelCost":
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})

    def to_dict(self) -> dict:
        # (the per-layer memory only when known: an empty list is not n_layer long)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items() if v != ()}

    def attended_cells(self, start: int, end: int, n_ctx: int) -> int:
        """The KV cells one attention layer of [start, end) reads (the attention scores of a
        full batch are sized by it): 0 for a stage of recurrent layers only."""
        if not self.layer_kv_bytes or any(self.layer_kv_bytes[start:end]):
            return n_ctx
        return 0

    @property
    def shares_pool(self) -> bool:
        """Its sessions can share one KV pool: no layer keeps a recurrent state (the engine
        gives a recurrent or hybrid model a stream per session)."""
        return not any(self.layer_state_bytes)

    @functools.cached_property
    def attention_masks(self) -> int:
        """How many F32 KQ masks an attention layer's pass fills: one per cache, full context
        and, when a layer has a window, the sliding window's (llama.cpp builds the inputs of
        the whole model's caches). A stage of recurrent layers only reserves them too but
        never fills them, so they take no resident memory there."""
        if not self.layer_kv_bytes:
            return 1
        return 1 + any(self.layer_window)

    def memory_bytes(self, start: int, end: int, n_ctx: int, n_sessions: int) -> int:
        """KV and recurrent state of layers [start, end) for N_SESSIONS sessions of N_CTX
        tokens: an attention layer keeps the context's cells, a sliding-window one too (the
        engine keeps llama.cpp's full-size window cache, swa_full, so a session can be cut
        back anywhere), a recurrent one a fixed state per session."""
        if not self.layer_kv_bytes:
            return (end - start) * self.kv_bytes_per_cell * n_ctx * n_sessions
        return n_sessions * sum(self.layer_kv_bytes[il] * n_ctx + self.layer_state_bytes[il]
                                for il in range(start, end))

    @functools.cached_property
    def _bytes_before(self) -> tuple[int, ...]:
        """_bytes_before[i]: the bytes of layers 0..i-1, so a range's weights cost one
        subtraction, not a sum over its layers."""
        return (0, *itertools.accumulate(self.layer_bytes))

    def weight_bytes(self, start: int, end: int) -> int:
        total = self._bytes_before[end] - self._bytes_before[start] + self.shared_bytes
        if start == 0:
            total += self.input_bytes
        if end == self.n_layer:
            total += self.output_bytes
            if self.tied_embeddings and start != 0:
                total += self.token_embd_bytes
        return total


@dataclass(frozen=True)
class Settings:
    """What a worker is started with (meshnet worker --ctx, --max-sessions, --kv-pool)."""
    n_ctx: int = defaults.N_CTX
    n_sessions: int = defaults.LIBRARY_SESSIONS
    n_batch: int = defaults.N_BATCH
    kv_pool: int = 0          # cells of one KV pool the sessions share; 0: n_ctx cells each
    # > 0: the pool may be as small as this to fit the node's memory (a worker's default
    # pool): a stage is planned at it, and takes what its memory leaves, up to kv_pool
    pool_floor: int = 0


@dataclass(frozen=True)
class Node:
    name: str
    mem: int                                   # bytes the node admits to its stage
    settings: Settings = field(default_factory=Settings)


@dataclass(frozen=True)
class PlannedStage:
    node: str
    layers: LayerRange
    bytes: int                                 # what the planner expects the stage to take

    def to_dict(self) -> dict:
        return {"node": self.node, "layers": [self.layers.start, self.layers.end], "bytes": self.bytes}


@dataclass(frozen=True)
class Plan:
    stages: list[PlannedStage]
    left_out: dict[str, str]                   # node -> why it holds nothing

    def to_dict(self) -> dict:
        return {"stages": [s.to_dict() for s in self.stages], "left_out": self.left_out}


def worker_settings(n_ctx_train: int, n_ctx: int | None = None, kv_pool: int | None = None,
                    max_sessions: int = defaults.MAX_SESSIONS, n_batch: int = defaults.N_BATCH,
                    fits_memory: bool = True) -> Settings:
    """What a worker started with these options holds (None: its defaults, from the
    model's trained context: defaults.kv_settings). A default pool may shrink to what the
    worker's memory leaves (FITS_MEMORY: it was given --mem), down to one whole context."""
    ctx, pool = defaults.kv_settings(n_ctx_train, n_ctx, kv_pool, max_sessions)
    floor = min(ctx, pool) if kv_pool is None and fits_memory and pool else 0
    return Settings(ctx, max_sessions, n_batch, pool, floor)


def stage_need(cost: ModelCost, start: int, end: int, settings: Settings = Settings(),
               overhead: int = OVERHEAD) -> int:
    """Bytes a stage [start, end) takes: weights, KV for every session's context, the
    engine's compute buffers and the process overhead."""
    # llama.cpp's graph for a full batch: each head's attention scores over one
    # session's context, the F32 masks over it and the FFN's activations dominate; the
    # tail's logits for the batch share that buffer (the allocator reuses it), so the
    # larger of the two counts
    if settings.pool_floor:
        settings = dataclasses.replace(settings, kv_pool=settings.pool_floor, pool_floor=0)
    if settings.kv_pool and not cost.shares_pool:
        # a memory a pool cannot share (engine_c/stage.cpp): as many whole contexts as it holds
        whole = max(1, min(settings.n_sessions, settings.kv_pool // settings.n_ctx))
        kv = cost.memory_bytes(start, end, settings.n_ctx, whole)
        scores = settings.n_batch * cost.attended_cells(start, end, settings.n_ctx)
    elif settings.kv_pool:
        # the pool's cells, which its sessions share; its attention covers all of them, for
        # physical batches of POOL_ROWS rows
        pool = -(-settings.kv_pool // POOL_BLOCK) * POOL_BLOCK
        share = max(1, min(settings.n_ctx, pool // settings.n_sessions))
        kv = cost.memory_bytes(start, end, -(-pool // settings.n_sessions), settings.n_sessions)
        scores = max(POOL_ROWS * cost.attended_cells(start, end, pool),
                     settings.n_batch * cost.attended_cells(start, end, share))
    else:
        kv = cost.memory_bytes(start, end, settings.n_ctx, settings.n_sessions)
        scores = settings.n_batch * cost.attended_cells(start, end, settings.n_ctx)
    compute = 4 * ((cost.n_head + cost.attention_masks) * scores + settings.n_batch * (cost.n_ff + 6 * cost.n_embd))
    if end == cost.n_layer:
        compute = max(compute, 4 * settings.n_batch * cost.n_vocab)
    compute += COMPUTE_SLACK
    return cost.weight_bytes(start, end) + kv + compute + overhead


def fitted_pool(cost: ModelCost, start: int, end: int, settings: Settings, mem: int | None,
                overhead: int = OVERHEAD) -> int:
    """The KV pool a stage [start, end) takes within MEM: the largest, in blocks, from the
    settings' floor up to their pool (the floor where none fits: what it was planned at);
    the settings' pool where it has no floor or no memory is given."""
    if not settings.pool_floor or mem is None:
        return settings.kv_pool
    fixed = dataclasses.replace(settings, pool_floor=0)
    lo, hi = -(-settings.pool_floor // POOL_BLOCK), max(-(-settings.pool_floor // POOL_BLOCK),
                                                         settings.kv_pool // POOL_BLOCK)
    while lo < hi:   # the need grows with the pool: the largest that fits
        mid = (lo + hi + 1) // 2
        if stage_need(cost, start, end, dataclasses.replace(fixed, kv_pool=mid * POOL_BLOCK), overhead) <= mem:
            lo = mid
        else:
            hi = mid - 1
    return max(lo * POOL_BLOCK, settings.n_ctx)


def plan(cost: ModelCost, nodes: list[Node], overhead: int = OVERHEAD, start: int = 0,
         end: int | None = None) -> Plan:
    """Layers [start, end) (the whole model by default) over NODES in route order, each
    stage as large as its node admits. A node that cannot hold even the next layer is
    left out (with the reason); when layers remain after the last node, MeshnetError
    (model_does_not_fit) names the shortfall."""
    end = cost.n_layer if end is None else end
    at, stages, left_out = start, [], {}
    last_stage_of_last_node = None
    for index, node in enumerate(nodes):
        if at == end:
            left_out[node.name] = "not needed: the nodes before it hold every layer"
            continue
        # need grows with b (the tail's output matrix only adds): take layers while they fit,
        # so a plan costs one look at each layer, whatever the layer count
        b = at
        while b < end and stage_need(cost, at, b + 1, node.settings, overhead) <= node.mem:
            b += 1
        if b == at:
            left_out[node.name] = (f"admits {format_size(node.mem)}, layer {at} alone needs "
                                   f"{format_size(stage_need(cost, at, at + 1, node.settings, overhead))}"
                                   + (" (with the token embedding)" if at == 0 else ""))
            continue
        stages.append(PlannedStage(node.name, LayerRange(at, b, cost.n_layer),
                                   stage_need(cost, at, b, node.settings, overhead)))
        if index == len(nodes) - 1:
            last_stage_of_last_node = stages[-1]
        at = b
    if at < end:
        if not nodes:
            raise MeshnetError(E.MODEL_DOES_NOT_FIT, "no node to plan over")
        last = nodes[-1]
        from_layer = last_stage_of_last_node.layers.start if last_stage_of_last_node else at
        need = stage_need(cost, from_layer, end, last.settings, overhead)
        shortfall = need - last.mem
        held = "nothing" if not stages else ", ".join(f"{s.node} {s.layers.label}" for s in stages)
        error = MeshnetError(
            E.MODEL_DOES_NOT_FIT,
            f"layers {at}..{end - 1} fit on no node: {shortfall} bytes ({format_size(shortfall)}) short. The nodes "
            f"would take {held}; node {last.name} would need {format_size(need)} for layers {from_layer}..{end - 1} and "
            f"admits {format_size(last.mem)}. Give a node more memory, add a node, or lower --ctx/--sessions",
            shortfall_bytes=shortfall)
        raise error
    return Plan(stages, left_out)
