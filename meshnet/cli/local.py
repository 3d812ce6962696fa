"""`meshnet run` and `meshnet chat`: one model split over local stages, in this process
or over worker processes."""

from __future__ import annotations

import codecs
import json
import sys

import click

from meshnet.cli.options import (DEFAULT_PROMPT, attention_options, fail, figure, local_keys_option, numerics_option,
                                prefix_cache_option,
                                resume_options, sampling_of_flags, sampling_options, speculate_option, usage_error)
from meshnet.core import defaults
from meshnet.core import errors
from meshnet.core import kv_cache
from meshnet.core.errors import MeshnetError
from meshnet.core.layers import parse_seams
from meshnet.engine import models


@click.command()
@click.option("--model", default=None, help=f"model name ({', '.join(sorted(models.MODELS))}), GGUF path (any split of one), "
              f"hf:ORG/REPO[:QUANT|:FILE] or ollama:NAME[:TAG] [default: {models.DEFAULT_MODEL}]")
@click.option("--stages", type=click.IntRange(min=1), default=None, help="split the model into N stages with even shares of the per-token work [default: 2]")
@click.option("--split", "split", default=None, callback=usage_error(parse_seams),
              help="seams, e.g. 15 for [0,15)+[15,n) or 10,20 for three stages")
@click.option("--prompt", default=DEFAULT_PROMPT, show_default=True, help="raw text, tokenized as llama.cpp does for the model")
@click.option("--chat", "chat_message", default=None,
              help="instead of continuing --prompt, answer this user message through the model's chat template")
@click.option("--max-tokens", type=click.IntRange(min=1), default=48, show_default=True)
@click.option("--threads", type=click.IntRange(min=0), default=0, help="threads per stage [default: one per physical core]")
@click.option("--ctx", "n_ctx", type=click.IntRange(min=16), default=defaults.N_CTX, show_default=True, help="context tokens")
@click.option("--in-process", is_flag=True, help="run every stage in this process instead of worker processes")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object (tokens, text, metrics) on the last line")
@local_keys_option
@numerics_option
@attention_options
@sampling_options
@resume_options
@prefix_cache_option
@speculate_option
def run(model, stages, split, prompt, chat_message, max_tokens, threads, n_ctx, in_process, as_json, secure, numerics,
        flash_attn, kv_type, resume_wait, max_resumes, prefix_cache_mib, speculate, **sampling_flags):
    """Continue PROMPT (or answer a --chat message) with the model split into stages (worker processes on this machine)."""
    from meshnet.core.conversation import answer_sampling
    from meshnet.core.layers import ranges_from_seams
    from meshnet.core.numerics import DEFAULT
    from meshnet.core.text import utf8_or_error
    from meshnet.engine.gguf_layout import read_layout

    if stages is not None and split is not None:
        raise click.UsageError("give --stages or --split, not both")
    if in_process and speculate:
        raise click.UsageError("--speculate drafts through worker processes: leave out --in-process")
    if chat_message is not None and click.get_current_context().get_parameter_source("prompt").name == "COMMANDLINE":
        raise click.UsageError("give --prompt (raw text to continue) or --chat (a message to answer), not both")
    sampling = answer_sampling(*sampling_of_flags(sampling_flags))
    try:
        utf8_or_error(prompt, "--prompt")
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
        stream = None if as_json else TextStreamer(prompt if chat_message is None else "")
        if in_process:
            tokens, text, metrics, stop_reason = _run_in_process(path, ranges, prompt, max_tokens, threads, n_ctx, stream,
                                                                 chat_message=chat_message, sampling=sampling,
                                                                 numerics=numerics, flash_attn=flash_attn,
                                                                 kv_type=kv_type)
        else:
            tokens, text, metrics, stop_reason = _run_on_workers(path, ranges, prompt, max_tokens, threads, n_ctx, stream,
                                                                 secure, chat_message=chat_message, sampling=sampling,
                                                                 resume_wait=resume_wait, max_resumes=max_resumes,
                                                                 numerics=numerics, flash_attn=flash_attn,
                                                                 kv_type=kv_type, prefix_cache_mib=prefix_cache_mib,
                                                                 speculate=speculate)
    except MeshnetError as e:
        fail(e)

    metrics = dict(metrics, model_sha256=sha256, stop_reason=stop_reason, workers=not in_process, curve=secure,
                   numerics=numerics or DEFAULT, flash_attn=flash_attn, kv_type=kv_type)
    if sampling is not None:
        metrics["sampling"] = sampling.to_wire()   # with its seed: the run can be replayed
    if as_json:
        click.echo(json.dumps({"tokens": tokens, "text": text, "metrics": metrics}))
        return
    stream.finish()
    # a figure that was not measured (one stage has no hop; one token, no decode rate) shows as "-"
    hops = f", hop p50 {figure(metrics.get('hop_us_p50'), '{:.0f}')} us" if len(ranges) > 1 else ""
    click.echo(
        f"[{len(ranges)} stage{'s' if len(ranges) > 1 else ''} {' '.join(r.label for r in ranges)}"
        f"{' in-process' if in_process else ' as worker processes'}{', CURVE on every link' if secure else ''}] "
        f"prompt {metrics['prompt_tokens']} tok, ttft {figure(metrics.get('ttft_ms'), '{:.0f}')} ms, "
        f"prefill {figure(metrics.get('prefill_tok_s'))} tok/s, decode {figure(metrics.get('decode_tok_s'))} tok/s{hops}, "
        f"{metrics['generated_tokens']} tokens ({stop_reason})",
        err=True,
    )


def _check_context(n_prompt: int, max_tokens: int, n_ctx: int) -> None:
    if n_prompt + max_tokens > n_ctx:
        raise MeshnetError(errors.CONTEXT_FULL, f"{n_prompt} prompt tokens + {max_tokens} new ones exceed --ctx {n_ctx}")


def _run_in_process(path, ranges, prompt, max_tokens, threads, n_ctx, stream, chat_message=None, sampling=None,
                    numerics=None, flash_attn=False, kv_type=kv_cache.DEFAULT):
    from meshnet.engine.pipeline import LocalPipeline

    with LocalPipeline(path, ranges, n_ctx=n_ctx, max_sessions=1, n_threads=threads, numerics=numerics,
                       flash_attn=flash_attn, kv_type=kv_type) as pipe:
        if chat_message is None:
            prompt_tokens = pipe.head.tokenize(prompt)
        else:   # as the workers' head does it (meshnet/core/conversation.py prompt_tokens)
            text = pipe.head.chat_template([{"role": "user", "content": chat_message}])
            prompt_tokens = pipe.head.tokenize(text, add_special=True, parse_special=True)
        _check_context(len(prompt_tokens), max_tokens, n_ctx)
        on_token = (lambda t: stream(pipe.tail.detokenize_bytes([t]))) if stream else None
        gen = pipe.generate(prompt_tokens, max_tokens, on_token=on_token, sampling=sampling)
        return gen.tokens, pipe.tail.detokenize(gen.tokens), gen.metrics, gen.stop_reason


def _say(text: str) -> None:
    click.echo(text, err=True)


def _run_on_workers(path, ranges, prompt, max_tokens, threads, n_ctx, stream, secure=False, chat_message=None,
                    sampling=None, resume_wait=None, max_resumes=2, numerics=None, flash_attn=False,
                    kv_type=kv_cache.DEFAULT, prefix_cache_mib=None, speculate=0):
    from meshnet.core.conversation import prompt_tokens as chat_tokens
    from meshnet.launch.local_cluster import LocalCluster

    with LocalCluster(path, ranges, threads=threads, n_ctx=n_ctx, max_sessions=1, secure=secure,
                      resume_wait=resume_wait, max_resumes=max_resumes, numerics=numerics, flash_attn=flash_attn,
                      kv_type=kv_type, prefix_cache_mib=prefix_cache_mib, speculate=speculate, progress=_say, supervise=True) as cluster:
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


class TextStreamer:
    """Prints the prompt, then the continuation as its bytes arrive; a character split
    across two tokens is printed once whole. The prompt waits for the first piece, so what
    the route says while it forms (its load bars) comes before it, not inside the text."""

    def __init__(self, prompt: str):
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.prompt: str | None = prompt

    def _begin(self) -> None:
        if self.prompt is not None:
            click.echo(self.prompt, nl=False)
            self.prompt = None

    def __call__(self, piece: bytes) -> None:
        self._begin()
        click.echo(self.decoder.decode(piece), nl=False)
        sys.stdout.flush()

    def finish(self) -> None:
        self._begin()
        click.echo(self.decoder.decode(b"", final=True))


@click.command()
@click.option("--model", default=None, help=f"model name ({', '.join(sorted(models.MODELS))}), GGUF path (any split of one), "
              f"hf:ORG/REPO[:QUANT|:FILE] or ollama:NAME[:TAG] [default: {models.DEFAULT_MODEL}]")
@click.option("--stages", type=click.IntRange(min=1), default=None, help="split the model into N stages with even shares of the per-token work [default: 2]")
@click.option("--threads", type=click.IntRange(min=0), default=0, help="threads per stage [default: one per physical core]")
@click.option("--ctx", "n_ctx", type=click.IntRange(min=16), default=defaults.N_CTX, show_default=True,
              help="context tokens: the conversation's oldest turns leave it when it is full")
@click.option("--max-tokens", type=click.IntRange(min=1), default=256, show_default=True, help="tokens per answer at most")
@click.option("--system", default=None, help="a system message that opens the conversation (and stays in it)")
@local_keys_option
@numerics_option
@attention_options
@sampling_options
@prefix_cache_option
@speculate_option
def chat(model, stages, threads, n_ctx, max_tokens, system, secure, numerics, flash_attn, kv_type, prefix_cache_mib,
         speculate, **sampling_flags):
    """Talk with the model split into stages (worker processes on this machine), through its own chat template.

    Ctrl-C stops an answer, Ctrl-D quits."""
    from meshnet.cli.chat import Chat
    from meshnet.core.text import utf8_or_error
    from meshnet.engine.gguf_layout import read_layout
    from meshnet.launch.local_cluster import LocalCluster

    if max_tokens >= n_ctx:
        raise click.UsageError(f"--max-tokens {max_tokens} leaves no room for the conversation within --ctx {n_ctx}")
    sampling, seed_given = sampling_of_flags(sampling_flags)
    try:
        if system is not None:
            utf8_or_error(system, "--system")
        path, _ = models.resolve(model)
        ranges = read_layout(path).balanced_ranges(stages or 2)
        with LocalCluster(path, ranges, threads=threads, n_ctx=n_ctx, max_sessions=1, secure=secure,
                          numerics=numerics, flash_attn=flash_attn, kv_type=kv_type,
                          prefix_cache_mib=prefix_cache_mib, speculate=speculate, progress=_say, supervise=True) as cluster:
            click.echo(f"meshnet chat: {model or models.DEFAULT_MODEL} in {len(ranges)} stages "
                       f"{' '.join(r.label for r in ranges)} as worker processes, context {n_ctx} tokens, "
                       f"{'greedy' if sampling is None or sampling.temperature <= 0 else 'sampled'} answers of up to "
                       f"{max_tokens} tokens. Ctrl-C stops an answer, Ctrl-D quits.", err=True)
            _readline_if_terminal()
            Chat(cluster.coordinator, n_ctx=n_ctx, max_tokens=max_tokens, sampling=sampling, seed_given=seed_given,
                 system=system).run()
    except MeshnetError as e:
        fail(e)


def _readline_if_terminal() -> None:
    """Line editing and the up-arrow history for input(), in a terminal."""
    if sys.stdin.isatty():
        try:
            import readline  # noqa: F401  (input() uses it once imported)
        except ImportError:
            pass
