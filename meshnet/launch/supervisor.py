"""Keeps a local route's workers running: `meshnet serve`, `run` and `chat` start their
stage workers themselves, so a worker that dies (a crash, the OOM killer, a SIGKILL) is
theirs to start again. The coordinator replays the sessions it had in flight onto the new
worker within its resume wait, token for token, as it does for any replacement.

Restarts back off (RESTART_DELAY_S, doubling up to RESTART_DELAY_MAX_S) and are bounded:
a stage that died MAX_RESTARTS times, each within STABLE_AFTER_S of its start, is left
down, and said so, rather than restarted in a loop."""

from __future__ import annotations

import threading
import time
from typing import Callable

RESTART_DELAY_S = 0.25
RESTART_DELAY_MAX_S = 8.0
MAX_RESTARTS = 5
STABLE_AFTER_S = 60.0    # a worker up this long has recovered: its count starts again
POLL_S = 0.1
# seconds the sessions of a worker that died wait for it to be back (the coordinator's
# resume wait, where no other is given): a stage's load and more
SUPERVISED_RESUME_WAIT = 30.0


class Supervisor(threading.Thread):
    """Watches the processes of a LocalCluster (a dict of range -> Popen, changed only by
    this thread once started) and starts a dead one again with SPAWN(range). It runs in its
    own thread for the cluster's life: the workers it starts die with the thread that
    started them (Linux's parent-death signal), and this one ends only at close."""

    def __init__(self, processes: dict, spawn: Callable, describe: Callable[[int], str],
                 say: Callable[[str], None]):
        super().__init__(name="meshnet-supervisor", daemon=True)
        self.processes, self.spawn, self.describe, self.say = processes, spawn, describe, say
        self.restarts: dict = {}          # range -> restarts in a row (each died before STABLE_AFTER_S)
        self.started_at = {layers: time.monotonic() for layers in processes}
        self.given_up: set = set()
        self.stopping = threading.Event()
        self.restarted = 0                # restarts in all, for the metrics

    def stop(self) -> None:
        """Before the cluster stops its workers: their exits are no longer failures."""
        self.stopping.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=5)

    def run(self) -> None:
        while not self.stopping.wait(POLL_S):
            for layers, process in list(self.processes.items()):
                if process.poll() is not None and layers not in self.given_up:
                    self._restart(layers, process)

    def _restart(self, layers, process) -> None:
        label = f"{layers[0]}:{layers[1]}"
        if time.monotonic() - self.started_at.get(layers, 0.0) > STABLE_AFTER_S:
            self.restarts[layers] = 0
        count = self.restarts.get(layers, 0)
        if count >= MAX_RESTARTS:
            self.given_up.add(layers)
            self.say(f"meshnet: the worker for layers {label} {self.describe(process.returncode)} again; it died "
                     f"{MAX_RESTARTS} times within {STABLE_AFTER_S:g} s of starting, so it is left down "
                     f"(see its last lines above)")
            return
        delay = min(RESTART_DELAY_S * 2 ** count, RESTART_DELAY_MAX_S)
        self.say(f"meshnet: the worker for layers {label} {self.describe(process.returncode)}; starting it again "
                 f"in {delay:g} s ({count + 1} of at most {MAX_RESTARTS})")
        if self.stopping.wait(delay):
            return
        self.restarts[layers] = count + 1
        self.started_at[layers] = time.monotonic()
        self.spawn(layers)
        self.restarted += 1
