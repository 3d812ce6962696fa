"""A session's sampling parameters: what the tail's llama.cpp sampler chain is built from.

The sampling itself happens in the engine (llama.cpp's samplers: penalties, top-k,
top-p, min-p, temperature, then a draw seeded per position). It is a pure function of
these parameters, the seed and the tokens so far, so that a route of any shape, the
whole model in one process and a replay all give the same tokens. This module only
says what a valid set of parameters is, in one place for the CLI, the wire and the
HTTP server.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from meshnet.core import errors as E
from meshnet.core.errors import MeshnetError

MAX_SEED = 2**64 - 1
MAX_GRAMMAR_BYTES = 256 * 1024


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0        # <= 0: greedy (the penalties still apply)
    top_k: int = 0                  # 0: off
    top_p: float = 1.0              # 1: off
    min_p: float = 0.0              # 0: off
    repeat_penalty: float = 1.0     # 1: off
    penalty_last_n: int = 64        # tokens the penalties look back on; -1: the whole context
    frequency_penalty: float = 0.0  # 0: off
    presence_penalty: float = 0.0   # 0: off
    seed: int = 0
    # llama.cpp's GBNF (rule root first), taken by the generated tokens: structured output
    # (a JSON schema's grammar: serve/structured.py) or a caller's own; "": none
    grammar: str = ""
    # a lazy grammar holds from the first match of one of these regexes over the text
    # generated, or the first of these tokens, on (a tool call's, by the chat template's format)
    grammar_lazy: bool = False
    trigger_patterns: tuple[str, ...] = ()
    trigger_tokens: tuple[int, ...] = ()
    # the last this many tokens of the prompt are the grammar's too: a chat template's
    # generation prompt, which llama.cpp's tool-call grammars begin with (it feeds them to
    # the grammar before the first draw, as common/sampling.cpp does)
    grammar_prefill: int = 0

    def __post_init__(self):
        def number(name, low, high, integer=False):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
                raise MeshnetError(E.INVALID_ARGUMENT, f"{name} must be {'an integer' if integer else 'a number'}, "
                                   f"not {value!r}", field=name)
            if not (math.isfinite(value) and low <= value <= high):
                raise MeshnetError(E.INVALID_ARGUMENT, f"{name} must be within [{low}, {high}], not {value!r}",
                                   field=name)

        number("temperature", 0.0, 100.0)
        number("top_k", 0, 1 << 31, integer=True)
        number("top_p", 0.0, 1.0)
        number("min_p", 0.0, 1.0)
        number("repeat_penalty", 0.0, 100.0)
        number("penalty_last_n", -1, 1 << 31, integer=True)
        number("frequency_penalty", -2.0, 2.0)
        number("presence_penalty", -2.0, 2.0)
        number("seed", 0, MAX_SEED, integer=True)
        number("grammar_prefill", 0, 4096, integer=True)
        if not isinstance(self.grammar, str) or len(self.grammar.encode(errors="replace")) > MAX_GRAMMAR_BYTES:
            raise MeshnetError(E.INVALID_ARGUMENT, f"grammar must be GBNF text of at most {MAX_GRAMMAR_BYTES} bytes",
                               field="grammar")
        if not isinstance(self.grammar_lazy, bool):
            raise MeshnetError(E.INVALID_ARGUMENT, "grammar_lazy must be true or false", field="grammar_lazy")
        for name, kind in (("trigger_patterns", str), ("trigger_tokens", int)):
            value = getattr(self, name)
            if not isinstance(value, (tuple, list)) or len(value) > 64 or not all(
                    isinstance(v, kind) and not isinstance(v, bool) for v in value):
                raise MeshnetError(E.INVALID_ARGUMENT, f"{name} must be at most 64 {kind.__name__}s", field=name)
            object.__setattr__(self, name, tuple(value))   # (from the wire: a list)
        if self.repeat_penalty == 0.0:
            raise MeshnetError(E.INVALID_ARGUMENT, "repeat_penalty must be above 0 (1 is off)", field="repeat_penalty")

    @property
    def greedy(self) -> bool:
        """Plain argmax: no temperature, no penalty and no grammar."""
        return (self.temperature <= 0.0 and self.repeat_penalty == 1.0 and self.frequency_penalty == 0.0
                and self.presence_penalty == 0.0 and not self.grammar)

    @property
    def uses_history(self) -> bool:
        """The penalties look at the tokens so far: the tail must be told the prompt."""
        return self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def to_wire(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v != getattr(GREEDY, k)}

    @classmethod
    def from_wire(cls, value) -> "Sampling":
        if not isinstance(value, dict):
            raise MeshnetError(E.BAD_FIELD, f"sampling must be a map, not {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(map(str, set(value) - known))
        if unknown:
            raise MeshnetError(E.BAD_FIELD, f"sampling has unknown fields {unknown}")
        try:
            return cls(**value)
        except MeshnetError as e:
            raise MeshnetError(E.BAD_FIELD, f"sampling: {e.message}") from None


GREEDY = Sampling()
