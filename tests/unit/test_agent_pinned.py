"""The entrypoint's control directory is reached through the process the agent located, pinned by its start
time (dynsnap/agent/entrypoint_control.py, issue 38): the container's root is opened once per read or
request and the process checked with it open, so a container restarted since (another process at the
located pid) is never read from nor written to. Against this test's own process and a real directory."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dynsnap.agent.entrypoint_control import EntrypointControl, EntrypointError
from dynsnap.models import protocol as P
from dynsnap.runtime import procfs

ME = os.getpid()


@pytest.fixture
def control_dir(tmp_path: Path) -> Path:
    d = tmp_path / "ctl"
    d.mkdir()
    doc = {"format": 1, "state": "active", "request_seq": 0, "ack_seq": 0, "worker_pid": 10001,
           "worker_alive": True, "pid_reserved": True, "seccomp": "on", "started": 1.0, "updated": 1.0}
    (d / P.ENTRYPOINT_CONTROL_FILE).write_text(json.dumps(doc))
    return d


def test_the_located_process_is_read_through(control_dir: Path) -> None:
    start = procfs.start_time(ME)
    assert start is not None
    info = EntrypointControl(control_dir, root=Path(f"/proc/{ME}/root"), pinned=(ME, start)).read()
    assert info["state"] == "active"


def test_another_process_at_the_located_pid_is_never_read_nor_written(control_dir: Path) -> None:
    start = procfs.start_time(ME)
    assert start is not None
    ctl = EntrypointControl(control_dir, root=Path(f"/proc/{ME}/root"), pinned=(ME, start + 1))
    with pytest.raises(EntrypointError, match="the container restarted; nothing was read or written"):
        ctl.read()
    before = sorted(p.name for p in control_dir.iterdir())
    with pytest.raises(EntrypointError, match="the container restarted"):
        import asyncio
        asyncio.run(ctl.request(P.EntrypointState.SUSPENDING, timeout=1.0))
    assert sorted(p.name for p in control_dir.iterdir()) == before, "a request was written"
