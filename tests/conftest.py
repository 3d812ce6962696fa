"""Shared fixtures: the real models, installed and checked by meshnet.models."""

import pytest

from meshnet import models

THREADS = 2  # parity is exact for the same thread count


@pytest.fixture(scope="session")
def smollm2_path():
    return str(models.ensure("smollm2"))


@pytest.fixture(scope="session")
def qwen_path():
    return str(models.ensure("qwen2.5-coder-1.5b"))
