"""Which workers make a route: plain data in, an ordered list of stages out, or a
refusal that says why (gap, overlap, hash mismatch, incompatible class).

Nothing here touches sockets or models, so it is tested with plain offers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from .errors import ROUTE_INCOMPLETE, MeshnetError
from .layers import LayerRange


@dataclass(frozen=True)
class StageOffer:
    worker: str                 # the worker's name
    model_sha256: str
    layers: LayerRange          # bound to the model: n_layer is known
    compat_class: tuple         # engine pin, backend, wire dtype

    @property
    def start(self) -> int:
        return self.layers.start

    @property
    def end(self) -> int:
        return self.layers.end

    @property
    def n_layer(self) -> int:
        return self.layers.n_layer

    @property
    def label(self) -> str:
        return self.layers.label


def offer_from_capability(worker: str, capability: dict) -> StageOffer:
    start, end = capability["layers"]
    return StageOffer(
        worker=worker,
        model_sha256=capability["model_sha256"],
        layers=LayerRange(start, end, capability["n_layer"]),
        compat_class=(capability["engine_pin"], capability["backend"], capability["wire_dtype"]),
    )


def build_route(offers: Iterable[StageOffer], model_sha256: str | None = None) -> list[StageOffer]:
    """Stages whose ranges are disjoint and cover [0, n_layer) exactly, in layer order."""
    offers = list(offers)
    if model_sha256 is not None:
        offers = [o for o in offers if o.model_sha256 == model_sha256]
    if not offers:
        raise MeshnetError(ROUTE_INCOMPLETE, "no worker has registered" + (f" for model {model_sha256[:12]}" if model_sha256 else ""))
    models = {o.model_sha256 for o in offers}
    if len(models) > 1:
        raise MeshnetError(ROUTE_INCOMPLETE, f"hash mismatch: workers serve {len(models)} different model files "
                           f"({', '.join(sorted(m[:12] for m in models))})")
    classes = {o.compat_class for o in offers}
    if len(classes) > 1:
        raise MeshnetError(ROUTE_INCOMPLETE, "incompatible class: workers differ in engine pin, backend or wire dtype: "
                           + "; ".join(" ".join(map(str, c)) for c in sorted(classes)))
    n_layer = offers[0].n_layer

    by_start: dict[int, list[StageOffer]] = {}
    for offer in sorted(offers, key=lambda o: (o.start, o.end, o.worker)):
        by_start.setdefault(offer.start, []).append(offer)

    def chain(at: int) -> list[StageOffer] | None:  # depth-first: ranges are few
        if at == n_layer:
            return []
        for offer in by_start.get(at, []):
            rest = chain(offer.end)
            if rest is not None:
                return [offer, *rest]
        return None

    route = chain(0)
    if route is None:
        raise MeshnetError(ROUTE_INCOMPLETE, _why_no_route(offers, n_layer))
    return route


def _why_no_route(offers: list[StageOffer], n_layer: int) -> str:
    ordered = sorted(offers, key=lambda o: (o.start, o.end))
    covered = 0
    for offer in ordered:
        if offer.start > covered:
            return f"gap: no worker holds layers {covered}..{offer.start - 1} of {n_layer}"
        covered = max(covered, offer.end)
    if covered < n_layer:
        return f"gap: no worker holds layers {covered}..{n_layer - 1} of {n_layer}"
    for a, b in zip(ordered, ordered[1:]):
        if b.start < a.end and b.start != a.start:
            return f"overlap: {a.label} and {b.label} both hold layers {b.start}..{min(a.end, b.end) - 1}"
    return "no chain of registered ranges covers [0, %d) exactly" % n_layer


def head_gathers(capabilities: list[dict]) -> bool:
    """Whether a route's head should gather its sessions' decode steps into one forward
    call: when the stages on the head's machine have more compute threads together than
    it has CPUs, two of them computing at once slow each other down, so the sessions had
    better go round the ring as one group (one stage computing at a time, as in one
    process) than as several groups in different stages at once. Stages on their own
    CPUs (or hosts) pipeline instead."""
    head = capabilities[0]
    beside = [c for c in capabilities if c["clock_id"] == head["clock_id"]]
    return len(beside) > 1 and sum(c.get("n_threads", 1) for c in beside) > head.get("n_cpus", 1 << 20)
