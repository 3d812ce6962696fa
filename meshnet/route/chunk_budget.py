"""How many rows of a prompt the next chunk takes while other sessions decode on the same
route (the invariant class, whose rows may be cut anywhere without changing a float).

A stage computes the steps it has waiting, decode steps and a prompt chunk, in one call
(engine_c/stage.cpp plan_calls), so while a chunk is computed the streams decoding there
wait for it. In the invariant class a row's cost is its own pass over the layers'
weights plus its attention over the cells it attends (its session's cells of the KV
pool: patches 0013, 0014), and at a few thousand cells of context the attention is the
larger part. The chunk is sized so that its rows cost about CHUNK_SHARE of the decode
batch they run beside: the streams' inter-token latency then rises by a bounded factor
however long the prompt, and the prompt takes longer instead.
"""

from __future__ import annotations

import math
from typing import Sequence

from meshnet.core.planner import ModelCost

# a chunk's call costs at most this share of the decode batch beside it
CHUNK_SHARE = 1.0
# What one row's pass over a layer's weights costs, in cells of attention over the same
# layer, per byte of weights over the bytes of K and V that every head reads per cell
# (f16, 2 x 2 x n_embd). Fitted with tools/bench_chunk_cost.py on SmolLM2 [0,15) on one
# thread: a row ~3.7 ms of weights, ~3 us per cell of attention (1200 cells a row,
# where its weights' bytes over 4 x n_embd give 962)
ROW_CELLS_PER_BYTE_RATIO = 1.25
DEFAULT_ROW_CELLS = 2048.0   # a model whose worker sent no cost


def row_cells(cost: ModelCost | None) -> float:
    """How many cells of attention cost what one row's pass over the weights costs."""
    if cost is None or cost.n_embd <= 0 or not any(cost.layer_bytes):
        return DEFAULT_ROW_CELLS
    weights = [b for b in cost.layer_bytes if b > 0]
    return max(1.0, ROW_CELLS_PER_BYTE_RATIO * (sum(weights) / len(weights)) / (4 * cost.n_embd))


def chunk_rows(decoding_cells: Sequence[int], groups: int, context: int, cells_per_row: float,
               share: float = CHUNK_SHARE) -> int | None:
    """The next chunk's rows at most: CONTEXT, the prompt's cells so far; DECODING_CELLS,
    the cells each session decoding on the route holds; GROUPS, the micro-batches the
    decoding sessions go round the route in. None: no session decodes beside it (the
    prompt goes in whole chunks)."""
    if not decoding_cells:
        return None
    per_batch = math.ceil(len(decoding_cells) / max(1, groups))
    # a decode batch: its rows, each attending over its own session's cells
    batch = per_batch * (1 + sum(decoding_cells) / len(decoding_cells) / cells_per_row)
    row = 1 + context / cells_per_row
    return max(1, int(share * batch / row))
