"""The prompt chunk's rows beside decoding sessions (route/chunk_budget.py), with plain
numbers: no model, no engine."""

from __future__ import annotations

from meshnet.core.planner import ModelCost
from meshnet.route.chunk_budget import DEFAULT_ROW_CELLS, chunk_rows, row_cells


def cost(layer_bytes: int, n_embd: int) -> ModelCost:
    return ModelCost(n_layer=2, layer_bytes=(layer_bytes, layer_bytes), input_bytes=0, output_bytes=0, shared_bytes=0,
                     tied_embeddings=False, token_embd_bytes=0, kv_bytes_per_cell=0, n_embd=n_embd, n_ff=0, n_head=1,
                     n_vocab=1)


def test_no_session_decoding_beside_it_leaves_the_prompt_whole_chunks():
    assert chunk_rows([], 2, 0, 2048.0) is None


def test_the_chunk_shrinks_as_its_context_grows_to_one_row_at_least():
    decoding = [300] * 4
    sizes = [chunk_rows(decoding, 2, context, 1000.0, share=4.0) for context in (0, 1000, 3000, 100_000)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[1] > sizes[2]
    assert sizes[-1] == 1


def test_the_chunk_costs_about_its_share_of_the_decode_batch_beside_it():
    decoding, groups, per_row = [500] * 6, 2, 2000.0
    per_batch = 3
    batch = per_batch * (1 + 500 / per_row)
    for context in (0, 2000, 8000):
        rows = chunk_rows(decoding, groups, context, per_row, share=2.0)
        row = 1 + context / per_row
        assert rows * row <= 2.0 * batch < (rows + 1) * row or rows == 1


def test_more_sessions_decoding_in_each_batch_let_a_larger_chunk_through():
    one = chunk_rows([400], 2, 1000, 2048.0, share=2.0)
    eight = chunk_rows([400] * 8, 2, 1000, 2048.0, share=2.0)
    assert eight > one


def test_a_row_weighs_more_cells_the_heavier_its_weights_are_against_its_kv():
    assert row_cells(None) == DEFAULT_ROW_CELLS
    assert row_cells(cost(0, 576)) == DEFAULT_ROW_CELLS   # (no weights counted: the default)
    light, heavy = row_cells(cost(1 << 20, 1024)), row_cells(cost(8 << 20, 1024))
    assert heavy == 8 * light
    assert row_cells(cost(1 << 20, 512)) == 2 * light
