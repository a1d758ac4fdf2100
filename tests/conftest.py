"""Shared pytest setup: the devices to run kernel grids on, and the GPU marker's skip."""
from __future__ import annotations

import pytest
import torch


def cuda_ready() -> bool:
    """True when torch sees a GPU and the native library has its CUDA backend."""
    if not torch.cuda.is_available():
        return False
    from conduit_rt import native

    return native.backends()["cuda"]["available"]


def pytest_collection_modifyitems(config, items):
    if cuda_ready():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device and a library built with CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Every kernel test runs on the CPU backend; the same grid runs on CUDA under the `gpu` marker.
DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param
