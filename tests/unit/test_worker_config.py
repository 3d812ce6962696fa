"""The one spelling of a worker's command line: what WorkerConfig.to_argv writes is what
`meshnet worker` parses back into the same options."""

from __future__ import annotations

import pytest

from meshnet.core.layers import LayerRange
from meshnet.stage.config import WorkerConfig


def parsed(argv: list[str]) -> dict:
    from meshnet.cli.mesh import worker

    assert argv[1:4] == ["-m", "meshnet.cli.main", "worker"]
    return worker.make_context("worker", argv[4:]).params


@pytest.mark.parametrize("config, key_files", [
    (WorkerConfig("tcp://127.0.0.1:5555", "/models/m.gguf", (0, 15)), None),
    (WorkerConfig("tcp://10.0.0.1:5555", "/models/m.gguf", (15, 30), n_ctx=512, max_sessions=3, n_threads=1,
                  max_queue=4, data_bind="tcp://10.0.0.2:7000", cpu=1, heartbeat_interval=0.1,
                  heartbeat_liveness=20, gpu=True, numerics="stock", trace="/tmp/stage-1.json"),
     ("/k/w.key_secret", "/k/c.key")),
    (WorkerConfig("tcp://127.0.0.1:5555", "/models/m.gguf", None, mem=800 << 20, n_threads=2), None),
])
def test_the_command_line_a_config_writes_parses_back_to_the_same_options(config, key_files):
    params = parsed(config.to_argv(key_files))
    layers = params["layers"]
    assert (None if layers is None else LayerRange.as_tuple(layers)) == config.layers
    assert (params["coordinator"], params["model"], params["mem"], params["threads"], params["n_ctx"],
            params["max_sessions"], params["data_bind"], params["cpu"], params["gpu"], params["numerics"],
            params["trace"]) == \
        (config.coordinator, config.model_path, config.mem, config.n_threads, config.n_ctx, config.max_sessions,
         config.data_bind, config.cpu, config.gpu, config.numerics, config.trace)
    # left out where they are the worker's defaults, so that the worker's own default stands
    assert (params["max_queue"] or config.max_queue, params["heartbeat_interval"] or config.heartbeat_interval,
            params["heartbeat_liveness"] or config.heartbeat_liveness) == \
        (config.max_queue, config.heartbeat_interval, config.heartbeat_liveness)
    assert (params["secret_file"], params["coordinator_key_file"]) == (key_files or (None, None))
