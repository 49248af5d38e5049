"""Shared test setup: the ``gpu`` marker skips without CUDA; tests are deterministic."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run on the CPU through the interpreter; checked against their references.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def cpu_copy(monkeypatch):
    """Offloader activations on the CPU copy through slots and hooks as on CUDA."""
    from shuttle.offload import CPU_COPY_ENV

    monkeypatch.setenv(CPU_COPY_ENV, "1")
