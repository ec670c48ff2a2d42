"""The README's first command: `dynsnap demo` runs on its own local cluster (own bridge and /16,
beside the session's): the controller and the agents, on their own, capture idle workers down to
min-active, wake them when load arrives, verify every wake with pinned requests, and no request
fails; it draws the PNG timeline of every capture and wake where it was told to; it cleans up after
itself."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dynsnap.demo import DEMO_BRIDGE

pytestmark = pytest.mark.cluster


def test_demo_runs_the_cycle_and_leaves_nothing_behind(tmp_path: Path) -> None:
    png = tmp_path / "timeline.png"
    r = subprocess.run([sys.executable, "-m", "dynsnap", "demo", "--timeline-out", str(png)], capture_output=True,
                       text=True, timeout=420, env=dict(os.environ), stdin=subprocess.DEVNULL)
    out = r.stdout
    assert r.returncode == 0, out[-3000:] + r.stderr[-3000:]
    assert "FAILED" not in out
    for line in ("the controller set each worker's serving gate",
                 "quiesced by the controller: gate", "frontend-stopped-routing",
                 "controller Normal  Quiescing", "controller Normal  CaptureRequested",
                 "captured by the agent (snapshot, ok=True): quiesce", "settle-snapshotted",
                 "2 workers asleep", "controller Normal  WakeRequested",
                 "woken in place by the agent (ok=True): wake", "restore", "settle-active",
                 "verification PASSED (Verified): 3/3 pinned answers",
                 "no liveness restart while workers slept",
                 "Timeline of every capture and wake",
                 "demo passed"):
        assert line in out, line
    assert len(re.findall(r"ok     demo-worker-\d: wake verified, 3/3 requests pinned", out)) == 2
    assert len(re.findall(r"ok     demo-worker-\d: same pod UID, pod IP and DWM UID", out)) == 2
    m = re.search(r"every request through the frontend answered: (\d+) ok, 0 failed", out)
    assert m and int(m.group(1)) > 0
    # the PNG timeline, where the output says it is (it outlives the demo's work directory)
    assert re.search(rf"ok     timeline of \d+ operations drawn: {re.escape(str(png.resolve()))} \(\d+x\d+ px\)", out)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not [ln for ln in netns.splitlines() if ln.startswith(f"{DEMO_BRIDGE}-")]
    assert subprocess.run(["ip", "link", "show", "dev", DEMO_BRIDGE], capture_output=True).returncode != 0
