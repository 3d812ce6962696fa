"""meshnet's version, as its installed package says: what the servers report of themselves
(Ollama's /api/version, llama-server's /props)."""

from __future__ import annotations

import importlib.metadata


def version() -> str:
    try:
        return importlib.metadata.version("meshnet")
    except importlib.metadata.PackageNotFoundError:   # run from a tree that was never installed
        return "0+unknown"
