"""What the meshnet commands share: option groups, the parsers of sizes (parse_size,
the planner's) and nodes, and how a command fails (its exit status from the error table)."""

from __future__ import annotations

import functools
import sys

import click

from meshnet.core import errors
from meshnet.core.errors import MeshnetError, exit_status
from meshnet.core.planner import parse_size
from meshnet.launch.supervisor import SUPERVISED_RESUME_WAIT

DEFAULT_PROMPT = "The capital of France is"


def figure(value, fmt: str = "{:.1f}") -> str:
    """A measured figure for a summary line, or "-" where there was nothing to measure."""
    return "-" if value is None else fmt.format(value)


def fail(error: MeshnetError):
    click.echo(f"error: {error}", err=True)
    sys.exit(exit_status(error.code))


def usage_error(parse):
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


def refuse_open_without_keys(option: str, endpoint: str, secret_file, insecure: bool) -> None:
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


def parse_node(text: str):
    name, sep, mem = str(text).partition("=")
    if not sep or not name:
        raise MeshnetError(errors.INVALID_ARGUMENT, f"'{text}' is not NAME=MEM (e.g. laptop=6G)")
    return name, parse_size(mem)


def parse_nodes(ctx, param, values):
    try:
        return [parse_node(v) for v in values]
    except MeshnetError as e:
        raise click.BadParameter(e.message) from None


def local_keys_option(command):
    """Local workers talk to their coordinator over CURVE with keys made for the run, so
    that no other process on this machine can join the route or read its prompts."""
    return click.option("--secure/--insecure", default=True, show_default=True,
                        help="fresh CURVE keys on every link between the coordinator and its local workers; "
                             "--insecure: plain links, which any local process can join")(command)


def numerics_option(command=None, *, baseline: bool = False):
    """--numerics: which kernels the stages compute with (meshnet/core/numerics.py). The worker
    also takes `baseline`, the kernels before the classes, for `meshnet bench` alone."""
    from meshnet.core import numerics

    def decorate(command):
        return click.option("--numerics", type=click.Choice(numerics.CLASSES if baseline else numerics.CHOICES),
                            default=None,
                            help="invariant: every row's logits bit-identical however rows are batched (the CPU, "
                                 "or a GPU on the Vulkan engine); "
                                 "stock: stock llama.cpp's default kernels and its tokens for one session, but a "
                                 "session batched with others may differ from it alone "
                                 "[default: invariant; stock on a GPU]")(command)
    return decorate(command) if command is not None else decorate


def attention_options(command):
    """--flash-attn: llama.cpp's flash-attention kernels, as llama-server uses by default; in
    the invariant class each query row on its own, so its rows stay alike however batched.
    --kv-type: the KV cache's element types (core/kv_cache.py), checked against it (a
    quantized V needs flash attention) before anything starts."""
    from meshnet.core import kv_cache

    @functools.wraps(command)
    def checked(*args, **kwargs):
        try:
            kwargs["kv_type"] = kv_cache.check(kwargs["kv_type"], kwargs["flash_attn"])
        except MeshnetError as e:
            raise click.UsageError(e.message) from None
        return command(*args, **kwargs)
    checked = click.option("--kv-type", "kv_type", default=kv_cache.DEFAULT, show_default=True,
                           metavar="TYPE[,TYPE]",
                           help=f"the KV cache's types, K and V alike or as K,V ({', '.join(kv_cache.TYPES)}): "
                                "q8_0 holds a context in about half of f16's memory, q4_0 in about a quarter; a "
                                "quantized V needs --flash-attn; a class of its own")(checked)
    return click.option("--flash-attn", "flash_attn", is_flag=True, default=False,
                        help="flash attention (llama-server's default on a CPU): attention over the cells in use "
                             "and no 16-bit transposed V; its tokens are those of the whole model with flash "
                             "attention, not without (a class of its own)")(checked)


def prefix_cache_option(command):
    """--prefix-cache: the memory each stage keeps of ended sessions, so that a session
    starting as one of them did (a chat's next turn, a shared system prompt) computes only
    the rest of its prompt."""
    from meshnet.core import defaults

    return click.option("--prefix-cache", "prefix_cache_mib", type=click.IntRange(min=0),
                        default=defaults.PREFIX_CACHE_MIB, show_default=True, metavar="MIB",
                        help="MiB per stage for the KV of ended sessions, least recently used out first; a new "
                             "session that shares their prompt's start restores it instead of computing it, with "
                             "the same tokens (the invariant class, models without recurrent state); 0: off")(command)


def speculate_option(command):
    """--speculate: drafted tokens the route verifies in one pass, the same tokens as without."""
    from meshnet.core.drafts import parse_speculate

    return click.option("--speculate", default="off", show_default=True, callback=usage_error(parse_speculate),
                        metavar="ngram[:K]|off",
                        help="speculative decoding: the head drafts up to K tokens a round (8 for ngram) from what "
                             "followed the session's last tokens earlier in it, and the route keeps those it would "
                             "have drawn itself, so the tokens are the same as without (invariant class, models "
                             "without recurrent state); repetitive text decodes in fewer trips round the "
                             "stages")(command)


def resume_options(command):
    """A session that loses a stage is replayed on a new route: at once when one stands
    ready (a spare), or when one forms within --resume-wait seconds."""
    command = click.option("--max-resumes", type=click.IntRange(min=0), default=2, show_default=True,
                           help="resumes per session at most; then stage_lost")(command)
    return click.option("--resume-wait", type=click.FloatRange(min=0), default=None,
                        help="seconds a session that lost a stage waits for a replacement to register (0: it is "
                             "replayed only on a spare already there, else ends with stage_lost) [default: "
                             f"{SUPERVISED_RESUME_WAIT:g} where the workers are local, which are started again "
                             "when one dies; 0 for workers elsewhere]")(command)


def sampling_options(command):
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


def sampling_of_flags(flags: dict):
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
