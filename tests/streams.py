"""Several sessions' token streams followed at once, with something done to the route
while they run (a worker killed): after every stream has given some tokens, or at once."""

import threading

from meshnet.core.errors import MeshnetError


def follow_while(handles, action, after_tokens=None, timeout=120.0):
    """Each of HANDLES' tokens, in a thread of its own; ACTION() once every stream has given
    AFTER_TOKENS tokens (None: as soon as they are started). Returns (tokens, errors), one
    of each per handle; a stream still open TIMEOUT s after ACTION fails the test."""
    got = [[] for _ in handles]
    failures = [None] * len(handles)
    streamed = threading.Barrier(len(handles) + 1)

    def follow(i):
        try:
            for event in handles[i]:
                got[i].append(event.token)
                if len(got[i]) == after_tokens:
                    streamed.wait(timeout)
        except MeshnetError as e:
            failures[i] = e
        except threading.BrokenBarrierError:
            pass
        finally:
            if after_tokens is not None and len(got[i]) < after_tokens:
                streamed.abort()   # it ended before it got there: nobody waits for it

    threads = [threading.Thread(target=follow, args=(i,), daemon=True) for i in range(len(handles))]
    for t in threads:
        t.start()
    if after_tokens is not None:
        try:
            streamed.wait(timeout)
        except threading.BrokenBarrierError:
            pass   # a stream ended early: the action still runs, and the test sees what each got
    action()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a session hung"
    return got, failures
