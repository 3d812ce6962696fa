"""A conversation as a model continues it: its prompt through the model's own chat template,
the oldest turns dropped until it fits the context, and the sampling of one answer. The
template and the tokenizer are llama.cpp's, reached through the coordinator given; the
terminal chat and the HTTP server both hold a conversation this way."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from meshnet.core import errors
from meshnet.core.errors import MeshnetError
from meshnet.core.sampling import MAX_SEED, Sampling


def prompt_tokens(coordinator, messages: Sequence[dict], limit: int | None = None) -> list[int]:
    """The conversation as the model expects to continue it: its template, then its tokens
    (the template's markers are special tokens, so they are parsed as such). With a
    limit, a conversation of more tokens is refused with context_full."""
    text = coordinator.chat_prompt(list(messages), add_generation_prompt=True, limit=limit)
    return coordinator.tokenize(text, add_special=True, parse_special=True, limit=limit)


def answer_sampling(sampling: Sampling | None, seed_given: bool) -> Sampling | None:
    """The sampling of one answer. Without --seed each answer draws afresh, as a chat
    should; with one, the same conversation gets the same answers."""
    if sampling is None or seed_given or sampling.temperature <= 0:
        return sampling
    return replace(sampling, seed=secrets.randbelow(MAX_SEED + 1))


@dataclass
class Fitted:
    messages: list[dict]
    tokens: list[int]
    dropped_turns: int


def fit(messages: Sequence[dict], tokens_of: Callable[[list[dict]], Sequence[int]], n_ctx: int,
        max_tokens: int) -> Fitted:
    """The conversation cut to what fits: the prompt and max_tokens new tokens within n_ctx.

    The oldest turns (a user message and the replies after it) go first; system messages
    and the last turn, the one being asked, always stay. If that last turn alone does not
    fit, CONTEXT_FULL says by how much."""
    kept = list(messages)
    dropped = 0
    while True:
        tokens = list(tokens_of(kept))
        if len(tokens) + max_tokens <= n_ctx:
            return Fitted(kept, tokens, dropped)
        rest = [i for i, m in enumerate(kept) if m["role"] != "system"]
        asks = [i for i in rest if kept[i]["role"] == "user"]
        if not asks or rest[0] >= asks[-1]:   # only the turn being asked is left
            raise MeshnetError(errors.CONTEXT_FULL, f"this message makes a prompt of {len(tokens)} tokens (with the "
                               f"template{' and the system message' if _has_system(kept) else ''}): with "
                               f"{max_tokens} new ones it exceeds the context of {n_ctx}; send a shorter one, or "
                               f"start with a larger --ctx or a smaller --max-tokens", prompt_tokens=len(tokens),
                               max_tokens=max_tokens, n_ctx=n_ctx)
        # the oldest turn: from the first message that is not the system's to the next question
        end = next(i for i in asks if i > rest[0])
        kept = [m for i, m in enumerate(kept) if not (rest[0] <= i < end and m["role"] != "system")]
        dropped += 1


def _has_system(messages: Sequence[dict]) -> bool:
    return any(m["role"] == "system" for m in messages)
