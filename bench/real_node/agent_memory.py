"""The chart's agent and controller memory on a node of 8 workers (issue 39: the chart's memory limits are
set from this), on the real node (kubelet, containerd, runc; the chart installed by helm; Dynamo 1.6.1's
frontends and mocker workers, the stub CUDA driver).

Two graphs of examples/dgd/agg.yaml with 4 workers each, one at tier suspend and one at tier snapshot
(min-active 1: three of each may sleep). After both are Ready, the peak resident size (VmHWM) of the
agent's and the controller's processes is set back to their resident size now (proc(5), clear_refs 5),
then ``--rounds`` rounds: the six workers that may sleep asked to sleep at once (the WorkerSnapshot's
``dynsnap.io/override`` annotation, as ``dynsnap suspend`` writes it), every one asleep, then all woken
at once and every wake verified. Prints each process's resident size before, its peak over the rounds
and its size after, in MiB, and one JSON line with the same.

From the repository root, as root, with the environment of `./run env` (its own bridge and /16):

    $DYNSNAP_VENV/bin/python bench/real_node/agent_memory.py [--rounds N]

Every wait is bounded (the harness's own, and each phase's here).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parents[2])]  # the repository's dynsnap, run as a script

from dynsnap.k8s.client import Obj  # noqa: E402
from dynsnap.models import protocol as P  # noqa: E402
from dynsnap.models import resources as R  # noqa: E402
from dynsnap.testenv import chart_node  # noqa: E402
from dynsnap.testenv.cluster import LocalCluster, wait_for  # noqa: E402
from dynsnap.testenv.hostprocs import container_pid, peak_reset, status_kib  # noqa: E402
from dynsnap.testenv.netns import SandboxNetwork  # noqa: E402
from dynsnap.testenv.real_graph import NodePod  # noqa: E402

BRIDGE, CIDR = "dsnmem0", "10.216.0.0/16"
WORKER = "VllmWorker"
MIB = 1024


def policy(tier: str) -> dict[str, str]:
    return {"dynsnap.io/enabled": "true", "dynsnap.io/idle-after": "1h", "dynsnap.io/tier": tier}


async def ws_of(env: chart_node.Env, w: NodePod) -> Obj:
    ws: Obj = await env.api.get(R.WORKER_SNAPSHOTS, w.name, namespace=w.namespace)
    return ws


async def set_override(env: chart_node.Env, w: NodePod, value: str | None) -> None:
    await env.api.merge_patch(R.WORKER_SNAPSHOTS, w.name, {"metadata": {"annotations": {P.ANN_OVERRIDE: value}}},
                              namespace=w.namespace)


def asleep(ws: Obj) -> bool:
    st = ws.get("status") or {}
    return ws["spec"]["desiredState"] == "Suspended" and st.get("state") == "Suspended"


def verified_after(ws: Obj, since: str | None) -> bool:
    st = ws.get("status") or {}
    wake = st.get("lastWake") or {}
    v = (st.get("controller") or {}).get("verification") or {}
    return bool(wake.get("id") and wake.get("id") != since and v.get("wakeId") == wake.get("id") and v.get("ok"))


async def one_round(env: chart_node.Env, sleepers: list[NodePod]) -> None:
    await asyncio.gather(*(set_override(env, w, "Suspended") for w in sleepers))
    for w in sleepers:
        async def done(w: NodePod = w) -> bool:
            return asleep(await ws_of(env, w))
        await wait_for(f"{w.name} asleep", done, timeout=300, interval=0.5)
    since = {w.name: ((await ws_of(env, w)).get("status") or {}).get("lastWake", {}).get("id") for w in sleepers}
    await asyncio.gather(*(set_override(env, w, "Active") for w in sleepers))
    for w in sleepers:
        async def woken(w: NodePod = w) -> bool:
            return verified_after(await ws_of(env, w), since[w.name])
        await wait_for(f"{w.name} woken and verified", woken, timeout=300, interval=0.5)
    await asyncio.gather(*(set_override(env, w, None) for w in sleepers))


async def measure(rounds: int) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="dynsnap-agent-memory-"))
    cluster = LocalCluster(work / "cluster", net=SandboxNetwork(bridge=BRIDGE, cidr=CIDR), fake_nodes=False)
    await cluster.start()
    try:
        env = await chart_node.start(cluster, work, gpus=8)
        try:
            sleepers: list[NodePod] = []
            for tier in ("suspend", "snapshot"):
                body = chart_node.example_body(env, name=f"mem-{tier}", worker_replicas=4, policy=policy(tier))
                graph = await chart_node.deploy_example(env, body)
                sleepers += graph.workers(WORKER)[1:]  # min-active 1: the first stays serving
            pids = {c: container_pid(await env.chart_pod(c), c) for c in ("agent", "controller")}
            before = {c: status_kib(p, "VmRSS") for c, p in pids.items()}
            for p in pids.values():
                peak_reset(p)  # the peak, from now
            for r in range(rounds):
                print(f"round {r + 1}: {len(sleepers)} workers to sleep and back", flush=True)
                await one_round(env, sleepers)
            out = {c: {"before_mib": before[c] / MIB, "peak_mib": status_kib(p, "VmHWM") / MIB,
                       "after_mib": status_kib(p, "VmRSS") / MIB} for c, p in pids.items()}
            out["workers"] = 8
            out["rounds"] = rounds
            return out
        finally:
            await chart_node.stop(env)
    finally:
        await cluster.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    out = asyncio.run(measure(ap.parse_args().rounds))
    for c in ("agent", "controller"):
        m = out[c]
        print(f"{c}: resident {m['before_mib']:.1f} MiB before, peak {m['peak_mib']:.1f} MiB over the rounds, "
              f"{m['after_mib']:.1f} MiB after")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
