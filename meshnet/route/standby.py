"""Planning for workers started with --layers auto: which layers each standby worker
loads, from what the registered workers hold or are loading. A pure function; the I/O
loop sends the ASSIGN requests it decides."""

from __future__ import annotations

from dataclasses import dataclass

from meshnet.core.errors import MeshnetError
from meshnet.core.layers import LayerRange
from meshnet.core.planner import Node, Settings, plan
from meshnet.route.registry import WorkerRecord
from meshnet.route.tracker import compat_class_of


@dataclass(frozen=True)
class Assignment:
    worker: WorkerRecord
    layers: LayerRange
    planned_bytes: int


def plan_standby(workers: list[WorkerRecord], overhead: int) -> tuple[list[Assignment], str | None]:
    """Ranges for the standby workers among WORKERS: for each class they belong to, the
    layers no worker of that class holds or is loading are planned over the standby
    workers of that class, in the order they registered, each as large as its memory
    allows. A gap that does not fit waits for more memory to be announced: the note
    says which (None when nothing waits)."""
    standby = [w for w in workers if w.offer is None and w.assigning is None and not w.assign_failed]
    assignments, notes = [], []
    for cls in dict.fromkeys(compat_class_of(w.capability) for w in standby):
        nodes = [w for w in standby if compat_class_of(w.capability) == cls]
        held = [w for w in workers if compat_class_of(w.capability) == cls]
        cost = nodes[0].capability.cost
        covered = [0] * cost.n_layer
        for w in held:
            r = w.offer.layers if w.offer is not None else w.assigning
            if r is not None:
                covered[r.start:r.end] = [1] * (r.end - r.start)
        for start, end in gaps(covered):
            try:
                result = plan(cost, [Node(w.name, w.capability.mem_bytes,
                                          Settings(w.capability.n_ctx, w.capability.max_sessions,
                                                   w.capability.n_batch, w.capability.kv_pool,
                                                   w.capability.kv_pool_floor)) for w in nodes],
                              overhead, start, end)
            except MeshnetError as e:
                notes.append(f"layers {start}..{end - 1} wait for more memory: {e.message}")
                continue
            by_name = {w.name: w for w in nodes}
            for stage in result.stages:
                worker = by_name[stage.node]
                assignments.append(Assignment(worker, stage.layers, stage.bytes))
                nodes.remove(worker)
    return assignments, "; ".join(notes) or None


def gaps(covered: list[int]) -> list[tuple[int, int]]:
    """The half-open runs of zeros in COVERED: layers no worker holds."""
    runs, start = [], None
    for i, c in enumerate([*covered, 1]):
        if not c and start is None:
            start = i
        elif c and start is not None:
            runs.append((start, i))
            start = None
    return runs
