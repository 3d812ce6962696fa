"""`meshnet bench`: the same model and prompts, side by side, on this machine:
the whole model in one process, N stages in one process, N worker processes.

Each configuration runs every prompt --repeats times, the configurations interleaved
so that machine noise falls on all of them; medians are printed with their spread
(min-max) and the ratio to the whole-model run. With --sessions N, each repeat also
runs N sessions at once in every configuration (the in-process ones batch them at
every stage, as the workers do) and reports their aggregate decode rate.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from meshnet.core import kv_cache
from meshnet.core import numerics as numerics_classes
from meshnet.core import trace
from meshnet.core.metrics import paired_ratio, rss_bytes
from meshnet.engine import models
from meshnet.engine.gguf_layout import read_layout
from meshnet.engine.pipeline import LocalPipeline, Request
from meshnet.evidence import tp_estimate
from meshnet.evidence.prompts import PROMPT_SETS
from meshnet.launch.local_cluster import LocalCluster

# workers: local worker processes as meshnet run starts them, with fresh CURVE keys;
# plain: the same without keys (--insecure), to measure what the keys cost
CONFIGS = ("whole", "stages", "workers", "plain")
CONCURRENT_DECODE = 2   # concurrent sessions decode this many times --decode: a window when all decode at once


@dataclass
class Samples:
    label: str
    prefill_tok_s: list[float] = field(default_factory=list)
    decode_tok_s: list[float] = field(default_factory=list)
    aggregate_decode_tok_s: list[float] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)
    hop_us_p50: list[float] = field(default_factory=list)
    hop_us_p99: list[float] = field(default_factory=list)
    seam_bytes_per_token: list[float] = field(default_factory=list)
    decode_seam_bytes_per_token: list[float] = field(default_factory=list)   # per seam
    decode_crossings_per_token: list[float] = field(default_factory=list)    # per seam
    rss_bytes: list[int] = field(default_factory=list)   # per process, at the end
    tokens_per_round: list[float] = field(default_factory=list)   # speculating: decode tokens per trip round the ring
    acceptance_rate: list[float] = field(default_factory=list)

    def add(self, metrics: dict) -> None:
        spec = metrics.get("speculation")
        if spec and spec.get("tokens_per_round") is not None:
            self.tokens_per_round.append(spec["tokens_per_round"])
            if spec.get("acceptance_rate") is not None:
                self.acceptance_rate.append(spec["acceptance_rate"])
        self.prefill_tok_s.append(metrics["prefill_tok_s"])
        self.decode_tok_s.append(metrics["decode_tok_s"])
        self.ttft_ms.append(metrics["ttft_ms"])
        tokens = metrics["prompt_tokens"] + metrics["generated_tokens"] - 1
        self.seam_bytes_per_token.append(metrics["seam_bytes"] / tokens)
        if metrics.get("hop_us_p50") is not None:
            self.hop_us_p50.append(metrics["hop_us_p50"])
            self.hop_us_p99.append(metrics["hop_us_p99"])
        if metrics.get("decode_seam_bytes_per_token") is not None:
            self.decode_seam_bytes_per_token.append(metrics["decode_seam_bytes_per_token"])
            self.decode_crossings_per_token.append(metrics["decode_crossings_per_token"])

    def add_concurrent(self, token_times: list[list[float]]) -> None:
        """N sessions that ran together: the tokens they gave while every one of them was
        decoding (from the last session's first token to the first session's last), over
        that time. Prompts read meanwhile by other sessions stay out of the figure."""
        start = max(times[0] for times in token_times)
        end = min(times[-1] for times in token_times)
        if end <= start:
            raise ValueError("the sessions never decoded all at once: decode more tokens (--decode)")
        decoded = sum(start < t <= end for times in token_times for t in times)
        self.aggregate_decode_tok_s.append(decoded / (end - start))


def summary(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def run_bench(model: str, n_stages: int, repeats: int, n_decode: int, threads: int, configs=CONFIGS,
              sessions: int = 1, numerics: Sequence[str] = (numerics_classes.DEFAULT,),
              trace_dir: str | None = None, speculate: int = 0, prompts: str = "prose", flash_attn: bool = False,
              kv_type: str = kv_cache.DEFAULT) -> dict:
    """NUMERICS: the classes to measure; every configuration runs in the first, and each
    other class (baseline: the kernels before the classes) adds a worker configuration
    of its own, "workers-<class>", measured side by side with the rest. TRACE_DIR: the
    workers configuration records its per-token spans (core/trace.py); their table is
    the report's "timeline", and TRACE_DIR gets the spans and a picture of them.
    SPECULATE: also "workers-ngram", the workers drafting up to that many tokens a round.
    The workers keep no prefix store: every run computes its prompt, as in one process.
    FLASH_ATTN, KV_TYPE: every configuration's attention and KV cache."""
    texts = PROMPT_SETS[prompts]
    path, sha256 = models.resolve(model)
    layout = read_layout(path)
    ranges = layout.balanced_ranges(n_stages)
    first_class, other_classes = numerics[0], list(numerics[1:])
    attention = dict(flash_attn=flash_attn, kv_type=kv_type)
    options = dict(n_ctx=1024, max_sessions=max(sessions, 1), n_threads=threads, numerics=first_class, **attention)
    runners, concurrent, closers, samples = {}, {}, [], {}

    def in_process(label, pipe):
        runners[label] = lambda tokens: pipe.generate(tokens, n_decode + 1, stop_at_eog=False).metrics
        concurrent[label] = lambda prompts: [c.token_times for c in pipe.generate_many(
            [Request(t, CONCURRENT_DECODE * n_decode, stop_at_eog=False) for t in prompts])]

    try:
        if "whole" in configs:
            whole = LocalPipeline(path, [(0, layout.n_layer)], **options)
            closers.append(whole.close)
            in_process("whole", whole)
            samples["whole"] = Samples("whole model, 1 process")
        if "stages" in configs:
            staged = LocalPipeline(path, ranges, **options)
            closers.append(staged.close)
            in_process("stages", staged)
            samples["stages"] = Samples(f"{n_stages} stages, 1 process")
        clusters = {}
        worker_configs = [(label, secure, what, first_class) for label, secure, what in (
            ("workers", True, "worker processes"), ("plain", False, "workers, no keys")) if label in configs]
        worker_configs += [(f"workers-{c}", True, f"workers, {c}", c) for c in other_classes]
        if speculate:
            worker_configs.append(("workers-ngram", True, f"workers, ngram:{speculate}", first_class))
        for label, secure, what, numerics_class in worker_configs:
            traced = trace_dir if label == "workers" else None
            cluster = clusters[label] = LocalCluster(path, ranges, threads=threads, n_ctx=1024,
                                                     max_sessions=max(sessions, 1), secure=secure,
                                                     numerics=numerics_class, trace_dir=traced, prefix_cache_mib=0,
                                                     speculate=speculate if label == "workers-ngram" else 0,
                                                     **attention).start()
            closers.append(cluster.close)
            runners[label] = lambda tokens, c=cluster.coordinator: c.generate(tokens, n_decode + 1,
                                                                              stop_at_eog=False).result().metrics
            concurrent[label] = lambda prompts, c=cluster.coordinator: [h.result().token_times for h in [
                c.generate(t, CONCURRENT_DECODE * n_decode, stop_at_eog=False) for t in prompts]]
            samples[label] = Samples(f"{n_stages} {what}")
        tokenizer = whole.head if "whole" in configs else staged.head if "stages" in configs else None
        prompt_tokens = [tokenizer.tokenize(p) if tokenizer else next(iter(clusters.values())).coordinator.tokenize(p)
                         for p in texts]
        batch = [prompt_tokens[i % len(prompt_tokens)] for i in range(sessions)]
        for label, run in runners.items():  # warm-up: first-touch allocations and caches
            run(prompt_tokens[0][:16])
            if sessions > 1:
                concurrent[label]([t[:16] for t in batch])
        for _ in range(repeats):
            for tokens in prompt_tokens:
                for label, run in runners.items():
                    samples[label].add(run(tokens))
            if sessions > 1:
                for label, run in concurrent.items():
                    samples[label].add_concurrent(run(batch))
        in_process_rss = rss_bytes()
        for label in ("whole", "stages"):
            if label in samples:
                samples[label].rss_bytes = [in_process_rss]  # this process holds both: shown with a mark
        for label, cluster in clusters.items():
            samples[label].rss_bytes = [s.get("rss_bytes", 0) for s in cluster.coordinator.metrics()["stages"]]
        coordinator_spans = clusters["workers"].coordinator.timeline() if trace_dir and "workers" in clusters else None
    finally:
        for close in reversed(closers):
            close()   # a traced worker writes its spans as it stops

    settings = {"model": model, "model_sha256": sha256, "stages": [list(r) for r in ranges], "repeats": repeats,
                "prompts": len(texts), "prompt_set": prompts, "decode_tokens": n_decode, "threads": threads, "sessions": sessions,
                "n_embd": layout.n_embd, "numerics": list(numerics), **attention}
    report = bench_report(settings, samples, first_class)
    report.update(tp_estimate.section(layout, samples.get("whole") and samples["whole"].decode_tok_s))
    if coordinator_spans is not None:
        report["timeline"] = write_timeline(trace_dir, len(ranges), coordinator_spans)
    return report


def write_timeline(trace_dir: str, n_stages: int, coordinator_spans: dict) -> dict:
    """The stages' spans (stage-I.json, written by the workers) and the coordinator's, in
    one file, with their table and a picture beside it."""
    timelines = [json.loads((Path(trace_dir) / f"stage-{i}.json").read_text()) for i in range(n_stages)]
    timelines.append(coordinator_spans)
    table = trace.decode_table(timelines, [t["where"] for t in timelines[:n_stages]])
    out = Path(trace_dir)
    (out / "timeline.json").write_text(json.dumps({"timelines": timelines, "table": table}))
    (out / "timeline.svg").write_text(trace.svg(timelines))
    (out / "timeline.txt").write_text(trace.format_table(table) + "\n")
    return table


def bench_report(settings: dict, samples: dict[str, "Samples"], first_class: str) -> dict:
    """The run's settings with each configuration's medians, and the ratios side by side:
    against the whole model, workers over stages, keys over none, class over class."""
    numerics = settings["numerics"]
    report = dict(settings, configs={})
    base = samples.get("whole")
    for label, s in samples.items():
        entry = {"label": s.label, "rss_bytes": s.rss_bytes}
        for key in ("prefill_tok_s", "decode_tok_s", "aggregate_decode_tok_s", "ttft_ms", "hop_us_p50", "hop_us_p99",
                    "seam_bytes_per_token", "decode_seam_bytes_per_token", "decode_crossings_per_token",
                    "tokens_per_round", "acceptance_rate"):
            entry[key] = summary(getattr(s, key))
        if base is not None:
            for key in ("prefill_tok_s", "decode_tok_s"):
                entry[f"{key}_ratio"] = statistics.median(getattr(s, key)) / statistics.median(getattr(base, key))
        if s.aggregate_decode_tok_s:
            entry["aggregate_over_one_session"] = (statistics.median(s.aggregate_decode_tok_s)
                                                   / statistics.median(s.decode_tok_s))
        report["configs"][label] = entry
    for key in ("decode_tok_s", "aggregate_decode_tok_s"):
        if "workers" in samples and "stages" in samples and getattr(samples["stages"], key):
            report[f"workers_over_stages_{key}"] = (statistics.median(getattr(samples["workers"], key))
                                                    / statistics.median(getattr(samples["stages"], key)))
            report[f"workers_over_stages_paired_{key}"] = paired_ratio(getattr(samples["workers"], key),
                                                                       getattr(samples["stages"], key))
        if "workers" in samples and "plain" in samples and getattr(samples["plain"], key):
            report[f"keys_over_plain_{key}"] = (statistics.median(getattr(samples["workers"], key))
                                                / statistics.median(getattr(samples["plain"], key)))
    report["cost_model"] = cost_model(samples, len(settings["stages"]))
    if "workers-ngram" in samples and "workers" in samples:
        ngram, plain = samples["workers-ngram"], samples["workers"]
        report["ngram_over_workers_decode_tok_s"] = (statistics.median(ngram.decode_tok_s)
                                                     / statistics.median(plain.decode_tok_s))
        report["ngram_over_workers_paired_decode_tok_s"] = paired_ratio(ngram.decode_tok_s, plain.decode_tok_s)
    # each class against each other, worker processes both (first_class's are "workers")
    by_class = {c: samples.get("workers" if c == first_class else f"workers-{c}") for c in numerics}
    report["numerics_ratios"] = {
        f"{a}/{b}": {key: statistics.median(getattr(by_class[a], key)) / statistics.median(getattr(by_class[b], key))
                     for key in ("prefill_tok_s", "decode_tok_s")}
        for a in numerics for b in numerics if a != b and by_class[a] and by_class[b]}
    return report


def cost_model(samples: dict[str, "Samples"], n_stages: int) -> dict:
    """Each worker configuration's decode, per trip round the ring: what a round took
    (the time per token times the tokens a round gave) against what it is made of, the
    whole model's compute for a token plus one one-way hop for each of the ring's links.
    A ring of S stages crosses S links a round (S - 1 seams and the tail's step back to
    the head), one way each: not a round trip per seam. The seams' hops are measured; the
    link back to the head is taken to cost what a seam's does."""
    whole = samples.get("whole")
    compute_us = 1e6 / statistics.median(whole.decode_tok_s) if whole and whole.decode_tok_s else None
    out = {}
    for label, s in samples.items():
        if label in ("whole", "stages") or not s.decode_tok_s:
            continue
        per_round = statistics.median(s.tokens_per_round) if s.tokens_per_round else 1.0
        token_us = 1e6 / statistics.median(s.decode_tok_s)
        hop_us = statistics.median(s.hop_us_p50) if s.hop_us_p50 else None
        entry = {"tokens_per_round": per_round, "token_us": token_us, "round_us": token_us * per_round,
                 "links": n_stages, "hop_us": hop_us, "compute_us": compute_us}
        if compute_us is not None and hop_us is not None:
            entry["model_round_us"] = compute_us + n_stages * hop_us   # one token's rows: a round without drafts
        out[label] = entry
    return out


def format_report(report: dict) -> str:
    def cell(s, fmt="{:.1f}"):
        if not s:
            return "-"
        return f"{fmt.format(s['median'])} [{fmt.format(s['min'])}-{fmt.format(s['max'])}]"

    n = report["sessions"]
    lines = [f"{report['model']} ({report['model_sha256'][:12]}), stages {report['stages']}, "
             f"{report['prompts']} prompts x {report['repeats']} repeats, {report['decode_tokens']} tokens decoded per run"
             f"{f', {n} concurrent sessions' if n > 1 else ''}, threads {report['threads'] or 'all'}; median [min-max]",
             f"{'configuration':<24} {'prefill tok/s':>20} {'decode tok/s':>20} {'ratio':>6} "
             + (f"{f'{n} sessions tok/s':>20} {'xone':>5} " if n > 1 else "")
             + f"{'TTFT ms':>18} {'hop p50 us':>16} {'hop p99 us':>18} {'seam B/tok':>10} {'RSS MiB':>12}"]
    shared = [label for label in ("whole", "stages") if label in report["configs"]]
    for label, entry in report["configs"].items():
        ratio = entry.get("decode_tok_s_ratio")
        ratio = "-" if ratio is None else f"{ratio:.2f}"
        rss = "/".join(f"{r / (1 << 20):.0f}" for r in entry["rss_bytes"]) + ("*" if label in shared else "")
        seam = entry["decode_seam_bytes_per_token"] or entry["seam_bytes_per_token"]
        seam = seam["median"] if seam else 0
        many = ""
        if n > 1:
            many = f"{cell(entry['aggregate_decode_tok_s']):>20} {entry.get('aggregate_over_one_session', 0):>5.2f} "
        lines.append(f"{entry['label']:<24} {cell(entry['prefill_tok_s']):>20} {cell(entry['decode_tok_s']):>20} "
                     f"{ratio:>6} {many}{cell(entry['ttft_ms']):>18} "
                     f"{cell(entry['hop_us_p50'], '{:.0f}'):>16} {cell(entry['hop_us_p99'], '{:.0f}'):>18} "
                     f"{seam:>10.0f} {rss:>12}")
    for key, what in (("decode_tok_s", "one session"), ("aggregate_decode_tok_s", f"{n} sessions")):
        if f"workers_over_stages_{key}" in report:
            lines.append(f"workers / stages in one process, {what}: {report[f'workers_over_stages_{key}']:.3f} "
                         f"(median of the runs side by side: {report[f'workers_over_stages_paired_{key}']:.3f})")
        if f"keys_over_plain_{key}" in report:
            lines.append(f"workers with CURVE keys (the default) / without, {what}: "
                         f"{report[f'keys_over_plain_{key}']:.3f}")
    for pair, ratio in report.get("numerics_ratios", {}).items():
        a, b = pair.split("/")   # each class over the baseline, and invariant over stock
        if b == numerics_classes.BASELINE or (a, b) == (numerics_classes.INVARIANT, numerics_classes.STOCK):
            lines.append(f"workers, numerics {a} / {b}: prefill {ratio['prefill_tok_s']:.3f}, "
                         f"decode {ratio['decode_tok_s']:.3f}")
    ngram = report["configs"].get("workers-ngram")
    if ngram and "ngram_over_workers_decode_tok_s" in report:
        rounds, accepted = ngram["tokens_per_round"], ngram["acceptance_rate"]
        lines.append(f"workers drafting n-grams / workers, decode: {report['ngram_over_workers_decode_tok_s']:.3f} "
                     f"(median of the runs side by side: {report['ngram_over_workers_paired_decode_tok_s']:.3f}); "
                     f"tokens per round {cell(rounds, '{:.2f}')}, drafts kept {cell(accepted, '{:.2f}')}")
    workers = report["configs"].get("workers")
    if workers and workers["decode_seam_bytes_per_token"]:
        lines.append(f"decode: {workers['decode_seam_bytes_per_token']['median']:.0f} B per token per seam "
                     f"(4 x n_embd = {4 * report['n_embd']}), "
                     f"{workers['decode_crossings_per_token']['median']:.2f} crossings per token per seam")
    for label, c in report.get("cost_model", {}).items():
        model = (f"; a round of one token should take the whole model's {c['compute_us']:.0f} + {c['links']} links x "
                 f"{c['hop_us']:.0f} us = {c['model_round_us']:.0f} us" if "model_round_us" in c else "")
        lines.append(f"per ring round, {report['configs'][label]['label']}: {c['round_us']:.0f} us for "
                     f"{c['tokens_per_round']:.2f} tokens ({c['token_us']:.0f} us a token){model}")
    if "tensor_parallel" in report:
        lines.extend(tp_estimate.describe(report["tensor_parallel"]))
    if shared:
        lines.append("* one process runs every in-process configuration: its RSS covers all of them together")
    if report.get("timeline"):
        lines.append("where a decode token's time goes, workers (median per token):")
        lines.append(trace.format_table(report["timeline"]))
    return "\n".join(lines)
