"""The names of a token sequence's prefixes, as prefix reuse across sessions needs them.

A stage past the head never sees token ids, only residual rows, so it cannot tell by
itself that a new session starts as an ended one did. The coordinator, which holds the
tokens, names each prefix that ends on a block boundary by a chain hash: the key of
block i covers the tokens of blocks 0..i and the route's compatibility class, so two
sequences share block i's key only when they share all its tokens and would compute the
same KV there. Each stage then stores and finds memory by these keys alone.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Sequence

BLOCK = 16               # tokens per block: a prefix is reused to the last whole block both share
MAX_BLOCKS = 4096        # keys one message carries (65,536 tokens); a longer prompt is named that far


def block_keys(tokens: Sequence[int], salt: str, limit: int | None = None) -> list[int]:
    """The chain keys of TOKENS' whole blocks (at most LIMIT tokens of them), 64-bit each."""
    n = len(tokens) if limit is None else min(limit, len(tokens))
    n_blocks = min(n // BLOCK, MAX_BLOCKS)
    keys, prev = [], hashlib.blake2b(salt.encode(), digest_size=8).digest()
    for b in range(n_blocks):
        block = struct.pack(f"<{BLOCK}i", *tokens[b * BLOCK:(b + 1) * BLOCK])
        prev = hashlib.blake2b(prev + block, digest_size=8).digest()
        keys.append(int.from_bytes(prev, "little"))
    return keys


def reusable_keys(prompt: Sequence[int], salt: str) -> list[int]:
    """The keys a new session may start from: its last prompt token must still be fed,
    since the tail's next token comes from that row's logits."""
    return block_keys(prompt, salt, limit=len(prompt) - 1)
