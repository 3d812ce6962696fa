"""Where meshnet keeps what it makes on a machine: $MESHNET_HOME (default ~/.cache/meshnet),
with models/, hashes/ and keys/ under it. Nothing is written outside it."""

from __future__ import annotations

import os
from pathlib import Path


def meshnet_home() -> Path:
    return Path(os.environ.get("MESHNET_HOME", Path.home() / ".cache" / "meshnet"))
