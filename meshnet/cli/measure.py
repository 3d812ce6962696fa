"""The commands that measure and plan: `meshnet drift`, `bench`, `accept`, `plan` and
`inspect`."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
import sys

import click

from meshnet.cli.options import (attention_options, fail, numerics_option, parse_nodes, parse_size, speculate_option,
                                 usage_error)
from meshnet.core import defaults
from meshnet.core import errors
from meshnet.core import kv_cache
from meshnet.core.errors import MeshnetError
from meshnet.core.layers import parse_seams
from meshnet.engine import models

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


@click.command()
@click.option("--model", default=None, help=f"model name, GGUF path, hf:ORG/REPO[:QUANT] or ollama:NAME[:TAG] "
              f"[default: {models.DEFAULT_MODEL}]")
@click.option("--stages", type=click.IntRange(min=1), default=None,
              help="split into N balanced stages; 1: the whole model in one worker [default: 2]")
@click.option("--split", "split", default=None, callback=usage_error(parse_seams), help="seams, e.g. 15 or 10,20")
@click.option("--gpu", "gpu", default=None, callback=usage_error(_stage_indices),
              help="run these stages on the GPU (worker --gpu): positions such as 0 (the head) or 0,2, or all")
@click.option("--allow-mixed", is_flag=True, help="let stages of another class (a GPU stage beside CPU ones) into the "
                                                  "route; without it the tracker refuses such a route, naming both classes")
@click.option("--against", type=click.Choice(["whole"]), default="whole", show_default=True,
              help="what the route is compared with: the whole model on the CPU in this process")
@click.option("--tokens", "n_tokens", type=click.IntRange(min=1), default=64, show_default=True, help="greedy tokens per prompt")
@click.option("--threads", type=click.IntRange(min=0), default=0, help="threads per stage and for the whole model [default: one per physical core]")
@click.option("--json", "as_json", is_flag=True)
@numerics_option
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
    # the options' own mistakes first, before a model is looked for (or installed)
    n_stages = len(split) + 1 if split is not None else stages or 2
    gpu_stages = range(n_stages) if gpu == "all" else (gpu or ())
    if any(i >= n_stages for i in gpu_stages):
        raise click.BadParameter(f"the route has {n_stages} stages, positions 0 to {n_stages - 1}", param_hint="--gpu")
    try:
        path, sha256 = models.resolve(model)
        layout = read_layout(path)
        ranges = ranges_from_seams(layout.n_layer, split) if split is not None else layout.balanced_ranges(n_stages)
        cluster = LocalCluster(path, ranges, threads=threads, n_ctx=1024, max_sessions=1, gpu_stages=gpu_stages,
                               allow_mixed=allow_mixed, numerics=numerics)
        report = measure_route(cluster, path, n_tokens, threads)
    except MeshnetError as e:
        fail(e)
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


@click.command()
@click.option("--model", "model_names", default="smollm2", show_default=True, help="comma-separated model names or paths")
@click.option("--stages", type=click.IntRange(min=2), default=2, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=5, show_default=True, help="runs of each prompt per configuration")
@click.option("--decode", "n_decode", type=click.IntRange(min=1), default=64, show_default=True, help="tokens decoded per run")
@click.option("--threads", type=click.IntRange(min=0), default=0, help="threads per stage [default: one per physical core]")
@click.option("--configs", default=",".join(("whole", "stages", "workers", "plain")), show_default=True,
              help="which of whole, stages, workers (with CURVE keys, as meshnet run) and plain (workers without "
                   "keys) to run")
@click.option("--sessions", type=click.IntRange(min=1, max=64), default=1, show_default=True,
              help="also run N concurrent sessions in each configuration and report their aggregate decode rate")
@click.option("--numerics", "numerics_list", default="invariant", show_default=True,
              help="numerics classes, comma-separated: every configuration runs in the first; each other one "
                   "(invariant, stock, or baseline: the kernels before the classes) adds worker processes of "
                   "its own, measured side by side")
@click.option("--trace", "trace_dir", default=None,
              help="record the workers' per-token spans: a table of where a decode token's time goes, and the "
                   "spans and a picture of them (timeline.json, timeline.svg) in this directory")
@click.option("--prompts", "prompt_set", type=click.Choice(["prose", "repetitive"]), default="prose", show_default=True,
              help="the prompts decoded: prose, or text that repeats what came before it (code, lists, refrains)")
@speculate_option
@attention_options
@click.option("--json", "as_json", is_flag=True)
def bench(model_names, stages, repeats, n_decode, threads, configs, sessions, numerics_list, trace_dir, prompt_set,
          speculate, flash_attn, kv_type, as_json):
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
            out = None
            if trace_dir is not None:
                out = os.path.join(trace_dir, os.path.basename(name)) if "," in model_names else trace_dir
                os.makedirs(out, exist_ok=True)
            report = run_bench(name, stages, repeats, n_decode, threads, chosen, sessions, classes, out,
                               speculate=speculate, prompts=prompt_set, flash_attn=flash_attn, kv_type=kv_type)
            reports.append(report)
            if not as_json:
                click.echo(format_report(report))
    except MeshnetError as e:
        fail(e)
    if as_json:
        click.echo(json.dumps(reports))


@click.command()
@click.option("--model", default=models.DEFAULT_MODEL, show_default=True, help="model name or GGUF path")
@click.option("--out", "out_dir", default="evidence", show_default=True, help="where the run's directory is written")
@click.option("--threads", type=click.IntRange(min=0), default=0, help="threads per stage [default: one per physical core]")
@numerics_option
@click.option("--only", "only", multiple=True, metavar="CHECK",
              help="run only this check (repeatable); the others are recorded as not asked for")
def accept(model, out_dir, threads, numerics, only):
    """Run the local two-process acceptance and write evidence/<run-id>/ (manifest + README).
    Each numerics class is also held to stock llama.cpp built as it says (make reference)."""
    from meshnet.evidence.accept import run_acceptance

    try:
        manifest, run_dir = run_acceptance(model, out_dir, threads, numerics, frozenset(only) if only else None)
    except MeshnetError as e:
        fail(e)
    for check in manifest["checks"]:
        click.echo(f"{check['status']:>8}  {check['name']}" + (f"  ({check['reason']})" if "reason" in check else "")
                   + (f"  {check['error']}" if "error" in check and check["status"] != "passed" else ""))
    click.echo(f"{'PASSED' if manifest['passed'] else 'FAILED'}: evidence in {run_dir}")
    sys.exit(0 if manifest["passed"] else 1)


@click.command()
@click.argument("model", required=False)
@click.option("--node", "nodes", multiple=True, required=True, callback=parse_nodes,
              help="NAME=MEM, a node and the memory it admits (e.g. laptop=6G), in route order; repeat per node")
@click.option("--ctx", "n_ctx", type=click.IntRange(min=16), default=None,
              help="context tokens a session may grow to (meshnet worker --ctx) [default: as a worker's, from the model]")
@click.option("--sessions", type=click.IntRange(min=1, max=256), default=defaults.MAX_SESSIONS, show_default=True,
              help="sessions each stage holds at once (meshnet worker --max-sessions)")
@click.option("--kv-pool", type=click.IntRange(min=0), default=None,
              help="cells of each stage's KV pool (meshnet worker --kv-pool) [default: as a worker's, from the model]")
@click.option("--overhead", default=None, callback=usage_error(parse_size),
              help="memory per worker process beside the stage itself [default: 128M]")
@attention_options
@click.option("--tp", "tp_members", type=click.IntRange(min=2, max=8), default=None,
              help="also say what a tensor-parallel group of this many members would give on hosts like this one "
                   "(runs the whole model briefly and a group's exchange over loopback to measure)")
@click.option("--json", "as_json", is_flag=True, help='one object {"stages": [{"node", "layers": [A, B], "bytes"}, ...]}')
def plan(model, nodes, n_ctx, sessions, kv_pool, overhead, flash_attn, kv_type, tp_members, as_json):
    """Split MODEL over nodes by the memory each admits: each stage, in route order, as large as its node allows."""
    from meshnet.core.planner import OVERHEAD, ModelCost, Node, fitted_pool, format_size, worker_settings
    from meshnet.core.planner import plan as make_plan
    from meshnet.engine.gguf_layout import read_layout

    try:
        path, _ = models.resolve(model)
        layout = read_layout(path)
        settings = worker_settings(layout.n_ctx_train, n_ctx, kv_pool, sessions)   # (as a worker with --mem)
        n_ctx = settings.n_ctx
        cost = ModelCost.from_layout(layout, _layer_memory_if_built(path, kv_type))
        overhead = OVERHEAD if overhead is None else overhead
        result = make_plan(cost, [Node(name, mem, settings) for name, mem in nodes], overhead)
    except MeshnetError as e:
        if as_json and "shortfall_bytes" in e.context:
            click.echo(json.dumps({"error": e.to_dict()}))
        fail(e)
    admitted = dict(nodes)
    pools = [fitted_pool(cost, s.layers.start, s.layers.end, settings, admitted[s.node], overhead) for s in result.stages]
    group = _tp_estimate(str(path), layout, tp_members) if tp_members else None
    if as_json:
        planned = result.to_dict()
        for stage, pool in zip(planned["stages"], pools):
            stage["kv_pool"] = pool
        click.echo(json.dumps(dict(planned, n_ctx=n_ctx, **({"tensor_parallel": group} if group else {}))))
        return
    click.echo(f"context {n_ctx} tokens per session at most, {sessions} sessions sharing each stage's KV pool"
               f" (KV cells in {kv_type})")
    click.echo(f"{'node':<16} {'layers':<10} {'needs':>12} {'admits':>12} {'KV pool':>10}")
    for stage, pool in zip(result.stages, pools):
        click.echo(f"{stage.node:<16} {stage.layers.label:<10} {format_size(stage.bytes):>12} "
                   f"{format_size(admitted[stage.node]):>12} {pool:>10}")
    for name, why in result.left_out.items():
        click.echo(f"{name:<16} {'-':<10} left out: {why}")
    if group:
        from meshnet.evidence.tp_estimate import describe
        click.echo("\n".join(describe(group)))


def _tp_estimate(path: str, layout, members: int) -> dict:
    """The cost model's figures for a group (evidence/tp_estimate.py), measured here."""
    from meshnet.evidence import tp_estimate

    try:
        return tp_estimate.estimate(layout, members, tp_estimate.whole_model_ms(path), tp_estimate.loopback_link(members))
    except MeshnetError as e:
        fail(e)


def _layer_memory_if_built(path, kv_type: str = kv_cache.DEFAULT):
    """Each layer's memory from the engine; None without an engine (then every layer is
    counted as full-context attention in f16, as a transformer's are)."""
    from meshnet.engine.binding import layer_memory

    try:
        return layer_memory(path, kv_type)
    except MeshnetError as e:
        if e.code != "engine_missing":
            raise
        return None


@click.command()
@click.argument("model", required=False)
@click.option("--json", "as_json", is_flag=True)
def inspect(model, as_json):
    """Describe a GGUF model: architecture, sizes, quant types, bytes per layer."""
    from meshnet.engine.gguf_layout import read_layout

    try:
        path, sha256 = models.resolve(model)
        layout = read_layout(path)
    except MeshnetError as e:
        fail(e)
    from meshnet.engine.binding import arch_support

    try:
        split_status, split_reason = arch_support(layout.arch)
    except MeshnetError as e:   # no engine built: the file's own facts are still worth showing
        split_status, split_reason = "unknown", e.message
    info = dict(vars(layout), sha256=sha256, splits=split_status == "splits", split_support=split_status,
                split_reason=split_reason, files=[dataclasses.asdict(f) for f in layout.files])
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
    click.echo(f"size        {layout.file_bytes / mib:.1f} MiB"
               + (f" in {len(layout.files)} files (gguf-split)" if len(layout.files) > 1 else ""))
    if len(layout.files) > 1:
        for i, f in enumerate(layout.files):
            click.echo(f"file {i + 1:<6} {f.file_bytes / mib:.2f} MiB  {Path(f.path).name}: {f.describe()}")
    click.echo(f"embeddings  {layout.input_bytes / mib:.2f} MiB (head)")
    click.echo(f"output      {layout.output_bytes / mib:.2f} MiB (tail)"
               + ("; tied: the tail also holds token_embd" if layout.tied_embeddings else ""))
    for i, n in enumerate(layout.layer_bytes):
        click.echo(f"layer {i:<5} {n / mib:.2f} MiB")
