"""The web console at `meshnet serve`'s `/`: a picture of the route (each stage a box on its
host, with its layers, memory, device and load progress; each seam its hop time and bytes
a token), live figures with a chart of the last minutes, the failovers and the security
layer's refusals, and a chat box that streams through the same /v1 API. Plain HTML and
JavaScript served from this package (console/), nothing fetched from elsewhere. The page
itself holds no data: its figures come from /console/state and the server-sent events of
/console/events, behind the same API key as /v1."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from fastapi import APIRouter, Depends, Request
from fastapi.responses import FileResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from meshnet.core import errors
from meshnet.core.errors import MeshnetError
from meshnet.serve.openai import ApiError

PAGE_DIR = Path(__file__).with_name("console")
PAGE_FILES = {"console.js": "text/javascript", "console.css": "text/css"}
EVERY_S = 1.0   # the events' period
# event streams one server holds open at once: each is a connection held and a wake-up
# every 0.1 s, so without a bound any holder of the key could slow every request down
# (1,100 streams took an answer's first token from 0.08 s to 1.7 s). A few browsers'
# tabs are far below it.
MAX_FEEDS = 32


def state(coordinator, model: str, slots) -> dict:
    """What the console shows, now."""
    try:
        snapshot = coordinator.metrics(timeout=1.0)
    except (MeshnetError, TimeoutError) as e:
        return {"model": model, "time": time.time(), "error": str(e), "stages": [], "seams": []}
    report = coordinator.route_report()
    stages = []
    for s in snapshot["stages"]:
        stages.append({k: s.get(k) for k in (
            "stage", "worker", "host", "in_route", "kept_out", "state", "load_progress", "load_seconds", "rss_bytes",
            "model_bytes", "kv_bytes_used", "device_bytes", "device_total", "backend", "device", "n_sessions",
            "queue_depth", "hop_us_p50", "seam_bytes", "unreachable")})
    counters = snapshot["counters"]
    tokens = max(counters.get("tokens", 0), 1)
    seams = [{"after": s["stage"], "hop_us_p50": s.get("hop_us_p50"),
              "bytes_per_token": round(s["seam_bytes"] / tokens) if s.get("seam_bytes") else None}
             for s in stages[1:] if s.get("in_route")]
    return {
        "model": model, "time": time.time(), "route": report["route"] or [], "route_error": report.get("error"),
        "stages": stages, "seams": seams, **slots.console(),
        "tokens_total": counters.get("tokens", 0), "queue": sum(s.get("queue_depth") or 0 for s in stages),
        "prefix_hits": counters.get("prefix_hit_tokens", 0), "resumes": snapshot["resumes"],
        "failovers": snapshot.get("failovers", []), "sessions": snapshot["sessions"],
        "refusals": {k: counters.get(k, 0) for k in ("refused_peers", "refused_handshakes", "dropped_bad_key")},
    }


class Feeds:
    """The event feeds open, at most LIMIT; stop() ends them all (the server is stopping: a
    console left open must not hold its shutdown). They share one state a period, so that
    what the coordinator is asked does not grow with the feeds."""

    def __init__(self, limit: int = MAX_FEEDS):
        self.stopped = False
        self.limit = limit
        self.open = 0   # (counted on the event loop's thread alone: no lock)
        self._latest: tuple[float, asyncio.Future] | None = None

    def stop(self) -> None:
        self.stopped = True

    def take(self) -> None:
        if self.open >= self.limit:
            raise ApiError(429, f"this server already streams /console/events to {self.limit} consoles, the most "
                           "it holds open: close one, or use /console/state", code=errors.TOO_MANY_STREAMS)
        self.open += 1

    def give(self) -> None:
        self.open -= 1

    async def state(self, coordinator, model: str, slots) -> dict:
        """The state, made at most once a period however many feeds ask for it."""
        at = time.monotonic()
        if self._latest is None or at - self._latest[0] >= EVERY_S / 2:
            self._latest = (at, asyncio.ensure_future(run_in_threadpool(state, coordinator, model, slots)))
        return await asyncio.shield(self._latest[1])   # a feed that goes away leaves it to the others


class FeedResponse(StreamingResponse):
    """An event feed that gives its place back however its response ends: a generator's own
    cleanup never runs for a client gone before the first event."""

    def __init__(self, feeds: Feeds, body):
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.feeds = feeds

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.feeds.give()


def routes(coordinator, model: str, slots, authorize, feeds: Feeds) -> tuple[APIRouter, APIRouter]:
    page = APIRouter()
    data = APIRouter(prefix="/console", dependencies=[Depends(authorize)])

    @page.get("/")
    async def index():
        return FileResponse(PAGE_DIR / "index.html", media_type="text/html")

    @page.get("/console/page/{name}")
    async def page_file(name: str):
        if name not in PAGE_FILES:
            raise ApiError(404, f"no console file {name!r}", code=None)
        return FileResponse(PAGE_DIR / name, media_type=PAGE_FILES[name])

    @data.get("/state")
    async def current():
        return await run_in_threadpool(state, coordinator, model, slots)

    @data.get("/events")
    async def events(request: Request):
        async def feed():
            while not feeds.stopped and not await request.is_disconnected():
                now = await feeds.state(coordinator, model, slots)
                yield f"data: {json.dumps(now, separators=(',', ':'))}\n\n"
                for _ in range(int(EVERY_S / 0.1)):   # (a stop is seen within 0.1 s)
                    if feeds.stopped:
                        return
                    await asyncio.sleep(0.1)
        feeds.take()
        return FeedResponse(feeds, feed())

    return page, data
