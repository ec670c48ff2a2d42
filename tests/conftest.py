"""Shared pytest configuration: the GPU marker is skipped where no CUDA driver exists."""

from __future__ import annotations

import ctypes.util
import os

import pytest


def _has_cuda_driver() -> bool:
    return bool(os.environ.get("DYNSNAP_LIBCUDA") or ctypes.util.find_library("cuda"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _has_cuda_driver():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU and the CUDA driver: run on the GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
