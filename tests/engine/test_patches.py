"""ACCEPTANCE A.1: the pinned tree, the patch stack and the engine built from them."""

import hashlib
import subprocess
from pathlib import Path

from meshnet.engine.binding import Stage, engine_pin

ROOT = Path(__file__).resolve().parents[2]
PATCHES = sorted((ROOT / "engine_c" / "patches").glob("*.patch"))
PRISTINE = ROOT / "build" / "llama.cpp-pristine"
TREE = ROOT / "build" / "llama.cpp"


def test_the_patch_stack_is_there():
    # every test below passes on an empty stack: it must not be empty
    assert len(PATCHES) >= 4, [p.name for p in PATCHES]


def test_each_patch_applies_and_reverses_cleanly_on_the_pristine_tree():
    assert PATCHES and (PRISTINE / "CMakeLists.txt").is_file()
    result = subprocess.run([str(ROOT / "tools" / "patch_tree.sh"), "check", str(PRISTINE), *map(str, PATCHES)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(PATCHES)} patches apply and reverse" in result.stdout
    for patch in PATCHES:  # each one, by name, both ways
        assert f"applies cleanly:  {patch.name}" in result.stdout
        assert f"reverses cleanly: {patch.name}" in result.stdout


def test_every_patch_says_why():
    assert PATCHES
    for patch in PATCHES:
        header = patch.read_text().split("\ndiff --git", 1)[0]
        why = header.split("Why:", 1)[1].strip() if "Why:" in header else ""
        assert len(why) > 20, f"{patch.name} has no 'Why:' header that says why"


def test_the_engine_tree_is_the_pristine_tree_with_exactly_this_stack(tmp_path):
    # what the build compiled: the stack it applied last is this one, byte for byte, and
    # reversing it gives back the pristine tree (nothing else was changed by hand)
    applied = sorted((TREE / ".meshnet-applied").glob("*.patch"))
    assert [p.name for p in applied] == [p.name for p in PATCHES]
    assert all(a.read_bytes() == p.read_bytes() for a, p in zip(applied, PATCHES))
    copy = tmp_path / "tree"
    subprocess.run(["cp", "-a", str(TREE), str(copy)], check=True)
    for patch in reversed(PATCHES):
        result = subprocess.run(["patch", "-d", str(copy), "-p1", "-R", "--fuzz=0", "--no-backup-if-mismatch", "-s"],
                                stdin=patch.open("rb"), capture_output=True, text=True)
        assert result.returncode == 0, f"{patch.name} does not reverse on the engine tree: {result.stdout}{result.stderr}"
    diff = subprocess.run(["diff", "-r", "-q", "-x", ".meshnet-applied", "-x", ".stamp", str(PRISTINE), str(copy)],
                          capture_output=True, text=True)
    assert diff.returncode == 0, diff.stdout[-2000:]


def test_engine_reports_the_pin_it_was_built_from(smollm2_path):
    stack = hashlib.sha256(b"".join(p.read_bytes() for p in PATCHES)).hexdigest()
    pin = engine_pin()
    assert pin.startswith("llama.cpp@0c1e57098 ")
    assert "sdist=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e" in pin
    assert f"patches={stack}" in pin
    with Stage(smollm2_path, (0, 10), n_ctx=64, max_sessions=1) as stage:
        assert stage.info().engine_pin == pin


def test_the_generated_graph_patch_is_what_its_script_writes_from_the_pristine_tree(tmp_path):
    # 0007 is never edited by hand: tools/stage_graphs.py writes it again, byte for byte
    out = tmp_path / "0007.patch"
    done = subprocess.run(["python3", str(ROOT / "tools" / "stage_graphs.py"), str(PRISTINE), str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert out.read_bytes() == (ROOT / "engine_c" / "patches" / "0007-stage-graphs.patch").read_bytes()
