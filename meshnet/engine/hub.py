"""Models by their Hugging Face name, `hf:ORG/REPO[:QUANT|:FILE]`, as llama.cpp's `-hf`
takes them: the repository's GGUF of that quantization (Q4_K_M when none is named, as
llama.cpp picks, else the first), every split of a model written as several files, each
downloaded into huggingface_hub's cache (HF_ENDPOINT and HF_TOKEN as it reads them),
resumed where an earlier run stopped, and checked against the sha256 the hub gives for the file
(its LFS object's): a file whose bytes are not that is deleted from the cache and refused.
With the hub away (or HF_HUB_OFFLINE), the newest cached copy is taken, checked against
the sha256 its cached blob is named by."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Callable

from meshnet.core import errors
from meshnet.core.errors import MeshnetError
from meshnet.engine.gguf_splits import SPLIT_NAME

PREFIX = "hf:"
DEFAULT_QUANT = "Q4_K_M"
# a repository id as the hub spells one: ORG/NAME of letters, digits and - _ .
_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def parse(spec: str) -> tuple[str, str | None]:
    """`hf:ORG/REPO[:QUANT|:FILE]` -> (repository id, quantization or file name or None)."""
    body = spec[len(PREFIX):]
    repo, _, selector = body.partition(":")
    if not _REPO.match(repo) or ".." in repo:
        raise MeshnetError(errors.MODEL_NOT_FOUND, f"'{spec}' is not hf:ORG/REPO[:QUANT|:FILE] (for example "
                           "hf:bartowski/Qwen2.5-Coder-1.5B-Instruct-GGUF:Q4_K_M)")
    return repo, selector or None


def choose(files: list[str], selector: str | None) -> list[str]:
    """The files of the model SELECTOR names among a repository's FILES: one file, or every
    split of one; [] when none is. A file name is taken as it is; a quantization matches a
    name (or a folder) that has it between separators, in any case; none takes Q4_K_M, else
    the first GGUF by name. Projector files (mmproj) are never the language model."""
    ggufs = _ggufs(files)
    if selector and selector.endswith(".gguf"):
        picked = [f for f in ggufs if f == selector]
    else:
        quant = (selector or DEFAULT_QUANT).upper()
        # Q4_K is not Q4_K_M: a tag ends at a dash, a dot or a folder's end, never at "_"
        tagged = re.compile(rf"(^|[-_./]){re.escape(quant)}([-./]|$)")
        picked = [f for f in ggufs if tagged.search(f.upper())]
        if not picked and selector is None:
            picked = ggufs
    if not picked:
        return []
    first = picked[0]
    m = SPLIT_NAME.match(first)
    if not m:
        return [first]
    # the other splits of the same model, by llama.cpp's names
    return [f for f in ggufs if (o := SPLIT_NAME.match(f)) and o["prefix"] == m["prefix"] and o["count"] == m["count"]]


def fetch(spec: str, sha256_of: Callable[[Path], str]) -> Path:
    """The local path of the model hf:... names (its first file), downloaded and each file
    checked by SHA256_OF (the hash that models.py remembers)."""
    try:
        from huggingface_hub import HfApi, hf_hub_download
    except ImportError:
        raise MeshnetError(errors.MODEL_SOURCE, "hf: models need the huggingface_hub package: pip install "
                           "huggingface_hub (make does)") from None
    repo, selector = parse(spec)
    # read now: huggingface_hub reads its environment once, when it is first imported
    endpoint = os.environ.get("HF_ENDPOINT") or None
    cache = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface"), "hub")
    try:
        info = HfApi(endpoint=endpoint).model_info(repo, files_metadata=True)
    except Exception as e:   # as a download's: the hub's answer, or no answer at all (HF_HUB_OFFLINE too)
        cached = _from_cache(Path(os.path.expanduser(cache)), repo, selector, sha256_of)
        if cached is None:
            raise MeshnetError(errors.MODEL_SOURCE, f"the Hugging Face hub could not list {repo} ({_said(e)}), and "
                               f"no copy of it is in the cache at {cache}") from None
        print(f"meshnet: the Hugging Face hub could not list {repo}; running its copy in the cache, {cached}",
              file=sys.stderr)
        return cached
    siblings = {s.rfilename: s for s in info.siblings or []}
    files = choose(list(siblings), selector)
    if not files:
        offered = ", ".join(_ggufs(list(siblings))) or "none"
        raise MeshnetError(errors.MODEL_NOT_FOUND, f"{repo} has no GGUF {selector or DEFAULT_QUANT}; its GGUFs: {offered}")
    paths = []
    for name in files:
        lfs = siblings[name].lfs
        if lfs is None or not re.fullmatch(r"[0-9a-f]{64}", str(lfs.sha256)):
            raise MeshnetError(errors.MODEL_SOURCE, f"the hub gives no sha256 for {repo}/{name}, so it cannot be "
                               "checked: it is not taken")
        try:
            _resume_blob(repo, name, info.sha, lfs, endpoint, Path(os.path.expanduser(cache)))
            path = Path(hf_hub_download(repo, name, revision=info.sha, endpoint=endpoint,
                                        cache_dir=os.path.expanduser(cache)))
        except Exception as e:   # huggingface_hub's, its HTTP client's (a dropped connection), the disk's
            raise MeshnetError(errors.MODEL_SOURCE, f"downloading {repo}/{name} failed ({_said(e)}); run it again "
                               "to resume") from None
        sha = sha256_of(path)
        if sha != lfs.sha256:
            _forget(path)
            raise MeshnetError(errors.MODEL_CHECKSUM, f"{repo}/{name} downloaded with sha256 {sha}, not the hub's "
                               f"{lfs.sha256}: it is deleted; run it again to download it anew")
        paths.append(path)
    return paths[0]


def _resume_blob(repo: str, name: str, revision: str, lfs, endpoint: str | None, cache: Path) -> None:
    """NAME's bytes into the cache as the blob its sha256 names, continuing the part an
    earlier run left; hf_hub_download then finds the blob and only links it into the
    snapshot. huggingface_hub itself resumes only within a run: each download goes to a
    file of its own, deleted when it fails, so a run that stops (a closed laptop, ^C, a
    dropped line past its retries) would start a file of tens of GB again. The part is kept
    under its sha256, so it only ever continues the same bytes, and the hub's HTTP path is
    taken (as llama.cpp's -hf does) even where the repository is stored by Xet."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import WeakFileLock, build_hf_headers

    folder = "models--" + repo.replace("/", "--")
    blob = cache / folder / "blobs" / lfs.sha256
    if blob.exists():   # before any lock: a cache may be mounted read-only
        return
    part = blob.with_name(blob.name + ".meshnet-part")
    lock = cache / ".locks" / folder / f"{lfs.sha256}.lock"   # the lock huggingface_hub takes for this blob
    lock.parent.mkdir(parents=True, exist_ok=True)
    blob.parent.mkdir(parents=True, exist_ok=True)
    with WeakFileLock(lock):
        if blob.exists():
            return
        part.touch()
        with open(part, "r+b") as f:
            have = f.seek(0, os.SEEK_END)
            if have > lfs.size:   # not a part of this file
                f.truncate(0)
                have = f.seek(0)
            if have:
                print(f"meshnet: resuming {repo}/{name} at {have} of {lfs.size} bytes", file=sys.stderr)
            http_get(hf_hub_url(repo, name, revision=revision, endpoint=endpoint), f, resume_size=have,
                     headers=build_hf_headers(), expected_size=lfs.size, displayed_filename=name)
        os.replace(part, blob)


def _from_cache(cache: Path, repo: str, selector: str | None, sha256_of: Callable[[Path], str]) -> Path | None:
    """The model's first file from huggingface_hub's cache, when the hub cannot be asked:
    the newest snapshot that holds every file SELECTOR picks, each checked against the
    name of the blob it links to (an LFS blob is named by its sha256)."""
    snapshots = cache / ("models--" + repo.replace("/", "--")) / "snapshots"
    try:
        found = sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
    except OSError:
        return None
    for snapshot in found:
        files = choose([str(p.relative_to(snapshot)) for p in snapshot.rglob("*.gguf") if p.is_file()], selector)
        if not files:
            continue
        for name in files:
            path = snapshot / name
            blob = path.resolve().name
            if sha256_of(path) != blob:
                raise MeshnetError(errors.MODEL_CHECKSUM, f"the cached {repo}/{name} does not have the sha256 its "
                                   f"blob is named by ({blob}): the cache is damaged; delete {path.resolve()}")
        return snapshot / files[0]
    return None


def _ggufs(files: list[str]) -> list[str]:
    return sorted(f for f in files if f.endswith(".gguf") and "mmproj" not in Path(f).name.lower())


def _forget(path: Path) -> None:
    """A downloaded file out of huggingface_hub's cache: the snapshot's link and its blob."""
    blob = path.resolve()
    for p in (path, blob):
        try:
            p.unlink()
        except OSError:
            pass


def _said(e: Exception) -> str:
    return f"{type(e).__name__}: " + " ".join(str(e).split())[:300]
