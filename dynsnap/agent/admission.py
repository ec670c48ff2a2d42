"""What the node agent checks before it touches a worker, from the WorkerSnapshot and its pod alone:
the pod exists with the UID the spec names, runs on this node, and opted in (it carries the
``dynsnap.io/serving`` readiness gate). Whether it runs under dynsnap-entrypoint is the executor's
finding on the node (``dynsnap.agent.worker``).

Layer: ``dynsnap.agent`` (pure: objects in, a verdict out).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dynsnap.models import protocol as P
from dynsnap.models.protocol import Reason
from dynsnap.models.workersnapshot import WorkerSnapshot

Obj = dict[str, Any]


@dataclass
class Verdict:
    """Whether a WorkerSnapshot may be acted on; ``reason`` names why not."""

    ok: bool
    reason: Reason
    message: str


def pod_serving_gate(pod: Obj) -> str | None:
    """The pod's dynsnap.io/serving condition status ("True", "False"), None when unset."""
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == P.CONDITION_SERVING:
            return str(c.get("status"))
    return None


def opted_in(pod: Obj) -> bool:
    gates = (pod.get("spec") or {}).get("readinessGates") or []
    return any(g.get("conditionType") == P.CONDITION_SERVING for g in gates)


def container_id(pod: Obj, container: str) -> str | None:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        if cs.get("name") == container and cs.get("containerID"):
            return str(cs["containerID"])
    return None


def admit(ws: WorkerSnapshot, pod: Obj | None, *, node: str) -> Verdict:
    """The checks before the agent touches anything."""
    if pod is None:
        return Verdict(False, Reason.POD_NOT_FOUND, f"pod {ws.metadata.namespace}/{ws.spec.pod_name} does not exist")
    uid = pod["metadata"].get("uid")
    if uid != ws.spec.pod_uid:
        return Verdict(False, Reason.POD_UID_MISMATCH, f"pod {ws.spec.pod_name} has UID {uid}, the spec names "
                       f"{ws.spec.pod_uid}: another pod (recreated?), never acted on")
    if (pod.get("spec") or {}).get("nodeName") != node:
        return Verdict(False, Reason.WRONG_NODE, f"pod runs on {pod.get('spec', {}).get('nodeName')!r}, "
                       f"this agent serves {node!r}")
    if not opted_in(pod):
        return Verdict(False, Reason.NOT_OPTED_IN, f"pod has no readiness gate {P.CONDITION_SERVING}: "
                       "it did not opt in to dynsnap")
    if (pod.get("spec") or {}).get("shareProcessNamespace") is True:
        # The pause container is PID 1 of a shared pid namespace: the entrypoint can neither reserve the pid
        # range a restore needs (every container's processes take pids there) nor be given the restored tree
        # back (it goes to PID 1). Refused by name, so the worker serves uncaptured instead of waiting.
        return Verdict(False, Reason.SHARED_PROCESS_NAMESPACE, "the pod sets shareProcessNamespace: true, so "
                       "dynsnap-entrypoint is not PID 1 of its pid namespace (the pause container is): dynsnap does "
                       "not capture it; it serves as it is")
    return Verdict(True, Reason.ACCEPTED, "")
