"""The meshnet command line."""

from __future__ import annotations

import json
import sys

import click

from . import models
from .errors import MeshnetError

DEFAULT_PROMPT = "The capital of France is"


def _fail(error: MeshnetError):
    click.echo(f"error: {error}", err=True)
    sys.exit(1)


@click.group()
@click.version_option(package_name="meshnet")
def main():
    """Run one GGUF model across several processes and hosts, a layer range each."""


def _parse_split(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise click.BadParameter(f"'{text}' is not a comma-separated list of layer numbers")


@main.command()
@click.option("--model", default=None, help=f"model name ({', '.join(sorted(models.MODELS))}) or GGUF path [default: {models.DEFAULT_MODEL}]")
@click.option("--stages", type=click.IntRange(min=1), default=None, help="split the layers evenly into N stages [default: 2]")
@click.option("--split", "split", default=None, help="seams, e.g. 15 for [0,15)+[15,n) or 10,20 for three stages")
@click.option("--prompt", default=DEFAULT_PROMPT, show_default=True, help="raw text, tokenized as llama.cpp does for the model")
@click.option("--max-tokens", type=click.IntRange(min=1), default=48, show_default=True)
@click.option("--threads", type=click.IntRange(min=0), default=0, help="threads per stage [default: one per core]")
@click.option("--ctx", "n_ctx", type=click.IntRange(min=16), default=2048, show_default=True, help="context tokens")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object (tokens, text, metrics) on the last line")
def run(model, stages, split, prompt, max_tokens, threads, n_ctx, as_json):
    """Generate greedily from PROMPT with the model split into stages."""
    from .gguf_layout import read_layout
    from .pipeline import LocalPipeline, even_ranges, ranges_from_seams

    if stages is not None and split is not None:
        raise click.UsageError("give --stages or --split, not both")
    try:
        path, sha256 = models.resolve(model)
        layout = read_layout(path)
        ranges = (
            ranges_from_seams(layout.n_layer, _parse_split(split))
            if split is not None
            else even_ranges(layout.n_layer, stages or 2)
        )
        with LocalPipeline(path, ranges, n_ctx=n_ctx, max_sessions=1, n_threads=threads) as pipe:
            prompt_tokens = pipe.head.tokenize(prompt)
            if len(prompt_tokens) + max_tokens > n_ctx:
                raise MeshnetError("context_full", f"{len(prompt_tokens)} prompt tokens + {max_tokens} new ones exceed --ctx {n_ctx}")
            streamer = None if as_json else _TextStreamer(pipe.tail, prompt)
            gen = pipe.generate(prompt_tokens, max_tokens, on_token=streamer)
            text = pipe.tail.detokenize(gen.tokens)
    except MeshnetError as e:
        _fail(e)

    metrics = dict(gen.metrics, model_sha256=sha256, stop_reason=gen.stop_reason)
    if as_json:
        click.echo(json.dumps({"tokens": gen.tokens, "text": text, "metrics": metrics}))
        return
    streamer.finish()
    decode = f"{metrics['decode_tok_s']:.1f}" if metrics["decode_tok_s"] else "-"
    click.echo(
        f"[{len(ranges)} stages {' '.join(f'[{a},{b})' for a, b in ranges)}] "
        f"prompt {metrics['prompt_tokens']} tok, ttft {metrics['ttft_ms']:.0f} ms, "
        f"prefill {metrics['prefill_tok_s']:.1f} tok/s, decode {decode} tok/s, "
        f"{metrics['generated_tokens']} tokens ({gen.stop_reason})",
        err=True,
    )


class _TextStreamer:
    """Prints the continuation as it grows; detokenizing the whole tail each time keeps
    multi-byte characters split across tokens intact."""

    def __init__(self, stage, prompt: str):
        self.stage, self.tokens, self.printed = stage, [], ""
        click.echo(prompt, nl=False)

    def __call__(self, token: int) -> None:
        self.tokens.append(token)
        text = self.stage.detokenize(self.tokens)
        if not text.endswith("\ufffd"):
            click.echo(text[len(self.printed):], nl=False)
            self.printed = text
        sys.stdout.flush()

    def finish(self) -> None:
        click.echo()


@main.command()
@click.argument("model", required=False)
@click.option("--json", "as_json", is_flag=True)
def inspect(model, as_json):
    """Describe a GGUF model: architecture, sizes, quant types, bytes per layer."""
    from .gguf_layout import read_layout

    try:
        path, sha256 = models.resolve(model)
        layout = read_layout(path)
    except MeshnetError as e:
        _fail(e)
    info = dict(vars(layout), sha256=sha256)
    if as_json:
        click.echo(json.dumps(info))
        return
    mib = 1 << 20
    click.echo(f"file        {layout.path}")
    click.echo(f"sha256      {sha256}")
    click.echo(f"arch        {layout.arch}")
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
