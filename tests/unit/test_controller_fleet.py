"""The controller's reading of objects: a DGD's components in both API versions (v1beta1
``spec.components[]``, v1alpha1 ``spec.services``), a worker's role from Dynamo's labels, its
EndpointSlice endpoint, its DWM (only one it owns), and the phase each combination means."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from dynsnap.controller import fleet as F
from dynsnap.controller.plan import Phase
from dynsnap.k8s.store import Store
from dynsnap.models import protocol as P
from dynsnap.models.workersnapshot import WorkerSnapshot

UID = "11111111-2222-3333-4444-555555555555"
T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def test_components_of_both_dgd_versions() -> None:
    beta = {"spec": {"components": [{"name": "Frontend", "componentType": "frontend"},
                                    {"name": "decode", "componentType": "worker", "subComponentType": "decode",
                                     "annotations": {P.ANN_MIN_ACTIVE: "2"}}]}}
    alpha = {"spec": {"services": {"Frontend": {"componentType": "frontend"},
                                   "VllmWorker": {"componentType": "worker", "annotations": {P.ANN_TIER: "snapshot"}}}}}
    b = F.dgd_components(beta)
    assert [(c.name, c.is_worker, c.sub) for c in b] == [("Frontend", False, None), ("decode", True, "decode")]
    assert b[1].annotations == {P.ANN_MIN_ACTIVE: "2"}
    a = F.dgd_components(alpha)
    assert [(c.name, c.is_worker) for c in a] == [("Frontend", False), ("VllmWorker", True)]
    assert a[1].annotations == {P.ANN_TIER: "snapshot"}


def test_components_in_dynamo_1_6_1_v1beta1_shape() -> None:
    """``type`` and a native ``podTemplate``: component policy lives on the template's metadata."""
    dgd = {"spec": {"components": [
        {"name": "Frontend", "type": "frontend"},
        {"name": "prefill", "type": "prefill", "podTemplate": {"metadata": {"annotations": {P.ANN_MIN_ACTIVE: "2"}}}},
        {"name": "VllmWorker", "type": "worker", "podTemplate": {"spec": {}}}]}}
    got = [(c.name, c.type, c.sub, c.is_worker, c.annotations) for c in F.dgd_components(dgd)]
    assert got == [("Frontend", "frontend", None, False, {}), ("prefill", "prefill", "prefill", True,
                                                              {P.ANN_MIN_ACTIVE: "2"}),
                   ("VllmWorker", "worker", None, True, {})]


def pod(*, sub: str | None = None, gate: str | None = "True", ready: bool = True, uid: str = UID) -> dict[str, Any]:
    labels = {P.LABEL_DGD_NAME: "g", P.LABEL_COMPONENT: "w", P.LABEL_COMPONENT_TYPE: "worker"}
    if sub:
        labels[P.LABEL_SUB_COMPONENT_TYPE] = sub
    conds = [{"type": "Ready", "status": "True" if ready else "False"}]
    if gate is not None:
        conds.append({"type": P.CONDITION_SERVING, "status": gate})
    return {"metadata": {"name": "g-w-0", "namespace": "ns", "uid": uid, "labels": labels},
            "spec": {"readinessGates": [{"conditionType": P.CONDITION_SERVING}], "nodeName": "n"},
            "status": {"podIP": "10.0.0.5", "conditions": conds}}


@pytest.mark.parametrize(("sub", "role"), [(None, F.Role.AGGREGATED), ("prefill", F.Role.PREFILL),
                                           ("decode", F.Role.DECODE)])
def test_role_from_labels(sub: str | None, role: F.Role) -> None:
    assert F.role_of(pod(sub=sub)) == role and F.is_worker_pod(pod(sub=sub)) and F.opted_in(pod())


def test_endpoint_and_dwm_belong_to_this_pod_only() -> None:
    slices = Store({"target": F.endpoint_targets})
    slices.upsert({"metadata": {"name": "s", "namespace": "ns"}, "endpoints": [
        {"targetRef": {"uid": UID}, "conditions": {"ready": False}},
        {"targetRef": {"uid": "other"}, "conditions": {"ready": True}}]})
    assert F.endpoint_ready(slices, pod()) is False
    assert F.endpoint_ready(slices, pod(uid="nobody")) is None
    dwms = Store()
    dwms.upsert({"metadata": {"name": "g-w-0", "namespace": "ns", "uid": "d1",
                              "ownerReferences": [{"uid": "someone-else"}]}})
    assert F.dwm_of(dwms, pod()) is None  # a stale DWM of an earlier pod of that name is not this worker's
    dwms.upsert({"metadata": {"name": "g-w-0", "namespace": "ns", "uid": "d2", "ownerReferences": [{"uid": UID}]},
                 "spec": {"data": {"endpoints": {"k": {"type": "Endpoint", "endpoint": "generate",
                                                       "instance_id": 42}}}}})
    assert F.instance_id(F.dwm_of(dwms, pod())) == 42


def ws(*, desired: str = "Active", state: str | None = "Active", suspended: str | None = None,
       accepted: str = "True", uid: str = UID, controller: dict[str, Any] | None = None,
       last_wake: dict[str, Any] | None = None) -> WorkerSnapshot:
    conds = [{"type": "Accepted", "status": accepted, "reason": "Accepted", "lastTransitionTime": T0.isoformat()}]
    if suspended:
        conds.append({"type": "Suspended", "status": suspended, "reason": "Suspended",
                      "lastTransitionTime": T0.isoformat()})
    status: dict[str, Any] = {"conditions": conds}
    if state:
        status["state"] = state
    if controller:
        status["controller"] = controller
    if last_wake:
        status["lastWake"] = last_wake
    return WorkerSnapshot.model_validate({
        "metadata": {"name": "g-w-0", "namespace": "ns"},
        "spec": {"podName": "g-w-0", "podUID": uid, "tier": "suspend", "desiredState": desired}, "status": status})


def q(started: datetime, finished: datetime | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"id": "q1", "tier": "suspend", "started": started.isoformat()}
    if finished:
        out["finished"] = finished.isoformat()
    return out


CASES = [
    ("no WorkerSnapshot", pod(), None, True, Phase.NEW),
    ("another pod's WorkerSnapshot", pod(), ws(uid="99999999-2222-3333-4444-555555555555"), True, Phase.NEW),
    ("refused by the agent", pod(), ws(accepted="False"), True, Phase.BROKEN),
    ("lost", pod(), ws(state="Lost"), True, Phase.BROKEN),
    ("serving", pod(), ws(), True, Phase.SERVING),
    ("gate True but endpoint not ready yet", pod(), ws(), False, Phase.STARTING),
    ("gate not yet set", pod(gate=None, ready=False), ws(), None, Phase.STARTING),
    ("quiescing", pod(gate="False", ready=False), ws(controller={"quiesce": q(T0)}), False, Phase.QUIESCING),
    ("capture asked", pod(gate="False", ready=False), ws(desired="Suspended"), False, Phase.CAPTURING),
    ("asleep", pod(gate="False", ready=False), ws(desired="Suspended", state="Suspended", suspended="True"), False,
     Phase.ASLEEP),
    ("waking", pod(gate="False", ready=False), ws(state="Waking"), False, Phase.WAKING),
    # a wake on request: resumed (Active, in serving all along), its last step not yet on record
    ("the agent's wake still open", pod(), ws(controller={"quiesce": q(T0, T0 + timedelta(seconds=1))},
                                              last_wake={"id": "w1", "tier": "suspend", "trigger": "request",
                                                         "started": (T0 + timedelta(seconds=2)).isoformat()}),
     True, Phase.WAKING),
    ("the agent's wake done", pod(), ws(controller={"quiesce": q(T0, T0 + timedelta(seconds=1))},
                                        last_wake={"id": "w1", "tier": "suspend", "trigger": "request", "ok": True,
                                                   "started": (T0 + timedelta(seconds=2)).isoformat(),
                                                   "finished": (T0 + timedelta(seconds=3)).isoformat()}),
     True, Phase.STARTING),
    ("awake again, not yet proven", pod(), ws(controller={"quiesce": q(T0, T0 + timedelta(seconds=1))}), True,
     Phase.STARTING),
    ("proven", pod(), ws(controller={"quiesce": q(T0, T0 + timedelta(seconds=1)), "verification": {
        "wakeId": "w", "ok": True, "reason": "Verified", "started": (T0 + timedelta(seconds=5)).isoformat()}}), True,
     Phase.SERVING),
    ("proof failed", pod(gate="False"), ws(controller={"quiesce": q(T0, T0 + timedelta(seconds=1)), "verification": {
        "wakeId": "w", "ok": False, "reason": "PinnedRequestFailed",
        "started": (T0 + timedelta(seconds=5)).isoformat()}}), True, Phase.BROKEN),
]


@pytest.mark.parametrize(("what", "p", "w", "ep", "phase"), CASES, ids=[c[0] for c in CASES])
def test_phase(what: str, p: dict[str, Any], w: WorkerSnapshot | None, ep: bool | None, phase: Phase) -> None:
    assert F.phase_of(p, w, ep) == phase


def test_what_holds_a_worker_in_starting_is_named() -> None:
    """The controller's log says which of the four a worker held in Starting lacks."""
    assert F.starting_why(pod(), ws(), True) == []
    assert F.starting_why(pod(gate=None, ready=False), ws(), None) == [
        f"gate {P.CONDITION_SERVING} not True", "pod not Ready", "no endpoint"]
    assert F.starting_why(pod(), ws(controller={"quiesce": q(T0, T0 + timedelta(seconds=1))}), False) == [
        "endpoint not ready", "verification pending"]
