"""The defaults a user meets in every command and class, written once: a worker, `meshnet
run`, `serve`, `plan`, the planner's settings and the engine's Stage all start from here."""

N_CTX = 2048           # context tokens per session opened from code, and the least a worker's
                       # session gets by default (a generated test model trained on 256 too)
CTX_CAP = 32768        # the longest a worker's session gets by default, however long the model's
                       # trained context: a 128k context of a large model is tens of GiB of KV
N_BATCH = 512          # tokens per forward pass, llama.cpp's n_batch default
MAX_SESSIONS = 64      # sessions a worker (and serve) holds at once: they share one KV pool
LIBRARY_SESSIONS = 4   # a Stage or LocalCluster opened from code, as tests and tools open many
KV_POOL_MIN = 16384    # a worker's default KV pool holds at least this many cells (64 sessions of a block) ...
POOL_ROOM = 4096       # ... and one whole context with room for 16 short sessions beside it
# serve: requests that wait for a session slot at most (beyond them: 429), and how long
# one waits before it is refused (a chat UI or an agent would rather wait than fail)
MAX_QUEUE = 256
QUEUE_WAIT_S = 300.0
# a session whose next positions a stage's KV pool has no room for leaves its route and waits
# in line this long at most, to be replayed once other sessions free room (route/sessions.py)
PAUSE_WAIT_S = 300.0
PREFIX_CACHE_MIB = 256  # per stage: ended sessions' memory kept for the next that start the same way (0: off)

# seconds one step of a stage may run before serve's /health says the stage is stuck: far
# past a step of any prompt chunk, and past a grammar's bounded work (engine_c/patches/0011)
STUCK_AFTER_S = 30.0


def kv_settings(n_ctx_train: int, n_ctx: int | None = None, kv_pool: int | None = None,
                max_sessions: int = MAX_SESSIONS) -> tuple[int, int]:
    """(context per session, cells of the stage's KV pool) of a worker of a model trained on
    N_CTX_TRAIN tokens of context, as llama-server sizes its slots: by default a session may
    grow to the model's trained context (within N_CTX and CTX_CAP), and the sessions share a
    pool that holds one such session and short ones beside it, and never more than every
    one of MAX_SESSIONS at its whole context. N_CTX (--ctx) is a cap and
    KV_POOL (--kv-pool) the pool's size where given (0: no pool, n_ctx cells per session)."""
    ctx = n_ctx or min(max(n_ctx_train or N_CTX, N_CTX), CTX_CAP)
    if kv_pool is None:
        return ctx, min(max(KV_POOL_MIN, ctx + POOL_ROOM), ctx * max_sessions)
    if kv_pool and not n_ctx:
        ctx = min(ctx, kv_pool)   # (a pool given smaller than the model's context caps it)
    return ctx, kv_pool
