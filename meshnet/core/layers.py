"""A layer range: the half-open [start, end) of a model's layers that one stage holds.

One type from the command line to the engine binding (like exo's Shard). A LayerRange is
always a possible range: 0 <= start < end, and end <= n_layer once the model is known
(n_layer is None until then). Anything else is refused with MeshnetError(bad_range).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterator, Sequence

from meshnet.core.errors import BAD_RANGE, MeshnetError


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class LayerRange:
    start: int
    end: int
    n_layer: int | None = None   # the model's layer count; None until the model is known

    def __post_init__(self):
        if not (_is_int(self.start) and _is_int(self.end)):
            raise MeshnetError(BAD_RANGE, f"layer range bounds must be integers, got {self.start!r}:{self.end!r}")
        if self.n_layer is not None and not (_is_int(self.n_layer) and self.n_layer >= 1):
            raise MeshnetError(BAD_RANGE, f"a model has a positive number of layers, not {self.n_layer!r}")
        if not 0 <= self.start < self.end:
            raise MeshnetError(BAD_RANGE, f"layer range {self.start}:{self.end} is empty or reversed: "
                                          "A:B needs 0 <= A < B")
        if self.n_layer is not None and self.end > self.n_layer:
            raise MeshnetError(BAD_RANGE, f"layers {self.label} are outside the model's {self.n_layer} layers "
                                          f"(0..{self.n_layer - 1})")

    @classmethod
    def parse(cls, text: str, n_layer: int | None = None) -> "LayerRange":
        """'A:B' -> LayerRange(A, B, n_layer), e.g. '0:15' for the first 15 layers."""
        start, sep, end = str(text).partition(":")
        try:
            if not sep:
                raise ValueError
            bounds = int(start), int(end)
        except ValueError:
            raise MeshnetError(BAD_RANGE, f"'{text}' is not a layer range A:B (e.g. 0:15 for layers 0..14)") from None
        return cls(*bounds, n_layer)

    def within(self, n_layer: int) -> "LayerRange":
        """This range bound to a model of n_layer layers, checked against it."""
        if self.n_layer is not None and self.n_layer != n_layer:
            raise MeshnetError(BAD_RANGE, f"layers {self.label} were given for a model of {self.n_layer} layers, "
                                          f"not {n_layer}")
        return LayerRange(self.start, self.end, n_layer)

    @property
    def is_head(self) -> bool:
        """Holds the first layer (and so the token embeddings)."""
        return self.start == 0

    @property
    def is_tail(self) -> bool:
        """Holds the last layer (and so the output); False while the model is not known."""
        return self.n_layer is not None and self.end == self.n_layer

    @property
    def label(self) -> str:
        return f"[{self.start},{self.end})"

    def as_tuple(self) -> tuple[int, int]:
        return self.start, self.end

    def __iter__(self) -> Iterator[int]:
        """So that `start, end = layers` works."""
        return iter((self.start, self.end))


def even_ranges(n_layer: int, n_stages: int) -> list[LayerRange]:
    """n_layer layers in n_stages ranges as even as whole layers allow."""
    if not 1 <= n_stages <= n_layer:
        raise MeshnetError(BAD_RANGE, f"cannot split {n_layer} layers into {n_stages} stages")
    bounds = [round(i * n_layer / n_stages) for i in range(n_stages + 1)]
    return [LayerRange(a, b, n_layer) for a, b in zip(bounds[:-1], bounds[1:])]


def balanced_ranges(layer_work: Sequence[int], tail_work: int, n_stages: int) -> list[LayerRange]:
    """n_stages contiguous ranges over len(layer_work) layers whose largest share of the
    work (the last range also does tail_work) is as small as it can be; among equally good
    splits, the one whose shares differ least. Exhaustive over seams: models have tens of
    layers and routes a few stages."""
    n_layer = len(layer_work)
    if not 1 <= n_stages <= n_layer:
        raise MeshnetError(BAD_RANGE, f"cannot split {n_layer} layers into {n_stages} stages")
    prefix = [0]
    for w in layer_work:
        prefix.append(prefix[-1] + w)

    def shares(bounds):
        work = [prefix[b] - prefix[a] for a, b in zip(bounds, bounds[1:])]
        work[-1] += tail_work
        return max(work), max(work) - min(work)

    @functools.lru_cache(maxsize=None)
    def best(start: int, stages: int) -> tuple[tuple[int, int], tuple[int, ...]]:
        """The best seams for layers [start, n_layer) in `stages` ranges: (score, bounds)."""
        if stages == 1:
            bounds = (start, n_layer)
            return shares(bounds), bounds
        options = []
        for seam in range(start + 1, n_layer - stages + 2):
            _, rest = best(seam, stages - 1)
            bounds = (start, *rest)
            options.append((shares(bounds), bounds))
        return min(options)

    _, bounds = best(0, n_stages)
    return [LayerRange(a, b, n_layer) for a, b in zip(bounds[:-1], bounds[1:])]


def ranges_from_seams(n_layer: int, seams: Sequence[int]) -> list[LayerRange]:
    """Seams [15] -> [0,15) [15,n_layer); seams must rise strictly inside the model."""
    bounds = [0, *seams, n_layer]
    if any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise MeshnetError(BAD_RANGE, f"seams {list(seams)} must rise strictly between 0 and {n_layer}")
    return [LayerRange(a, b, n_layer) for a, b in zip(bounds[:-1], bounds[1:])]


def parse_seams(text: str) -> list[int]:
    """'10,20' -> [10, 20]; checked against the model by ranges_from_seams."""
    try:
        return [int(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        raise MeshnetError(BAD_RANGE, f"'{text}' is not a comma-separated list of layer numbers (e.g. 10,20)") from None
