"""Fixtures of the native tier. dynsnap-cuda's (the built CLI, the stub libcuda and stub NVML, a
per-test stub driver) live in cuda_harness.py."""

from cuda_harness import cuda_cli, stub, stub_lib, stub_nvml_lib  # noqa: F401
