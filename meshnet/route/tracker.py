"""Which workers make a route: plain data in, an ordered list of stages out, or a
refusal that says why (gap, overlap, hash mismatch, incompatible class).

Only workers of one compatibility class (model sha256, engine pin with its patch hash,
backend, wire dtype, numerics class, flash attention) share a route; the others are kept out with a reason naming both
classes, and never stop the compatible ones from forming one. Several workers may offer
the same range (spares): any live one will do. Between complete candidate routes the
tracker prefers fewer stages, then the earliest registered workers, so the choice never
depends on connection ids. Nothing here touches sockets or models, so it is tested with
plain offers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, NamedTuple

from meshnet.core import kv_cache
from meshnet.core.errors import ROUTE_INCOMPLETE, MeshnetError
from meshnet.core.layers import LayerRange
from meshnet.net.capability import Capability


class CompatClass(NamedTuple):
    model_sha256: str
    engine_pin: str
    backend: str
    wire_dtype: str
    numerics: str
    flash_attn: bool = False   # its attention sums differ from the plain kernels': a class of its own
    kv_type: str = kv_cache.DEFAULT   # the cache rounds what attention reads: so does this

    def __str__(self) -> str:
        return (f"model {self.model_sha256[:12]} {self.engine_pin} {self.backend} {self.wire_dtype} numerics "
                f"{self.numerics}" + (" flash attention" if self.flash_attn else "")
                + (f" kv {self.kv_type}" if self.kv_type != kv_cache.DEFAULT else ""))

    def differences(self, other: "CompatClass") -> str:
        """What differs, in words: 'model abc... vs def...; backend CPU vs CUDA'."""
        parts = []
        for name, mine, theirs in zip(self._fields, self, other):
            if mine != theirs:
                if name == "model_sha256":
                    mine, theirs = mine[:12], theirs[:12]
                parts.append(f"{name.replace('_', ' ')} {mine} vs {theirs}")
        return "; ".join(parts)


@dataclass(frozen=True)
class StageOffer:
    worker: str                 # the worker's name
    layers: LayerRange          # bound to the model: n_layer is known
    compat_class: CompatClass
    registered: int = 0         # the order workers registered in: earlier is smaller
    n_embd: int = 0             # the residual's width: stages of a mixed route must agree on it

    @property
    def model_sha256(self) -> str:
        return self.compat_class.model_sha256

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


def compat_class_of(capability: Capability) -> CompatClass:
    return CompatClass(capability.model_sha256, capability.engine_pin, capability.backend,
                       capability.wire_dtype, capability.numerics, capability.flash_attn, capability.kv_type)


def offer_from_capability(worker: str, capability: Capability, registered: int = 0) -> StageOffer:
    start, end = capability.layers
    return StageOffer(worker=worker, layers=LayerRange(start, end, capability.n_layer),
                      compat_class=compat_class_of(capability), registered=registered, n_embd=capability.n_embd)


# what every worker of one model file must say alike: a worker that claims another shape
# for a model already known is not serving that file, whatever hash it names
MODEL_SHAPE = ("arch", "n_layer", "n_embd", "n_vocab")


def shape_disagreement(capability: Capability, known: Capability) -> str | None:
    """Why CAPABILITY cannot be a worker of the model that KNOWN (a registered worker's
    capability, same model sha256) describes, or None when they agree: the shape, and
    the per-layer cost table when both give one."""
    for name in MODEL_SHAPE:
        if getattr(capability, name) != getattr(known, name):
            return f"it says {name} {getattr(capability, name)!r:.40}, the model's is {getattr(known, name)!r}"
    if capability.cost is not None and known.cost is not None and capability.cost != known.cost:
        return "its per-layer cost table differs from the model's"
    return None


@dataclass
class Route:
    stages: list[StageOffer]
    kept_out: dict[str, str] = field(default_factory=dict)   # worker -> why it is not in the route

    @property
    def mixed(self) -> bool:
        """Stages of more than one class (only with allow_mixed): its output may drift."""
        return len({o.compat_class for o in self.stages}) > 1


def choose_route(offers: Iterable[StageOffer], model_sha256: str | None = None, allow_mixed: bool = False) -> Route:
    """The best complete route among OFFERS, with the reasons the others are kept out;
    MeshnetError(route_incomplete) when there is none, saying why."""
    offers = list(offers)
    kept_out: dict[str, str] = {}
    if model_sha256 is not None:
        for o in offers:
            if o.model_sha256 != model_sha256:
                kept_out[o.worker] = f"hash mismatch: it serves model {o.model_sha256[:12]}, not {model_sha256[:12]}"
        offers = [o for o in offers if o.model_sha256 == model_sha256]
    if not offers:
        raise MeshnetError(ROUTE_INCOMPLETE, "no worker has registered" + (f" for model {model_sha256[:12]}" if model_sha256 else ""))

    # the pools a route may be drawn from: one per class, or with allow_mixed one per
    # model shape (a model of another shape cannot continue the residual) and numerics
    # class (a route of both would give neither class's output)
    def pool_of(o: StageOffer):
        return (o.n_layer, o.n_embd, o.compat_class.numerics) if allow_mixed else o.compat_class

    pools: dict[object, list[StageOffer]] = {}
    for o in offers:
        pools.setdefault(pool_of(o), []).append(o)
    candidates = [(key, route) for key, pool in pools.items() if (route := _best_chain(pool)) is not None]
    if candidates:
        key, stages = min(candidates, key=lambda c: _preference(c[1]))
        route = Route(stages, kept_out)
        reference = stages[0].compat_class
        for o in offers:
            if o.worker in kept_out or o in stages:
                continue
            if pool_of(o) != key:
                kept_out[o.worker] = _class_reason(o, reference, stages[0].worker)
            else:
                kept_out[o.worker] = f"spare: another worker holds {o.label} in the route"
        return route

    # no class makes a route: explain the pool of the earliest registered worker, and
    # why the others cannot help it
    first = min(offers, key=lambda o: o.registered)
    pool = pools[pool_of(first)]
    reasons = [_why_no_route(pool, first.n_layer)]
    others = [o for o in offers if o not in pool]
    if others:
        reasons.append("kept out: " + "; ".join(f"{o.worker} {o.label} ({_class_reason(o, first.compat_class, first.worker)})"
                                               for o in sorted(others, key=lambda o: o.registered)))
    raise MeshnetError(ROUTE_INCOMPLETE, ". ".join(reasons))


def build_route(offers: Iterable[StageOffer], model_sha256: str | None = None, allow_mixed: bool = False) -> list[StageOffer]:
    """Stages whose ranges are disjoint and cover [0, n_layer) exactly, in layer order."""
    return choose_route(offers, model_sha256, allow_mixed).stages


def _class_reason(offer: StageOffer, reference: CompatClass, reference_worker: str) -> str:
    kind = "hash mismatch" if offer.model_sha256 != reference.model_sha256 else "incompatible class"
    return (f"{kind}: its class ({offer.compat_class}) differs from {reference_worker}'s ({reference}): "
            f"{offer.compat_class.differences(reference)}")


def _preference(route: list[StageOffer]) -> tuple:
    return len(route), tuple(o.registered for o in route)


def _best_chain(offers: list[StageOffer]) -> list[StageOffer] | None:
    """The exact cover of [0, n_layer) with the fewest stages, then the earliest
    registered workers (compared in route order); None when there is no cover. Only
    the layers where an offer starts are looked at, so the work grows with the offers,
    never with the layer count a capability claims."""
    n_layer = offers[0].n_layer
    by_start: dict[int, list[StageOffer]] = {}
    for offer in offers:
        by_start.setdefault(offer.start, []).append(offer)
    best: dict[int, list[StageOffer] | None] = {n_layer: []}
    for at in sorted(by_start, reverse=True):   # from the tail back: best[at] covers [at, n_layer)
        chains = [[o, *best[o.end]] for o in by_start[at] if o.end <= n_layer and best.get(o.end) is not None]
        best[at] = min(chains, key=_preference) if chains else None
    return best.get(0)


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


def head_gathers(capabilities: list[Capability]) -> bool:
    """Whether a route's head should gather its sessions' decode steps into one forward
    call: when the stages on the head's machine have more compute threads together than
    it has CPUs, two of them computing at once slow each other down, so the sessions had
    better go round the ring as one group (one stage computing at a time, as in one
    process) than as several groups in different stages at once. Stages on their own
    CPUs (or hosts) pipeline instead."""
    head = capabilities[0]
    beside = [c for c in capabilities if c.clock_id == head.clock_id]
    return len(beside) > 1 and sum(c.n_threads or 1 for c in beside) > (head.n_cpus or 1 << 20)
