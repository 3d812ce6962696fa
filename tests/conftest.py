"""Shared fixtures: the real models, installed and checked by meshnet.models; and the
command line as a user runs it."""

import json
import subprocess
import sys

import pytest

from meshnet import models

THREADS = 2  # parity is exact for the same thread count


@pytest.fixture(scope="session")
def smollm2_path():
    return str(models.ensure("smollm2"))


@pytest.fixture(scope="session")
def qwen_path():
    return str(models.ensure("qwen2.5-coder-1.5b"))


def meshnet(*args, timeout=300):
    """`meshnet ARGS...` in a process of its own, its output captured."""
    return subprocess.run([sys.executable, "-m", "meshnet.cli", *args], capture_output=True, text=True, timeout=timeout)


def last_json_line(stdout):
    return json.loads(stdout.strip().splitlines()[-1])
