"""The README's set-up: `make` on a Debian whose system Python is externally managed
(PEP 668) must install into a virtual environment, never into the system Python.

CI runs the real thing (`.ci/run` builds with /usr/bin/python3); these tests read what
`make` would do, so that a Makefile change that would go back to the system pip fails
here in a second."""

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def make_dry_run(*targets, fresh=True, **env):
    environment = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    environment.update(env)
    # -B: as on a fresh clone, every recipe would run
    result = subprocess.run(["make", "-n", *(["-B"] if fresh else []), *targets], cwd=ROOT, capture_output=True, text=True, env=environment,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_make_without_an_active_venv_installs_into_the_project_venv_made_with_the_given_python():
    lines = make_dry_run("python", "model", PYTHON="/usr/bin/python3")
    assert "/usr/bin/python3 -m venv .venv" in lines
    installs = [line for line in lines if " install " in line]
    assert installs and all(line.startswith(".venv/bin/python -m pip install") for line in installs), installs
    assert not any(line.startswith("/usr/bin/python3 -m pip") for line in lines)
    assert ".venv/bin/python -m meshnet.engine.models ensure smollm2" in lines


def test_make_uses_an_active_virtual_environment_as_it_is(tmp_path):
    python = tmp_path / "mine" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.touch()  # an existing venv, as an activated one is
    lines = make_dry_run("python", fresh=False, VIRTUAL_ENV=str(tmp_path / "mine"))
    assert not any(" -m venv " in line for line in lines)  # the user's venv already exists
    assert any(line.startswith(f"{tmp_path}/mine/bin/python -m pip install") for line in lines), lines


def test_make_test_and_make_run_use_the_venv():
    assert any(re.search(r"\.venv/bin/python -m pytest -q( --\S+)* tests$", line) for line in make_dry_run("test"))
    assert any(line.strip() == ".venv/bin/meshnet run" for line in make_dry_run("run"))


def test_ci_builds_with_the_system_python_where_there_is_one():
    script = (ROOT / ".ci" / "run").read_text()
    assert "/usr/bin/python3" in script and "python3-venv" in script
    assert "unset VIRTUAL_ENV" in script


def test_the_cuda_engine_builds_apart_for_one_architecture_and_needs_nvcc(tmp_path):
    lines = make_dry_run("engine-cuda", fresh=False, GPU="cuda", CUDA_ARCH="90")
    commands = " ".join(line.rstrip("\\").strip() for line in lines)   # one line per command, continuations joined
    configure = commands[commands.index("cmake -S engine_c -B build/cuda/cmake"):]
    assert "-DGGML_CUDA=ON" in configure and "-DCMAKE_CUDA_ARCHITECTURES=90" in configure
    assert "-DMESHNET_LIB_DIR=" + str(ROOT / "build" / "cuda") in configure   # the CPU engine stays where it is
    assert "all: engine-cuda" not in make_dry_run("all", fresh=False)          # plain make: the CPU engine only
    # without CUDA's compiler on the PATH: one clear line, before anything is configured
    bare = tmp_path / "bin"
    bare.mkdir()
    for tool in ("make", "sh", "cmake"):
        (bare / tool).symlink_to(subprocess.run(["which", tool], capture_output=True, text=True).stdout.strip())
    environment = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    cuda_build = ROOT / "build" / "cuda" / "cmake"
    configured_before = cuda_build.exists()    # a GPU engine built here before stays as it was
    result = subprocess.run(["make", "engine-cuda", "GPU=cuda"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                            env=dict(environment, PATH=str(bare)))
    assert result.returncode != 0 and "needs CUDA's compiler, nvcc, on the PATH" in result.stderr, result.stderr
    assert cuda_build.exists() == configured_before and "cmake" not in result.stdout
    refused = subprocess.run(["make", "-n", "GPU=rocm"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "GPU=rocm is not a backend" in refused.stderr


def test_the_vulkan_engine_builds_apart_and_names_debian_s_packages_where_its_tools_are_missing(tmp_path):
    lines = make_dry_run("engine-vulkan", fresh=False, GPU="vulkan")
    commands = " ".join(line.rstrip("\\").strip() for line in lines)
    configure = commands[commands.index("cmake -S engine_c -B build/vulkan/cmake"):]
    assert "-DGGML_VULKAN=ON" in configure and "-DMESHNET_LIB_DIR=" + str(ROOT / "build" / "vulkan") in configure
    assert "all: engine-vulkan" not in make_dry_run("all", fresh=False)
    bare = tmp_path / "bin"   # no glslc, no pkg-config
    bare.mkdir()
    for tool in ("make", "sh", "cmake"):
        (bare / tool).symlink_to(subprocess.run(["which", tool], capture_output=True, text=True).stdout.strip())
    environment = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    result = subprocess.run(["make", "engine-vulkan", "GPU=vulkan"], cwd=ROOT, capture_output=True, text=True,
                            timeout=60, env=dict(environment, PATH=str(bare)))
    assert result.returncode != 0 and "apt-get install glslc libvulkan-dev spirv-headers" in result.stderr, result.stderr
    assert "cmake" not in result.stdout
    assert "make GPU=vulkan" in (ROOT / ".ci" / "run").read_text()
