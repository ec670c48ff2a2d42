"""What the agent reads of one process's /proc is bounded (dynsnap/runtime/procfs.py, issue 39): a process
that maps more than MAPS_READ_BOUND bytes of /proc/<pid>/maps or holds more than FD_COUNT_BOUND descriptors
is ProcBoundExceeded, counted before anything past the bound is read; the agent refuses its pod by name
(ProcessTooLarge, dynsnap/agent/worker.py). A copy of /proc here (a real process cannot hold that many
descriptors on this machine: its hard RLIMIT_NOFILE is 20000 and root lacks CAP_SYS_RESOURCE)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dynsnap.agent import worker as W
from dynsnap.models.protocol import Reason
from dynsnap.runtime import procfs

LINE = b"7f0000000000-7f0000001000 r--p 00000000 00:00 1 /" + b"x" * 100 + b"\n"


def _maps(proc: Path, pid: int, lines: int) -> None:
    (proc / str(pid)).mkdir(parents=True, exist_ok=True)
    (proc / str(pid) / "maps").write_bytes(LINE * lines)


def test_maps_past_the_bound_are_refused_and_within_it_read(tmp_path: Path) -> None:
    _maps(tmp_path, 1, 10)
    assert procfs.maps_paths(1, tmp_path) == {"/" + "x" * 100}
    _maps(tmp_path, 2, procfs.MAPS_READ_BOUND // len(LINE) + 1)
    with pytest.raises(procfs.ProcBoundExceeded, match="maps more than the 16777216 bytes"):
        procfs.maps_paths(2, tmp_path)


def test_descriptors_past_the_bound_are_refused_before_any_is_read(tmp_path: Path) -> None:
    fd = tmp_path / "3" / "fd"
    fd.mkdir(parents=True)
    for i in range(procfs.FD_COUNT_BOUND + 1):
        os.symlink("/dev/null", fd / str(i))
    with pytest.raises(procfs.ProcBoundExceeded, match="more than the 65536 descriptors"):
        procfs.fd_targets(3, tmp_path)
    os.unlink(fd / "0")
    assert len(procfs.fd_targets(3, tmp_path)) == procfs.FD_COUNT_BOUND


def test_the_gpu_look_passes_the_bound_on_and_the_refusal_names_its_reason(tmp_path: Path) -> None:
    _maps(tmp_path, 4, procfs.MAPS_READ_BOUND // len(LINE) + 1)
    with pytest.raises(procfs.ProcBoundExceeded):
        W.is_gpu_process(4, tmp_path)
    assert W.ProcessTooLarge("pod u: x").reason == Reason.PROCESS_TOO_LARGE
