"""`meshnet serve`: OpenAI's HTTP API over local workers or a coordinator."""

from __future__ import annotations


import click

from meshnet.cli.options import (attention_options, fail, numerics_option, parse_size, prefix_cache_option,
                                 refuse_open_without_keys, resume_options, speculate_option, usage_error)
from meshnet.core import defaults
from meshnet.core import kv_cache
from meshnet.core.errors import MeshnetError

@click.command()
@click.option("--model", default=None, help="model name, GGUF path, hf:ORG/REPO[:QUANT] or ollama:NAME[:TAG]; clients "
                                            "ask for it by its name (a path's file stem) [default: smollm2]")
@click.option("--host", default="127.0.0.1", show_default=True, help="the HTTP address (loopback unless you say otherwise)")
@click.option("--port", type=click.IntRange(min=0, max=65535), default=8080, show_default=True, help="0: a free port")
@click.option("--api-key", envvar="MESHNET_API_KEY", default=None,
              help="clients must send 'Authorization: Bearer KEY' on /v1 [env: MESHNET_API_KEY]")
@click.option("--stages", type=click.IntRange(min=1), default=None, help="local workers: N stages [default: 2]")
@click.option("--threads", type=click.IntRange(min=0), default=None, help="local workers: threads per stage [default: one per physical core]")
@click.option("--ctx", "n_ctx", type=click.IntRange(min=16), default=None,
              help=f"local workers: context tokens a session may grow to [default: the model's trained context, at "
                   f"least {defaults.N_CTX} and at most {defaults.CTX_CAP}, within --kv-pool]")
@click.option("--max-sessions", type=click.IntRange(min=1, max=256), default=None,
              help=f"local workers: sessions at once; beyond them a request waits in the queue "
                   f"[default: {defaults.MAX_SESSIONS}]")
@click.option("--kv-pool", type=click.IntRange(min=0), default=None,
              help=f"local workers: cells of the one KV pool each stage's sessions share, each growing up to --ctx "
                   f"(at least --ctx); 0: each session its own --ctx cells [default: --ctx + {defaults.POOL_ROOM}, at "
                   f"least {defaults.KV_POOL_MIN}]")
@click.option("--max-queue", type=click.IntRange(min=0), default=defaults.MAX_QUEUE, show_default=True,
              help="requests that may wait for a session slot; one beyond them gets 429")
@click.option("--queue-wait", type=click.FloatRange(min=0), default=defaults.QUEUE_WAIT_S, show_default=True,
              help="seconds a request waits for a session slot before it gets 429")
@click.option("--coordinator", "bind", default=None,
              help="instead of local workers, bind a coordinator here (e.g. tcp://0.0.0.0:5555) and serve through the "
                   "meshnet workers that connect to it")
@click.option("--secret", "secret_file", default=None,
              help="with --coordinator: its CURVE key (NAME.key_secret) [default: this host's, under $MESHNET_HOME/keys]")
@click.option("--allow", "allow_path", default=None,
              help="with --coordinator: workers' public keys admitted besides the join token's (NAME.key or a directory)")
@click.option("--mem", default=None, callback=usage_error(parse_size),
              help="with --coordinator: this host runs a worker too, within this memory, and the workers that join "
                   "take the rest of the model (they fetch its bytes from here)")
@click.option("--announce/--no-announce", default=None,
              help="with --coordinator: announce it on the LAN by mDNS when it listens beyond loopback "
                   "[default: yes, unless MESHNET_ANNOUNCE=0]")
@click.option("--insecure", is_flag=True, help="listen beyond loopback without keys (--coordinator) or without --api-key "
                                            "(--host); local workers: plain links instead of fresh CURVE keys")
@click.option("--cors-origin", "cors_origins", multiple=True,
              help="a browser origin (https://ui.example:3000, or *) whose pages may call the API: CORS headers and "
                   "preflights for it, as llama-server's --cors; repeat per origin [default: none]")
@click.option("--stuck-after", type=click.FloatRange(min=0.1), default=defaults.STUCK_AFTER_S, show_default=True,
              help="seconds one step of a stage may run before /health reports the stage stuck (503)")


@numerics_option
@attention_options
@resume_options
@prefix_cache_option
@speculate_option
def serve(model, host, port, api_key, stages, threads, n_ctx, max_sessions, kv_pool, max_queue, queue_wait, bind, secret_file, allow_path, mem, announce,
          insecure, cors_origins, stuck_after, numerics, flash_attn, kv_type, resume_wait, max_resumes, prefix_cache_mib, speculate):
    """Serve the model over OpenAI's HTTP API (/v1/chat/completions, /v1/completions, /v1/responses, /v1/models),
    Anthropic's (/v1/messages) and Ollama's (/api/chat, /api/generate, /api/tags) until Ctrl-C."""
    from meshnet.net import security
    from meshnet.serve.launch import listen
    from meshnet.serve.launch import serve as run_server

    local = {"--stages": stages, "--threads": threads, "--ctx": n_ctx, "--max-sessions": max_sessions, "--kv-pool": kv_pool,
             "--numerics": numerics, "--flash-attn": flash_attn or None,
             "--kv-type": kv_type if kv_type != kv_cache.DEFAULT else None,
             "--prefix-cache": prefix_cache_mib if click.get_current_context().get_parameter_source(
                 "prefix_cache_mib").name == "COMMANDLINE" else None}
    if bind is not None and any(v is not None for v in local.values()):
        raise click.UsageError(f"{next(k for k, v in local.items() if v is not None)} is for local workers: with "
                               "--coordinator, give it to each meshnet worker")
    if (secret_file is not None or allow_path is not None or mem is not None) and bind is None:
        raise click.UsageError("--secret, --allow and --mem go with --coordinator")
    if bind is not None and insecure:
        if secret_file or allow_path:
            raise click.UsageError("--insecure runs without keys: drop it, or drop --secret and --allow")
        refuse_open_without_keys("--coordinator", bind, None, insecure)
    if api_key is None and not security.is_loopback(f"tcp://{host}:{port}"):
        if not insecure:
            raise click.UsageError(f"--host {host} is reachable beyond this machine and no --api-key is given: anyone "
                                   "could use the model. Give --api-key (or MESHNET_API_KEY), or --insecure")
        click.echo(f"WARNING: --host {host} without --api-key (--insecure): anyone who can reach it can use it", err=True)
    from meshnet.launch.mesh_host import MeshHost, announce_by_default

    mesh = None
    try:
        options = dict(resume_wait=resume_wait, max_resumes=max_resumes, speculate=speculate)
        if bind is not None:
            from meshnet.engine import models

            # this host serves the model's bytes when it names the model or runs a worker of it
            held = models.resolve(model) if model is not None or mem is not None else None
            mesh = MeshHost(bind, keys=security.load_secret(secret_file) if secret_file else None,
                            secure=not insecure, model=held)
            options.update(mesh.coordinator_options(security.load_allowed(allow_path) if allow_path else set()))
        run_server(model, listen(host, port), api_key=api_key, bind=bind, coordinator_options=options,
                   mesh=mesh, mesh_mem=mem, announce=announce_by_default() if announce is None else announce,
                   stages=stages or 2, threads=threads or 0, n_ctx=n_ctx, max_sessions=max_sessions or defaults.MAX_SESSIONS,
                   secure=not insecure, numerics=numerics, flash_attn=flash_attn, kv_type=kv_type,
                   prefix_cache_mib=prefix_cache_mib, stuck_after=stuck_after,
                   max_queue=max_queue, queue_wait=queue_wait, kv_pool=kv_pool, cors_origins=list(cors_origins),
                   echo=lambda line: click.echo(line, err=True))
    except MeshnetError as e:
        fail(e)
    finally:
        if mesh is not None:
            mesh.close()
