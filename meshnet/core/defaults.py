"""The defaults a user meets in every command and class, written once: a worker, `meshnet
run`, `serve`, `plan`, the planner's settings and the engine's Stage all start from here."""

N_CTX = 2048           # context tokens per session (llama.cpp's usual server default is 4096; a
                       # small machine holding a range of a large model has less room)
N_BATCH = 512          # tokens per forward pass, llama.cpp's n_batch default
MAX_SESSIONS = 8       # sessions a worker holds at once (its KV is sized for all of them)
LIBRARY_SESSIONS = 4   # a Stage or LocalCluster opened from code, as tests and tools open many
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
