"""The commands of a mesh across hosts: `meshnet worker`, `meshnet coordinator`,
`meshnet keys` and `meshnet status`."""

from __future__ import annotations

import json
import os
import sys

import click

from meshnet.cli.local import TextStreamer
from meshnet.cli.options import (attention_options, fail, numerics_option, parse_size, prefix_cache_option,
                                 refuse_open_without_keys, resume_options, speculate_option, usage_error)
from meshnet.core import defaults
from meshnet.core import errors
from meshnet.core.errors import MeshnetError
from meshnet.core.layers import LayerRange
from meshnet.engine import models
from meshnet.launch.progress import load_bars


@click.command()
@click.option("--join", "join_token", default=None, envvar="MESHNET_JOIN",
              help="the token `meshnet coordinator` printed: its address, key and credential; without --model the "
                   "worker fetches its layers' bytes from the mesh. Give it in the environment (MESHNET_JOIN=TOKEN, "
                   "as the printed line does) or with --join-file: on a command line every user of this machine "
                   "can read it (ps) [env: MESHNET_JOIN]")
@click.option("--join-file", type=click.File("r"), default=None,
              help="a file holding the join token (- for standard input), in place of --join")
@click.option("--discover", is_flag=True,
              help="find the coordinator on the LAN by mDNS (with --join: the one whose key the token names)")
@click.option("--coordinator", default=None, help="the coordinator's ROUTER address, e.g. tcp://127.0.0.1:5555")
@click.option("--model", default=None, help="model name or GGUF path [default: smollm2; with --join: the "
                                            "coordinator's model, fetched]")
@click.option("--layers", default=None, callback=usage_error(lambda v: None if v == "auto" else LayerRange.parse(v)),
              help="the half-open layer range A:B this worker holds, e.g. 0:15, or 'auto': the coordinator plans it "
                   "within --mem [default with --join: auto]")
@click.option("--mem", default=None, callback=usage_error(parse_size),
              help="memory this worker admits, e.g. 800M or 1.5G (with --layers auto: the planner's budget for it)")
@click.option("--threads", type=click.IntRange(min=0), default=0, help="compute threads [default: one per physical core]")
@click.option("--ctx", "n_ctx", type=click.IntRange(min=16), default=None,
              help=f"context tokens a session may grow to [default: the model's trained context, at least "
                   f"{defaults.N_CTX} and at most {defaults.CTX_CAP}, within --kv-pool]")
@click.option("--max-sessions", type=click.IntRange(min=1, max=256), default=defaults.MAX_SESSIONS, show_default=True,
              help="sessions at once; beyond them (or beyond the pool's room) a session waits its turn")
@click.option("--kv-pool", type=click.IntRange(min=0), default=None,
              help=f"cells of the one KV pool the sessions share, each growing up to --ctx (at least --ctx); 0: each "
                   f"session its own --ctx cells. A recurrent or hybrid model's pool holds pool / ctx whole sessions "
                   f"[default: --ctx + {defaults.POOL_ROOM}, at least {defaults.KV_POOL_MIN}]")
@click.option("--max-queue", type=click.IntRange(min=1), default=None, help="steps waiting on the stage before 'busy'")
@click.option("--data-bind", default="tcp://127.0.0.1:0", show_default=True,
              help="where this stage takes its inputs from the previous stage (loopback unless you say otherwise)")
@click.option("--cpu", type=click.IntRange(min=0), default=None,
              help="pin the data path (the stage loop and ZeroMQ's I/O thread) to this CPU; with several stages on "
                   "one machine, give each its own")
@click.option("--heartbeat-interval", type=click.FloatRange(min=0.01), default=None, help="seconds [default: 0.25]")
@click.option("--heartbeat-liveness", type=click.IntRange(min=1), default=None, help="missed beats before the peer is dead [default: 8]")
@click.option("--secret", "secret_file", default=None,
              help="this worker's CURVE key (NAME.key_secret from meshnet keys generate): the link to the "
                   "coordinator is encrypted and authenticated (needs --coordinator-key)")
@click.option("--coordinator-key", "coordinator_key_file", default=None, help="the coordinator's public key file (NAME.key)")
@click.option("--insecure", is_flag=True, help="serve a non-loopback --data-bind without keys: anyone who can reach it "
                                                 "may send this stage activations; and without a join token, fetch the "
                                                 "model's bytes checked against an unauthenticated coordinator's word")
@click.option("--gpu", is_flag=True, help="run the stage's layers, KV cache and compute on the first GPU (a GPU engine: "
                                            "make GPU=cuda or GPU=vulkan); it then reports its backend, the GPU's "
                                            "name and its memory")
@numerics_option(baseline=True)
@attention_options
@click.option("--trace", default=None, help="record a span per step of the per-token path and write them to this "
                                            "file (JSON) when the worker stops: what meshnet bench --trace reads")
@click.option("--spin-ms", type=click.FloatRange(min=0), default=None,
              help="after each input, poll for the next one this long before sleeping: the next decode step is taken "
                   "at once instead of after an idle CPU wakes (0: always sleep) [default: 50 when --threads uses at "
                   "most half the CPUs, so no stage beside it computes where it spins; else 0]")
@prefix_cache_option
@click.option("--tp", default=None, callback=usage_error(lambda v: None if v is None else _parse_tp(v)),
              help="RANK/SIZE: this worker is a member of a tensor-parallel group of 2 (each member holds half of every "
                   "layer of the range): 0/2 leads it, as the route's stage, with --tp-bind; 1/2 follows its leader "
                   "(--tp-leader) and talks to nobody else")
@click.option("--tp-bind", default=None, help="the group's leader: where its follower joins, e.g. tcp://10.0.0.1:5560")
@click.option("--tp-leader", default=None, help="a follower: its leader's --tp-bind address")
@click.option("--tp-peer-key", "tp_peer_key_file", default=None,
              help="the other member's public key (NAME.key): a leader's follower's, a follower's leader's")
def worker(join_token, join_file, discover, coordinator, model, layers, mem, threads, n_ctx, max_sessions, kv_pool,
           max_queue,
           data_bind, cpu, heartbeat_interval, heartbeat_liveness, secret_file, coordinator_key_file, insecure, gpu,
           numerics, flash_attn, kv_type, trace, spin_ms, prefix_cache_mib, tp, tp_bind, tp_leader, tp_peer_key_file):
    """Serve one layer range of a model to a coordinator until SIGTERM."""
    from meshnet.net import addresses, security
    from meshnet.net.join import MAX_TOKEN_CHARS
    from meshnet.stage.config import WorkerConfig, given
    from meshnet.core.planner import worker_settings
    from meshnet.engine.gguf_layout import read_layout
    from meshnet.stage.worker import StageWorker

    group = _group_options(tp, tp_bind, tp_leader, tp_peer_key_file, secret_file, insecure)
    if group is not None:
        # a group's members hold their sessions alike: one range, known before either loads,
        # the same kernels (the baseline class changes them process-wide), on the CPU
        if gpu or numerics == "baseline" or join_token or join_file or discover:
            raise click.UsageError("--tp groups run on the CPU in the stock or invariant class, with --secret keys "
                                   "(not --gpu, --numerics baseline, --join or --discover)")
        if group.rank == 0 and layers is None:
            raise click.UsageError("--tp 0/2 leads a group over a range it knows: --layers A:B, not auto")
        if group.rank > 0:
            _follow(group, model, secret_file, threads)
    context = click.get_current_context()
    if join_file is not None:
        if context.get_parameter_source("join_token").name == "COMMANDLINE":
            raise click.UsageError("give the token once: --join or --join-file")
        join_token = join_file.read(MAX_TOKEN_CHARS + 1).strip()
    elif join_token is not None and context.get_parameter_source("join_token").name == "COMMANDLINE":
        # a bearer credential in argv is in /proc/PID/cmdline, which every local user may read
        click.echo("WARNING: --join on the command line shows the token to every user of this machine (ps): give it "
                   "as MESHNET_JOIN=TOKEN or with --join-file FILE", err=True)
    layers_given = context.get_parameter_source("layers").name == "COMMANDLINE"
    if not layers_given and join_token is None:
        raise click.UsageError("give --layers A:B or --layers auto (or a join token, which plans them)")
    if layers is None and mem is None:
        raise click.UsageError("--layers auto needs --mem: the memory the planner may give this worker")
    if (secret_file is None) != (coordinator_key_file is None):
        raise click.UsageError("--secret and --coordinator-key go together: this worker's key and the coordinator's")
    if join_token is not None and secret_file is not None:
        raise click.UsageError("--join carries the keys: drop --secret and --coordinator-key")
    if coordinator is None and join_token is None and not discover:
        raise click.UsageError("where is the coordinator? give a join token (MESHNET_JOIN or --join-file), "
                               "--coordinator ADDRESS or --discover")
    refuse_open_without_keys("--data-bind", data_bind, secret_file or join_token, insecure)
    if numerics == "baseline":
        # the engine before the classes turned the tiled matmul off for its whole process
        os.environ.setdefault("GGML_CPU_TILED_MM", "0")
    holder = None
    try:
        from meshnet.launch.joining import Joined, join_mesh

        # a mistyped address fails before the model is looked for (and installed from its package)
        if coordinator is not None:
            addresses.checked(coordinator, "--coordinator")
        addresses.checked(data_bind, "--data-bind")
        keys = security.load_secret(secret_file) if secret_file else None
        coordinator_key = security.load_public(coordinator_key_file) if coordinator_key_file else None
        joined = Joined(coordinator, keys, coordinator_key, None, None)
        if join_token is not None or discover:
            joined = join_mesh(join_token, coordinator, discover, model, data_bind,
                               echo=lambda line: click.echo(line, err=True), insecure=insecure)
            holder = joined.holder
        path, sha256 = joined.model or models.resolve(model)
        # a default pool shrinks to what --mem leaves beside the range, down to one whole context
        settings = worker_settings(read_layout(path).n_ctx_train, n_ctx, kv_pool, max_sessions,
                                   fits_memory=mem is not None)
        config = WorkerConfig(coordinator=joined.coordinator, model_path=str(path), layers=layers,
                              model_sha256=sha256, n_ctx=settings.n_ctx, max_sessions=max_sessions,
                              kv_pool=settings.kv_pool, kv_pool_floor=settings.pool_floor,
                              n_threads=threads,
                              data_bind=data_bind, cpu=cpu, mem=mem, gpu=gpu, numerics=numerics, flash_attn=flash_attn,
                              kv_type=kv_type, trace=trace, spin_ms=spin_ms, prefix_cache_mib=prefix_cache_mib, keys=joined.keys,
                              coordinator_key=joined.coordinator_key, fetch=joined.fetch,
                              weights=holder.endpoint if holder is not None else None, group=group,
                              **given(max_queue=max_queue, heartbeat_interval=heartbeat_interval,
                                      heartbeat_liveness=heartbeat_liveness))
        status = StageWorker(config).run()
    except MeshnetError as e:
        if holder is not None:
            holder.close()
        fail(e)
    if holder is not None:
        holder.close()
    sys.exit(status)


def _parse_tp(text: str) -> tuple[int, int]:
    rank, sep, size = text.partition("/")
    if not sep or not rank.isdigit() or size != "2" or int(rank) > 1:
        raise MeshnetError(errors.INVALID_ARGUMENT, f"{text!r}: a group is of 2 members here: 0/2 (the leader) or "
                           "1/2 (its follower)")
    return int(rank), 2


def _group_options(tp, bind, leader, peer_key_file, secret_file, insecure):
    """--tp and its companions, checked: a tensor-parallel member's GroupOptions, or None."""
    from meshnet.net import addresses, security
    from meshnet.stage.tp_member import GroupOptions

    if tp is None:
        if bind or leader or peer_key_file:
            raise click.UsageError("--tp-bind, --tp-leader and --tp-peer-key go with --tp")
        return None
    rank, size = tp
    if rank == 0 and (not bind or leader):
        raise click.UsageError("--tp 0/2 leads the group: give --tp-bind (where its follower joins), not --tp-leader")
    if rank > 0 and (not leader or bind):
        raise click.UsageError("--tp 1/2 follows a leader: give --tp-leader (its --tp-bind), not --tp-bind")
    if (secret_file is None) != (peer_key_file is None):
        raise click.UsageError("a keyed member needs the other's public key: --secret and --tp-peer-key go together")
    endpoint = bind or leader
    addresses.checked(endpoint, "--tp-bind" if bind else "--tp-leader")
    refuse_open_without_keys("--tp-bind" if bind else "--tp-leader", endpoint, secret_file, insecure)
    peer_key = security.load_public(peer_key_file) if peer_key_file else None
    return GroupOptions(rank, size, bind=bind, leader=leader, peer_key=peer_key)


def _follow(group, model, secret_file, threads) -> None:
    """meshnet worker --tp 1/2: a follower's whole life (stage/tp_member.py), then exit."""
    from meshnet.engine.binding import default_threads
    from meshnet.engine.gguf_layout import read_layout
    from meshnet.net import security
    from meshnet.stage.tp_member import run_follower

    try:
        keys = security.load_secret(secret_file) if secret_file else None
        path, sha256 = models.resolve(model)
        status = run_follower(group, keys, str(path), sha256, threads or default_threads(False),
                              read_layout(path).n_embd)
    except MeshnetError as e:
        fail(e)
    sys.exit(status)


@click.command()
@click.option("--bind", default="tcp://127.0.0.1:5555", show_default=True,
              help="address of the ROUTER socket workers connect to (loopback unless you say otherwise)")
@click.option("--prompt", default=None, help="once the route is whole, generate from this text and exit")
@click.option("--max-tokens", type=click.IntRange(min=1), default=48, show_default=True)
@click.option("--wait", type=click.FloatRange(min=0), default=300, show_default=True,
              help="seconds to wait for a whole route before giving up (with --prompt)")
@click.option("--json", "as_json", is_flag=True, help="with --prompt: one JSON object on the last line")
@click.option("--metrics-port", type=click.IntRange(min=0, max=65535), default=None,
              help="serve Prometheus text at /metrics and JSON at /status on this port (127.0.0.1)")
@click.option("--allow-mixed", is_flag=True,
              help="let workers of another compatibility class (model file, engine pin, backend, wire dtype) into "
                   "the route; every run then reports its drift from the whole model (needs --reference)")
@click.option("--reference", default=None, help="with --allow-mixed: the whole model (name or GGUF path) runs are compared with")
@click.option("--data-bind", default=None,
              help="where the stages send tokens back, e.g. tcp://10.0.0.1:5556 (a fixed port for a firewall) "
                   "[default: the --bind address's host, a free port]")
@click.option("--secret", "secret_file", default=None,
              help="the coordinator's CURVE key (NAME.key_secret) [default: this host's, made once under "
                   "$MESHNET_HOME/keys]")
@click.option("--allow", "allow_path", default=None,
              help="workers' public keys admitted besides the join token's: a NAME.key file or a directory of them")
@click.option("--model", default=None,
              help="a model (name or GGUF path) whose bytes this host serves to workers that join without the file")
@click.option("--announce/--no-announce", default=None,
              help="announce this coordinator on the LAN by mDNS when it listens beyond loopback "
                   "[default: yes, unless MESHNET_ANNOUNCE=0]")
@click.option("--insecure", is_flag=True, help="no keys: plain links, and anyone who can reach --bind may register as "
                                                 "a worker (no join token)")
@resume_options
@speculate_option
def coordinator(bind, prompt, max_tokens, wait, as_json, metrics_port, allow_mixed, reference, data_bind, secret_file,
                allow_path, model, announce, insecure, resume_wait, max_resumes, speculate):
    """Track stage workers and route sessions through them.

    Every link is CURVE with keys kept under $MESHNET_HOME/keys, and it prints the line that
    adds a machine: `MESHNET_JOIN=TOKEN meshnet worker --mem 8G`. Without --prompt it serves until
    Ctrl-C, printing each change of the route."""
    import time

    from meshnet.core.text import utf8_or_error
    from meshnet.evidence.drift import DriftMeter
    from meshnet.launch.mesh_host import MeshHost, announce_by_default
    from meshnet.net import security
    from meshnet.net.metrics_server import MetricsServer
    from meshnet.route.config import CoordinatorConfig
    from meshnet.route.coordinator import Coordinator

    if allow_mixed and reference is None:
        raise click.UsageError("--allow-mixed needs --reference MODEL: a mixed route's output is compared with it")
    if insecure and (secret_file or allow_path):
        raise click.UsageError("--insecure runs without keys: drop it, or drop --secret and --allow")
    if insecure:
        refuse_open_without_keys("--bind", bind, None, insecure)
        if data_bind is not None:
            refuse_open_without_keys("--data-bind", data_bind, None, insecure)
    host = coord = None
    try:
        if prompt is not None:
            utf8_or_error(prompt, "--prompt")
        reference_path = str(models.resolve(reference)[0]) if reference else None
        held = models.resolve(model) if model else None
        keys = security.load_secret(secret_file) if secret_file else None
        allowed = security.load_allowed(allow_path) if allow_path else set()
        host = MeshHost(bind, keys=keys, secure=not insecure, model=held)
        config = CoordinatorConfig(bind, data_bind=data_bind, allow_mixed=allow_mixed, resume_wait=resume_wait,
                                   max_resumes=max_resumes, speculate=speculate, **host.coordinator_options(allowed))
        coord = Coordinator(config, drift_meter=DriftMeter(reference_path) if reference_path else None)
        host.started(coord.endpoint, announce_by_default() if announce is None else announce)
    except MeshnetError as e:
        if host is not None:
            host.close()
        fail(e)
    with host, coord:
        click.echo(f"coordinator listening on {coord.endpoint}", err=True)
        if host.holder is not None:
            click.echo(f"serving the bytes of {held[0].name} to workers without it, on {host.holder.endpoint}",
                       err=True)
        joining = host.join_line()
        join_key = host.join_key.public() if host.join_key else None
        if joining:
            click.echo("to add a machine, run there:", err=True)
            click.echo(joining, err=True)
        if metrics_port is not None:
            server = MetricsServer(coord.metrics, metrics_port)
            click.echo(f"metrics on http://127.0.0.1:{server.port}/metrics and /status", err=True)
        if prompt is None:
            last = None
            try:
                while True:
                    if joining and host.join_key.public() != join_key:   # (a stat, until the file changes)
                        joining, join_key = host.join_line(), host.join_key.public()
                        click.echo("the join key was rotated: tokens before now are refused; to add a machine, "
                                   "run there:", err=True)
                        click.echo(joining, err=True)
                    report = coord.route_report()
                    status = ("route " + " ".join(report["route"]) + (" (mixed classes)" if report.get("mixed") else "")
                              if report["route"] else f"no route: {report['error']}")
                    status += "".join(f"\n  kept out {name}: {why}" for name, why in report["kept_out"].items())
                    if report["route"]:   # without a route the reason already names them
                        status += "".join(f"\n  {name}: {state}" for name, state in report["standby"].items())
                    if any(str(state).startswith("loading") for state in report["standby"].values()):
                        # (a worker that fetches its range's bytes first is "loading" it here too)
                        status += "".join(f"\n  {line}" for line in load_bars(coord.metrics(timeout=1)))
                    if status != last:
                        click.echo(status, err=True)
                        last = status
                    time.sleep(0.5)
            except KeyboardInterrupt:
                return
        try:
            coord.wait_for_route(wait)
            tokens = coord.tokenize(prompt)
            session = coord.generate(tokens, max_tokens)
            stream = None if as_json else TextStreamer(prompt)
            for event in session:
                if stream:
                    stream(event.piece)
            text = coord.detokenize(session.tokens)
        except MeshnetError as e:
            fail(e)
        if as_json:
            # each stage's own numbers (RSS, model and KV bytes, forwards), asked before the
            # workers are left: the run's evidence from every host
            click.echo(json.dumps({"tokens": session.tokens, "text": text,
                                   "metrics": dict(session.metrics, stop_reason=session.stop_reason),
                                   "stages": coord.metrics()["stages"],
                                   "mechanisms": {"control": security.mechanism(coord.router),
                                                  "data": security.mechanism(coord.data)}}))
        else:
            stream.finish()
            if "drift" in session.metrics:
                drift = session.metrics["drift"]
                click.echo(f"mixed route: top-1 agreement {drift['top1_agreement']:.3f}, max |logit diff| "
                           f"{drift['max_abs_logit_diff']:.4g} over {len(drift['steps'])} steps", err=True)


@click.group()
def keys():
    """CURVE keys for encrypted, authenticated links between coordinator and workers."""


@keys.command("rotate-join")
def keys_rotate_join():
    """A new join key: every token made before is refused from now on (a running
    coordinator prints the new join line)."""
    from meshnet.net import join

    join.JoinKey().rotate()
    click.echo(f"join key rotated ({join.JoinKey().path}): tokens made before now are refused; "
               "`meshnet keys join-token` or the coordinator prints the new one")


@keys.command("join-token")
@click.option("--address", "addresses", multiple=True,
              help="a control endpoint the token names, e.g. tcp://10.0.0.1:5555 (repeat for several); none: the "
                   "worker finds the coordinator by mDNS (MESHNET_JOIN=TOKEN meshnet worker --discover)")
@click.option("--mem", default="8G", show_default=True, help="the --mem the printed line suggests")
def keys_join_token(addresses, mem):
    """Print the join line for this host's coordinator key and the current join key."""
    from meshnet.net import addresses as checks
    from meshnet.net import join

    try:
        for address in addresses:
            checks.tcp_peer(address, "--address")
        token = join.make_token(addresses, join.coordinator_keys(), join.JoinKey().pair())
    except MeshnetError as e:
        fail(e)
    click.echo(join.join_line(token, mem))


@keys.command("generate")
@click.argument("directory")
@click.option("--name", required=True, help="the key's name: writes NAME.key (public) and NAME.key_secret")
def keys_generate(directory, name):
    """Write a key pair into DIRECTORY (give NAME.key to the peers, keep NAME.key_secret)."""
    from meshnet.net import security

    try:
        public, secret = security.generate(directory, name)
    except MeshnetError as e:
        fail(e)
    click.echo(f"public key {public} (hand it to the peers); secret key {secret} (keep it here)")


@click.command()
@click.option("--url", default="http://127.0.0.1:9464", show_default=True,
              help="a coordinator's metrics address (meshnet coordinator --metrics-port)")
@click.option("--watch", type=click.FloatRange(min=0.2), default=None, help="refresh every N seconds")
@click.option("--json", "as_json", is_flag=True)
@click.option("--discover", is_flag=True, help="list the coordinators announced on the LAN (mDNS) instead")
@click.option("--timeout", type=click.FloatRange(min=0.5), default=3.0, show_default=True,
              help="with --discover: seconds to listen for announcements")
def status(url, watch, as_json, discover, timeout):
    """Show a running coordinator's stages: memory, KV, queue, hops, failures."""
    import time
    import urllib.error
    import urllib.request

    if discover:
        from meshnet.net import discovery

        try:
            found = discovery.browse(timeout)
        except MeshnetError as e:
            fail(e)
        if as_json:
            click.echo(json.dumps([{"name": f.name, "endpoints": list(f.endpoints), **f.properties} for f in found]))
        elif not found:
            click.echo(f"no meshnet coordinator announced itself on the LAN within {timeout:g} s")
        for f in ([] if as_json else found):
            model = f.properties.get("model") or "-"
            click.echo(f"{f.name}  {' '.join(f.endpoints)}  key {f.properties.get('key') or '(none: insecure)'}  "
                       f"model {model[:12]}  protocol {f.properties.get('v', '?')}")
        return

    timeout = 10
    while True:
        try:
            with urllib.request.urlopen(url.rstrip("/") + "/status", timeout=timeout) as response:
                snapshot = json.loads(response.read())
        except TimeoutError:
            fail(MeshnetError(errors.TIMEOUT, f"the coordinator at {url} did not answer within {timeout} s"))
        except urllib.error.URLError as e:
            if isinstance(e.reason, TimeoutError):  # a timeout while connecting comes wrapped
                fail(MeshnetError(errors.TIMEOUT, f"the coordinator at {url} did not answer within {timeout} s"))
            fail(MeshnetError(errors.UNREACHABLE, f"no coordinator metrics at {url}: {e.reason}"))
        except (OSError, ValueError) as e:
            fail(MeshnetError(errors.UNREACHABLE, f"no coordinator metrics at {url}: {e}"))
        if as_json:
            click.echo(json.dumps(snapshot))
        else:
            click.echo(_status_table(snapshot))
        if watch is None:
            return
        time.sleep(watch)


def _status_table(snapshot: dict) -> str:
    mib = 1 << 20
    rows = [f"{'stage':<10} {'worker':<12} {'rss MiB':>8} {'model MiB':>9} {'KV used MiB':>11} {'sessions':>8} "
            f"{'queue':>5} {'hop p50 us':>10} {'p99 us':>8} {'seam MiB':>8} failures"]
    for s in snapshot["stages"]:
        def num(key, scale=1, fmt="{:.1f}"):
            return fmt.format(s[key] / scale) if s.get(key) is not None else "-"
        failures = ", ".join(f"{k}={v}" for k, v in {**s.get("errors", {}), **s.get("reply_errors", {})}.items()) or "0"
        if s.get("state") == "loading":
            failures = f"LOADING {int(100 * (s.get('load_progress') or 0))}%; {failures}"
        elif s.get("state") == "fetching":
            failures = f"FETCHING {int(100 * (s.get('fetch_progress') or 0))}%; {failures}"
        if s.get("unreachable"):  # what the coordinator knows of a worker that did not answer
            failures = f"SILENT (last heard {s.get('last_heard_s', 0):.1f} s ago: {s['unreachable']}); {failures}"
        rows.append(f"{s['stage']:<10} {s['worker']:<12} {num('rss_bytes', mib):>8} {num('model_bytes', mib):>9} "
                    f"{num('kv_bytes_used', mib):>11} {num('n_sessions', fmt='{:.0f}'):>8} {num('queue_depth', fmt='{:.0f}'):>5} "
                    f"{num('hop_us_p50', fmt='{:.0f}'):>10} {num('hop_us_p99', fmt='{:.0f}'):>8} {num('seam_bytes', mib):>8} {failures}"
                    + ("" if s.get("in_route", True) else f"  NOT IN THE ROUTE: {s.get('kept_out') or 'no route'}"))
    sessions = ", ".join(f"{k} {v}" for k, v in snapshot["sessions"].items())
    route = f"\nno route: {snapshot['route_error']}" if snapshot.get("route_error") else ""
    bars = "".join(f"\n{line}" for line in load_bars(snapshot))
    return "\n".join(rows) + f"\nsessions: {sessions}" + route + bars
