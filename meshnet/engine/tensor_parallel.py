"""A tensor-parallel group in one process: N member stages of the same layers, each holding
its share of every layer's heads and rows (engine_c/patches/0019), each computing on a
thread of its own and gathering the group's rows through memory. Every member computes
the whole model's values bit for bit, so the group answers with its first member's output.

This is the group's exactness and its tests; members in other processes and on other hosts
exchange their rows over the network instead (the same gather, another transport)."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

import numpy as np

from meshnet.core import errors
from meshnet.core.errors import MeshnetError
from meshnet.engine.binding import Entry, Output, Stage

GATHER_TIMEOUT_S = 60.0   # a member that does not reach a gather by then has failed


class LocalExchange:
    """The gathers of N members in one process. Each member copies its rows into this
    gather's slot and takes the others' once all are there: one wait a gather. The slots
    alternate between two sets: a member can be one gather ahead of the slowest, never two
    (it cannot pass the next gather until the slowest has arrived there, after reading)."""

    def __init__(self, size: int, timeout: float = GATHER_TIMEOUT_S):
        self.size, self.timeout = size, timeout
        self.slots: list[list[tuple[int, int, int, np.ndarray] | None]] = [[None] * size, [None] * size]
        self.arrived = [0, 0]
        self.generation = [0] * size       # each member's count of gathers
        self.broken: str | None = None
        self.cond = threading.Condition()

    def gather_for(self, rank: int):
        def gather(layer: int, point: int, local: np.ndarray, offset: int, whole: np.ndarray) -> None:
            g = self.generation[rank]
            side = g % 2
            with self.cond:
                if self.broken:
                    raise MeshnetError(errors.TP_EXCHANGE, self.broken)
                self.slots[side][rank] = (layer, point, offset, local.copy())
                self.arrived[side] += 1
                if self.arrived[side] == self.size:
                    self.cond.notify_all()
                elif not self.cond.wait_for(lambda: self.broken or self.arrived[side] >= self.size, self.timeout):
                    self.break_(f"member {rank} waited {self.timeout:.0f} s at layer {layer}'s gather {point} "
                                "for the group's other members")
                if self.broken:
                    raise MeshnetError(errors.TP_EXCHANGE, self.broken)
                parts = list(self.slots[side])
            for peer, (peer_layer, peer_point, peer_offset, rows) in enumerate(parts):
                if (peer_layer, peer_point) != (layer, point):
                    self.break_(f"member {peer} gathered layer {peer_layer}'s point {peer_point} where member "
                                f"{rank} gathered layer {layer}'s point {point}: the group's passes differ")
                    raise MeshnetError(errors.TP_EXCHANGE, self.broken)
                whole[:, peer_offset:peer_offset + rows.shape[1]] = rows
            self.generation[rank] = g + 1
            with self.cond:
                # the slot set is free again once every member has read it: the last reset
                # it before anyone can reach it two gathers on
                self.arrived[side] += 1
                if self.arrived[side] == 2 * self.size:
                    self.arrived[side] = 0
                    self.slots[side] = [None] * self.size
                    self.cond.notify_all()
        return gather

    def reset(self) -> None:
        """Fresh slots and counts, the break forgotten: only while no member is in a gather."""
        with self.cond:
            self.slots = [[None] * self.size, [None] * self.size]
            self.arrived = [0, 0]
            self.generation = [0] * self.size
            self.broken = None

    def break_(self, why: str) -> None:
        """Every member waiting, or arriving later, fails with WHY (a member lost)."""
        with self.cond:
            self.broken = self.broken or why
            self.cond.notify_all()


class LocalGroup:
    """N members of LAYERS of MODEL_PATH (None: the whole model), each a Stage with its own
    threads (STAGE_OPTIONS as Stage takes them), run side by side: forward() gives member
    0's output, which every member's equals."""

    def __init__(self, model_path: str | os.PathLike, size: int, layers=None, **stage_options):
        if size < 2:
            raise MeshnetError(errors.INVALID_ARGUMENT, f"a tensor-parallel group has 2 or more members, not {size}")
        self.exchange = LocalExchange(size)
        self.members: list[Stage] = []
        try:
            for rank in range(size):
                self.members.append(Stage(model_path, layers, tp=(rank, size),
                                          tp_gather=self.exchange.gather_for(rank), **stage_options))
        except BaseException:
            self.close()
            raise
        self.pool = ThreadPoolExecutor(size, thread_name_prefix="meshnet-tp")

    def _all(self, call) -> list:
        futures = [self.pool.submit(call, member) for member in self.members]
        done, pending = wait(futures, return_when=FIRST_EXCEPTION)
        failed = next((f.exception() for f in futures if f.done() and f.exception() is not None), None)
        if failed is not None:
            # the others must not wait out their gathers for a member that has failed
            self.exchange.break_(f"a member failed: {failed}")
        wait(pending)
        if failed is not None:
            # no member is in a gather now: the next call starts the exchange afresh (each
            # member's engine drops what the failed pass left in its sessions)
            self.exchange.reset()
            raise failed
        return [f.result() for f in futures]

    def forward(self, entries: Sequence[Entry], want_logits: bool = True) -> Output:
        return self._all(lambda m: m.forward(entries, want_logits))[0]

    def open_session(self, session_id: int) -> None:
        self._all(lambda m: m.open_session(session_id))

    def release_session(self, session_id: int) -> None:
        self._all(lambda m: m.release_session(session_id))

    def truncate_session(self, session_id: int, n_keep: int) -> None:
        self._all(lambda m: m.truncate_session(session_id, n_keep))

    def info(self):
        return self.members[0].info()

    def close(self) -> None:
        for member in self.members:
            member.close()
        if getattr(self, "pool", None) is not None:
            self.pool.shutdown(wait=True)

    def __enter__(self) -> "LocalGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
