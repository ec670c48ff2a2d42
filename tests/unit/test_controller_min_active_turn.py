"""``min-active`` holds between concurrent reconciles (dynsnap.controller.reconciler, the component's
turn): three serving workers of one component, idle, ``min-active: 1``, reconciled side by side by
the controller's workers. While the first one's quiesce record is on its way to the API server, the
agent's report of fresh activity on that very worker arrives (a request the frontend still sent it):
a plan made then keeps that worker and puts the other two out of serving. Made side by side with
the first, that plan would leave none serving; in the component's turn it sees the first already
quiescing and keeps one of the others. Real Reconciler, real stores and planner; the API server's
answers come from :class:`stub_Kube`."""

from __future__ import annotations

import asyncio
import copy
from datetime import UTC, datetime, timedelta
from typing import Any

from dynsnap.controller import fleet as F
from dynsnap.controller.frontend import Frontend
from dynsnap.controller.main import _dgd_index
from dynsnap.controller.plan import Demand
from dynsnap.controller.reconciler import Reconciler, Stores
from dynsnap.controller.settings import ControllerSettings
from dynsnap.k8s.store import Store
from dynsnap.models import protocol as P

NAMES = ("g-w-0", "g-w-1", "g-w-2")
UIDS = {n: f"{i:08d}-2222-3333-4444-555555555555" for i, n in enumerate(NAMES)}


def _iso(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def pod(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns", "uid": UIDS[name], "resourceVersion": "1",
                         "labels": {P.LABEL_DGD_NAME: "g", P.LABEL_COMPONENT: "w", P.LABEL_COMPONENT_TYPE: "worker"}},
            "spec": {"readinessGates": [{"conditionType": P.CONDITION_SERVING}], "nodeName": "n"},
            "status": {"podIP": f"10.0.0.{NAMES.index(name) + 5}", "conditions": [
                {"type": "Ready", "status": "True"}, {"type": P.CONDITION_SERVING, "status": "True"}]}}


def ws(name: str, active: datetime, rv: int = 1) -> dict[str, Any]:
    t0 = _iso(active - timedelta(minutes=5))
    return {"apiVersion": "dynsnap.io/v1alpha1", "kind": "WorkerSnapshot",
            "metadata": {"name": name, "namespace": "ns", "resourceVersion": str(rv), "uid": f"ws-{name}",
                         "generation": 1},
            "spec": {"podName": name, "podUID": UIDS[name], "tier": "suspend", "desiredState": "Active"},
            "status": {"state": "Active", "conditions": [
                {"type": "Accepted", "status": "True", "reason": "Accepted", "lastTransitionTime": t0},
                {"type": P.ConditionType.POLICY.value, "status": "True", "reason": "Valid", "lastTransitionTime": t0}],
                "idle": {"inflight": 0, "requestsTotal": 3, "idleSince": _iso(active), "lastActivity": _iso(active)}}}


def dwm(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns", "uid": f"dwm-{name}", "resourceVersion": "1",
                         "ownerReferences": [{"uid": UIDS[name], "kind": "Pod", "name": name}]},
            "spec": {"data": {"endpoints": {"e": {"type": "Endpoint", "endpoint": "generate",
                                                  "instance_id": 1000 + NAMES.index(name)}}}}}


class stub_Kube:
    """Stands in for the API server's answers to the status writes and Events a quiesce's first step
    makes: each status apply merged into the stored WorkerSnapshot and answered at the next
    resourceVersion. The first apply waits for ``release``, so the reconciles around it run while it is
    on its way."""

    def __init__(self, wss: Store) -> None:
        self.wss, self.rv, self.quiesced = wss, 100, []  # type: ignore[var-annotated]
        self.release, self.first_waiting = asyncio.Event(), asyncio.Event()
        self.on_request = None

    async def apply(self, res: Any, body: dict[str, Any], **kw: Any) -> dict[str, Any]:
        name = body["metadata"]["name"]
        if (body.get("status") or {}).get("controller", {}).get("quiesce") and name not in self.quiesced:
            self.quiesced.append(name)
            if len(self.quiesced) == 1:
                self.first_waiting.set()
                await self.release.wait()
        obj = copy.deepcopy(self.wss.get("ns", name))
        obj["status"].update(copy.deepcopy(body["status"]))
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        return obj

    async def create(self, *a: Any, **kw: Any) -> dict[str, Any]:  # Events
        return {}


async def test_three_concurrent_reconciles_leave_min_active_serving() -> None:
    now = datetime.now(UTC)
    # Idle past idle-after (3 s), g-w-2 the most recently active: the plan keeps g-w-2 serving.
    active = {"g-w-0": now - timedelta(seconds=30), "g-w-1": now - timedelta(seconds=20),
              "g-w-2": now - timedelta(seconds=10)}
    stores = Stores(dgds=Store(), pods=Store({"dgd": _dgd_index}), dwms=Store(),
                    slices=Store({"target": F.endpoint_targets}), wss=Store())
    stores.dgds.upsert({"metadata": {"name": "g", "namespace": "ns", "uid": "dgd-uid", "resourceVersion": "1",
                                     "annotations": {P.ANN_ENABLED: "true", P.ANN_IDLE_AFTER: "3s",
                                                     P.ANN_MIN_ACTIVE: "1", P.ANN_TIER: "suspend"}},
                        "spec": {"components": [{"name": "w", "componentType": "worker"}]}})
    for n in NAMES:
        stores.pods.upsert(pod(n))
        stores.wss.upsert(ws(n, active[n]))
        stores.dwms.upsert(dwm(n))
    stores.slices.upsert({"metadata": {"name": "g-w-x", "namespace": "ns", "resourceVersion": "1"}, "endpoints": [
        {"targetRef": {"uid": UIDS[n], "name": n}, "conditions": {"ready": True}} for n in NAMES]})
    kube = stub_Kube(stores.wss)
    r = Reconciler(kube=kube, settings=ControllerSettings(leader_elect=False),  # type: ignore[arg-type]
                   stores=stores, frontend=Frontend(timeout=1.0))
    r.demand["ns/g"] = Demand(inflight=0)

    first = asyncio.create_task(r.reconcile("ns/g-w-0"))  # least wanted: it is the first to go
    await asyncio.wait_for(kube.first_waiting.wait(), 5)
    assert kube.quiesced == ["g-w-0"]
    # The agent reports a request g-w-0 just served (its gate is not False yet: the frontend still routes to it).
    stores.wss.upsert(ws("g-w-0", datetime.now(UTC), rv=50))
    others = [asyncio.create_task(r.reconcile(f"ns/{n}")) for n in ("g-w-1", "g-w-2")]
    await asyncio.sleep(0.2)  # the others' reconciles run as far as they can while g-w-0's write is out
    kube.release.set()
    await asyncio.wait_for(asyncio.gather(first, *others), 5)
    for n in ("g-w-1", "g-w-2"):  # and once more each, with every write back
        await asyncio.wait_for(r.reconcile(f"ns/{n}"), 5)
    serving = [n for n in NAMES if n not in kube.quiesced]
    assert len(serving) == 1, (kube.quiesced, "min-active 1: exactly one worker stays serving")
    assert kube.quiesced[0] == "g-w-0"
