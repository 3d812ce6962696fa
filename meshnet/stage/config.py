"""What a worker is started with: the options of `meshnet worker`, as one dataclass, and
the command line that starts a worker with them (for the processes meshnet spawns
itself: local clusters, `--layers auto` workers)."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from meshnet.core import defaults
from meshnet.core import kv_cache
from meshnet.core import numerics as numerics_classes
from meshnet.net.heartbeat import HEARTBEAT_INTERVAL, HEARTBEAT_LIVENESS
from meshnet.net.security import KeyPair

MAX_QUEUE = 16                      # steps waiting on the stage before "busy": at least this, and two per session
DATA_BIND = "tcp://127.0.0.1:0"     # the data endpoint: loopback unless told otherwise
SPIN_MS = 50.0                      # how long a stage with cores of its own polls for its next input (see spin_ms_for)
THREAD_POLL = 50                    # ... and its compute threads for the next forward pass (llama.cpp's default)


def spin_ms_for(n_threads: int, n_cpus: int) -> float:
    """How long a stage polls for its next input before it sleeps, unless told: SPIN_MS when
    its threads use at most half the CPUs it may run on, so that the CPU it spins on is one
    no stage beside it computes on (two one-thread stages on two cores), else 0.
    Waking a sleeping CPU took 100-300 us per hop on the VMs measured (meshnet bench
    --trace); a stage that polls has its input at once, at the price of a busy core while
    it waits, and only while it decodes (it sleeps once no input came for SPIN_MS)."""
    return SPIN_MS if 0 < n_threads and 2 * n_threads <= n_cpus else 0.0


def given(**options) -> dict:
    """The options a caller set (not None): the others keep WorkerConfig's defaults."""
    return {name: value for name, value in options.items() if value is not None}


@dataclass
class WorkerConfig:
    coordinator: str
    model_path: str
    layers: tuple[int, int] | None         # None: --layers auto, the coordinator's planner assigns a range
    model_sha256: str | None = None        # checked against the file by `meshnet worker` (models.resolve)
    n_ctx: int = defaults.N_CTX
    max_sessions: int = defaults.LIBRARY_SESSIONS   # (meshnet worker's own defaults: cli/mesh.py)
    kv_pool: int = 0                       # cells of one KV pool the sessions share (0: n_ctx cells per session)
    kv_pool_floor: int = 0                 # > 0: the pool may shrink to this to fit --mem (meshnet worker's default pool)
    n_batch: int = defaults.N_BATCH
    n_threads: int = 0
    max_queue: int | None = None           # None: max_queue_for(its sessions)
    data_bind: str = DATA_BIND
    cpu: int | None = None                 # the CPU of the data path (stage loop + ZeroMQ I/O thread)
    mem: int | None = None                 # bytes this worker admits (--mem); with layers None, the planner's budget
    keys: KeyPair | None = None            # this worker's CURVE keys: the control link is encrypted and authenticated
    coordinator_key: bytes | None = None   # ... to the coordinator holding this public key
    heartbeat_interval: float = HEARTBEAT_INTERVAL
    heartbeat_liveness: int = HEARTBEAT_LIVENESS
    gpu: bool = False                      # all the stage's layers on the first GPU (the GPU engine, make GPU=cuda)
    numerics: str | None = None            # the numerics class (meshnet/core/numerics.py); None: the default for gpu
    flash_attn: bool = False               # llama.cpp's flash-attention kernels: a compatibility class of their own
    kv_type: str = kv_cache.DEFAULT        # the KV cache's element types (core/kv_cache.py): part of the class too
    trace: str | None = None               # a file the worker writes its per-token spans to when it stops (core/trace.py)
    spin_ms: float | None = None           # polling for the next input before sleeping; None: spin_ms_for
    prefix_cache_mib: int = defaults.PREFIX_CACHE_MIB   # the prefix store's cap (stage/prefix_store.py); 0: none
    # weights over the mesh (meshnet worker --join): without the model file, the fetch that
    # brings a range's bytes before it loads (weights/fetch.Fetch); with it, the endpoint
    # where this process serves the file's bytes to the others (weights/holder.Holder)
    fetch: object | None = None
    weights: str | None = None
    group: object | None = None            # --tp 0/2: this worker leads a tensor-parallel group (tp_member.GroupOptions)

    def max_queue_for(self, n_sessions: int) -> int:
        """Steps that may wait on the stage before it answers "busy": as given, else room
        for each session's prompt chunk and decode step at once, so that every session the
        stage holds can be under way (a burst of them opening together is no error)."""
        return self.max_queue if self.max_queue is not None else max(MAX_QUEUE, 2 * n_sessions)

    def spin_ms_on(self, n_cpus: int) -> float:
        """The polling this worker does for its next input, on N_CPUS CPUs."""
        return self.spin_ms if self.spin_ms is not None else spin_ms_for(self.n_threads or n_cpus, n_cpus)

    def thread_poll_on(self, n_cpus: int) -> int:
        """Its compute threads' polling for the next forward pass: where the worker polls for
        its input, on cores no stage beside it computes on, its threads poll too."""
        return THREAD_POLL if self.spin_ms_on(n_cpus) > 0 else 0

    @property
    def numerics_class(self) -> str:
        return self.numerics or numerics_classes.default_for(self.gpu)

    def to_argv(self, key_files: tuple[str, str] | None = None) -> list[str]:
        """`python -m meshnet.cli.main worker ...` with these options (KEY_FILES: this
        worker's secret key file and the coordinator's public one, which stand for keys
        and coordinator_key on a command line). A test holds it against the CLI's parse."""
        layers = "auto" if self.layers is None else f"{self.layers[0]}:{self.layers[1]}"
        argv = [sys.executable, "-m", "meshnet.cli.main", "worker", "--coordinator", self.coordinator,
                "--model", str(self.model_path), "--layers", layers, "--threads", str(self.n_threads),
                "--ctx", str(self.n_ctx), "--max-sessions", str(self.max_sessions)]
        optional = {"--mem": self.mem, "--cpu": self.cpu, "--numerics": self.numerics, "--trace": self.trace,
                    # (a pool that may shrink to --mem is the worker's default: no --kv-pool)
                    "--kv-pool": None if self.kv_pool_floor else self.kv_pool,
                    "--spin-ms": self.spin_ms,
                    "--prefix-cache": self.prefix_cache_mib if self.prefix_cache_mib != defaults.PREFIX_CACHE_MIB
                    else None,
                    "--max-queue": self.max_queue,
                    "--data-bind": self.data_bind if self.data_bind != DATA_BIND else None,
                    "--heartbeat-interval": self.heartbeat_interval if self.heartbeat_interval != HEARTBEAT_INTERVAL
                    else None,
                    "--heartbeat-liveness": self.heartbeat_liveness if self.heartbeat_liveness != HEARTBEAT_LIVENESS
                    else None}
        for flag, value in optional.items():
            if value is not None:
                argv += [flag, str(value)]
        if self.gpu:
            argv.append("--gpu")
        if self.flash_attn:
            argv.append("--flash-attn")
        if self.kv_type != kv_cache.DEFAULT:
            argv += ["--kv-type", self.kv_type]
        if key_files is not None:
            argv += ["--secret", str(key_files[0]), "--coordinator-key", str(key_files[1])]
        return argv
