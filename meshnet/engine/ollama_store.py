"""Models a user already has in Ollama's store, `ollama:NAME[:TAG]`, run from the store's
own blob (no copy): the manifest Ollama keeps for the name
(`manifests/registry.ollama.ai/library/NAME/TAG`, or NAMESPACE/NAME, or HOST/NAMESPACE/NAME)
names its model layer by digest, and the blob `blobs/sha256-HEX` is that GGUF. The store
is $OLLAMA_MODELS, as Ollama reads it, or ~/.ollama/models. The blob's sha256 is checked
against its digest (once, then remembered while the file holds, as any model's)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Callable

from meshnet.core import errors
from meshnet.core.errors import MeshnetError

PREFIX = "ollama:"
DEFAULT_HOST, DEFAULT_NAMESPACE, DEFAULT_TAG = "registry.ollama.ai", "library", "latest"
MODEL_MEDIA_TYPE = "application/vnd.ollama.image.model"
MAX_MANIFEST_BYTES = 1 << 20   # a manifest lists a handful of layers in a few KB
_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def store() -> Path:
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models").expanduser()


def parse(spec: str) -> tuple[str, str, str, str]:
    """`ollama:[[HOST/]NAMESPACE/]NAME[:TAG]` -> (host, namespace, name, tag), as Ollama
    fills a short name in."""
    body = spec[len(PREFIX):]
    name, _, tag = body.rpartition(":") if ":" in body.rsplit("/", 1)[-1] else (body, "", "")
    parts = name.split("/")
    parts = [DEFAULT_HOST, DEFAULT_NAMESPACE][:3 - len(parts)] + parts if len(parts) < 3 else parts
    tag = tag or DEFAULT_TAG
    if len(parts) != 3 or not all(_PART.match(p) and p not in (".", "..") for p in (*parts, tag)):
        raise MeshnetError(errors.MODEL_NOT_FOUND, f"'{spec}' is not ollama:NAME[:TAG] (for example ollama:qwen2.5-coder:1.5b)")
    return parts[0], parts[1], parts[2], tag


def find(spec: str, sha256_of: Callable[[Path], str]) -> Path:
    """The store's blob of the model ollama:... names, its sha256 (by SHA256_OF, the hash
    models.py remembers) checked against its digest."""
    host, namespace, name, tag = parse(spec)
    root = store()
    manifest_path = root / "manifests" / host / namespace / name / tag
    try:
        with open(manifest_path, "rb") as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError:
        pulled = sorted(p.parent.name + ":" + p.name for p in (root / "manifests" / host / namespace).glob("*/*"))[:8]
        raise MeshnetError(errors.MODEL_NOT_FOUND, f"Ollama's store at {root} has no {name}:{tag}"
                           + (f" (it has {', '.join(pulled)})" if pulled else "")
                           + f"; `ollama pull {name}:{tag}` first, or set OLLAMA_MODELS to the store") from None
    digest = _model_digest(raw, manifest_path)
    blob = root / "blobs" / f"sha256-{digest}"
    if not blob.is_file():
        raise MeshnetError(errors.MODEL_SOURCE, f"{manifest_path} names the blob {blob.name}, which is not in the "
                           "store: pull the model again")
    sha = sha256_of(blob)
    if sha != digest:
        raise MeshnetError(errors.MODEL_CHECKSUM, f"the blob {blob} has sha256 {sha}, not its name's: the store is "
                           "damaged; pull the model again")
    return blob


def _model_digest(raw: bytes, path: Path) -> str:
    try:
        if len(raw) > MAX_MANIFEST_BYTES:
            raise ValueError("too long")
        layers = json.loads(raw)["layers"]
        digests = [layer["digest"] for layer in layers if layer.get("mediaType") == MODEL_MEDIA_TYPE]
    except (ValueError, KeyError, TypeError, AttributeError):
        raise MeshnetError(errors.MODEL_SOURCE, f"{path} is not an Ollama manifest this version reads") from None
    if len(digests) != 1 or not isinstance(digests[0], str) or not re.fullmatch(r"sha256:[0-9a-f]{64}", digests[0]):
        raise MeshnetError(errors.MODEL_SOURCE, f"{path} names {len(digests)} model layers, not one GGUF by its "
                           "sha256")
    return digests[0][len("sha256:"):]
