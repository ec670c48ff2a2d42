"""What the controller keeps in memory stays true and bounded (issue 18): an operation repeated is
counted (three quiesces of a worker: one Quiescing Event with ``series.count`` 3, through the real
EventRecorder), a level-triggered repeat of one operation is not; and what it kept about a pod or a
graph (the Events it said, the parsed WorkerSnapshot, the graph's model and demand) goes with it."""

from __future__ import annotations

import copy
from typing import Any

from dynsnap.controller.frontend import Frontend
from dynsnap.controller.main import Controller
from dynsnap.controller.reconciler import Reconciler, Stores
from dynsnap.controller.settings import ControllerSettings
from dynsnap.k8s.events import EventRecorder
from dynsnap.k8s.store import DELETED, Store
from dynsnap.models.protocol import Reason

UID = "00000001-2222-3333-4444-555555555555"
POD = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "w-0", "namespace": "ns", "uid": UID}}
NOTE = "taking it out of serving: manual override: suspended"


class stub_Kube:
    """Stands in for the API server's Events API: creates and series patches, kept as they land."""

    on_request: Any = None

    def __init__(self) -> None:
        self.events: dict[str, dict[str, Any]] = {}

    async def create(self, res: Any, body: dict[str, Any], **kw: Any) -> dict[str, Any]:
        self.events[body["metadata"]["name"]] = copy.deepcopy(body)
        return copy.deepcopy(body)

    async def merge_patch(self, res: Any, name: str, patch: dict[str, Any], **kw: Any) -> dict[str, Any]:
        self.events[name].update(copy.deepcopy(patch))
        return copy.deepcopy(self.events[name])


def reconciler(kube: Any, events: Any = None) -> Reconciler:
    return Reconciler(kube=kube, settings=ControllerSettings(leader_elect=False),
                      stores=Stores(dgds=Store(), pods=Store(), dwms=Store(), slices=Store({"target": lambda o: []}),
                                    wss=Store()),
                      frontend=Frontend(timeout=1.0), events=events)


def count(e: dict[str, Any]) -> int:
    return int((e.get("series") or {}).get("count") or 1)


async def test_three_quiesces_are_one_event_counted_three_times_and_a_repeat_is_not_counted() -> None:
    kube = stub_Kube()
    r = reconciler(kube, EventRecorder(kube, reporting_controller="dynsnap.io/controller",  # type: ignore[arg-type]
                                       reporting_instance="test"))
    for q in ("q1", "q2", "q3"):
        for _ in range(3):  # each reconcile of one quiesce says it again: said once
            await r.ctx.say(POD, "Normal", Reason.QUIESCING, NOTE, occurrence=q)
    quiescing = [e for e in kube.events.values() if e["reason"] == "Quiescing"]
    assert len(quiescing) == 1 and count(quiescing[0]) == 3, quiescing
    # A standing condition (no occurrence) is said once for as long as it stands.
    for _ in range(3):
        await r.ctx.say(POD, "Warning", Reason.INVALID_OVERRIDE, "bad value")
    assert [count(e) for e in kube.events.values() if e["reason"] == "InvalidOverride"] == [1]


async def test_what_was_kept_about_a_pod_goes_with_it() -> None:
    kube = stub_Kube()
    r = reconciler(kube, EventRecorder(kube, reporting_controller="dynsnap.io/controller",  # type: ignore[arg-type]
                                       reporting_instance="test"))
    await r.ctx.say(POD, "Normal", Reason.QUIESCING, NOTE, occurrence="q1")
    other = copy.deepcopy(POD)
    other["metadata"]["name"] = "w-1"
    await r.ctx.say(other, "Normal", Reason.QUIESCING, NOTE, occurrence="q1")
    r.stores.wss.upsert({"apiVersion": "dynsnap.io/v1alpha1", "kind": "WorkerSnapshot",
                         "metadata": {"name": "w-0", "namespace": "ns", "resourceVersion": "3"},
                         "spec": {"podName": "w-0", "podUID": UID, "tier": "suspend"}})
    assert r.peer_ws("ns", "w-0") is not None and "ns/w-0" in r._parsed
    assert await r.reconcile("ns/w-0") is None  # the pod is gone from the store
    assert set(r.ctx.reported) == {"ns/w-1/Quiescing"} and "ns/w-0" not in r._parsed


def test_what_was_kept_about_a_graph_goes_with_it() -> None:
    c = Controller(stub_Kube(), ControllerSettings(leader_elect=False))  # type: ignore[arg-type]
    dgd = {"metadata": {"name": "g", "namespace": "ns", "uid": "u1", "generation": 1}}
    c.reconciler.ctx.models.put("ns/g", dgd, "tiny")
    c.reconciler.demand["ns/g"] = None
    c.reconciler.ctx.reported["policy/ns/g/worker"] = ("bad", None)
    c.reconciler.ctx.reported["policy/ns/gg/worker"] = ("bad", None)
    c._on_dgd(DELETED, dgd)
    assert len(c.reconciler.ctx.models) == 0 and "ns/g" not in c.reconciler.demand
    assert set(c.reconciler.ctx.reported) == {"policy/ns/gg/worker"}
