"""The wake times of the sandbox environment, taken the way tests/integration/test_real_node_wake.py takes
them on the real node, for the side-by-side in docs/BENCHMARKS.md ("The real node: wakes"): a graph of a
frontend and two mocker workers under dynsnap-entrypoint (min-active 1, 3 verifying requests), the node
agents and the controller as processes of their own (tests/integration/controllerenv.py), one worker
captured and woken three times per tier through the manual override on its pod; each wake's time is its
WorkerSnapshot's lastWake record (finished - started), and each must have been verified.

From the repository root, as root, with the environment of `./run env`:

    DYNSNAP_TEST_BRIDGE=dsnbr9 DYNSNAP_TEST_CIDR=10.219.0.0/16 \\
      $DYNSNAP_VENV/bin/python bench/real_node/sandbox_wake.py

Prints one line per tier: the three times and their median. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "integration")]

from controllerenv import CtlEnv, asleep, get_ws, policy, running, verified_after  # noqa: E402

from dynsnap.k8s.client import Obj  # noqa: E402
from dynsnap.models import protocol as P  # noqa: E402
from dynsnap.models import resources as R  # noqa: E402
from dynsnap.testenv import dynamo as D  # noqa: E402
from dynsnap.testenv.cluster import LocalCluster, RunningPod, wait_for  # noqa: E402
from dynsnap.testenv.dynsnap_parts import StubDriver  # noqa: E402
from dynsnap.testenv.netns import SandboxNetwork  # noqa: E402

CYCLES = 3


def graph(driver: StubDriver) -> Obj:
    worker = D.mocker_component("worker", replicas=2, dynsnap=True, env={"LD_PRELOAD": str(driver.libcuda)})
    worker["annotations"] = policy(min_active=1, verify_requests=3)
    body = D.dgd("sandbox-wake", [D.frontend_component(), worker])
    body["metadata"]["annotations"] = policy(enabled=True, idle_after="10m", tier="suspend")
    return body


async def _ws_until(env: CtlEnv, pod: RunningPod, what: str, check: Callable[[Obj | None], bool]) -> Obj:
    async def probe() -> Obj | None:
        ws = await get_ws(env.api, pod)
        return ws if check(ws) else None
    got: Obj = await wait_for(what, probe, timeout=240, interval=0.5)
    return got


async def main() -> int:
    net = SandboxNetwork(bridge=os.environ.get("DYNSNAP_TEST_BRIDGE", "dsnbr9"),
                         cidr=os.environ.get("DYNSNAP_TEST_CIDR", "10.219.0.0/16"))
    cluster = LocalCluster(Path(tempfile.mkdtemp(prefix="dynsnap-bench-")) / "cluster", net=net)
    await cluster.start()
    times: dict[str, list[float]] = {"suspend": [], "snapshot": []}
    try:
        async with running(cluster, graph) as env:
            w = env.graph.workers("worker")[0]
            for tier in times:
                await env.api.merge_patch(R.DGDS, "sandbox-wake", {"metadata": {"annotations": {
                    "dynsnap.io/tier": tier}}}, namespace=w.namespace)
                await _ws_until(env, w, f"tier {tier}", lambda ws, t=tier: bool(ws and ws["spec"]["tier"] == t))  # type: ignore[misc]
                for _ in range(CYCLES):
                    before = (((await get_ws(env.api, w)) or {}).get("status") or {}).get("lastWake", {}).get("id")
                    for value, check in (("suspended", asleep), ("active", verified_after(before))):
                        await env.api.merge_patch(R.PODS, w.name, {"metadata": {"annotations": {
                            P.ANN_DESIRED_STATE: value}}}, namespace=w.namespace)
                        ws = await _ws_until(env, w, f"{w.name} {value}", check)
                    wake = ws["status"]["lastWake"]
                    assert wake["ok"] is True and wake["tier"] == tier, wake
                    times[tier].append((datetime.fromisoformat(wake["finished"])
                                        - datetime.fromisoformat(wake["started"])).total_seconds())
    finally:
        await cluster.stop()
    for tier, secs in times.items():
        print(f"sandbox, tier {tier}: wake (lastWake) {', '.join(f'{s:.3f}' for s in secs)} s; "
              f"median {statistics.median(secs):.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
