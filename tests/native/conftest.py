"""Fixtures of the native tier. dynsnap-cuda's (the built CLI, the stub libcuda and stub NVML, a
per-test stub driver) live in cuda_harness.py; dynsnap-entrypoint's (the built binary, a sandbox
that runs it as PID 1 of its own pid namespace) in entrypoint_harness.py."""

from cuda_harness import cuda_cli, stub, stub_lib, stub_nvml_lib  # noqa: F401
from entrypoint_harness import entrypoint_bin, sandbox  # noqa: F401
