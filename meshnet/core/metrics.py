"""Numbers measured where they happen, and their two shapes: a JSON snapshot and
Prometheus text (net/metrics_server.py serves both on an opt-in HTTP port)."""

from __future__ import annotations

import os
import statistics
import uuid
from typing import Iterable

import numpy as np

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes(pid: int | str = "self") -> int:
    """Resident memory of a process, from /proc (0 where there is no /proc)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


def generation_metrics(ranges, n_prompt: int, n_generated: int, t_start: float, t_first: float, t_end: float,
                       seam_bytes: int, cached: int = 0) -> dict:
    """One session's numbers, the same for the in-process pipeline and the coordinator:
    the first token comes from the prefill, every later one from a decode step. The
    prefill's rate counts the prompt tokens computed, not the CACHED ones restored."""
    n_decode = n_generated - 1
    return {
        "stages": [list(r) for r in ranges],
        "prompt_tokens": n_prompt,
        "cached_tokens": cached,
        "generated_tokens": n_generated,
        "ttft_ms": (t_first - t_start) * 1e3,
        "prefill_tok_s": (n_prompt - cached) / max(t_first - t_start, 1e-9),
        "decode_tok_s": n_decode / (t_end - t_first) if n_decode > 0 else None,
        "seam_bytes": seam_bytes,
    }


def speculation_metrics(counts: dict, n_generated: int) -> dict:
    """A speculating session's rounds: the share of drafts the route kept, and the tokens
    each decode round gave (1.0 without drafts; the first token is the prefill's)."""
    rounds, drafted = counts["rounds"], counts["drafted"]
    return {**counts, "acceptance_rate": counts["accepted"] / drafted if drafted else None,
            "tokens_per_round": (n_generated - 1) / rounds if rounds else None}


def percentiles(values: Iterable[float], points=(50, 99)) -> dict:
    data = np.fromiter(values, dtype=np.float64)
    if data.size == 0:
        return {f"p{p}": None for p in points}
    return {f"p{p}": float(np.percentile(data, p)) for p in points}


def paired_ratio(a: list[float], b: list[float]) -> float:
    """The median of A[i] / B[i], for two configurations run in turns: the i-th of each
    ran seconds apart on the same prompt, and a slow spell of the machine (minutes
    long, up to 2x) falls on both sides of a pair instead of on one side of the medians."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def prometheus_text(snapshot: dict) -> str:
    """The coordinator's snapshot as Prometheus exposition text."""
    lines = []

    def metric(name, kind, help_text, samples):
        lines.append(f"# HELP meshnet_{name} {help_text}")
        lines.append(f"# TYPE meshnet_{name} {kind}")
        for labels, value in samples:
            if value is None:
                continue
            label_text = ",".join(f'{k}="{v}"' for k, v in labels.items())
            lines.append(f"meshnet_{name}{{{label_text}}} {value}")

    stages = snapshot.get("stages", [])
    per_stage = [
        ("stage_rss_bytes", "gauge", "resident memory of the stage's worker process", "rss_bytes"),
        ("stage_model_bytes", "gauge", "weight bytes the stage loaded", "model_bytes"),
        ("stage_vram_bytes", "gauge", "GPU memory the stage holds (weights, KV cache, compute buffers); 0 on a CPU",
         "vram_bytes"),
        ("stage_kv_bytes_used", "gauge", "KV cache bytes holding tokens of open sessions", "kv_bytes_used"),
        ("stage_queue_depth", "gauge", "forward requests waiting on the stage", "queue_depth"),
        ("stage_sessions", "gauge", "sessions open on the stage", "n_sessions"),
        ("seam_bytes_total", "counter", "residual bytes sent into the stage", "seam_bytes"),
        ("hop_latency_us_p50", "gauge", "round trip to the stage minus its own time, median", "hop_us_p50"),
        ("hop_latency_us_p99", "gauge", "round trip to the stage minus its own time, 99th percentile", "hop_us_p99"),
        ("stage_requests_total", "counter", "requests the stage answered", "requests"),
    ]
    for name, kind, help_text, key in per_stage:
        metric(name, kind, help_text, [({"stage": s["stage"], "worker": s["worker"]}, s.get(key)) for s in stages])
    metric("stage_in_route", "gauge", "1 when the worker is in the route, 0 when it is kept out (meshnet status says why)",
           [({"stage": s["stage"], "worker": s["worker"]}, int(s["in_route"]) if "in_route" in s else None)
            for s in stages])
    metric("stage_failures_total", "counter", "requests the stage answered with an error, by code",
           [({"stage": s["stage"], "code": code}, n) for s in stages for code, n in s.get("errors", {}).items()])
    metric("sessions_total", "counter", "sessions by outcome",
           [({"outcome": k}, v) for k, v in snapshot.get("sessions", {}).items()])
    metric("workers", "gauge", "registered workers", [({}, len(stages))])
    counters = snapshot.get("counters", {})
    metric("refused_handshakes_total", "counter", "peers refused in the CURVE handshake (no key, another coordinator's "
           "key, a key not allowed)", [({}, counters.get("refused_handshakes"))])
    metric("refused_peers_total", "counter", "peers whose CURVE key the allow-list refused",
           [({}, counters.get("refused_peers"))])
    metric("stage_refused_peers_total", "counter", "peers whose CURVE key a stage's data endpoint refused",
           [({"stage": s["stage"]}, s.get("refused_peers")) for s in stages])
    resumes = snapshot.get("resumes", {})
    metric("resumes_total", "counter", "sessions replayed on a new route after a stage was lost",
           [({}, resumes.get("count"))])
    metric("replayed_tokens_total", "counter", "tokens fed again to replay sessions", [({}, resumes.get("replayed_tokens"))])
    for name, help_text, key in (
            ("prefix_cache_hits_total", "sessions that started from a prefix every stage of the route held",
             "prefix_hits"),
            ("prefix_cache_misses_total", "sessions that found no stored prefix on some stage of the route",
             "prefix_misses"),
            ("prefix_cache_hit_tokens_total", "prompt tokens restored instead of computed", "prefix_hit_tokens"),
            ("speculation_rounds_total", "decode rounds of speculating sessions", "speculation_rounds"),
            ("speculation_drafted_total", "drafted tokens the route verified", "speculation_drafted"),
            ("speculation_accepted_total", "drafted tokens the route kept (its own draws)", "speculation_accepted"),
            ("kv_pauses_total", "times a stage's KV pool had no room for a session, which waited in line to be "
             "replayed", "kv_pauses"),
            ("text_retries_total", "text requests (tokenize, template) asked again of the route because the worker "
             "they went to was lost before it answered", "text_retries")):
        metric(name, "counter", help_text, [({}, counters.get(key))])
    caches = [(s, s.get("prefix_cache")) for s in stages if s.get("prefix_cache")]
    for name, kind, help_text, key in (
            ("stage_prefix_cache_bytes", "gauge", "bytes of ended sessions' memory the stage keeps", "bytes"),
            ("stage_prefix_cache_entries", "gauge", "ended sessions the stage keeps", "entries"),
            ("stage_prefix_cache_hits_total", "counter", "sessions the stage started from a stored prefix", "hits"),
            ("stage_prefix_cache_misses_total", "counter", "sessions that found no prefix the stage stored", "misses"),
            ("stage_prefix_cache_evictions_total", "counter", "stored sessions dropped for room, oldest use first",
             "evictions")):
        metric(name, kind, help_text, [({"stage": s["stage"], "worker": s["worker"]}, cache.get(key))
                                       for s, cache in caches])
    metric("resume_ms", "gauge", "from a stage's loss to the session's next token",
           [({"quantile": "0.5"}, resumes.get("ms_p50")), ({"quantile": "0.99"}, resumes.get("ms_p99"))])
    return "\n".join(lines) + "\n"


def clock_id() -> str:
    """Equal on processes that share one monotonic clock (one booted kernel; network
    namespaces included), so a hop between them can be timed from two timestamps."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return "boot:" + f.read().strip()
    except OSError:
        return "process:" + uuid.uuid4().hex   # unknown: never equal, hops are not timed
