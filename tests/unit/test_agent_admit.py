"""What the agent refuses before it touches anything: a missing pod, a pod with another UID (a
recreated pod is another worker), a pod on another node, a pod that did not opt in."""

from __future__ import annotations

from typing import Any

import pytest

from dynsnap.agent.admission import admit, container_id, opted_in, pod_serving_gate
from dynsnap.models.protocol import CONDITION_SERVING, Reason
from dynsnap.models.workersnapshot import WorkerSnapshot

UID = "0f6c3f2e-1b2a-4c3d-8e4f-5a6b7c8d9e0f"
OTHER = "1f6c3f2e-1b2a-4c3d-8e4f-5a6b7c8d9e0f"


def _ws() -> WorkerSnapshot:
    return WorkerSnapshot.model_validate({"metadata": {"name": "w-0", "namespace": "d"},
                                          "spec": {"podName": "w-0", "podUID": UID, "tier": "suspend"}})


def _pod(uid: str = UID, node: str = "node-a", gated: bool = True) -> dict[str, Any]:
    return {"metadata": {"name": "w-0", "namespace": "d", "uid": uid},
            "spec": {"nodeName": node, "readinessGates": [{"conditionType": CONDITION_SERVING}] if gated else []},
            "status": {"conditions": [{"type": CONDITION_SERVING, "status": "False"}],
                       "containerStatuses": [{"name": "main", "containerID": "containerd://abc"}]}}


@pytest.mark.parametrize(("pod", "reason"), [
    (None, Reason.POD_NOT_FOUND),
    (_pod(uid=OTHER), Reason.POD_UID_MISMATCH),
    (_pod(node="node-b"), Reason.WRONG_NODE),
    (_pod(gated=False), Reason.NOT_OPTED_IN),
])
def test_refusals(pod: dict[str, Any] | None, reason: Reason) -> None:
    v = admit(_ws(), pod, node="node-a")
    assert not v.ok and v.reason == reason and v.message


def test_accepted() -> None:
    assert admit(_ws(), _pod(), node="node-a").ok


def test_pod_facts() -> None:
    pod = _pod()
    assert opted_in(pod) and pod_serving_gate(pod) == "False" and container_id(pod, "main") == "containerd://abc"
    assert container_id(pod, "sidecar") is None and pod_serving_gate({"status": {}}) is None
