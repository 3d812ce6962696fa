"""The registry of stage workers, a plain table: who is registered, what each offers or
is loading, what was measured about it, and the route the tracker chooses among them.

No socket or thread: the I/O loop (io_loop.py) feeds it what the workers said and
carries out what it decides (refusals, losses), and the session table asks it for
routes."""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass, field

from meshnet.core.errors import MeshnetError
from meshnet.core.layers import LayerRange
from meshnet.net.capability import Capability
from meshnet.net.heartbeat import Liveness
from meshnet.route.tracker import Route, StageOffer, choose_route, offer_from_capability, shape_disagreement


@dataclass(eq=False)   # a worker is itself: two records are never equal
class WorkerRecord:
    identity: bytes
    name: str
    capability: Capability
    offer: StageOffer | None     # None: holds nothing yet (--layers auto, or loading its range)
    liveness: Liveness
    assigning: LayerRange | None = None   # the range it is loading (told to, or started for) and has not offered
    public_key: str | None = None         # its CURVE key, as the handshake proved it (None without CURVE)
    assign_failed: str | None = None      # why loading its range failed: it is not planned for again
    epoch: int = 0                        # its READY's: a higher one says it dropped its sessions
    unreachable: bool = False             # a send to it found its connection gone: the next clock pass loses it
    # measured here: hop = round trip minus the worker's own time (its two timestamps)
    hops_us: collections.deque = field(default_factory=lambda: collections.deque(maxlen=10_000))
    seam_bytes: int = 0
    replies: int = 0
    errors: collections.Counter = field(default_factory=collections.Counter)

    @property
    def label(self) -> str:
        if self.offer is not None:
            return self.offer.label
        return f"loading {self.assigning.label}" if self.assigning else "standby"

    @property
    def standby_state(self) -> str:
        return self.label + (f" (failed: {self.assign_failed})" if self.assign_failed else "")

    @property
    def layer_order(self) -> tuple:
        return (0, self.offer.start, self.offer.end) if self.offer else (1, 0, 0)


@dataclass(frozen=True)
class Admission:
    """What a READY means for the registry: `again` (the same worker saying it again;
    `dropped` when its epoch says it dropped its sessions), `refused` (`why` for the
    worker, `detail` for the coordinator's log), or `new`, after the workers in `lose`
    (each with why) are lost."""

    outcome: str
    why: str | None = None
    detail: str | None = None
    dropped: bool = False
    lose: tuple[tuple[WorkerRecord, str], ...] = ()


class Registry:
    def __init__(self, *, allow_mixed: bool = False):
        self.allow_mixed = allow_mixed      # let workers of other classes into a route
        self.workers: dict[bytes, WorkerRecord] = {}
        self.plan_note: str | None = None   # why the standby workers were not given ranges
        self._order = itertools.count()

    def get(self, identity: bytes) -> WorkerRecord | None:
        return self.workers.get(identity)

    def __contains__(self, identity: bytes) -> bool:
        return identity in self.workers

    def all(self) -> list[WorkerRecord]:
        return list(self.workers.values())

    def in_layer_order(self) -> list[WorkerRecord]:
        return sorted(self.workers.values(), key=lambda w: w.layer_order)

    def standby(self) -> list[WorkerRecord]:
        return [w for w in self.workers.values() if w.offer is None]

    def admit(self, identity: bytes, capability: Capability, epoch: int) -> Admission:
        """What to do with a READY (its capability checked field by field already)."""
        current = self.workers.get(identity)
        if current is not None and current.capability == capability:
            current.liveness.heard()
            dropped = epoch > current.epoch
            current.epoch = max(epoch, current.epoch)
            return Admission("again", dropped=dropped)
        known = next((w for w in self.workers.values() if w.identity != identity
                      and w.capability.model_sha256 == capability.model_sha256), None)
        why = known and shape_disagreement(capability, known.capability)
        if why:
            # not a worker of that model file, whatever hash it names: nothing it claims is used
            return Admission("refused", why=why, detail=f"it claims model {capability.model_sha256[:12]} but "
                                                        f"{why} (as worker {known.name} serves it)")
        lose = []
        if current is not None and current.offer is None and capability.holds_layers:
            del self.workers[identity]   # a standby worker offering the range it loaded: it had no sessions
        elif current is not None:  # this connection now offers something else: what it offered is gone
            lose.append((current, "announced a different capability"))
        # the worker process connected again: its old connection is dead, whatever it still delivers
        lose += [(w, "connected again") for w in self.workers.values()
                 if w.capability.worker_id == capability.worker_id and w is not current]
        return Admission("new", lose=tuple(lose))

    def add(self, identity: bytes, capability: Capability, liveness: Liveness, public_key: str | None,
            epoch: int) -> WorkerRecord:
        # the worker process's id and this connection's: readable, and unique among the registered
        name = f"{capability.worker_id[:8]}.{identity.hex()[-4:]}"
        order = next(self._order)
        offer = offer_from_capability(name, capability, order) if capability.holds_layers else None
        record = self.workers[identity] = WorkerRecord(
            identity, name, capability, offer, liveness, public_key=public_key, epoch=epoch,
            assigning=LayerRange(*capability.loading) if capability.loading else None)
        return record

    def remove(self, identity: bytes) -> WorkerRecord | None:
        return self.workers.pop(identity, None)

    def choose(self, numerics_class: str | None = None) -> Route:
        """The tracker's choice among the registered ranges (of NUMERICS_CLASS only, when
        given); without one, the refusal also names the --layers auto workers and what
        their plan waits for."""
        try:
            return choose_route([w.offer for w in self.workers.values() if w.offer is not None
                                 and not w.unreachable
                                 and numerics_class in (None, w.offer.compat_class.numerics)],
                                allow_mixed=self.allow_mixed)
        except MeshnetError as e:
            waiting = self.standby()
            if not waiting:
                raise
            raise MeshnetError(e.code, f"{e.message}; {len(waiting)} worker(s) without a range yet: "
                               + ", ".join(f"{w.name} {w.standby_state}" for w in waiting)
                               + (f"; {self.plan_note}" if self.plan_note else "")) from None

    def route(self, numerics_class: str | None = None) -> list[WorkerRecord]:
        """The route's workers; with NUMERICS_CLASS, of that class only (a session that
        resumes keeps the kernels it ran with: on the other class its tokens would be
        neither's)."""
        by_name = {w.name: w for w in self.workers.values()}
        return [by_name[o.worker] for o in self.choose(numerics_class).stages]

    def report(self) -> dict:
        """The route (or why there is none) and why each registered worker is not in it."""
        try:
            chosen = self.choose()
            result = {"route": [f"{o.label}@{o.worker}" for o in chosen.stages], "mixed": chosen.mixed,
                      "kept_out": chosen.kept_out}
        except MeshnetError as e:   # the same words a session would get
            result = {"route": None, "error": e.message, "kept_out": {}}
        result["standby"] = {w.name: w.standby_state for w in self.standby()}
        result["plan_note"] = self.plan_note
        return result

    def membership(self) -> tuple[set[str], dict, str | None]:
        """Which workers are in the route, why the others are kept out, and why there is
        no route (None when there is one)."""
        try:
            chosen = self.choose()
            return {o.worker for o in chosen.stages}, chosen.kept_out, None
        except MeshnetError as e:
            return set(), {}, e.message
