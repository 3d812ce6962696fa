"""Bars of the stages loading their ranges, from a coordinator's metrics (each worker's
health carries llama.cpp's progress_callback fraction, or the share of its range's bytes
fetched from the mesh): what `meshnet run`, `meshnet
coordinator` and `meshnet status` draw while a route forms."""

from __future__ import annotations

BAR_WIDTH = 20


def load_bars(snapshot: dict, width: int = BAR_WIDTH) -> list[str]:
    """A bar per stage loading its range, to the tenth (so a bar is redrawn ten times)."""
    lines = []
    for s in snapshot["stages"]:
        # a worker without the model file fetches its range's bytes first (weights/fetch.py)
        for state, key, verb in (("fetching", "fetch_progress", "fetching "), ("loading", "load_progress", "")):
            if s.get("state") == state and s.get(key) is not None:
                done = int(s[key] * 10) / 10
                lines.append(f"{s['stage']} {s['worker']}: {verb}[{'#' * int(done * width):<{width}}] "
                             f"{int(done * 100)}%")
    return lines
