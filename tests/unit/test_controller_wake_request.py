"""The controller's wake request (dynsnap.controller.wake.awake -> request_wake) is one operation
however often it is reconciled: a reconcile that still sees the old desired state (its spec write not
yet back from the watch, or set back by a person) asks again as the same wake, with the same trace,
rather than opening a second wake the agent's record would not match. And the spec write is stored
as answered, so the next reconcile sees it (read your own write)."""

from __future__ import annotations

import copy
from typing import Any

from dynsnap.controller import wake as W
from dynsnap.controller.frontend import Frontend
from dynsnap.controller.plan import Decision, Want
from dynsnap.controller.reconciler import Reconciler, Stores
from dynsnap.controller.scope import Scope, utcnow
from dynsnap.controller.settings import ControllerSettings
from dynsnap.k8s.store import Store
from dynsnap.models import protocol as P
from dynsnap.models.policy import ParsedPolicy, Policy
from dynsnap.models.workersnapshot import WorkerSnapshot
from dynsnap.telemetry.tracing import parse_traceparent

UID = "00000001-2222-3333-4444-555555555555"


class stub_Kube:
    """Stands in for the API server's answers to the two writes a wake request makes: the status apply
    and the spec merge patch, each answered with the object at the next resourceVersion."""

    def __init__(self, obj: dict[str, Any]) -> None:
        self.obj, self.rv, self.patches = obj, 10, []  # type: ignore[var-annotated]

    def _next(self) -> dict[str, Any]:
        self.rv += 1
        self.obj["metadata"]["resourceVersion"] = str(self.rv)
        return copy.deepcopy(self.obj)

    async def apply(self, res: Any, body: dict[str, Any], **kw: Any) -> dict[str, Any]:
        self.obj["status"].update(copy.deepcopy(body["status"]))
        return self._next()

    async def merge_patch(self, res: Any, name: str, patch: dict[str, Any], **kw: Any) -> dict[str, Any]:
        self.patches.append(copy.deepcopy(patch))
        self.obj["spec"].update(patch["spec"])
        self.obj["metadata"].setdefault("annotations", {}).update((patch.get("metadata") or {}).get("annotations", {}))
        return self._next()


def _ws() -> dict[str, Any]:
    return {"apiVersion": "dynsnap.io/v1alpha1", "kind": "WorkerSnapshot",
            "metadata": {"name": "w-0", "namespace": "ns", "resourceVersion": "10", "uid": "ws-uid", "generation": 1},
            "spec": {"podName": "w-0", "podUID": UID, "tier": "suspend", "desiredState": "Suspended"},
            "status": {"state": "Suspended", "conditions": []}}


def scope(pod: dict[str, Any], ws: dict[str, Any]) -> Scope:
    return Scope(key="ns/w-0", pod=pod, dgd={}, component="worker", ws=WorkerSnapshot.model_validate(ws),
                 parsed=ParsedPolicy(Policy()), endpoint_ready=None, now=utcnow())


def reconciler_over(ws: dict[str, Any]) -> tuple[Reconciler, stub_Kube, Store]:
    """A reconciler whose API server is a stub_Kube holding ``ws``, and its WorkerSnapshot store."""
    kube = stub_Kube(copy.deepcopy(ws))
    wss = Store()
    wss.upsert(copy.deepcopy(ws))
    r = Reconciler(kube=kube, settings=ControllerSettings(leader_elect=False),  # type: ignore[arg-type]
                   stores=Stores(dgds=Store(), pods=Store(), dwms=Store(), slices=Store(), wss=wss),
                   frontend=Frontend(timeout=1.0))
    return r, kube, wss


POD = {"metadata": {"name": "w-0", "namespace": "ns", "uid": UID}}


async def test_a_stale_reconcile_asks_again_as_the_same_wake() -> None:
    stale = _ws()
    r, kube, wss = reconciler_over(stale)
    pod = POD
    d = Decision(Want.AWAKE, "manual override: active")
    await W.awake(r.ctx, scope(pod, stale), Policy(), d)
    first = kube.patches[-1]["metadata"]["annotations"][P.ANN_TRACEPARENT]
    assert parse_traceparent(first) is not None and kube.patches[-1]["spec"]["desiredState"] == "Active"
    # Read our own write: the store holds the spec as patched, not the status write before it.
    stored = wss.get("ns", "w-0")
    assert stored["spec"]["desiredState"] == "Active" and stored["metadata"]["resourceVersion"] == "12"
    wake = stored["status"]["controller"]["wake"]
    assert wake["traceContext"] == first
    # The watch event of the status write (rv 11) arrives late: it does not take the store back.
    late = copy.deepcopy(stored)
    late["metadata"]["resourceVersion"], late["spec"]["desiredState"] = "11", "Suspended"
    wss.upsert(late)
    assert wss.get("ns", "w-0")["spec"]["desiredState"] == "Active"
    # A reconcile that did read the old spec (status with the wake on record, spec Suspended): the
    # same wake is asked for again, under the same trace, and no second wake record is opened.
    await W.awake(r.ctx, scope(pod, late), Policy(), d)
    assert kube.patches[-1]["metadata"]["annotations"][P.ANN_TRACEPARENT] == first
    assert kube.obj["status"]["controller"]["wake"] == wake
