"""Which workers the controller requeues for a change (dynsnap.controller.main.Controller's informer
handlers): the worker itself always; every worker of its component only when the change altered what
the planner sees of the worker (phase, idle facts, last capture, override) or the worker came or
went. A status write that changes none of that (a quiesce step, a decision's text) costs one
reconcile, not one per worker of the component (bench/scale, docs/BENCHMARKS.md)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest

from dynsnap.controller.main import Controller
from dynsnap.controller.settings import ControllerSettings
from dynsnap.k8s.store import ADDED, DELETED, MODIFIED
from dynsnap.models import protocol as P
from dynsnap.runtime.workqueue import WorkQueue

T0 = "2026-11-30T12:00:00Z"
UIDS = {f"g-{c}-{i}": f"{i + (10 if c == 'v' else 0):08d}-2222-3333-4444-555555555555"
        for c in ("w", "v") for i in range(3)}


class NoKube:
    """Nothing here talks to an API server: the handlers only read the stores and fill the queue."""

    on_request: Any = None


def pod(name: str, *, gate: str = "True", labels: dict[str, str] | None = None) -> dict[str, Any]:
    comp = name.split("-")[1]
    return {"metadata": {"name": name, "namespace": "ns", "uid": UIDS[name], "resourceVersion": "1",
                         "labels": {P.LABEL_DGD_NAME: "g", P.LABEL_COMPONENT: comp,
                                    P.LABEL_COMPONENT_TYPE: "worker", **(labels or {})}},
            "spec": {"readinessGates": [{"conditionType": P.CONDITION_SERVING}], "nodeName": "n"},
            "status": {"podIP": "10.0.0.5", "conditions": [{"type": "Ready", "status": "True"},
                                                          {"type": P.CONDITION_SERVING, "status": gate}]}}


def ws(name: str, rv: str = "1", *, idle_since: str | None = None, decision: str | None = None) -> dict[str, Any]:
    status: dict[str, Any] = {"state": "Active", "conditions": [
        {"type": "Accepted", "status": "True", "reason": "Accepted", "lastTransitionTime": T0}]}
    if idle_since:
        status["idle"] = {"inflight": 0, "idleSince": idle_since, "lastActivity": idle_since}
    if decision:
        status["controller"] = {"decision": decision, "decided": T0}
    return {"apiVersion": "dynsnap.io/v1alpha1", "kind": "WorkerSnapshot",
            "metadata": {"name": name, "namespace": "ns", "resourceVersion": rv},
            "spec": {"podName": name, "podUID": UIDS[name], "tier": "suspend", "desiredState": "Active"},
            "status": status}


@pytest.fixture
def ctl() -> Iterator[Controller]:
    c = Controller(NoKube(), ControllerSettings(leader_elect=False))  # type: ignore[arg-type]
    for name in UIDS:
        c.pods.store.upsert(pod(name))
        c.wss.store.upsert(ws(name))
    c.slices.store.upsert({"metadata": {"name": "g-w-x", "namespace": "ns", "resourceVersion": "1"}, "endpoints": [
        {"targetRef": {"uid": UIDS[n]}, "conditions": {"ready": True}} for n in UIDS]})  # all serving
    for name in UIDS:  # what the first events taught it: every worker's view
        c._on_ws(ADDED, ws(name))
    c.queue = WorkQueue()
    yield c


def queued(c: Controller) -> set[str]:
    out = {k.removeprefix("ns/") for k in c.queue._queued}
    c.queue = WorkQueue()
    return out


def changed(c: Controller, obj: dict[str, Any]) -> set[str]:
    if obj.get("kind") == "WorkerSnapshot":
        c.wss.store.upsert(obj)
        c._on_ws(MODIFIED, obj)
    else:
        c.pods.store.upsert(obj)
        c._on_pod(MODIFIED, obj)
    return queued(c)


W = {"g-w-0", "g-w-1", "g-w-2"}


def test_a_status_write_the_planner_cannot_see_requeues_only_that_worker(ctl: Controller) -> None:
    assert changed(ctl, ws("g-w-0", "2", decision="verified")) == {"g-w-0"}
    assert changed(ctl, ws("g-w-0", "3", decision="something else")) == {"g-w-0"}


def test_idle_facts_requeue_the_whole_component_and_not_another(ctl: Controller) -> None:
    assert changed(ctl, ws("g-w-1", "2", idle_since=T0)) == W
    assert changed(ctl, ws("g-w-1", "3", idle_since=T0, decision="x")) == {"g-w-1"}  # the same idle facts


def test_a_pod_change_requeues_the_component_only_when_the_phase_moves(ctl: Controller) -> None:
    assert changed(ctl, pod("g-w-2", labels={"unrelated": "1"})) == {"g-w-2"}
    assert changed(ctl, pod("g-w-2", gate="False")) == W  # Serving -> Starting: peers may have to stay awake
    p = pod("g-w-2", gate="False")
    p["metadata"]["annotations"] = {P.ANN_DESIRED_STATE: "suspended"}
    assert changed(ctl, p) == W  # the manual override is part of the plan (the deprecated annotation)


def test_an_override_on_the_workersnapshot_requeues_the_component(ctl: Controller) -> None:
    """``dynsnap suspend`` writes the WorkerSnapshot's dynsnap.io/override: the plan changes, so the component's
    workers are looked at again; the same override written again changes nothing."""
    o = ws("g-w-2", "2")
    o["metadata"]["annotations"] = {P.ANN_OVERRIDE: "Suspended"}
    assert changed(ctl, o) == W
    again = copy.deepcopy(o)
    again["metadata"]["resourceVersion"] = "3"
    assert changed(ctl, again) == {"g-w-2"}


@pytest.mark.parametrize(("spec", "annotation", "want"), [
    (None, None, (None, None, False)),
    ("Suspended", None, ("Suspended", None, False)),
    (None, "suspended", ("Suspended", None, True)),  # the deprecated annotation, still obeyed, said
    ("Active", "suspended", ("Active", None, False)),  # the WorkerSnapshot's wins
    (None, "asleep", (None, f"{P.ANN_DESIRED_STATE}='asleep': must be suspended or active", True)),
])
def test_the_override_is_the_workersnapshots_and_the_annotation_only_without_it(
        spec: str | None, annotation: str | None, want: tuple[str | None, str | None, bool]) -> None:
    from dynsnap.controller.fleet import override_of
    from dynsnap.models.workersnapshot import WorkerSnapshot
    w = ws("g-w-0")
    if spec:
        w["metadata"]["annotations"] = {P.ANN_OVERRIDE: spec}
    p = pod("g-w-0")
    if annotation:
        p["metadata"]["annotations"] = {P.ANN_DESIRED_STATE: annotation}
    assert override_of(p, WorkerSnapshot.model_validate(w)) == want


def test_a_worker_that_comes_or_goes_requeues_its_component(ctl: Controller) -> None:
    gone = copy.deepcopy(ws("g-w-0"))
    ctl.wss.store.remove(gone)
    ctl._on_ws(DELETED, gone)
    assert queued(ctl) == W
    ctl.wss.store.upsert(ws("g-w-0", "5"))
    ctl._on_ws(ADDED, ws("g-w-0", "5"))
    assert queued(ctl) == W
    p = pod("g-v-1")
    ctl._on_pod(DELETED, p)
    assert queued(ctl) == {"g-v-0", "g-v-1", "g-v-2"}


def dgd(rv: str, enabled: str) -> dict[str, Any]:
    return {"metadata": {"name": "g", "namespace": "ns", "resourceVersion": rv,
                         "annotations": {P.ANN_ENABLED: enabled}},
            "spec": {"components": [{"name": "w", "componentType": "worker"}]}}


def test_opted_in_graphs_follow_each_graphs_changes(ctl: Controller) -> None:
    """Kept per resourceVersion (the scrape asks every interval), never past a change."""
    def names() -> list[str]:
        return [d["metadata"]["name"] for d in ctl.opted_in_graphs()]

    ctl.dgds.store.upsert(dgd("1", "true"))
    assert names() == ["g"]
    assert names() == ["g"]
    ctl.dgds.store.upsert(dgd("2", "false"))
    assert names() == []
    ctl.dgds.store.upsert(dgd("3", "true"))
    assert names() == ["g"]
    ctl.dgds.store.remove("ns/g")
    assert names() == [] and ctl._opted_in == {}


def asleep_ws(name: str, rv: str) -> dict[str, Any]:
    w = ws(name, rv)
    w["spec"]["desiredState"] = "Suspended"
    w["status"]["state"] = "Suspended"
    w["status"]["conditions"].append({"type": "Suspended", "status": "True", "reason": "Suspended",
                                      "lastTransitionTime": T0})
    return w


def test_a_demand_change_requeues_only_the_workers_it_can_move(ctl: Controller) -> None:
    """More demand never puts a serving worker to sleep and less never wakes a sleeping one: a rise
    requeues all but the serving, a fall all but the asleep; demand becoming known or unknown, all."""
    from dynsnap.controller.plan import Demand
    changed(ctl, asleep_ws("g-w-0", "2"))
    changed(ctl, pod("g-w-1", gate="False"))  # Starting: awake, not serving
    assert ctl._views["ns/g-w-0"].phase.value == "Asleep" and ctl._views["ns/g-w-2"].phase.value == "Serving"
    everyone = W | {"g-v-0", "g-v-1", "g-v-2"}

    def requeued(before: Demand | None, after: Demand | None) -> set[str]:
        ctl._enqueue_graph("ns/g", skip=Controller.demand_skips(before, after))
        return queued(ctl)

    assert requeued(Demand(0.0), Demand(8.0)) == {"g-w-0", "g-w-1"}  # the serving ones (g-w-2, g-v-*) cannot move
    assert requeued(Demand(8.0), Demand(1.0)) == everyone - {"g-w-0"}
    assert requeued(None, Demand(1.0)) == everyone
    assert requeued(Demand(1.0), None) == everyone
    assert requeued(Demand(1.0), Demand(1.0)) == everyone
