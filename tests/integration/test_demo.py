"""The README's first command: `dynsnap demo` runs the whole suspend -> wake -> verify cycle
on its own local cluster (own bridge and /16, beside the session's) and cleans up after itself."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dynsnap.demo import DEMO_BRIDGE

pytestmark = pytest.mark.cluster


def test_demo_runs_the_cycle_and_leaves_nothing_behind() -> None:
    r = subprocess.run([sys.executable, "-m", "dynsnap", "demo"], capture_output=True, text=True, timeout=420,
                       env=dict(os.environ), stdin=subprocess.DEVNULL)
    out = r.stdout
    assert r.returncode == 0, out[-3000:] + r.stderr[-3000:]
    assert "FAILED" not in out
    for line in ("chat completion served",
                 "3/3 requests pinned to demo-worker-0 answered by it (before)",
                 "3/3 requests pinned to demo-worker-1 answered by it (before)",
                 "accepted by the agent on",
                 "agent captured it: quiesce", "settle-snapshotted",
                 "3/3 requests pinned to demo-worker-0 answered by it (during sleep)",
                 "agent woke it: wake", "settle-active",
                 "same pod UID and IP", "same DWM UID and instance id",
                 "its EndpointSlice endpoint is ready again, same targetRef.uid",
                 "3/3 requests pinned to demo-worker-1 answered by it (after wake)",
                 "no liveness restart while it slept",
                 "demo passed"):
        assert line in out, line
    for table in ("Pods", "DynamoWorkerMetadata", "EndpointSlices (discovery-enabled)", "Who served what"):
        assert f"\n{table}\n" in out, table
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not [ln for ln in netns.splitlines() if ln.startswith(f"{DEMO_BRIDGE}-")]
    assert subprocess.run(["ip", "link", "show", "dev", DEMO_BRIDGE], capture_output=True).returncode != 0
