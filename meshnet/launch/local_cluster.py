"""Stage workers as child processes of this one, with a coordinator in this process:
what `meshnet run`, the tests and the benchmarks use to build a route on one machine.
Children die with their parent (PR_SET_PDEATHSIG), so nothing outlives a crash or Ctrl-C.
While the route forms, the children are watched: one that exits, or is stopped, is
reported at once with its exit status and the last lines it wrote to stderr, instead of
a wait for a route that cannot form.
"""

from __future__ import annotations

import collections
import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

from meshnet.core import defaults
from meshnet.core import errors
from meshnet.core import kv_cache
from meshnet.core import numerics as numerics_classes
from meshnet.core.errors import MeshnetError
from meshnet.core.layers import LayerRange
from meshnet.launch.progress import load_bars
from meshnet.launch.supervisor import SUPERVISED_RESUME_WAIT, Supervisor
from meshnet.route.config import CoordinatorConfig
from meshnet.route.coordinator import Coordinator
from meshnet.stage.config import WorkerConfig, given

PR_SET_PDEATHSIG = 1
STOPPED_GRACE = 2.0     # seconds a child may stay stopped (SIGSTOP) while the route forms
STDERR_TAIL_LINES = 12
ALL_IN_GRACE = 2.0      # seconds every worker may be registered without a route forming
BARS_EVERY_S = 0.5      # how often the load bars are asked for
PROGRESS_LINE = "meshnet worker: loading layers"   # a worker's own line of its load's progress


def _worker_child() -> None:
    """In a local worker, before exec: it dies with its parent, and a Ctrl-C in the
    terminal (sent to the whole foreground process group) is the parent's to act on: an
    interrupted chat answer must not take the workers with it, and the parent stops them
    itself (SIGTERM) when it ends. An ignored signal stays ignored across exec."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: the finally-blocks of LocalCluster still stop the children


class StderrTail(threading.Thread):
    """Passes a child's stderr through to ours, keeping its last lines for an error report."""

    def __init__(self, stream, echo: bool, hidden: str | None = None):
        super().__init__(name="meshnet-worker-stderr", daemon=True)
        self.stream, self.echo, self.hidden = stream, echo, hidden   # HIDDEN: lines with it are kept, not echoed
        self.lines: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        self.start()

    def run(self) -> None:
        for raw in iter(self.stream.readline, b""):
            line = raw.decode(errors="replace")
            self.lines.append(line.rstrip("\n"))
            if self.echo and not (self.hidden and self.hidden in line):
                sys.stderr.write(line)
                sys.stderr.flush()

    def text(self) -> str:
        self.join(timeout=1)  # an exited child's last words may still be in the pipe
        return "\n".join(self.lines)


class BarsShown:
    """The load bars (launch/progress.py) given to PROGRESS: each stage's, when it has
    moved."""

    def __init__(self, coordinator: Coordinator, progress: Callable[[str], None]):
        self.coordinator, self.progress = coordinator, progress
        self.shown: list[str] = []
        self.asked = 0.0

    def update(self) -> None:
        if time.monotonic() - self.asked < BARS_EVERY_S or not any(
                str(state).startswith("loading") for state in self.coordinator.route_report()["standby"].values()):
            return
        self.asked = time.monotonic()
        try:
            bars = load_bars(self.coordinator.metrics(timeout=1))
        except (MeshnetError, TimeoutError):
            return   # (a figure late is not a reason to stop waiting for the route)
        moved = [bar for bar in bars if bar not in self.shown]
        if moved:
            self.progress("\n".join(moved))
        self.shown = bars


def children_of(pid: int) -> list[int]:
    """The pids whose parent is pid, from /proc: how tests and tools find a run's workers."""
    children = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:  # the field after the state
                        children.append(int(name))
            except (OSError, ValueError, IndexError):
                pass
    return children


def _process_state(pid: int) -> str | None:
    """The kernel's one-letter state of a process (T: stopped), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _say(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with status {returncode}"


def start_auto_worker(coordinator: str, model_path: str, mem: int, *, threads: int = 0, n_ctx: int = defaults.N_CTX,
                      max_sessions: int = defaults.LIBRARY_SESSIONS, extra: Sequence[str] = ()) -> subprocess.Popen:
    """A `--layers auto` worker child: the coordinator's planner gives it its range."""
    args = WorkerConfig(coordinator, str(model_path), None, mem=mem, n_threads=threads, n_ctx=n_ctx,
                        max_sessions=max_sessions).to_argv() + list(extra)
    return subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, preexec_fn=_worker_child)


def _layer_range(layers: LayerRange | tuple[int, int]) -> LayerRange:
    return layers if isinstance(layers, LayerRange) else LayerRange(*layers)


class LocalCluster:
    def __init__(
        self,
        model_path: str | Path,
        ranges: Sequence[LayerRange | tuple[int, int]],
        *,
        threads: int = 0,
        n_ctx: int = defaults.N_CTX,
        max_sessions: int = defaults.LIBRARY_SESSIONS,
        kv_pool: int = 0,
        max_queue: int | None = None,
        heartbeat_interval: float | None = None,
        heartbeat_liveness: int | None = None,
        worker_log: str | None = None,
        pin_cpus: bool = True,
        secure: bool = True,
        gpu_stages: Sequence[int] = (),
        numerics: str | None = None,
        flash_attn: bool = False,
        kv_type: str = kv_cache.DEFAULT,
        trace_dir: str | None = None,
        prefix_cache_mib: int | None = None,
        progress: Callable[[str], None] | None = None,
        supervise: bool = False,
        **coordinator_options,
    ):
        self.model_path = str(model_path)
        self.ranges = [_layer_range(r) for r in ranges]
        # one class for the whole route, a GPU stage's or not (a GPU runs stock)
        self.numerics = numerics or numerics_classes.default_for(bool(gpu_stages))
        self.worker_options = dict(n_threads=threads, n_ctx=n_ctx, max_sessions=max_sessions, kv_pool=kv_pool,
                                   numerics=self.numerics, flash_attn=flash_attn, kv_type=kv_type,
                                   **given(max_queue=max_queue, heartbeat_interval=heartbeat_interval,
                                           heartbeat_liveness=heartbeat_liveness, prefix_cache_mib=prefix_cache_mib))
        if heartbeat_interval is not None:
            coordinator_options["heartbeat_interval"] = heartbeat_interval
        if heartbeat_liveness is not None:
            coordinator_options["heartbeat_liveness"] = heartbeat_liveness
        self.worker_log = worker_log
        # where a bar per stage loading its range goes while the route forms (the workers'
        # own lines of it are then not echoed)
        self.progress = progress
        # tracing: each worker writes its spans to stage-I.json here when it stops, the coordinator keeps its own
        self.trace_dir = trace_dir
        if trace_dir is not None:
            coordinator_options["trace"] = True
        self.gpu_stages = set(gpu_stages)   # route positions whose worker runs on the GPU (worker --gpu)
        # fresh CURVE keys for this run: the coordinator's, one per worker, all in a private
        # directory that goes with the cluster
        self.keys_dir = None
        if secure:
            from meshnet.net import security

            self.keys_dir = tempfile.TemporaryDirectory(prefix="meshnet-keys-")
            keys = Path(self.keys_dir.name)
            security.generate(keys, "coordinator")
            for i in range(len(ranges)):
                security.generate(keys / "allowed", f"worker-{i}")
            coordinator_options["keys"] = security.load_secret(keys / "coordinator.key_secret")
            coordinator_options["allowed_workers"] = security.load_allowed(keys / "allowed")
        # each stage's data path on its own CPU (stage i on CPU i, round the machine's CPUs)
        self.pin_cpus = pin_cpus and len(os.sched_getaffinity(0)) > 1
        tail_cpu = self._cpu_of(len(self.ranges) - 1)
        if self.pin_cpus and tail_cpu != self._cpu_of(0):
            # a token reaches the coordinator as the tail ends its forward and the head starts
            # the next one: on the head's CPU its handling would delay that forward
            coordinator_options.setdefault("cpu", tail_cpu)
        # a worker that dies is started again (supervise: what serve, run and chat ask for),
        # and its sessions wait for it by default
        self.supervise = supervise
        self.supervisor: Supervisor | None = None
        if coordinator_options.get("resume_wait") is None:
            coordinator_options["resume_wait"] = SUPERVISED_RESUME_WAIT if supervise else 0.0
        drift_meter = coordinator_options.pop("drift_meter", None)
        self.coordinator = Coordinator(CoordinatorConfig(**coordinator_options), drift_meter=drift_meter)
        # keyed by the plain (start, end), so a test can say processes[(0, 15)]
        self.processes: dict[tuple[int, int], subprocess.Popen] = {}
        self.stderr_tails: dict[tuple[int, int], StderrTail] = {}

    @staticmethod
    def _cpu_of(index: int) -> int:
        cpus = sorted(os.sched_getaffinity(0))
        return cpus[index % len(cpus)]

    def spawn_worker(self, layers: LayerRange | tuple[int, int]) -> subprocess.Popen:
        """A worker process for this range (a spare, when one holds it already). It dies
        with the thread that calls this (Linux's parent-death signal is per thread): call
        it from one that lives as long as the cluster."""
        layers = _layer_range(layers)
        start, end = layers
        index = next((i for i, r in enumerate(self.ranges) if r.as_tuple() == layers.as_tuple()), 0)
        config = WorkerConfig(self.coordinator.endpoint, self.model_path, (start, end), **self.worker_options,
                              cpu=self._cpu_of(index) if self.pin_cpus else None, gpu=index in self.gpu_stages,
                              trace=os.path.join(self.trace_dir, f"stage-{index}.json") if self.trace_dir else None)
        key_files = None
        if self.keys_dir is not None:
            keys = Path(self.keys_dir.name)
            key_files = (keys / "allowed" / f"worker-{index}.key_secret", keys / "coordinator.key")
        args = config.to_argv(key_files)
        log = open(self.worker_log, "ab") if self.worker_log else subprocess.DEVNULL
        process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log,
                                   stderr=log if self.worker_log else subprocess.PIPE, preexec_fn=_worker_child)
        self.processes[layers.as_tuple()] = process
        if not self.worker_log:
            self.stderr_tails[layers.as_tuple()] = StderrTail(process.stderr, echo=True,
                                                              hidden=PROGRESS_LINE if self.progress else None)
        return process

    def wait_offered(self, process: subprocess.Popen, timeout: float = 60.0) -> None:
        """Until PROCESS (a worker spawn_worker started) offers its range to the
        coordinator: it registers as soon as it connects, and offers the range once it has
        loaded it."""
        deadline = time.monotonic() + timeout
        while not any(w.get("pid") == process.pid and "layers" in w for w in self.coordinator.workers_snapshot()):
            if process.poll() is not None:
                raise MeshnetError(errors.WORKER_EXITED, f"the worker (pid {process.pid}) "
                                   f"{_describe_exit(process.returncode)} before it offered its range")
            if time.monotonic() > deadline:
                raise MeshnetError(errors.TIMEOUT, f"the worker (pid {process.pid}) did not offer its range "
                                   f"within {timeout:g} s")
            time.sleep(0.05)

    def start(self, timeout: float = 120.0) -> "LocalCluster":
        try:
            for layers in self.ranges:
                self.spawn_worker(layers)
            deadline = time.monotonic() + timeout
            stopped_since: dict[tuple[int, int], float] = {}
            all_in_since = None
            bars = BarsShown(self.coordinator, self.progress) if self.progress else None
            while True:
                self._check_children(stopped_since)
                if bars is not None:
                    bars.update()
                try:
                    self.coordinator.wait_for_route(0.2, n_stages=len(self.ranges))
                    if self.supervise:
                        self.supervisor = Supervisor(self.processes, self.spawn_worker, _describe_exit, _say)
                        self.supervisor.start()
                    return self
                except MeshnetError:
                    if time.monotonic() > deadline:
                        raise
                    # every child has registered its range and still there is no route (a
                    # worker of another class, without allow_mixed): nobody else is coming
                    if len([w for w in self.coordinator.workers_snapshot() if "layers" in w]) >= len(self.ranges):
                        all_in_since = all_in_since or time.monotonic()
                        if time.monotonic() - all_in_since > ALL_IN_GRACE:
                            raise
                    else:
                        all_in_since = None
        except BaseException:
            self.close()
            raise

    def _check_children(self, stopped_since: dict) -> None:
        """Raise at once for a child that can no longer join the route."""
        for layers, process in self.processes.items():
            label = LayerRange(*layers).label
            if process.poll() is not None:
                raise MeshnetError(errors.WORKER_EXITED, f"the worker for layers {label} {_describe_exit(process.returncode)} "
                                   f"before the route formed{self._tail_of(layers)}", stage=label,
                                   exit_status=process.returncode)
            if _process_state(process.pid) == "T":
                since = stopped_since.setdefault(layers, time.monotonic())
                if time.monotonic() - since > STOPPED_GRACE:
                    raise MeshnetError(errors.WORKER_EXITED, f"the worker for layers {label} (pid {process.pid}) has been "
                                       f"stopped for {STOPPED_GRACE:g} s before the route formed (SIGSTOP?)",
                                       stage=label)
            else:
                stopped_since.pop(layers, None)

    def _tail_of(self, layers: tuple[int, int]) -> str:
        if layers in self.stderr_tails:
            text = self.stderr_tails[layers].text()
        elif self.worker_log:
            text = "\n".join(Path(self.worker_log).read_text(errors="replace").splitlines()[-STDERR_TAIL_LINES:])
        else:
            text = ""
        return f"; its last words:\n{text}" if text.strip() else "; it wrote nothing to stderr"

    def close(self) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()
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
        if self.keys_dir is not None:
            self.keys_dir.cleanup()

    def __enter__(self):
        return self if self.processes else self.start()   # started already: `with cluster.start() as c`

    def __exit__(self, *exc):
        self.close()
