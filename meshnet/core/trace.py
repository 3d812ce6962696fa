"""Where a decode token's time goes: spans recorded where they happen, and their table.

With tracing on (`meshnet worker --trace FILE`, `meshnet bench --trace DIR`), every process
on the route records one span per step of the per-token path, on the host's monotonic
clock (the same for every process of one host: clock_id says so), with the thread and CPU
it ran on. A span is keyed by the session and the position of the step it belongs to, so
that the spans of one token line up across processes, and what lies between them (the
hop: ZeroMQ's I/O threads, the wire, a wake-up) is measured as the gap from one process's
send to the next one's receive.

Spans of a stage, per step: receive (the recv call), decode (the header checked, the
step built), wait (until its forward call starts), forward (the engine), send_next (the
output encoded and pushed to the next stage; at the tail, the next decode step to the
head) and send_reply (the token or "taken" to the coordinator). The coordinator records
coordinator (a token received, handled and its effects carried out).
"""

from __future__ import annotations

import collections
import ctypes
import json
import os
import statistics
import threading
from dataclasses import dataclass
from typing import Iterable

KEPT = 200_000   # spans a process keeps: the last ones, so that a long run stays bounded

STAGE_SPANS = ("receive", "decode", "wait", "forward", "send_next")   # a stage's share of the critical path
SIDE_SPANS = ("send_reply",)                                            # after the critical send: off the path

try:
    _sched_getcpu = ctypes.CDLL(None, use_errno=True).sched_getcpu
except (OSError, AttributeError):   # no libc symbol: the CPU is not known
    _sched_getcpu = None


def current_cpu() -> int:
    return _sched_getcpu() if _sched_getcpu is not None else -1


class Timeline:
    """The spans of one process (appends from several threads are safe: a deque)."""

    def __init__(self, where: str, kept: int = KEPT):
        self.where = where
        self.spans: collections.deque = collections.deque(maxlen=kept)

    def span(self, name: str, sid: int, pos: int, n: int, t0_ns: int, t1_ns: int) -> None:
        self.spans.append((name, sid, pos, n, t0_ns, t1_ns, threading.get_native_id(), current_cpu()))

    def to_dict(self) -> dict:
        return {"where": self.where, "pid": os.getpid(), "spans": list(self.spans)}

    def write(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f)


@dataclass(frozen=True)
class Span:
    where: str
    name: str
    sid: int
    pos: int
    n: int
    t0_ns: int
    t1_ns: int
    tid: int
    cpu: int

    @property
    def us(self) -> float:
        return (self.t1_ns - self.t0_ns) / 1000


def spans_of(timelines: Iterable[dict]) -> list[Span]:
    return [Span(t["where"], *s) for t in timelines for s in t["spans"]]


def decode_table(timelines: list[dict], route: list[str]) -> dict:
    """Per decode token (a step of one row), the median, mean and 90th percentile of each
    span at each stage of ROUTE (the stages' `where`, in route order), each hop into a
    stage, and the token's period at the coordinator: with what the spans leave
    unexplained. The medians say what a token usually costs; the means add up (a sum of
    medians does not), and a mean far above its median is a tail: a wait of milliseconds
    now and then."""
    spans = [s for s in spans_of(timelines) if s.n == 1]
    by = collections.defaultdict(dict)   # (where, name) -> {(sid, pos): span}
    for s in spans:
        by[(s.where, s.name)][(s.sid, s.pos)] = s
    rows = []

    def row(where: str, span: str, values) -> dict:
        values = sorted(values)
        found = {"where": where, "span": span, "us": None, "mean_us": None, "p90_us": None, "n": len(values)}
        if values:
            found.update(us=statistics.median(values), mean_us=statistics.fmean(values),
                         p90_us=values[min(len(values) - 1, int(0.9 * len(values)))])
        return found

    for k, where in enumerate(route):
        sender = route[k - 1]   # the head's input comes from the tail (the ring)
        receives = by[(where, "receive")]
        sends = by[(sender, "send_next")]
        rows.append(row(where, f"hop in (from {sender})",
                        [r.t0_ns / 1000 - sends[key].t1_ns / 1000 for key, r in receives.items() if key in sends]))
        for name in STAGE_SPANS + SIDE_SPANS:
            rows.append(row(where, name, [s.us for s in by[(where, name)].values()]))
    on_path = [r for r in rows if r["span"].startswith("hop in") or r["span"] in STAGE_SPANS]
    critical = sum(r["us"] or 0.0 for r in on_path)
    critical_mean = sum(r["mean_us"] or 0.0 for r in on_path)
    handled = by[("coordinator", "coordinator")]
    rows.append(row("coordinator", "coordinator", [s.us for s in handled.values()]))
    arrivals = sorted((s.sid, s.t0_ns) for s in handled.values())
    periods = [(b[1] - a[1]) / 1000 for a, b in zip(arrivals, arrivals[1:]) if a[0] == b[0]]
    period = statistics.median(periods) if periods else None
    period_mean = statistics.fmean(periods) if periods else None
    cpus = {where: sorted({s.cpu for s in spans if s.where == where and s.name == "forward"}) for where in route}
    return {"rows": rows, "critical_us": critical, "period_us": period,
            "unexplained_us": None if period is None else period - critical,
            "critical_mean_us": critical_mean, "period_mean_us": period_mean,
            "unexplained_mean_us": None if period_mean is None else period_mean - critical_mean,
            "forward_cpus": cpus}


def format_table(table: dict) -> str:
    def us(value):
        return "-" if value is None else f"{value:.0f}"

    lines = [f"{'where':<14} {'span':<24} {'median us':>10} {'mean us':>10} {'p90 us':>10} {'n':>6}"]
    for row in table["rows"]:
        lines.append(f"{row['where']:<14} {row['span']:<24} {us(row['us']):>10} {us(row.get('mean_us')):>10} "
                     f"{us(row.get('p90_us')):>10} {row['n']:>6}")
    lines.append(f"critical path (hops + stage spans): {us(table['critical_us'])} us; token period at the "
                 f"coordinator: {us(table['period_us'])} us; unexplained: {us(table['unexplained_us'])} us (medians)")
    if table.get("period_mean_us") is not None:
        lines.append(f"the same in means: {us(table['critical_mean_us'])} us; {us(table['period_mean_us'])} us; "
                     f"unexplained: {us(table['unexplained_mean_us'])} us")
    lines.append("forward CPUs: " + ", ".join(f"{w} {c}" for w, c in table["forward_cpus"].items()))
    return "\n".join(lines)


COLOURS = {"receive": "#4c78a8", "decode": "#f58518", "wait": "#bab0ac", "forward": "#54a24b",
           "send_next": "#e45756", "send_reply": "#b279a2", "coordinator": "#eeca3b"}


def svg(timelines: list[dict], tokens: int = 6, width: int = 1200) -> str:
    """A picture of the last TOKENS decode tokens of one session: a lane per process and
    thread, a box per span (the colours of COLOURS), time left to right."""
    spans = [s for s in spans_of(timelines) if s.n == 1]
    if not spans:
        return "<svg xmlns='http://www.w3.org/2000/svg'/>"
    sid = max(spans, key=lambda s: s.t1_ns).sid
    positions = sorted({s.pos for s in spans if s.sid == sid})[-tokens:]
    shown = [s for s in spans if s.sid == sid and s.pos in positions]
    t0, t1 = min(s.t0_ns for s in shown), max(s.t1_ns for s in shown)
    lanes = sorted({(s.where, s.tid) for s in shown})
    scale = (width - 220) / max(t1 - t0, 1)
    out = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{40 + 30 * len(lanes) + 40}' "
           "font-family='sans-serif' font-size='11'>",
           f"<text x='10' y='15'>session {sid}, positions {positions[0]}..{positions[-1]}: "
           f"{(t1 - t0) / 1e6:.2f} ms</text>"]
    for i, lane in enumerate(lanes):
        y = 30 + 30 * i
        out.append(f"<text x='10' y='{y + 15}'>{lane[0]} (tid {lane[1]})</text>")
        for s in shown:
            if (s.where, s.tid) != lane:
                continue
            x, w = 210 + (s.t0_ns - t0) * scale, max((s.t1_ns - s.t0_ns) * scale, 1)
            out.append(f"<rect x='{x:.1f}' y='{y}' width='{w:.1f}' height='20' fill='{COLOURS.get(s.name, '#999')}'>"
                       f"<title>{s.name} pos {s.pos}: {s.us:.0f} us, cpu {s.cpu}</title></rect>")
    y = 40 + 30 * len(lanes)
    for j, (name, colour) in enumerate(COLOURS.items()):
        out.append(f"<rect x='{10 + 140 * j}' y='{y}' width='12' height='12' fill='{colour}'/>"
                   f"<text x='{26 + 140 * j}' y='{y + 11}'>{name}</text>")
    out.append("</svg>")
    return "\n".join(out)
