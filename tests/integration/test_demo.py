"""The README's first command: `dynsnap demo` runs on its own local cluster and real node (own
bridge and /16, beside the session's), dynsnap installed by helm: the controller and the agent, on
their own, capture idle workers down to min-active, wake them when load arrives, verify every wake
with pinned requests, and no request fails; kubelet reports the same container, never restarted,
out of serving only through the gate; it draws the PNG timeline of every capture and wake where it
was told to; ``helm uninstall`` and the node leave nothing behind."""

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
    print(out)  # whole, in the captured output a failure shows: the Events of the demo's start tell why
    print(r.stderr, file=sys.stderr)
    assert r.returncode == 0, out[-3000:] + r.stderr[-3000:]
    assert "FAILED" not in out
    for line in ("Ready: kubelet v1.", "containerd://1.", "helm install done: dynsnap-node-controller-",
                 "(dynsnap-agent:", "applying examples/dgd/agg.yaml as DGD demo",
                 "the controller set each worker's serving gate",
                 "quiesced by the controller: gate", "frontend-stopped-routing",
                 "controller Normal  Quiescing", "controller Normal  CaptureRequested",
                 "captured by the agent (snapshot, ok=True): quiesce", "settle-snapshotted",
                 "2 workers asleep", "controller Normal  WakeRequested",
                 "woken in place by the agent (ok=True): wake", "restore", "settle-active",
                 "verification PASSED (Verified): 3/3 pinned answers",
                 "Timeline of every capture and wake",
                 "helm uninstall done and the node left nothing behind",
                 "demo passed"):
        assert line in out, line
    # the kubelet's facts for each of the three workers and the engine: one container, restartCount 0
    assert len(re.findall(r"ok     demo-(wor-)?vllmworker-\d: kubelet reports one container containerd://[0-9a-f]+"
                          r"\.\.\. restartCount 0 in \d+ looks", out)) == 4
    slept = re.findall(r"ok     (demo-vllmworker-\d): Ready False and True again only through the serving gate "
                       r"\(.*gate False/Ready False.*-> gate True/Ready True\)", out)
    assert len(slept) == 2
    awake = re.findall(r"ok     (demo-vllmworker-\d): Ready all along \(gate True/Ready True\)", out)
    assert len(awake) == 1 and awake[0] not in slept
    assert len(re.findall(r"ok     demo-vllmworker-\d: wake verified, 3/3 requests pinned", out)) == 2
    assert len(re.findall(r"ok     demo-vllmworker-\d: same pod UID, pod IP and DWM UID", out)) == 2
    # The last scene: the model's only worker sleeps routable, the model stays listed, its first request
    # is answered by the worker it woke, and that wake is verified.
    for line in ("phase 3: wake on request", "kept in serving by the controller (asleep routable: no quiesce)",
                 "asleep routable (GPU memory freed, still in serving): the model is listed, kubelet has the pod "
                 "Ready=True",
                 "demo-wor-vllmworker-0: Ready all along, asleep routable too (kept in serving)",
                 "agent      Normal  WokenByRequest", "controller Normal  WokenByRequest"):
        assert line in out, line
    # (the narrator's lines may come between the two checks: they run at once)
    iid = re.search(r"ok     demo-wor-vllmworker-0 asleep routable.*\n(?:.*\n)*?.*ok     one request: answered 200 by "
                    r"instance (\d+) \(the worker it woke\)", out)
    assert iid, out[-3000:]
    assert re.search(r"demo-wor-vllmworker-0: verification PASSED \(Verified\): 3/3 pinned answers", out)
    assert re.search(r"ok     demo-wor-vllmworker-0: woken by that request, wake verified 3/3 pinned", out)
    assert f"answered by instance {iid.group(1)}" in out  # the controller's Verified names the same instance
    assert "httpx" not in out + r.stderr  # the timeline is not buried under a line per HTTP request
    m = re.search(r"every request through the frontend answered: (\d+) ok, 0 failed", out)
    assert m and int(m.group(1)) > 0
    # the PNG timeline, where the output says it is (it outlives the demo's work directory)
    assert re.search(rf"ok     timeline of \d+ operations drawn: {re.escape(str(png.resolve()))} \(\d+x\d+ px\)", out)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not [ln for ln in netns.splitlines() if ln.startswith(f"{DEMO_BRIDGE}-")]
    assert subprocess.run(["ip", "link", "show", "dev", DEMO_BRIDGE], capture_output=True).returncode != 0
