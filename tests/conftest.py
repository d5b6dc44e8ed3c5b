"""Test set-up: the Triton interpreter on CPU-only machines, the GPU marker, the device fixture. Shared
helpers are in ``helpers.py``."""

import os

import torch

if not torch.cuda.is_available():
    # Must be set before any @triton.jit function is defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from helpers import HAS_CUDA  # noqa: E402


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def no_recorded_steps():
    """Every test starts with no recorded eager steps (``qsa.attention.replay``): a test that patches a
    launcher's settings function must not be served a step another test recorded."""
    from qsa.attention import api
    from qsa.cache import paged
    from qsa.model import kernels
    from qsa.selection import api as selection

    caches = (api._STEPS, selection._SELECTIONS, paged._WRITES, selection._UPDATES, kernels._NORM_ROPES)
    for cache in caches:
        cache.clear()
    yield
    for cache in caches:
        cache.clear()


@pytest.fixture
def device():
    """The device CPU-sized tests run on: the GPU when there is one, else the CPU (interpreter)."""
    return "cuda" if HAS_CUDA else "cpu"
