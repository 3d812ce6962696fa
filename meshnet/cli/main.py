"""The meshnet command line."""

from __future__ import annotations

import codecs
import json
import os
from pathlib import Path
import sys

import click

from meshnet.core import defaults
from meshnet.core import errors
from meshnet.core.errors import MeshnetError, exit_status
from meshnet.core.layers import LayerRange, parse_seams
from meshnet.engine import models

DEFAULT_PROMPT = "The capital of France is"


def _figure(value, fmt: str = "{:.1f}") -> str:
    """A measured figure for a summary line, or "-" where there was nothing to measure."""
    return "-" if value is None else fmt.format(value)


def _fail(error: MeshnetError):
    click.echo(f"error: {error}", err=True)
    sys.exit(exit_status(error.code))


@click.group()
@click.version_option(package_name="meshnet")
def main():
    """Run one GGUF model across several processes and hosts, a layer range each."""


def _usage_error(parse):
    """A click callback: what the command line alone shows is wrong is a usage error (exit
    status 2); checks that need the model come later, as bad_range (3)."""
    def callback(ctx, param, value):
        if value is None:
            return None
        try:
            return parse(value)
        except MeshnetError as e:
            raise click.BadParameter(e.message) from None
    return callback


def _refuse_open_without_keys(option: str, endpoint: str, secret_file, insecure: bool) -> None:
    """Beyond loopback, a socket without CURVE keys lets anyone in: only on request."""
    from meshnet.net.security import is_loopback

    if secret_file is not None or not endpoint.startswith("tcp://") or is_loopback(endpoint):
        return   # (an address that is not tcp:// at all is refused when it is bound, as bad_address)
    if not insecure:
        raise click.UsageError(f"{option} {endpoint} is reachable beyond this machine and no keys are given: anyone "
                               "could connect. Give --secret (see meshnet keys generate), or --insecure on a network "
                               "you trust")
    click.echo(f"WARNING: {option} {endpoint} without keys (--insecure): anyone who can reach it can connect, "
               "unauthenticated and unencrypted", err=True)


def _size(text: str) -> int:
    from meshnet.core.planner import parse_size
    return parse_size(text)


def _node(text: str):
    from meshnet.core.planner import parse_size

    name, sep, mem = str(text).partition("=")
    if not sep or not name:
        raise MeshnetError(errors.INVALID_ARGUMENT, f"'{text}' is not NAME=MEM (e.g. laptop=6G)")
    return name, parse_size(mem)


def _nodes(ctx, param, values):
    try:
        return [_node(v) for v in values]
    except MeshnetError as e:
        raise click.BadParameter(e.message) from None


def _local_keys_option(command):
    """Local workers talk to their coordinator over CURVE with keys made for the run, so
    that no other process on this machine can join the route or read its prompts."""
    return click.option("--secure/--insecure", default=True, show_default=True,
                        help="fresh CURVE keys on every link between the coordinator and its local workers; "
                             "--insecure: plain links, which any local process can join")(command)


def _numerics_option(command=None, *, baseline: bool = False):
    """--numerics: which kernels the stages compute with (meshnet/core/numerics.py). The worker
    also takes `baseline`, the kernels before the classes, for `meshnet bench` alone."""
    from meshnet.core import numerics

    def decorate(command):
        return click.option("--numerics", type=click.Choice(numerics.CLASSES if baseline else numerics.CHOICES),
                            default=None,
                            help="invariant: every row's logits bit-identical however rows are batched (CPU only); "
                                 "stock: stock llama.cpp's default kernels and its tokens for one session, but a "
                                 "session batched with others may differ from it alone "
                                 "[default: invariant; stock on a GPU]")(command)
    return decorate(command) if command is not None else decorate


def _resume_options(command):
    """A session that loses a stage is replayed on a new route: at once when one stands
    ready (a spare), or when one forms within --resume-wait seconds."""
    command = click.option("--max-resumes", type=click.IntRange(min=0), default=2, show_default=True,
                           help="resumes per session at most; then stage_lost")(command)
    return click.option("--resume-wait", type=click.FloatRange(min=0), default=0.0, show_default=True,
                        help="seconds a session that lost a stage waits for a replacement to register (0: it is "
                             "replayed only on a spare already there, else ends with stage_lost)")(command)


def _sampling_options(command):
    """llama.cpp's sampler chain at the tail (meshnet/core/sampling.py); with none of them, greedy."""
    options = [
        click.option("--temperature", type=float, default=None, help="0 is greedy [default: 0]"),
        click.option("--top-p", type=float, default=None, help="nucleus sampling; 1 is off [default: 1]"),
        click.option("--top-k", type=int, default=None, help="0 is off [default: 0]"),
        click.option("--min-p", type=float, default=None, help="0 is off [default: 0]"),
        click.option("--repeat-penalty", type=float, default=None, help="1 is off [default: 1]"),
        click.option("--seed", type=int, default=None,
                     help="the same seed gives the same tokens [default: a fresh one per answer with --temperature]"),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _sampling(flags: dict):
    """The Sampling the flags given make (None: greedy), and whether --seed was given.
    Values out of range are a bad command line."""
    from meshnet.core.sampling import Sampling

    given = {name: value for name, value in flags.items() if value is not None}
    if not given:
        return None, False
    try:
        return Sampling(**given), "seed" in given
    except MeshnetError as e:
        raise click.BadParameter(e.message, param_hint="--" + e.context.get("field", "").replace("_", "-")) from None


@main.command()
@click.option("--model", default=None, help=f"model name ({', '.join(sorted(models.MODELS))}) or GGUF path [default: {models.DEFAULT_MODEL}]")
@click.option("--stages", type=click.IntRange(min=1), default=None, help="split the model into N stages with even shares of the per-token work [default: 2]")
@click.option("--split", "split", default=None, callback=_usage_error(parse_seams),
              help="seams, e.g. 15 for [0,15)+[15,n) or 10,20 for three stages")
@click.option("--prompt", default=DEFAULT_PROMPT, show_default=True, help="raw text, tokenized as llama.cpp does for the model")
@click.option("--chat", "chat_message", default=None,
              help="instead of continuing --prompt, answer this user message through the model's chat template")
@click.option("--max-tokens", type=click.IntRange(min=1), default=48, show_default=True)
@click.option("--threads", type=click.IntRange(min=0), default=0, help="threads per stage [default: one per core]")
@click.option("--ctx", "n_ctx", type=click.IntRange(min=16), default=defaults.N_CTX, show_default=True, help="context tokens")
@click.option("--in-process", is_flag=True, help="run every stage in this process instead of worker processes")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object (tokens, text, metrics) on the last line")
@_local_keys_option
@_numerics_option
@_sampling_options
@_resume_options
def run(model, stages, split, prompt, chat_message, max_tokens, threads, n_ctx, in_process, as_json, secure, numerics,
        resume_wait, max_resumes, **sampling_flags):
    """Continue PROMPT (or answer a --chat message) with the model split into stages (worker processes on this machine)."""
    from meshnet.core.conversation import answer_sampling
    from meshnet.core.layers import ranges_from_seams
    from meshnet.core.text import utf8_or_error
    from meshnet.engine.gguf_layout import read_layout

    if stages is not None and split is not None:
        raise click.UsageError("give --stages or --split, not both")
    if chat_message is not None and click.get_current_context().get_parameter_source("prompt").name == "COMMANDLINE":
        raise click.UsageError("give --prompt (raw text to continue) or --chat (a message to answer), not both")
    sampling = answer_sampling(*_sampling(sampling_flags))
    try:
        utf8_or_error(prompt, "--prompt")  # at once, before any model or worker starts
        if chat_message is not None:
            utf8_or_error(chat_message, "--chat")
        path, sha256 = models.resolve(model)
        layout = read_layout(path)
        ranges = (
            ranges_from_seams(layout.n_layer, split)
            if split is not None
            else layout.balanced_ranges(stages or 2)
        )
        secure = secure and not in_process   # one process has no links to secure
        stream = None if as_json else _TextStreamer(prompt if chat_message is None else "")
        if in_process:
            tokens, text, metrics, stop_reason = _run_in_process(path, ranges, prompt, max_tokens, threads, n_ctx, stream,
                                                                 chat_message=chat_message, sampling=sampling,
                                                                 numerics=numerics)
        else:
            tokens, text, metrics, stop_reason = _run_on_workers(path, ranges, prompt, max_tokens, threads, n_ctx, stream,
                                                                 secure, chat_message=chat_message, sampling=sampling,
                                                                 resume_wait=resume_wait, max_resumes=max_resumes,
                                                                 numerics=numerics)
    except MeshnetError as e:
        _fail(e)

    from meshnet.core.numerics import DEFAULT
    metrics = dict(metrics, model_sha256=sha256, stop_reason=stop_reason, workers=not in_process, curve=secure,
                   numerics=numerics or DEFAULT)
    if sampling is not None:
        metrics["sampling"] = sampling.to_wire()   # with its seed: the run can be replayed
    if as_json:
        click.echo(json.dumps({"tokens": tokens, "text": text, "metrics": metrics}))
        return
    stream.finish()
    # a figure that was not measured (one stage has no hop; one token, no decode rate) shows as "-"
    hops = f", hop p50 {_figure(metrics.get('hop_us_p50'), '{:.0f}')} us" if len(ranges) > 1 else ""
    click.echo(
        f"[{len(ranges)} stage{'s' if len(ranges) > 1 else ''} {' '.join(r.label for r in ranges)}"
        f"{' in-process' if in_process else ' as worker processes'}{', CURVE on every link' if secure else ''}] "
        f"prompt {metrics['prompt_tokens']} tok, ttft {_figure(metrics.get('ttft_ms'), '{:.0f}')} ms, "
        f"prefill {_figure(metrics.get('prefill_tok_s'))} tok/s, decode {_figure(metrics.get('decode_tok_s'))} tok/s{hops}, "
        f"{metrics['generated_tokens']} tokens ({stop_reason})",
        err=True,
    )


def _check_context(n_prompt: int, max_tokens: int, n_ctx: int) -> None:
    if n_prompt + max_tokens > n_ctx:
        raise MeshnetError(errors.CONTEXT_FULL, f"{n_prompt} prompt tokens + {max_tokens} new ones exceed --ctx {n_ctx}")


def _run_in_process(path, ranges, prompt, max_tokens, threads, n_ctx, stream, chat_message=None, sampling=None,
                    numerics=None):
    from meshnet.engine.pipeline import LocalPipeline

    with LocalPipeline(path, ranges, n_ctx=n_ctx, max_sessions=1, n_threads=threads, numerics=numerics) as pipe:
        if chat_message is None:
            prompt_tokens = pipe.head.tokenize(prompt)
        else:   # as the workers' head does it (meshnet/core/conversation.py prompt_tokens)
            text = pipe.head.chat_template([{"role": "user", "content": chat_message}])
            prompt_tokens = pipe.head.tokenize(text, add_special=True, parse_special=True)
        _check_context(len(prompt_tokens), max_tokens, n_ctx)
        on_token = (lambda t: stream(pipe.tail.detokenize_bytes([t]))) if stream else None
        gen = pipe.generate(prompt_tokens, max_tokens, on_token=on_token, sampling=sampling)
        return gen.tokens, pipe.tail.detokenize(gen.tokens), gen.metrics, gen.stop_reason


def _run_on_workers(path, ranges, prompt, max_tokens, threads, n_ctx, stream, secure=False, chat_message=None,
                    sampling=None, resume_wait=0.0, max_resumes=2, numerics=None):
    from meshnet.core.conversation import prompt_tokens as chat_tokens
    from meshnet.launch.local_cluster import LocalCluster

    with LocalCluster(path, ranges, threads=threads, n_ctx=n_ctx, max_sessions=1, secure=secure,
                      resume_wait=resume_wait, max_resumes=max_resumes, numerics=numerics) as cluster:
        coordinator = cluster.coordinator
        if chat_message is None:
            prompt_tokens = coordinator.tokenize(prompt)
        else:
            prompt_tokens = chat_tokens(coordinator, [{"role": "user", "content": chat_message}])
        _check_context(len(prompt_tokens), max_tokens, n_ctx)
        session = coordinator.generate(prompt_tokens, max_tokens, sampling=sampling)
        for event in session:
            if stream:
                stream(event.piece)
        return session.tokens, coordinator.detokenize(session.tokens), session.metrics, session.stop_reason


class _TextStreamer:
    """Prints the continuation as its bytes arrive; a character split across two tokens
    is printed once whole."""

    def __init__(self, prompt: str):
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        click.echo(prompt, nl=False)

    def __call__(self, piece: bytes) -> None:
        click.echo(self.decoder.decode(piece), nl=False)
        sys.stdout.flush()

    def finish(self) -> None:
        click.echo(self.decoder.decode(b"", final=True))


@main.command()
@click.option("--model", default=None, help=f"model name ({', '.join(sorted(models.MODELS))}) or GGUF path [default: {models.DEFAULT_MODEL}]")
@click.option("--stages", type=click.IntRange(min=1), default=None, help="split the model into N stages with even shares of the per-token work [default: 2]")
@click.option("--threads", type=click.IntRange(min=0), default=0, help="threads per stage [default: one per core]")
@click.option("--ctx", "n_ctx", type=click.IntRange(min=16), default=defaults.N_CTX, show_default=True,
              help="context tokens: the conversation's oldest turns leave it when it is full")
@click.option("--max-tokens", type=click.IntRange(min=1), default=256, show_default=True, help="tokens per answer at most")
@click.option("--system", default=None, help="a system message that opens the conversation (and stays in it)")
@_local_keys_option
@_numerics_option
@_sampling_options
def chat(model, stages, threads, n_ctx, max_tokens, system, secure, numerics, **sampling_flags):
    """Talk with the model split into stages (worker processes on this machine), through its own chat template.

    Ctrl-C stops an answer, Ctrl-D quits."""
    from meshnet.cli.chat import Chat
    from meshnet.core.text import utf8_or_error
    from meshnet.engine.gguf_layout import read_layout
    from meshnet.launch.local_cluster import LocalCluster

    if max_tokens >= n_ctx:
        raise click.UsageError(f"--max-tokens {max_tokens} leaves no room for the conversation within --ctx {n_ctx}")
    sampling, seed_given = _sampling(sampling_flags)
    try:
        if system is not None:
            utf8_or_error(system, "--system")
        path, _ = models.resolve(model)
        ranges = read_layout(path).balanced_ranges(stages or 2)
        with LocalCluster(path, ranges, threads=threads, n_ctx=n_ctx, max_sessions=1, secure=secure,
                          numerics=numerics) as cluster:
            click.echo(f"meshnet chat: {model or models.DEFAULT_MODEL} in {len(ranges)} stages "
                       f"{' '.join(r.label for r in ranges)} as worker processes, context {n_ctx} tokens, "
                       f"{'greedy' if sampling is None or sampling.temperature <= 0 else 'sampled'} answers of up to "
                       f"{max_tokens} tokens. Ctrl-C stops an answer, Ctrl-D quits.", err=True)
            _readline_if_terminal()
            Chat(cluster.coordinator, n_ctx=n_ctx, max_tokens=max_tokens, sampling=sampling, seed_given=seed_given,
                 system=system).run()
    except MeshnetError as e:
        _fail(e)


def _readline_if_terminal() -> None:
    """Line editing and the up-arrow history for input(), in a terminal."""
    if sys.stdin.isatty():
        try:
            import readline  # noqa: F401  (input() uses it once imported)
        except ImportError:
            pass


@main.command()
@click.option("--coordinator", required=True, help="the coordinator's ROUTER address, e.g. tcp://127.0.0.1:5555")
@click.option("--model", default=None, help="model name or GGUF path [default: smollm2]")
@click.option("--layers", required=True, callback=_usage_error(lambda v: None if v == "auto" else LayerRange.parse(v)),
              help="the half-open layer range A:B this worker holds, e.g. 0:15, or 'auto': the coordinator plans it "
                   "within --mem")
@click.option("--mem", default=None, callback=_usage_error(_size),
              help="memory this worker admits, e.g. 800M or 1.5G (with --layers auto: the planner's budget for it)")
@click.option("--threads", type=click.IntRange(min=0), default=0, help="compute threads [default: one per core]")
@click.option("--ctx", "n_ctx", type=click.IntRange(min=16), default=defaults.N_CTX, show_default=True, help="context tokens per session")
@click.option("--max-sessions", type=click.IntRange(min=1, max=256), default=defaults.MAX_SESSIONS, show_default=True)
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
                                                 "may send this stage activations")
@click.option("--gpu", is_flag=True, help="run the stage's layers, KV cache and compute on the first GPU (the GPU engine: "
                                            "make GPU=cuda); it then reports backend CUDA and the GPU's name")
@_numerics_option(baseline=True)
def worker(coordinator, model, layers, mem, threads, n_ctx, max_sessions, max_queue, data_bind, cpu, heartbeat_interval,
           heartbeat_liveness, secret_file, coordinator_key_file, insecure, gpu, numerics):
    """Serve one layer range of a model to a coordinator until SIGTERM."""
    from meshnet.net import security
    from meshnet.stage.worker import StageWorker, WorkerConfig

    if layers is None and mem is None:
        raise click.UsageError("--layers auto needs --mem: the memory the planner may give this worker")
    if (secret_file is None) != (coordinator_key_file is None):
        raise click.UsageError("--secret and --coordinator-key go together: this worker's key and the coordinator's")
    _refuse_open_without_keys("--data-bind", data_bind, secret_file, insecure)
    if numerics == "baseline":
        # the engine before the classes turned the tiled matmul off for its whole process
        os.environ.setdefault("GGML_CPU_TILED_MM", "0")
    try:
        path, sha256 = models.resolve(model)
        config = WorkerConfig(coordinator=coordinator, model_path=str(path), layers=layers,
                              model_sha256=sha256, n_ctx=n_ctx, max_sessions=max_sessions, n_threads=threads,
                              data_bind=data_bind, cpu=cpu, mem=mem, gpu=gpu, numerics=numerics,
                              keys=security.load_secret(secret_file) if secret_file else None,
                              coordinator_key=security.load_public(coordinator_key_file) if coordinator_key_file else None)
        if max_queue is not None:
            config.max_queue = max_queue
        if heartbeat_interval is not None:
            config.heartbeat_interval = heartbeat_interval
        if heartbeat_liveness is not None:
            config.heartbeat_liveness = heartbeat_liveness
        sys.exit(StageWorker(config).run())
    except MeshnetError as e:
        _fail(e)


@main.command()
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
              help="the coordinator's CURVE key (NAME.key_secret): workers must connect with a key in --allow")
@click.option("--allow", "allow_path", default=None, help="the workers' public keys: a NAME.key file or a directory of them")
@click.option("--insecure", is_flag=True, help="serve a non-loopback --bind without keys: anyone who can reach it may "
                                                 "register as a worker")
@_resume_options
def coordinator(bind, prompt, max_tokens, wait, as_json, metrics_port, allow_mixed, reference, data_bind, secret_file,
                allow_path, insecure, resume_wait, max_resumes):
    """Track stage workers and route sessions through them.

    Without --prompt it serves until Ctrl-C, printing each change of the route."""
    import time

    from meshnet.core.text import utf8_or_error
    from meshnet.evidence.drift import DriftMeter
    from meshnet.net import security
    from meshnet.net.metrics_server import MetricsServer
    from meshnet.route.config import CoordinatorConfig
    from meshnet.route.coordinator import Coordinator

    if allow_mixed and reference is None:
        raise click.UsageError("--allow-mixed needs --reference MODEL: a mixed route's output is compared with it")
    if (secret_file is None) != (allow_path is None):
        raise click.UsageError("--secret and --allow go together: the coordinator's key and the workers' keys")
    _refuse_open_without_keys("--bind", bind, secret_file, insecure)
    if data_bind is not None:
        _refuse_open_without_keys("--data-bind", data_bind, secret_file, insecure)
    try:
        if prompt is not None:
            utf8_or_error(prompt, "--prompt")
        reference_path = str(models.resolve(reference)[0]) if reference else None
        keys = security.load_secret(secret_file) if secret_file else None
        allowed = security.load_allowed(allow_path) if allow_path else None
        config = CoordinatorConfig(bind, data_bind=data_bind, allow_mixed=allow_mixed, keys=keys,
                                   allowed_workers=allowed, resume_wait=resume_wait, max_resumes=max_resumes)
        coord = Coordinator(config, drift_meter=DriftMeter(reference_path) if reference_path else None)
    except MeshnetError as e:
        _fail(e)
    with coord:
        click.echo(f"coordinator listening on {coord.endpoint}", err=True)
        if metrics_port is not None:
            server = MetricsServer(coord.metrics, metrics_port)
            click.echo(f"metrics on http://127.0.0.1:{server.port}/metrics and /status", err=True)
        if prompt is None:
            last = None
            try:
                while True:
                    report = coord.route_report()
                    status = ("route " + " ".join(report["route"]) + (" (mixed classes)" if report.get("mixed") else "")
                              if report["route"] else f"no route: {report['error']}")
                    status += "".join(f"\n  kept out {name}: {why}" for name, why in report["kept_out"].items())
                    if report["route"]:   # without a route the reason already names them
                        status += "".join(f"\n  {name}: {state}" for name, state in report["standby"].items())
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
            stream = None if as_json else _TextStreamer(prompt)
            for event in session:
                if stream:
                    stream(event.piece)
            text = coord.detokenize(session.tokens)
        except MeshnetError as e:
            _fail(e)
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


@main.group()
def keys():
    """CURVE keys for encrypted, authenticated links between coordinator and workers."""


@keys.command("generate")
@click.argument("directory")
@click.option("--name", required=True, help="the key's name: writes NAME.key (public) and NAME.key_secret")
def keys_generate(directory, name):
    """Write a key pair into DIRECTORY (give NAME.key to the peers, keep NAME.key_secret)."""
    from meshnet.net import security

    try:
        public, secret = security.generate(directory, name)
    except MeshnetError as e:
        _fail(e)
    click.echo(f"public key {public} (hand it to the peers); secret key {secret} (keep it here)")


@main.command()
@click.option("--url", default="http://127.0.0.1:9464", show_default=True,
              help="a coordinator's metrics address (meshnet coordinator --metrics-port)")
@click.option("--watch", type=click.FloatRange(min=0.2), default=None, help="refresh every N seconds")
@click.option("--json", "as_json", is_flag=True)
def status(url, watch, as_json):
    """Show a running coordinator's stages: memory, KV, queue, hops, failures."""
    import time
    import urllib.error
    import urllib.request

    timeout = 10
    while True:
        try:
            with urllib.request.urlopen(url.rstrip("/") + "/status", timeout=timeout) as response:
                snapshot = json.loads(response.read())
        except TimeoutError:
            _fail(MeshnetError(errors.TIMEOUT, f"the coordinator at {url} did not answer within {timeout} s"))
        except urllib.error.URLError as e:
            if isinstance(e.reason, TimeoutError):  # a timeout while connecting comes wrapped
                _fail(MeshnetError(errors.TIMEOUT, f"the coordinator at {url} did not answer within {timeout} s"))
            _fail(MeshnetError(errors.UNREACHABLE, f"no coordinator metrics at {url}: {e.reason}"))
        except (OSError, ValueError) as e:
            _fail(MeshnetError(errors.UNREACHABLE, f"no coordinator metrics at {url}: {e}"))
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
        if s.get("unreachable"):  # what the coordinator knows of a worker that did not answer
            failures = f"SILENT (last heard {s.get('last_heard_s', 0):.1f} s ago: {s['unreachable']}); {failures}"
        rows.append(f"{s['stage']:<10} {s['worker']:<12} {num('rss_bytes', mib):>8} {num('model_bytes', mib):>9} "
                    f"{num('kv_bytes_used', mib):>11} {num('n_sessions', fmt='{:.0f}'):>8} {num('queue_depth', fmt='{:.0f}'):>5} "
                    f"{num('hop_us_p50', fmt='{:.0f}'):>10} {num('hop_us_p99', fmt='{:.0f}'):>8} {num('seam_bytes', mib):>8} {failures}"
                    + ("" if s.get("in_route", True) else f"  NOT IN THE ROUTE: {s.get('kept_out') or 'no route'}"))
    sessions = ", ".join(f"{k} {v}" for k, v in snapshot["sessions"].items())
    route = f"\nno route: {snapshot['route_error']}" if snapshot.get("route_error") else ""
    return "\n".join(rows) + f"\nsessions: {sessions}" + route


def _stage_indices(text: str) -> tuple[int, ...] | str:
    """--gpu 0 or 0,2 (route positions) or all."""
    if text == "all":
        return "all"
    try:
        indices = tuple(sorted({int(part) for part in text.split(",")}))
    except ValueError:
        raise MeshnetError(errors.INVALID_ARGUMENT, f"--gpu takes stage positions (0 is the head), e.g. 0 or 0,2, "
                           f"or all; not {text!r}") from None
    if not indices or indices[0] < 0:
        raise MeshnetError(errors.INVALID_ARGUMENT, f"--gpu: stage positions start at 0 (the head); not {text!r}")
    return indices


@main.command()
@click.option("--model", default=None, help=f"model name or GGUF path [default: {models.DEFAULT_MODEL}]")
@click.option("--stages", type=click.IntRange(min=1), default=None,
              help="split into N balanced stages; 1: the whole model in one worker [default: 2]")
@click.option("--split", "split", default=None, callback=_usage_error(parse_seams), help="seams, e.g. 15 or 10,20")
@click.option("--gpu", "gpu", default=None, callback=_usage_error(_stage_indices),
              help="run these stages on the GPU (worker --gpu): positions such as 0 (the head) or 0,2, or all")
@click.option("--allow-mixed", is_flag=True, help="let stages of another class (a GPU stage beside CPU ones) into the "
                                                  "route; without it the tracker refuses such a route, naming both classes")
@click.option("--against", type=click.Choice(["whole"]), default="whole", show_default=True,
              help="what the route is compared with: the whole model on the CPU in this process")
@click.option("--tokens", "n_tokens", type=click.IntRange(min=1), default=64, show_default=True, help="greedy tokens per prompt")
@click.option("--threads", type=click.IntRange(min=0), default=0, help="threads per stage and for the whole model [default: one per core]")
@click.option("--json", "as_json", is_flag=True)
@_numerics_option
def drift(model, stages, split, gpu, allow_mixed, against, n_tokens, threads, as_json, numerics):
    """How far a route of worker processes drifts from the whole model: the bench prompts,
    each step teacher-forced; top-1 agreement, max |logit diff|, KL(whole || route) and the
    first step where the top-1 tokens part, with the route's decode rate. On one backend
    every figure is exactly 0."""
    from meshnet.core.layers import ranges_from_seams
    from meshnet.engine.gguf_layout import read_layout
    from meshnet.evidence.drift import measure_route
    from meshnet.launch.local_cluster import LocalCluster

    if stages is not None and split is not None:
        raise click.UsageError("give --stages or --split, not both")
    try:
        path, sha256 = models.resolve(model)
        layout = read_layout(path)
        ranges = ranges_from_seams(layout.n_layer, split) if split is not None else layout.balanced_ranges(stages or 2)
        gpu_stages = range(len(ranges)) if gpu == "all" else (gpu or ())
        if any(i >= len(ranges) for i in gpu_stages):
            raise click.BadParameter(f"the route has {len(ranges)} stages, positions 0 to {len(ranges) - 1}",
                                     param_hint="--gpu")
        cluster = LocalCluster(path, ranges, threads=threads, n_ctx=1024, max_sessions=1, gpu_stages=gpu_stages,
                               allow_mixed=allow_mixed, numerics=numerics)
        report = measure_route(cluster, path, n_tokens, threads)
    except MeshnetError as e:
        _fail(e)
    report = {"model": str(path), "model_sha256": sha256, "against": against, **report}
    if as_json:
        click.echo(json.dumps(report))
        return
    route = " ".join(f"{s['layers']}:{s['backend']}" for s in report["route"])
    click.echo(f"{Path(path).name}: route {route} against the whole model on the CPU, {len(report['prompts'])} prompts "
               f"x {n_tokens} tokens (teacher-forced)")
    for s in report["route"]:
        vram = f", VRAM {s['vram_bytes'] / (1 << 20):.0f} MiB" if s.get("vram_bytes") else ""
        compute = f", {s['compute_us_per_forward'] / 1e3:.2f} ms per forward" if s.get("compute_us_per_forward") else ""
        click.echo(f"  stage {s['layers']}: {s['backend']} ({s['device']}), RSS {s['rss_bytes'] / (1 << 20):.0f} MiB"
                   f"{vram}{compute}")
    click.echo(f"{'prompt':<40} {'top-1 agreement':>15} {'max |dlogit|':>12} {'max KL':>10} {'first divergence':>16}")
    for r in report["prompts"]:
        first = "-" if r["first_divergence"] is None else str(r["first_divergence"])
        click.echo(f"{r['prompt'][:40]:<40} {r['top1_agreement']:>15.3f} {r['max_abs_logit_diff']:>12.4g} "
                   f"{r['max_kl']:>10.3g} {first:>16}")
    click.echo(f"decode: route {report['route_decode_tok_s']:.1f} tok/s, whole model on the CPU in this process "
               f"{report['whole_decode_tok_s']:.1f} tok/s (medians over the prompts)")


@main.command()
@click.option("--model", "model_names", default="smollm2", show_default=True, help="comma-separated model names or paths")
@click.option("--stages", type=click.IntRange(min=2), default=2, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=5, show_default=True, help="runs of each prompt per configuration")
@click.option("--decode", "n_decode", type=click.IntRange(min=1), default=64, show_default=True, help="tokens decoded per run")
@click.option("--threads", type=click.IntRange(min=0), default=0, help="threads per stage [default: one per core]")
@click.option("--configs", default=",".join(("whole", "stages", "workers", "plain")), show_default=True,
              help="which of whole, stages, workers (with CURVE keys, as meshnet run) and plain (workers without "
                   "keys) to run")
@click.option("--sessions", type=click.IntRange(min=1, max=64), default=1, show_default=True,
              help="also run N concurrent sessions in each configuration and report their aggregate decode rate")
@click.option("--numerics", "numerics_list", default="invariant", show_default=True,
              help="numerics classes, comma-separated: every configuration runs in the first; each other one "
                   "(invariant, stock, or baseline: the kernels before the classes) adds worker processes of "
                   "its own, measured side by side")
@click.option("--json", "as_json", is_flag=True)
def bench(model_names, stages, repeats, n_decode, threads, configs, sessions, numerics_list, as_json):
    """Whole model vs N stages in one process vs N worker processes, side by side."""
    from meshnet.core.numerics import CHOICES, CLASSES
    from meshnet.evidence.bench import CONFIGS, format_report, run_bench

    chosen = tuple(c for c in configs.split(",") if c)
    if not chosen or set(chosen) - set(CONFIGS):
        raise click.BadParameter(f"choose from {', '.join(CONFIGS)}", param_hint="--configs")
    classes = tuple(dict.fromkeys(c for c in numerics_list.split(",") if c))
    if not classes or set(classes) - set(CLASSES) or classes[0] not in CHOICES:
        raise click.BadParameter(f"choose from {', '.join(CLASSES)} (baseline not first: the in-process "
                                 "configurations run the first)", param_hint="--numerics")
    reports = []
    try:
        for name in model_names.split(","):
            report = run_bench(name, stages, repeats, n_decode, threads, chosen, sessions, classes)
            reports.append(report)
            if not as_json:
                click.echo(format_report(report))
    except MeshnetError as e:
        _fail(e)
    if as_json:
        click.echo(json.dumps(reports))


@main.command()
@click.option("--model", default=models.DEFAULT_MODEL, show_default=True, help="model name or GGUF path")
@click.option("--out", "out_dir", default="evidence", show_default=True, help="where the run's directory is written")
@click.option("--threads", type=click.IntRange(min=0), default=0, help="threads per stage [default: one per core]")
@_numerics_option
def accept(model, out_dir, threads, numerics):
    """Run the local two-process acceptance and write evidence/<run-id>/ (manifest + README).
    Each numerics class is also held to stock llama.cpp built as it says (make reference)."""
    from meshnet.evidence.accept import run_acceptance

    try:
        manifest, run_dir = run_acceptance(model, out_dir, threads, numerics)
    except MeshnetError as e:
        _fail(e)
    for check in manifest["checks"]:
        click.echo(f"{check['status']:>8}  {check['name']}" + (f"  ({check['reason']})" if "reason" in check else "")
                   + (f"  {check['error']}" if "error" in check and check["status"] != "passed" else ""))
    click.echo(f"{'PASSED' if manifest['passed'] else 'FAILED'}: evidence in {run_dir}")
    sys.exit(0 if manifest["passed"] else 1)


@main.command()
@click.argument("model", required=False)
@click.option("--node", "nodes", multiple=True, required=True, callback=_nodes,
              help="NAME=MEM, a node and the memory it admits (e.g. laptop=6G), in route order; repeat per node")
@click.option("--ctx", "n_ctx", type=click.IntRange(min=16), default=defaults.N_CTX, show_default=True, help="context tokens per session")
@click.option("--sessions", type=click.IntRange(min=1, max=256), default=defaults.MAX_SESSIONS, show_default=True,
              help="sessions each stage keeps KV for (meshnet worker --max-sessions)")
@click.option("--overhead", default=None, callback=_usage_error(_size),
              help="memory per worker process beside the stage itself [default: 128M]")
@click.option("--json", "as_json", is_flag=True, help='one object {"stages": [{"node", "layers": [A, B], "bytes"}, ...]}')
def plan(model, nodes, n_ctx, sessions, overhead, as_json):
    """Split MODEL over nodes by the memory each admits: each stage, in route order, as large as its node allows."""
    from meshnet.core.planner import OVERHEAD, ModelCost, Node, Settings, format_size
    from meshnet.core.planner import plan as make_plan
    from meshnet.engine.gguf_layout import read_layout

    settings = Settings(n_ctx=n_ctx, n_sessions=sessions)
    try:
        path, _ = models.resolve(model)
        cost = ModelCost.from_layout(read_layout(path), _layer_memory_if_built(path))
        result = make_plan(cost, [Node(name, mem, settings) for name, mem in nodes],
                           OVERHEAD if overhead is None else overhead)
    except MeshnetError as e:
        if as_json and "shortfall_bytes" in e.context:
            click.echo(json.dumps({"error": e.to_dict()}))
        _fail(e)
    if as_json:
        click.echo(json.dumps(result.to_dict()))
        return
    admitted = dict(nodes)
    click.echo(f"{'node':<16} {'layers':<10} {'needs':>12} {'admits':>12}")
    for stage in result.stages:
        click.echo(f"{stage.node:<16} {stage.layers.label:<10} {format_size(stage.bytes):>12} "
                   f"{format_size(admitted[stage.node]):>12}")
    for name, why in result.left_out.items():
        click.echo(f"{name:<16} {'-':<10} left out: {why}")


@main.command()
@click.option("--model", default=None, help="model name or GGUF path; clients ask for it by its name (a path's file "
                                            "stem) [default: smollm2]")
@click.option("--host", default="127.0.0.1", show_default=True, help="the HTTP address (loopback unless you say otherwise)")
@click.option("--port", type=click.IntRange(min=0, max=65535), default=8080, show_default=True, help="0: a free port")
@click.option("--api-key", envvar="MESHNET_API_KEY", default=None,
              help="clients must send 'Authorization: Bearer KEY' on /v1 [env: MESHNET_API_KEY]")
@click.option("--stages", type=click.IntRange(min=1), default=None, help="local workers: N stages [default: 2]")
@click.option("--threads", type=click.IntRange(min=0), default=None, help="local workers: threads per stage [default: one per core]")
@click.option("--ctx", "n_ctx", type=click.IntRange(min=16), default=None,
              help=f"local workers: context tokens per session [default: {defaults.N_CTX}]")
@click.option("--max-sessions", type=click.IntRange(min=1, max=256), default=None,
              help=f"local workers: sessions at once; beyond them a request gets 429 [default: {defaults.MAX_SESSIONS}]")
@click.option("--coordinator", "bind", default=None,
              help="instead of local workers, bind a coordinator here (e.g. tcp://0.0.0.0:5555) and serve through the "
                   "meshnet workers that connect to it")
@click.option("--secret", "secret_file", default=None, help="with --coordinator: its CURVE key (NAME.key_secret)")
@click.option("--allow", "allow_path", default=None, help="with --coordinator: the workers' public keys (NAME.key or a directory)")
@click.option("--insecure", is_flag=True, help="listen beyond loopback without keys (--coordinator) or without --api-key "
                                            "(--host); local workers: plain links instead of fresh CURVE keys")
@_numerics_option
@_resume_options
def serve(model, host, port, api_key, stages, threads, n_ctx, max_sessions, bind, secret_file, allow_path, insecure,
          numerics, resume_wait, max_resumes):
    """Serve the model over OpenAI's HTTP API (/v1/chat/completions, /v1/completions, /v1/models) until Ctrl-C."""
    from meshnet.net import security
    from meshnet.serve.launch import listen
    from meshnet.serve.launch import serve as run_server

    local = {"--stages": stages, "--threads": threads, "--ctx": n_ctx, "--max-sessions": max_sessions,
             "--numerics": numerics}
    if bind is not None and any(v is not None for v in local.values()):
        raise click.UsageError(f"{next(k for k, v in local.items() if v is not None)} is for local workers: with "
                               "--coordinator, give it to each meshnet worker")
    if (secret_file is None) != (allow_path is None) or (secret_file is not None and bind is None):
        raise click.UsageError("--secret and --allow go together, with --coordinator")
    if bind is not None:
        _refuse_open_without_keys("--coordinator", bind, secret_file, insecure)
    if api_key is None and not security.is_loopback(f"tcp://{host}:{port}"):
        if not insecure:
            raise click.UsageError(f"--host {host} is reachable beyond this machine and no --api-key is given: anyone "
                                   "could use the model. Give --api-key (or MESHNET_API_KEY), or --insecure")
        click.echo(f"WARNING: --host {host} without --api-key (--insecure): anyone who can reach it can use it", err=True)
    try:
        options = {"keys": security.load_secret(secret_file),
                   "allowed_workers": security.load_allowed(allow_path)} if secret_file else {}
        options.update(resume_wait=resume_wait, max_resumes=max_resumes)
        run_server(model, listen(host, port), api_key=api_key, bind=bind, coordinator_options=options,
                   stages=stages or 2, threads=threads or 0, n_ctx=n_ctx or defaults.N_CTX, max_sessions=max_sessions or defaults.MAX_SESSIONS,
                   secure=not insecure, numerics=numerics, echo=lambda line: click.echo(line, err=True))
    except MeshnetError as e:
        _fail(e)


def _layer_memory_if_built(path):
    """Each layer's memory from the engine; None without an engine (then every layer is
    counted as full-context attention, as a transformer's are)."""
    from meshnet.engine.binding import layer_memory

    try:
        return layer_memory(path)
    except MeshnetError as e:
        if e.code != "engine_missing":
            raise
        return None


@main.command()
@click.argument("model", required=False)
@click.option("--json", "as_json", is_flag=True)
def inspect(model, as_json):
    """Describe a GGUF model: architecture, sizes, quant types, bytes per layer."""
    from meshnet.engine.gguf_layout import read_layout

    try:
        path, sha256 = models.resolve(model)
        layout = read_layout(path)
    except MeshnetError as e:
        _fail(e)
    from meshnet.engine.binding import arch_support

    try:
        split_status, split_reason = arch_support(layout.arch)
    except MeshnetError as e:   # no engine built: the file's own facts are still worth showing
        split_status, split_reason = "unknown", e.message
    info = dict(vars(layout), sha256=sha256, splits=split_status == "splits", split_support=split_status,
                split_reason=split_reason)
    if as_json:
        click.echo(json.dumps(info))
        return
    mib = 1 << 20
    click.echo(f"file        {layout.path}")
    click.echo(f"sha256      {sha256}")
    click.echo(f"arch        {layout.arch}")
    split_line = ("yes: any layer range gives the whole model's logits" if split_status == "splits"
                  else f"{split_status}: {split_reason}")
    click.echo(f"split       {split_line}")
    click.echo(f"layers      {layout.n_layer}")
    click.echo(f"n_embd      {layout.n_embd}")
    click.echo(f"vocab       {layout.n_vocab}")
    click.echo(f"quant types {', '.join(f'{k} x{v}' for k, v in layout.quant_types.items())}")
    click.echo(f"size        {layout.file_bytes / mib:.1f} MiB")
    click.echo(f"embeddings  {layout.input_bytes / mib:.2f} MiB (head)")
    click.echo(f"output      {layout.output_bytes / mib:.2f} MiB (tail)"
               + ("; tied: the tail also holds token_embd" if layout.tied_embeddings else ""))
    for i, n in enumerate(layout.layer_bytes):
        click.echo(f"layer {i:<5} {n / mib:.2f} MiB")


if __name__ == "__main__":
    main()
