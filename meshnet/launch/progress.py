"""Bars of the stages loading their ranges, from a coordinator's metrics (each worker's
health carries llama.cpp's progress_callback fraction): what `meshnet run`, `meshnet
coordinator` and `meshnet status` draw while a route forms."""

from __future__ import annotations

BAR_WIDTH = 20


def load_bars(snapshot: dict, width: int = BAR_WIDTH) -> list[str]:
    """A bar per stage loading its range, to the tenth (so a bar is redrawn ten times)."""
    lines = []
    for s in snapshot["stages"]:
        if s.get("state") == "loading" and s.get("load_progress") is not None:
            done = int(s["load_progress"] * 10) / 10
            lines.append(f"{s['stage']} {s['worker']}: [{'#' * int(done * width):<{width}}] {int(done * 100)}%")
    return lines
