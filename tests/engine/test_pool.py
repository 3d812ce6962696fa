"""A stage's KV pool (meshnet_stage_params.pool_cells, patch 0012): sessions that share one
cache, each in blocks of 256 cells of its own that grow, move and are packed as they need,
give every token and logit they give alone, on every architecture that splits; a session
the pool has no room for fails alone (kv_full) and goes on once room is made."""

import numpy as np
import pytest
from gguf import GGUFReader

from meshnet.core import errors
from meshnet.core.errors import MeshnetError
from meshnet.engine.binding import Entry, Stage

from conftest import THREADS, generated_models, model_arch, read_arch_table

BLOCK = 256
PROMPT = 250          # a prompt within one block: its session's next steps cross into a second
SPLITS = {line.arch for line in read_arch_table().read_table() if line.status == "splits"}
MODELS = {stem: path for stem, path in generated_models().items() if model_arch(stem) in SPLITS}


class Session:
    """A session's tokens: a prompt, then its greedy steps; and the logits of each call."""

    def __init__(self, sid: int, prompt: list[int]):
        self.sid, self.tokens, self.logits = sid, list(prompt), []

    def feed(self, stage: Stage, n_prompt: int | None = None) -> None:
        """The prompt (N_PROMPT tokens of it: its first call), else one decode step."""
        pos = len(self.tokens) - 1 if self.logits else 0
        rows = self.tokens[:n_prompt] if not self.logits else self.tokens[-1:]
        out = stage.forward([Entry(self.sid, pos, tokens=np.array(rows))])
        self.logits.append(out.logits[0].copy())
        self.tokens.append(int(out.token[0]))


def alone(path: str, prompt: list[int], steps: int) -> Session:
    with Stage(path, None, n_ctx=1024, max_sessions=1, n_threads=THREADS) as stage:
        session = Session(1, prompt)
        stage.open_session(1)
        session.feed(stage)
        for _ in range(steps):
            session.feed(stage)
        return session


def prompts(path: str, n: int) -> list[list[int]]:
    with Stage(path, None, n_ctx=256, max_sessions=1, n_threads=THREADS) as stage:
        n_vocab = stage.info_static.n_vocab
    rng = np.random.default_rng(7)
    return [rng.integers(1, n_vocab, PROMPT).tolist() for _ in range(n)]


def learned_positions(path: str) -> bool:
    """A model with a table of learned positions (GPT-2's): the generated ones hold 256."""
    return any(t.name == "position_embd.weight" for t in GGUFReader(path).tensors)


def same(session: Session, reference: Session) -> bool:
    n = len(session.logits)
    return session.tokens == reference.tokens[:len(session.tokens)] and all(
        np.array_equal(a, b) for a, b in zip(session.logits, reference.logits[:n]))


@pytest.mark.parametrize("stem", sorted(MODELS))
def test_sessions_in_one_pool_grow_move_and_wait_for_room_with_the_tokens_they_have_alone(stem):
    path = MODELS[stem]
    if learned_positions(path):
        pytest.skip(f"{stem} learned 256 positions: its sessions cannot cross a block")
    a_prompt, b_prompt, c_prompt = prompts(path, 3)
    steps = 10
    ref = {"a": alone(path, a_prompt, steps), "b": alone(path, b_prompt, steps), "c": alone(path, c_prompt, 2)}
    a, b, c = Session(1, a_prompt), Session(2, b_prompt), Session(3, c_prompt)
    with Stage(path, None, n_ctx=1024, max_sessions=4, n_threads=THREADS, pool_cells=4 * BLOCK) as stage:
        if stage.info_static.pool_cells == 0:   # a memory a pool cannot place (recurrent, hybrid): streams
            pytest.skip(f"{stem}'s memory keeps a stream per session")
        assert stage.info_static.pool_cells == 4 * BLOCK
        for s in (a, b):
            stage.open_session(s.sid)
            s.feed(stage)                 # a: block 0, b: block 1
        for _ in range(steps):
            a.feed(stage)                 # past 256: block 1 is b's, so a moves to blocks 2-3
        stage.open_session(c.sid)
        c.feed(stage)                     # c: block 0
        with pytest.raises(MeshnetError) as full:
            for _ in range(steps):
                b.feed(stage)             # past 256: no two free blocks in a row, nor two free at all
        assert full.value.code == errors.KV_FULL, full.value
        c.feed(stage)                     # the others go on beside the one that waits
        stage.release_session(c.sid)      # room: b moves to blocks 0-1 and goes on
        while len(b.logits) < steps + 1:
            b.feed(stage)
    assert same(a, ref["a"]) and same(b, ref["b"]) and same(c, ref["c"]), stem


def test_a_full_pool_packs_its_sessions_to_make_a_run_of_blocks_and_changes_no_token():
    path = MODELS["llama-dense"]
    sessions = [Session(sid, p) for sid, p in enumerate(prompts(path, 4), 1)]
    steps = 40
    refs = [alone(path, s.tokens, steps) for s in sessions]
    # 4 sessions of 1 block each in a pool of 7, then three grow to 2 blocks in turn: the
    # first moves to blocks 4-5, the second to 0-1, and the third finds 2 free blocks that
    # are not side by side (2 and 6): the pool packs the others, and it lands in 5-6
    with Stage(path, None, n_ctx=1024, max_sessions=4, n_threads=THREADS, pool_cells=7 * BLOCK) as stage:
        for s in sessions:
            stage.open_session(s.sid)
            s.feed(stage)
        for _ in range(steps):
            for s in sessions[:3]:
                s.feed(stage)
        stage.release_session(sessions[0].sid)
        for _ in range(steps):
            sessions[3].feed(stage)
    assert all(same(s, ref) for s, ref in zip(sessions, refs))


# a plain model, ALiBi's positions in the mask (bloom), and sliding-window pairs of caches
WINDOWED = ["llama-dense", "bloom-dense", "gemma3-dense", "cohere2-dense"]


@pytest.mark.parametrize("stem", WINDOWED)
def test_decode_steps_across_the_pool_in_shared_calls_give_what_each_gives_alone(stem):
    """Each group of neighbouring sessions' rows attends over its own span of the pool
    (patches 0013, 0014), all in one call: one forward call of four sessions' steps gives
    each what it gives alone."""
    path = MODELS[stem]
    short = prompts(path, 4)
    long_prompt = short[0] + short[1]                    # two blocks, and a third as it decodes
    prompt_of = {1: short[2], 2: long_prompt, 3: short[3], 4: short[0]}
    steps = 24
    refs = {sid: alone(path, p, steps) for sid, p in prompt_of.items()}
    sessions = {sid: Session(sid, p) for sid, p in prompt_of.items()}
    with Stage(path, None, n_ctx=1024, max_sessions=4, n_threads=THREADS, pool_cells=12 * BLOCK) as stage:
        for sid in (1, 2, 3, 4):
            stage.open_session(sid)
            sessions[sid].feed(stage)     # blocks 0, 1-2, 3, 4; as they cross a block, they move apart
        for _ in range(steps):
            order = [1, 2, 3, 4]
            entries = [Entry(sid, len(sessions[sid].tokens) - 1, tokens=np.array(sessions[sid].tokens[-1:]))
                       for sid in order]
            out = stage.forward(entries)
            for e, sid in enumerate(order):
                sessions[sid].logits.append(out.logits[e].copy())
                sessions[sid].tokens.append(int(out.token[e]))
    for sid, session in sessions.items():
        assert same(session, refs[sid]), (stem, sid)


@pytest.mark.parametrize("stem", WINDOWED)
def test_a_prompt_fed_in_chunks_beside_decode_steps_in_one_call_gives_what_each_gives_alone(stem):
    """A prompt's chunk and other sessions' decode steps share one call (stage.cpp
    plan_calls), each group of rows over its own window (patch 0014): the chunked prompt
    and the steps beside it give what each gives alone."""
    path = MODELS[stem]
    short = prompts(path, 4)
    prompt_of = {1: short[0], 2: short[1], 3: short[2], 4: short[3]}
    steps, chunk = 12, 50
    refs = {sid: alone(path, p, steps) for sid, p in prompt_of.items()}
    sessions = {sid: Session(sid, p) for sid, p in prompt_of.items()}
    with Stage(path, None, n_ctx=1024, max_sessions=4, n_threads=THREADS, pool_cells=8 * BLOCK) as stage:
        for sid in (1, 2, 3):
            stage.open_session(sid)
            sessions[sid].feed(stage)
        stage.open_session(4)
        fed = 0
        while len(sessions[4].logits) < steps + 1:
            entries, sids = [], []
            for sid in (1, 2, 3):
                if len(sessions[sid].logits) < steps + 1:
                    entries.append(Entry(sid, len(sessions[sid].tokens) - 1, tokens=np.array(sessions[sid].tokens[-1:])))
                    sids.append(sid)
            four = sessions[4]
            if fed < PROMPT:
                rows = four.tokens[fed:fed + chunk]
                entries.append(Entry(4, fed, tokens=np.array(rows)))
                fed += len(rows)
            else:
                entries.append(Entry(4, len(four.tokens) - 1, tokens=np.array(four.tokens[-1:])))
            sids.append(4)
            out = stage.forward(entries)
            for e, sid in enumerate(sids):
                if sid == 4 and fed < PROMPT:
                    continue              # the prompt's last chunk gives its first token
                sessions[sid].logits.append(out.logits[e].copy())
                sessions[sid].tokens.append(int(out.token[e]))
    for sid, session in sessions.items():
        assert same(session, refs[sid]), (stem, sid)


@pytest.mark.parametrize("stem", sorted(stem for stem, path in MODELS.items() if learned_positions(path)))
def test_a_position_past_a_learned_table_of_positions_is_context_full_not_an_abort(stem):
    with Stage(MODELS[stem], None, n_ctx=1024, max_sessions=1, n_threads=THREADS) as stage:
        stage.open_session(1)
        with pytest.raises(MeshnetError) as full:
            stage.forward([Entry(1, 0, tokens=np.ones(300, dtype=np.int32))])
        assert full.value.code == errors.CONTEXT_FULL and "learned positions" in full.value.message
        stage.forward([Entry(1, 0, tokens=np.ones(8, dtype=np.int32))])   # the session goes on


@pytest.mark.parametrize("stem", ["granitehybrid-dense", "mamba2-dense"])
def test_a_pool_a_model_s_memory_cannot_share_holds_as_many_whole_contexts_as_fit(stem):
    """A hybrid's and a recurrent model's memory keeps a stream per session: a pool of 1024
    cells with contexts of 512 is two sessions of 512, each with its tokens alone."""
    path = MODELS[stem]
    a_prompt, b_prompt = prompts(path, 2)
    ref = {"a": alone(path, a_prompt, 4), "b": alone(path, b_prompt, 4)}
    with Stage(path, None, n_ctx=512, max_sessions=8, n_threads=THREADS, pool_cells=4 * BLOCK) as stage:
        info = stage.info_static
        assert (info.pool_cells, info.max_sessions, info.n_ctx) == (0, 2, 512)
        a, b = Session(1, a_prompt), Session(2, b_prompt)
        for s in (a, b):
            stage.open_session(s.sid)
            s.feed(stage)
        for _ in range(4):
            a.feed(stage)
            b.feed(stage)
    assert same(a, ref["a"]) and same(b, ref["b"])


def test_a_recurrent_or_hybrid_model_holds_a_session_count_that_divides_its_batch():
    """llama.cpp splits a recurrent model's reserved batch evenly over its sequences: 3 of
    512 would break kimi-linear's graph (an abort); the stage holds 2 and says so."""
    with Stage(MODELS["kimi-linear-moe"], None, n_ctx=256, max_sessions=3, n_threads=THREADS) as stage:
        assert stage.info_static.max_sessions == 2
