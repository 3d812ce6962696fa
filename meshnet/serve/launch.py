"""Starting `meshnet serve`: the HTTP socket (bound before any worker starts, so a port
in use fails at once), local workers or a coordinator that workers elsewhere connect
to, and uvicorn until SIGINT or SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

from meshnet.core import defaults
from meshnet.core import kv_cache
from meshnet.net import addresses
from meshnet.engine import models
from meshnet.serve.app import create_app
from meshnet.serve.openai import model_id


def listen(host: str, port: int) -> socket.socket:
    """The HTTP socket, bound and listening before any worker starts: a port in use fails at once."""
    return addresses.tcp_listener(host, port, 1024, "choose another --host/--port", reuse_address=True)


def serve(model: str | None, sock: socket.socket, *, api_key: str | None = None, bind: str | None = None,
          coordinator_options: dict | None = None, stages: int = 2, threads: int = 0, n_ctx: int | None = None,
          max_sessions: int = defaults.MAX_SESSIONS, secure: bool = True, numerics: str | None = None,
          flash_attn: bool = False, kv_type: str = kv_cache.DEFAULT,
          prefix_cache_mib: int | None = None, mesh=None, mesh_mem: int | None = None, announce: bool = True,
          stuck_after: float = defaults.STUCK_AFTER_S, max_queue: int = defaults.MAX_QUEUE,
          queue_wait: float = defaults.QUEUE_WAIT_S, kv_pool: int | None = None, cors_origins: list[str] = (),
          echo=print) -> None:
    """Serve until SIGINT or SIGTERM: in front of local workers (CURVE on their links
    unless not secure), or (bind) of a coordinator that workers elsewhere connect to.
    N_CTX, KV_POOL: the local workers' (None: defaults.kv_settings, from the model)."""
    import uvicorn

    from meshnet.engine.gguf_layout import read_layout
    from meshnet.launch.local_cluster import LocalCluster
    from meshnet.route.config import CoordinatorConfig
    from meshnet.route.coordinator import Coordinator

    def run(coordinator, where: str, path=None):
        host, port = sock.getsockname()[:2]
        app = create_app(coordinator, model_id(model), api_key=api_key, stuck_after=stuck_after, max_queue=max_queue,
                         queue_wait=queue_wait, facts=model_facts(path) if path is not None else None,
                         cors_origins=cors_origins)

        class Server(uvicorn.Server):
            async def shutdown(self, sockets=None):
                app.state.stop_sessions()   # streams end now, with an error, and their connections close
                await super().shutdown(sockets)
        server = Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
        echo(f"meshnet serve: {model_id(model)} on http://{host}:{port}/v1 ({where})")
        server.run(sockets=[sock])

    def stop(signum, frame):   # uvicorn passes SIGTERM on once it has stopped: the workers close too
        raise KeyboardInterrupt
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        if bind is None:
            path, _ = models.resolve(model)
            layout = read_layout(path)
            ranges = layout.balanced_ranges(stages)
            n_ctx, kv_pool = defaults.kv_settings(layout.n_ctx_train, n_ctx, kv_pool, max_sessions)
            # the workers ignore the terminal's Ctrl-C: they are closed after the server
            resume = {k: v for k, v in (coordinator_options or {}).items()
                      if k in ("resume_wait", "max_resumes", "speculate")}
            if numerics == "stock" and max_sessions > 1:
                echo("meshnet serve: numerics stock: one request alone gets stock llama.cpp's tokens; requests "
                     "batched together may get others (--numerics invariant holds them under any batching)")
            with LocalCluster(path, ranges, threads=threads, n_ctx=n_ctx, max_sessions=max_sessions, kv_pool=kv_pool,
                              secure=secure,
                              numerics=numerics, flash_attn=flash_attn, kv_type=kv_type, prefix_cache_mib=prefix_cache_mib,
                              progress=echo,
                              supervise=True, **resume) as cluster:
                run(cluster.coordinator, f"{len(ranges)} local workers {' '.join(r.label for r in ranges)}", path)
        else:
            with Coordinator(CoordinatorConfig(bind, **(coordinator_options or {}))) as coordinator:
                local = None
                if mesh is not None:
                    mesh.started(coordinator.endpoint, announce)
                    if mesh.join_line():
                        echo("meshnet serve: to add a machine, run there:")
                        echo(mesh.join_line())
                    if mesh_mem is not None:
                        local = spawn_joined_worker(mesh, mesh_mem)
                try:
                    run(coordinator, f"workers connect to {coordinator.endpoint}"
                        + (f"; a worker here within {mesh_mem} bytes" if local else ""),
                        mesh.holder.path if mesh is not None and mesh.holder is not None else None)
                finally:
                    if local is not None:
                        local.terminate()
                        try:
                            local.wait(timeout=10)
                        except subprocess.TimeoutExpired:
                            local.kill()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        sock.close()


def model_facts(path) -> dict:
    """What the model's file says of it, as Ollama's API lists a model: its bytes and
    sha256, architecture, parameters and main quantization, and its trained context."""
    from meshnet.engine.gguf_layout import read_layout

    layout = read_layout(path)
    parameters = sum(layout.layer_weights) + layout.output_weights   # (the weights a token multiplies)
    quant = max((t for t in layout.quant_types if t not in ("F32",)), key=layout.quant_types.get, default="F32")
    return {"sha256": models.resolve(str(path))[1], "bytes": layout.file_bytes, "arch": layout.arch,
            "parameters": parameters, "parameter_size": _count(parameters), "quantization": quant,
            "context_length": layout.n_ctx_train}


def _count(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def spawn_joined_worker(mesh, mem: int) -> subprocess.Popen:
    """This host's own worker in the mesh it serves: it joins with the token, as any other
    machine does, from the model file here (whose bytes it serves too), within MEM."""
    from meshnet.launch.local_cluster import _worker_child
    from meshnet.launch.mesh_host import WILDCARD_HOSTS, reachable_addresses

    token = mesh.token()
    coordinator = reachable_addresses(mesh.endpoint)[0]
    host = mesh.endpoint.partition("://")[2].rpartition(":")[0]
    # its data endpoint where the other machines reach it: the coordinator's interface
    data_bind = "tcp://0.0.0.0:0" if host in WILDCARD_HOSTS else f"tcp://{host}:0"
    args = [sys.executable, "-m", "meshnet.cli.main", "worker", "--coordinator", coordinator,
            "--model", str(mesh.holder.path), "--layers", "auto", "--mem", str(mem), "--data-bind", data_bind]
    env = dict(os.environ)
    if token is not None:
        env["MESHNET_JOIN"] = token.encode()   # not on its command line, which any local user can read
    elif not data_bind.startswith("tcp://127."):
        args.append("--insecure")
    return subprocess.Popen(args, stdin=subprocess.DEVNULL, env=env, preexec_fn=_worker_child)
