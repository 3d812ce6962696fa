"""The one spelling of a worker's command line: what WorkerConfig.to_argv writes is what
`meshnet worker` parses back into the same options."""

from __future__ import annotations

import pytest

from meshnet.core.layers import LayerRange
from meshnet.stage.config import SPIN_MS, WorkerConfig, spin_ms_for


def parsed(argv: list[str]) -> dict:
    from meshnet.cli.mesh import worker

    assert argv[1:4] == ["-m", "meshnet.cli.main", "worker"]
    return worker.make_context("worker", argv[4:]).params


@pytest.mark.parametrize("config, key_files", [
    (WorkerConfig("tcp://127.0.0.1:5555", "/models/m.gguf", (0, 15)), None),
    (WorkerConfig("tcp://10.0.0.1:5555", "/models/m.gguf", (15, 30), n_ctx=512, max_sessions=3, kv_pool=4096, n_threads=1,
                  max_queue=4, data_bind="tcp://10.0.0.2:7000", cpu=1, heartbeat_interval=0.1,
                  heartbeat_liveness=20, gpu=True, numerics="stock", flash_attn=True, kv_type="q8_0",
                  trace="/tmp/stage-1.json", spin_ms=5.0),
     ("/k/w.key_secret", "/k/c.key")),
    (WorkerConfig("tcp://127.0.0.1:5555", "/models/m.gguf", None, mem=800 << 20, n_threads=2), None),
    # a default pool (that shrinks to --mem) is left to the worker's own default
    (WorkerConfig("tcp://127.0.0.1:5555", "/models/m.gguf", None, mem=800 << 20, kv_pool=16384, kv_pool_floor=8192),
     None),
])
def test_the_command_line_a_config_writes_parses_back_to_the_same_options(config, key_files):
    params = parsed(config.to_argv(key_files))
    layers = params["layers"]
    assert (None if layers is None else LayerRange.as_tuple(layers)) == config.layers
    assert (params["coordinator"], params["model"], params["mem"], params["threads"], params["n_ctx"],
            params["max_sessions"], params["kv_pool"], params["data_bind"], params["cpu"], params["gpu"], params["numerics"],
            params["flash_attn"], params["kv_type"], params["trace"], params["spin_ms"]) == \
        (config.coordinator, config.model_path, config.mem, config.n_threads, config.n_ctx, config.max_sessions,
         None if config.kv_pool_floor else config.kv_pool, config.data_bind, config.cpu, config.gpu, config.numerics,
         config.flash_attn, config.kv_type, config.trace, config.spin_ms)
    # left out where they are the worker's defaults, so that the worker's own default stands
    assert (params["max_queue"] or config.max_queue, params["heartbeat_interval"] or config.heartbeat_interval,
            params["heartbeat_liveness"] or config.heartbeat_liveness) == \
        (config.max_queue, config.heartbeat_interval, config.heartbeat_liveness)
    assert (params["secret_file"], params["coordinator_key_file"]) == (key_files or (None, None))


@pytest.mark.parametrize("n_threads, n_cpus, spins", [
    (1, 2, True),     # two one-thread stages on two cores: the CPU it polls on is its own
    (2, 4, True),
    (2, 2, False),    # all the CPUs: a stage beside it would lose the core it polls on
    (3, 4, False),
    (1, 1, False),
])
def test_a_stage_polls_for_its_next_input_only_where_its_threads_leave_half_the_cpus(n_threads, n_cpus, spins):
    assert spin_ms_for(n_threads, n_cpus) == (SPIN_MS if spins else 0.0)


def test_a_spin_given_is_kept_and_threads_0_means_every_cpu():
    config = WorkerConfig("tcp://127.0.0.1:5555", "/models/m.gguf", (0, 15))
    assert config.spin_ms_on(2) == 0.0   # --threads 0: one per CPU, all of them
    assert WorkerConfig("tcp://127.0.0.1:5555", "/m.gguf", (0, 15), n_threads=1).spin_ms_on(2) == SPIN_MS
    assert WorkerConfig("tcp://127.0.0.1:5555", "/m.gguf", (0, 15), n_threads=1, spin_ms=0.0).spin_ms_on(2) == 0.0
    assert WorkerConfig("tcp://127.0.0.1:5555", "/m.gguf", (0, 15), spin_ms=7.5).spin_ms_on(64) == 7.5


def test_a_stage_s_threads_poll_for_the_next_pass_where_it_polls_for_its_input():
    from meshnet.stage.config import THREAD_POLL

    assert WorkerConfig("tcp://127.0.0.1:5555", "/m.gguf", (0, 15)).thread_poll_on(2) == 0   # every CPU: sleep
    assert WorkerConfig("tcp://127.0.0.1:5555", "/m.gguf", (0, 15), n_threads=1).thread_poll_on(2) == THREAD_POLL
    assert WorkerConfig("tcp://127.0.0.1:5555", "/m.gguf", (0, 15), n_threads=1, spin_ms=0.0).thread_poll_on(2) == 0
