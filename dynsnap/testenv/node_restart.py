"""What a node's supervisor (systemd, on a real machine) does to the real node's daemons under a
sleeping worker: kubelet or containerd stopped and started again, with the same configuration and
state, the containers left running (each container's shim is a process group of its own, so a stop
of containerd's group leaves them). Each returns once the daemon is serving again: kubelet's healthz
answers and its Node's Ready heartbeat is newer than the restart; containerd answers ``ctr version``
and lists the containers it had.

Layer: ``dynsnap.testenv`` (test harness only; never imported by the product).
"""

from __future__ import annotations

from datetime import UTC, datetime

import httpx

from dynsnap.models import resources as R
from dynsnap.runtime.command import run_command
from dynsnap.testenv.node import RealNode

RESTART_TIMEOUT = 120.0


async def restart_kubelet(node: RealNode) -> None:
    assert node.kubelet is not None, f"{node.name}: kubelet not started"
    await node.kubelet.stop()
    since = datetime.now(UTC).replace(microsecond=0)

    async def serving() -> bool:
        async with httpx.AsyncClient(timeout=2.0) as c:
            r = await c.get(f"http://127.0.0.1:{node.healthz_port}/healthz")
        if r.status_code != 200:
            return False
        conds = (await node.api.get(R.NODES, node.name)).get("status", {}).get("conditions") or []
        ready: dict[str, str] = next((c for c in conds if c["type"] == "Ready"), {})
        beat = ready.get("lastHeartbeatTime")
        return ready.get("status") == "True" and beat is not None and datetime.fromisoformat(beat) >= since
    await node.kubelet.start()
    await node.kubelet.wait_ready(serving, timeout=RESTART_TIMEOUT, what="serving again after its restart")


async def restart_containerd(node: RealNode) -> None:
    assert node.containerd is not None, f"{node.name}: containerd not started"
    before = await _containers(node)
    await node.containerd.stop()
    await node.containerd.start()

    async def serving() -> bool:
        return await _containers(node) >= before
    await node.containerd.wait_ready(serving, timeout=RESTART_TIMEOUT, what="serving its containers again")


async def _containers(node: RealNode) -> set[str]:
    out = await run_command(node.ctr_argv("containers", "list", "--quiet"), timeout=10)
    return set(out.stdout.split())
