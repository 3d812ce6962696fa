"""`meshnet bench`: the same model and prompts, side by side, on this machine:
the whole model in one process, N stages in one process, N worker processes.

Each configuration runs every prompt --repeats times, the configurations interleaved
so that machine noise falls on all of them; medians are printed with their spread
(min-max) and the ratio to the whole-model run.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from . import models
from .cluster import LocalCluster
from .gguf_layout import read_layout
from .metrics import rss_bytes
from .pipeline import LocalPipeline, even_ranges

PROMPTS = [
    "In the far north, where the winters last for most of the year, a small village of fishermen kept an old "
    "tradition: every evening, one of them would climb the hill and light a fire so that the boats could find "
    "their way home.",
    "The history of mathematics begins with counting. Long before writing, people kept tallies on bones and "
    "sticks, and the first numbers were simply marks, one for each sheep or each day.",
    "A good recipe for bread needs only four things: flour, water, salt and yeast. The baker's skill lies in "
    "time and temperature, and in knowing when the dough is ready.",
]
CONFIGS = ("whole", "stages", "workers")


@dataclass
class Samples:
    label: str
    prefill_tok_s: list[float] = field(default_factory=list)
    decode_tok_s: list[float] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)
    hop_us_p50: list[float] = field(default_factory=list)
    hop_us_p99: list[float] = field(default_factory=list)
    seam_bytes_per_token: list[float] = field(default_factory=list)
    rss_bytes: list[int] = field(default_factory=list)   # per process, at the end

    def add(self, metrics: dict) -> None:
        self.prefill_tok_s.append(metrics["prefill_tok_s"])
        self.decode_tok_s.append(metrics["decode_tok_s"])
        self.ttft_ms.append(metrics["ttft_ms"])
        tokens = metrics["prompt_tokens"] + metrics["generated_tokens"] - 1
        self.seam_bytes_per_token.append(metrics["seam_bytes"] / tokens)
        if metrics.get("hop_us_p50") is not None:
            self.hop_us_p50.append(metrics["hop_us_p50"])
            self.hop_us_p99.append(metrics["hop_us_p99"])


def summary(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def run_bench(model: str, n_stages: int, repeats: int, n_decode: int, threads: int,
              configs=CONFIGS) -> dict:
    path, sha256 = models.resolve(model)
    layout = read_layout(path)
    ranges = even_ranges(layout.n_layer, n_stages)
    options = dict(n_ctx=1024, max_sessions=1, n_threads=threads)
    runners, closers, samples = {}, [], {}
    try:
        if "whole" in configs:
            whole = LocalPipeline(path, [(0, layout.n_layer)], **options)
            closers.append(whole.close)
            runners["whole"] = lambda tokens: whole.generate(tokens, n_decode + 1, stop_at_eog=False).metrics
            samples["whole"] = Samples("whole model, 1 process")
        if "stages" in configs:
            staged = LocalPipeline(path, ranges, **options)
            closers.append(staged.close)
            runners["stages"] = lambda tokens: staged.generate(tokens, n_decode + 1, stop_at_eog=False).metrics
            samples["stages"] = Samples(f"{n_stages} stages, 1 process")
        if "workers" in configs:
            cluster = LocalCluster(path, ranges, threads=threads, n_ctx=1024, max_sessions=1).start()
            closers.append(cluster.close)
            runners["workers"] = lambda tokens: cluster.coordinator.generate(tokens, n_decode + 1,
                                                                             stop_at_eog=False).result().metrics
            samples["workers"] = Samples(f"{n_stages} worker processes")
        tokenizer = whole.head if "whole" in configs else staged.head if "stages" in configs else None
        prompt_tokens = [tokenizer.tokenize(p) if tokenizer else cluster.coordinator.tokenize(p) for p in PROMPTS]
        for run in runners.values():  # warm-up: first-touch allocations and caches
            run(prompt_tokens[0][:16])
        for _ in range(repeats):
            for tokens in prompt_tokens:
                for label, run in runners.items():
                    samples[label].add(run(tokens))
        in_process_rss = rss_bytes()
        for label in ("whole", "stages"):
            if label in samples:
                samples[label].rss_bytes = [in_process_rss]  # this process holds both: shown with a mark
        if "workers" in samples:
            samples["workers"].rss_bytes = [s.get("rss_bytes", 0) for s in cluster.coordinator.metrics()["stages"]]
    finally:
        for close in reversed(closers):
            close()

    report = {"model": model, "model_sha256": sha256, "stages": [list(r) for r in ranges], "repeats": repeats,
              "prompts": len(PROMPTS), "decode_tokens": n_decode, "threads": threads, "configs": {}}
    base = samples.get("whole")
    for label, s in samples.items():
        entry = {"label": s.label, "rss_bytes": s.rss_bytes}
        for key in ("prefill_tok_s", "decode_tok_s", "ttft_ms", "hop_us_p50", "hop_us_p99", "seam_bytes_per_token"):
            entry[key] = summary(getattr(s, key))
        if base is not None:
            for key in ("prefill_tok_s", "decode_tok_s"):
                entry[f"{key}_ratio"] = statistics.median(getattr(s, key)) / statistics.median(getattr(base, key))
        report["configs"][label] = entry
    return report


def format_report(report: dict) -> str:
    def cell(s, fmt="{:.1f}"):
        if not s:
            return "-"
        return f"{fmt.format(s['median'])} [{fmt.format(s['min'])}-{fmt.format(s['max'])}]"

    lines = [f"{report['model']} ({report['model_sha256'][:12]}), stages {report['stages']}, "
             f"{report['prompts']} prompts x {report['repeats']} repeats, {report['decode_tokens']} tokens decoded per run; "
             "median [min-max]",
             f"{'configuration':<24} {'prefill tok/s':>22} {'decode tok/s':>22} {'ratio':>6} {'TTFT ms':>20} "
             f"{'hop p50 us':>18} {'hop p99 us':>18} {'seam B/tok':>10} {'RSS MiB':>14}"]
    shared = [label for label in ("whole", "stages") if label in report["configs"]]
    for label, entry in report["configs"].items():
        ratio = entry.get("decode_tok_s_ratio")
        ratio = "-" if ratio is None else f"{ratio:.2f}"
        rss = "/".join(f"{r / (1 << 20):.0f}" for r in entry["rss_bytes"]) + ("*" if label in shared else "")
        seam = entry["seam_bytes_per_token"]["median"] if entry["seam_bytes_per_token"] else 0
        lines.append(f"{entry['label']:<24} {cell(entry['prefill_tok_s']):>22} {cell(entry['decode_tok_s']):>22} "
                     f"{ratio:>6} {cell(entry['ttft_ms']):>20} "
                     f"{cell(entry['hop_us_p50'], '{:.0f}'):>18} {cell(entry['hop_us_p99'], '{:.0f}'):>18} "
                     f"{seam:>10.0f} {rss:>14}")
    if shared:
        lines.append("* one process runs every in-process configuration: its RSS covers all of them together")
    return "\n".join(lines)
