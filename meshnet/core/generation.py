"""Generation, defined once, with no I/O (as h11 defines HTTP): prompt chunks, the
pipelining rule, decode steps, the stop rule and the timings of one session.

A driver feeds it events and carries out the actions it returns:

    opened(cached)                    -> [FeedHead(first prompt chunk after the cached prefix)]
    head_took(pos, n)                 -> [FeedHead(next chunk)] while the prompt lasts
    tail_gave(pos, n, token, is_eog)  -> a prompt chunk before the last: [FeedHead(next
                                         chunk)] when that makes room, else [];
                                         then [Token(t), FeedHead(decode step) | Finish(reason)]
    failed()                          -> [Finish("error")]

The pipelining rule: chunk k+1 enters the head as soon as the head has taken chunk k,
so that the head reads the prompt while later stages work on what it already read, as
long as fewer than `depth` chunks (one per stage) are between the head and the end of
the tail: a head faster than the stages after it never floods their queues. The tail
reports each prompt chunk it finished (tail_gave; before the last one there is no token).
On a ring (workers), the tail itself sends each decode step to the head: the driver
at the coordinator then gets no FeedHead for decode steps (`tail_feeds_head`), and the
tail decides to go on with the same StopRule, so both ends agree on the last token.
The in-process pipeline and the coordinator both drive this class; tests drive it with
plain data.

A session that lost a stage is rebuilt on a new route by `replay()`: the prompt and the
tokens generated so far go through the new route as they first went through the old
one (the prompt in the same chunks, each generated token alone), because the engine's
floats depend on how rows are grouped into forward calls; the tail then computes the
next token from the same logits, and a sampled session draws it with the same seed.
The caller sees no replayed token twice, only the tokens after them.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from meshnet.core import errors as E
from meshnet.core.errors import MeshnetError
from meshnet.core.metrics import generation_metrics


@dataclass(frozen=True)
class StopRule:
    """When a session ends: at an end-of-generation token (unless told to go on), or at
    max_tokens generated tokens."""

    max_tokens: int
    stop_at_eog: bool = True

    def reason(self, n_generated: int, is_eog: bool) -> str | None:
        if self.stop_at_eog and is_eog:
            return "eog"
        if n_generated >= self.max_tokens:
            return "length"
        return None


# actions


@dataclass(frozen=True)
class FeedHead:
    """Give the head stage these token ids at this position; a prompt chunk (`prompt`)
    is reported back by head_took once the head has taken it."""

    pos: int
    tokens: tuple[int, ...]
    prompt: bool


@dataclass(frozen=True)
class Token:
    token: int


@dataclass(frozen=True)
class Finish:
    reason: str   # eog | length | error


Action = FeedHead | Token | Finish


def even_chunk_ends(n: int, chunk: int) -> list[int]:
    """Where the chunks of n prompt tokens end, chunk tokens each but the last."""
    return list(range(chunk, n, chunk)) + [n]


@dataclass
class Generation:
    prompt: Sequence[int]
    rule: StopRule
    chunk: int
    tail_feeds_head: bool = False
    depth: int = 2                    # prompt chunks in flight at most: the number of stages
    clock: Callable[[], float] = time.perf_counter
    tokens: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)   # the clock as each token came
    state: str = "opening"            # opening | prefill | decode | done
    stop_reason: str | None = None
    prompt_fed: int = 0               # prompt tokens handed to the head so far
    head_done: int = 0                # ... taken by the head
    tail_done: int = 0                # ... finished by the tail
    t_start: float | None = None
    t_first: float | None = None
    t_end: float | None = None
    # where each prompt chunk ends: by `chunk` unless a replay fixed them (see replay())
    chunk_ends: list[int] | None = None
    n_prompt: int | None = None       # the caller's prompt; a replay's prompt also holds the tokens so far
    replayed: int = 0                 # tokens generated before a replay, fed again
    cached: int = 0                   # prompt tokens the stages restored from a stored prefix, not fed
    # the next prompt chunk's rows at most, where the caller cuts chunks shorter than
    # `chunk` (None: no such cut); a cut chunk's end is kept in chunk_ends, so a replay
    # feeds the chunks as they were fed
    chunk_limit: int | None = None

    def __post_init__(self):
        if not self.prompt:
            raise MeshnetError(E.INVALID_ARGUMENT, "the prompt has no tokens")
        if self.n_prompt is None:
            self.n_prompt = len(self.prompt)
        if self.rule.max_tokens < 1:
            raise MeshnetError(E.INVALID_ARGUMENT, "max_tokens must be at least 1")
        if self.chunk < 1 or self.depth < 1:
            raise MeshnetError(E.INVALID_ARGUMENT, "a prompt chunk holds at least one token, a pipeline one stage")

    @property
    def done(self) -> bool:
        return self.state == "done"

    def opened(self, cached: int = 0) -> list[Action]:
        """Every stage has the session open, each holding the prompt's first CACHED tokens
        (a prefix stored from an earlier session): the prompt is fed from there."""
        self._expect("opening")
        if not 0 <= cached < len(self.prompt):
            raise MeshnetError(E.INTERNAL, f"{cached} cached tokens of a prompt of {len(self.prompt)}: the last "
                               "prompt token is always fed")
        self.state = "prefill"
        if self.t_start is None:
            self.t_start = self.clock()
        if self.chunk_ends is None:   # the chunk is the route's to bound until now
            self.chunk_ends = [cached + end for end in even_chunk_ends(len(self.prompt) - cached, self.chunk)]
        else:
            self.chunk_ends = [end for end in self.chunk_ends if end > cached]
        self.cached = cached
        self.prompt_fed = self.head_done = self.tail_done = cached
        return [self._next_chunk()]

    def bound_chunks(self, n_batch: int, fixed: bool = False) -> None:
        """Before the session opens: no prompt chunk over the route's N_BATCH; FIXED
        feeds chunks of exactly n_batch (the stock class's, as stock llama.cpp feeds)."""
        self._expect("opening")
        self.chunk = n_batch if fixed else min(self.chunk, n_batch)

    def on_route(self, depth: int) -> None:
        """The route it opens on has DEPTH stages: as many prompt chunks may be in flight."""
        self._expect("opening")
        self.depth = depth

    def replay(self, n_batch: int | None = None) -> "Generation":
        """This session again from the start, for a new route: the prompt in the chunks it
        was fed in, then each generated token alone, as when it was decoded; the token
        after them is the next one the caller gets. A route that takes fewer than a
        chunk's rows at once (N_BATCH) gets even chunks of n_batch instead (its floats
        may then differ: the run's note says which chunking ran)."""
        if self.done:
            raise MeshnetError(E.INTERNAL, "a finished generation has nothing to replay")
        n_prompt = self.n_prompt
        prompt_ends = self.chunk_ends or even_chunk_ends(n_prompt, self.chunk)
        prompt_ends = [end for end in prompt_ends if end <= n_prompt]
        ends = prompt_ends + [n_prompt + i + 1 for i in range(len(self.tokens))]
        chunk = self.chunk
        if n_batch is not None and max(b - a for a, b in zip([0] + ends, ends)) > n_batch:
            chunk, ends = n_batch, None
        return Generation(list(self.prompt[:n_prompt]) + self.tokens, self.rule, chunk,
                          tail_feeds_head=self.tail_feeds_head, depth=self.depth, clock=self.clock,
                          tokens=list(self.tokens), token_times=list(self.token_times), t_start=self.t_start,
                          t_first=self.t_first, chunk_ends=ends, n_prompt=n_prompt,
                          replayed=len(self.tokens))

    def head_took(self, pos: int, n: int) -> list[Action]:
        """The head has taken the prompt chunk at pos: the next one may enter it."""
        if self.state != "prefill":
            return []  # a decode step
        self.head_done = max(self.head_done, pos + n)
        return self._feed_prompt()

    def tail_gave(self, pos: int, n: int, token: int, is_eog: bool) -> list[Action]:
        """The tail has computed rows [pos, pos + n) and their greedy next token."""
        if self.state == "done":
            return []
        if pos + n < len(self.prompt):  # a prompt chunk before the last: its token predicts a prompt token
            if self.state != "prefill":
                return []
            self.tail_done = max(self.tail_done, pos + n)
            return self._feed_prompt()
        self._expect("prefill", "decode")
        now = self.clock()
        if self.state == "prefill":
            self.state = "decode"
            if self.t_first is None:   # a replay keeps the first token's time
                self.t_first = now
        self.tokens.append(token)
        self.token_times.append(now)
        reason = self.rule.reason(len(self.tokens), is_eog)
        if reason is not None:
            return [Token(token), *self._finish(reason, now)]
        if self.tail_feeds_head:
            return [Token(token)]
        return [Token(token), FeedHead(pos + n, (token,), prompt=False)]

    def failed(self) -> list[Action]:
        return [] if self.done else self._finish("error")

    def metrics(self, ranges, seam_bytes: int) -> dict:
        t_end = self.t_end if self.t_end is not None else self.clock()
        t_start = self.t_start if self.t_start is not None else t_end
        return generation_metrics(ranges, self.n_prompt, len(self.tokens), t_start,
                                  self.t_first if self.t_first is not None else t_end, t_end, seam_bytes,
                                  cached=self.cached)

    # internals

    def _feed_prompt(self) -> list[Action]:
        """The next prompt chunk, if the head is free for it and the pipeline has room."""
        if self.prompt_fed >= len(self.prompt) or self.head_done < self.prompt_fed:
            return []
        in_flight = sum(1 for end in self.chunk_ends if self.tail_done < end <= self.prompt_fed)
        return [self._next_chunk()] if in_flight < self.depth else []

    def _next_chunk(self) -> FeedHead:
        at = self.prompt_fed
        end = next(e for e in self.chunk_ends if e > at)
        if self.chunk_limit is not None and end - at > self.chunk_limit:
            end = at + max(1, self.chunk_limit)
            bisect.insort(self.chunk_ends, end)
        self.prompt_fed = end
        return FeedHead(at, tuple(self.prompt[at:end]), prompt=True)

    def _finish(self, reason: str, now: float | None = None) -> list[Action]:
        self.state = "done"
        self.stop_reason = reason
        self.t_end = self.clock() if now is None else now
        return [Finish(reason)]

    def _expect(self, *states: str) -> None:
        if self.state not in states:
            raise MeshnetError(E.INTERNAL, f"generation got an event for state {'/'.join(states)} in state {self.state}")


def tail_step(prompt_len: int, rule: StopRule, n_generated: int, pos: int, n: int, is_eog: bool) -> tuple[bool, bool]:
    """What the tail of a ring does with rows [pos, pos + n): (is a token, feed it to the
    head). The same rule as Generation.tail_gave, for a stage that holds no prompt."""
    if pos + n < prompt_len:
        return False, False
    return True, rule.reason(n_generated + 1, is_eog) is None
