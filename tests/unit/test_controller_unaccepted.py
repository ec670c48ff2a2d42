"""A worker the agent does not accept (``Accepted=False``) that the controller was taking out of serving
goes back at once (dynsnap.controller.wake.unaccepted), not at the capture's deadline: the agent
captures nothing while it refuses the pod, and the planner counts the worker nowhere, so nothing else
would ever ask it back before ``capture_timeout`` (900 s by default). The capture asked for is called
off with the agent's reason on the capture's record; an open quiesce is closed. A worker captured (or
on its way) is left to its agent, and one the agent accepts is not this function's.

The real-node suite proves the same on a real container: tests/integration/node/test_agent_trust.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from test_controller_wake_request import POD, UID, reconciler_over, scope, stub_Kube

from dynsnap.controller import wake as W
from dynsnap.models.policy import Policy

T0 = "2026-12-06T10:00:00Z"
T1 = "2026-12-06T10:00:05Z"
T2 = "2026-12-06T10:00:09Z"
REFUSED = {"type": "Accepted", "status": "False", "reason": "EntrypointUnreadable",
           "message": "/run/dynsnap/entrypoint.json: not JSON", "lastTransitionTime": T1}


def _ws(*, desired: str, state: str, accepted: dict[str, Any], quiesce_finished: str | None) -> dict[str, Any]:
    quiesce = {"id": "q1", "tier": "suspend", "started": T0, **({"finished": quiesce_finished, "ok": True}
                                                                if quiesce_finished else {})}
    controller: dict[str, Any] = {"quiesce": quiesce}
    if desired == "Suspended":
        controller["capture"] = {"id": "c1", "tier": "suspend", "started": T1}
    return {"apiVersion": "dynsnap.io/v1alpha1", "kind": "WorkerSnapshot",
            "metadata": {"name": "w-0", "namespace": "ns", "resourceVersion": "10", "uid": "ws-uid", "generation": 2},
            "spec": {"podName": "w-0", "podUID": UID, "tier": "suspend", "desiredState": desired},
            "status": {"state": state, "conditions": [accepted], "controller": controller}}


async def _unaccepted(obj: dict[str, Any]) -> stub_Kube:
    r, kube, _ = reconciler_over(obj)
    await W.unaccepted(r.ctx, scope(POD, obj), Policy())
    return kube


@pytest.mark.parametrize("state", ["Active", "Unknown"])  # Unknown: what the agent says of a pod it refuses
async def test_a_capture_asked_of_a_worker_the_agent_refuses_is_called_off_with_its_reason(state: str) -> None:
    kube = await _unaccepted(_ws(desired="Suspended", state=state, accepted=REFUSED, quiesce_finished=T1))
    assert kube.patches and kube.patches[-1]["spec"]["desiredState"] == "Active"
    rec = kube.obj["status"]["controller"]
    cap = rec["capture"]
    assert cap.get("finished") and cap["ok"] is False
    assert cap["error"]["reason"] == "EntrypointUnreadable" and "not JSON" in cap["error"]["message"]
    assert rec["wake"]["started"] and "does not accept the pod: EntrypointUnreadable" in rec["decision"]


async def test_a_quiesce_under_way_of_a_worker_the_agent_refuses_is_closed() -> None:
    kube = await _unaccepted(_ws(desired="Active", state="Active", accepted=REFUSED, quiesce_finished=None))
    q = kube.obj["status"]["controller"]["quiesce"]
    assert q.get("finished") and q["ok"] is False
    assert not kube.patches, "no spec change: Active is already asked"


@pytest.mark.parametrize("state", ["Suspended", "Capturing", "Waking", "Lost"])
async def test_a_worker_captured_or_on_its_way_is_left_to_its_agent(state: str) -> None:
    obj = _ws(desired="Suspended", state=state, accepted=REFUSED, quiesce_finished=T1)
    kube = await _unaccepted(obj)
    assert not kube.patches and kube.obj["status"] == obj["status"]


@pytest.mark.parametrize(("finished", "ok", "called_back"), [
    (None, None, False),  # a capture under way since the quiesce: the agent's to finish or roll back
    (T2, True, False),  # captured since the quiesce (its state then Unknown): only the agent can wake it
    (T2, False, True),  # a capture that failed since the quiesce was rolled back: the worker runs
])
async def test_the_agents_capture_record_since_the_quiesce_decides(finished: str | None, ok: bool | None,
                                                                      called_back: bool) -> None:
    obj = _ws(desired="Suspended", state="Unknown", accepted=REFUSED, quiesce_finished=T1)
    obj["status"]["lastCapture"] = {"id": "a1", "tier": "suspend", "started": T1,
                                    **({"finished": finished, "ok": ok} if finished else {})}
    kube = await _unaccepted(obj)
    assert bool(kube.patches) == called_back, kube.patches


async def test_a_worker_the_agent_accepts_is_not_called_back() -> None:
    ok = {**REFUSED, "status": "True", "reason": "Accepted", "message": ""}
    obj = _ws(desired="Suspended", state="Active", accepted=ok, quiesce_finished=T1)
    kube = await _unaccepted(obj)
    assert not kube.patches and kube.obj["status"] == obj["status"]
