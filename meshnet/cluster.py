"""Stage workers as child processes of this one, with a coordinator in this process:
what `meshnet run`, the tests and the benchmarks use to build a route on one machine.
Children die with their parent (PR_SET_PDEATHSIG), so nothing outlives a crash or Ctrl-C.
"""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from .coordinator import Coordinator

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: the finally-blocks of LocalCluster still stop the children


class LocalCluster:
    def __init__(
        self,
        model_path: str | Path,
        ranges: Sequence[tuple[int, int]],
        *,
        threads: int = 0,
        n_ctx: int = 2048,
        max_sessions: int = 4,
        max_queue: int | None = None,
        heartbeat_interval: float | None = None,
        heartbeat_liveness: int | None = None,
        worker_log: str | None = None,
        **coordinator_options,
    ):
        self.model_path = str(model_path)
        self.ranges = list(ranges)
        self.worker_options = {"threads": threads, "ctx": n_ctx, "max-sessions": max_sessions, "max-queue": max_queue,
                               "heartbeat-interval": heartbeat_interval, "heartbeat-liveness": heartbeat_liveness}
        if heartbeat_interval is not None:
            coordinator_options["heartbeat_interval"] = heartbeat_interval
        if heartbeat_liveness is not None:
            coordinator_options["heartbeat_liveness"] = heartbeat_liveness
        self.worker_log = worker_log
        self.coordinator = Coordinator(**coordinator_options)
        self.processes: dict[tuple[int, int], subprocess.Popen] = {}

    def spawn_worker(self, layers: tuple[int, int]) -> subprocess.Popen:
        args = [sys.executable, "-m", "meshnet.cli", "worker", "--coordinator", self.coordinator.endpoint,
                "--model", self.model_path, "--layers", f"{layers[0]}:{layers[1]}"]
        for name, value in self.worker_options.items():
            if value is not None:
                args += [f"--{name}", str(value)]
        log = open(self.worker_log, "ab") if self.worker_log else subprocess.DEVNULL
        process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=log if self.worker_log else None,
                                   preexec_fn=_die_with_parent)
        self.processes[layers] = process
        return process

    def start(self, timeout: float = 120.0) -> "LocalCluster":
        try:
            for layers in self.ranges:
                self.spawn_worker(layers)
            self.coordinator.wait_for_route(timeout, n_stages=len(self.ranges))
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                try:
                    process.send_signal(signal.SIGCONT)  # a stopped child cannot handle SIGTERM
                    process.terminate()
                except ProcessLookupError:
                    pass
        for process in self.processes.values():
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.coordinator.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()
