"""ACCEPTANCE A.1: the pinned tree, the patch stack and the engine built from them."""

import hashlib
import subprocess
from pathlib import Path

from meshnet.engine import Stage, engine_pin

ROOT = Path(__file__).resolve().parent.parent
PATCHES = sorted((ROOT / "engine_c" / "patches").glob("*.patch"))


def test_each_patch_applies_and_reverses_cleanly_on_the_pristine_tree():
    result = subprocess.run(
        [str(ROOT / "tools" / "patch_tree.sh"), "check", str(ROOT / "build" / "llama.cpp-pristine"), *map(str, PATCHES)],
        capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(PATCHES)} patches apply and reverse" in result.stdout


def test_every_patch_says_why():
    for patch in PATCHES:
        header = patch.read_text().split("\ndiff --git", 1)[0]
        assert "Why:" in header, f"{patch.name} has no 'Why:' header"


def test_engine_reports_the_pin_it_was_built_from(smollm2_path):
    stack = hashlib.sha256(b"".join(p.read_bytes() for p in PATCHES)).hexdigest()
    pin = engine_pin()
    assert pin.startswith("llama.cpp@0c1e57098 ")
    assert "sdist=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e" in pin
    assert f"patches={stack}" in pin
    with Stage(smollm2_path, (0, 10), n_ctx=64, max_sessions=1) as stage:
        assert stage.info().engine_pin == pin
