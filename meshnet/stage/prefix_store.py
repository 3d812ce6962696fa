"""What a stage keeps of ended sessions for the next ones that start the same way: each
session's memory on this stage (engine bytes), under the chain keys of its token blocks
(core/prefix.py), least recently used first out once the bytes pass the cap.

A stored session serves any prefix of it that ends on a block boundary: its key for
block i names that prefix. A new session is then restored from the entry and cut back
to that length, which the engine does exactly for an attention model (its KV at a
position does not depend on what follows).
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass

from meshnet.core import numerics
from meshnet.core.planner import OVERHEAD
from meshnet.core.prefix import BLOCK


def store_refusal(capacity_mib: int, numerics_class: str, layers) -> str | None:
    """Why a stage of these LAYERS (their engine layer memory) keeps no prefix store, or
    None: it keeps one where a restored prefix gives exactly the tokens a full prefill gives."""
    if capacity_mib <= 0:
        return "--prefix-cache 0"
    if numerics_class != numerics.INVARIANT:
        return (f"the {numerics_class} numerics class computes a row's KV differently beside other rows, so a "
                "restored prefix would not give the tokens a full prefill gives")
    if any(layer.state_bytes for layer in layers):
        return "these layers keep a recurrent state, which cannot be cut back to a shorter prefix"
    return None


def store_capacity(capacity_mib: int, admitted: int | None, stage_bytes: int) -> int:
    """The store's cap in bytes: --prefix-cache, and within --mem (ADMITTED, when given) no
    more than what the stage's own STAGE_BYTES and the process's overhead leave of it: the
    planner budgets a worker by --mem without the store."""
    capacity = capacity_mib << 20
    if admitted is not None:
        capacity = min(capacity, max(0, admitted - stage_bytes - OVERHEAD))
    return capacity


@dataclass
class Stored:
    keys: tuple[int, ...]        # one per block, block i's key covering blocks 0..i
    memory: bytes                # the engine's save of a session of len(keys) * BLOCK tokens

    @property
    def n_tokens(self) -> int:
        return len(self.keys) * BLOCK


class PrefixStore:
    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self.bytes = 0
        self._entries: collections.OrderedDict[int, Stored] = collections.OrderedDict()   # oldest use first
        self._holding: dict[int, set[int]] = collections.defaultdict(set)   # block key -> entries holding it
        self._ids = itertools.count()
        self.counters: collections.Counter = collections.Counter()   # hits, misses, hit_tokens, stored, evictions, ...

    def __len__(self) -> int:
        return len(self._entries)

    def find(self, keys: list[int]) -> tuple[Stored, int] | None:
        """The entry holding the longest prefix named by KEYS, and that prefix's block
        count; None when no block of it is held."""
        for n_blocks in range(len(keys), 0, -1):
            held = self._holding.get(keys[n_blocks - 1])
            if held:
                entry_id = max(held)   # the newest of those holding it
                self._entries.move_to_end(entry_id)
                self.counters["hits"] += 1
                self.counters["hit_tokens"] += n_blocks * BLOCK
                return self._entries[entry_id], n_blocks
        if keys:
            self.counters["misses"] += 1
        return None

    def refresh(self, keys: list[int]) -> bool:
        """An entry holds all of KEYS' blocks already: it is used again (the last out)."""
        for entry_id in self._holding.get(keys[-1], ()) if keys else ():
            if len(self._entries[entry_id].keys) >= len(keys):
                self._entries.move_to_end(entry_id)
                return True
        return False

    def put(self, keys: list[int], memory: bytes) -> bool:
        """Keep MEMORY, a session of len(keys) blocks; False when it alone passes the cap.
        Entries it extends go: it serves every prefix they served."""
        if not keys:
            return False
        if len(memory) > self.capacity_bytes:
            self.counters["too_large"] += 1
            return False
        keys = tuple(keys)
        if self.refresh(list(keys)):
            return True
        for entry_id in [e for e, stored in self._entries.items()
                         if len(stored.keys) < len(keys) and stored.keys[-1] == keys[len(stored.keys) - 1]]:
            self._drop(entry_id)
            self.counters["superseded"] += 1
        entry_id = next(self._ids)
        self._entries[entry_id] = Stored(keys, memory)
        for key in keys:
            self._holding[key].add(entry_id)
        self.bytes += len(memory)
        self.counters["stored"] += 1
        while self.bytes > self.capacity_bytes:
            self._drop(next(iter(self._entries)))
            self.counters["evictions"] += 1
        return True

    def stats(self) -> dict:
        return {"entries": len(self._entries), "bytes": self.bytes, "capacity_bytes": self.capacity_bytes,
                **{k: self.counters[k] for k in ("hits", "misses", "hit_tokens", "stored", "evictions")}}

    def _drop(self, entry_id: int) -> None:
        stored = self._entries.pop(entry_id)
        self.bytes -= len(stored.memory)
        for key in stored.keys:
            held = self._holding[key]
            held.discard(entry_id)
            if not held:
                del self._holding[key]
