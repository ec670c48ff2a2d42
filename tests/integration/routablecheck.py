"""What the wake-on-request suites check of a component whose workers all sleep, on the real node
(node/test_wake_on_request.py): which WorkerSnapshot sleeps routable, every worker asleep with exactly
one routable, and that one still in serving.

Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

from typing import TypeVar

from controllerenv import PodRef, asleep, get_ws

from dynsnap.k8s.client import Kube, Obj
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.testenv import dynamo as D
from dynsnap.testenv.cluster import LocalCluster, wait_for

Pod = TypeVar("Pod", bound=PodRef)


def routable(ws: Obj | None) -> bool:
    """Asleep routable: asleep, and the agent's Suspended condition says Routable."""
    c = next((c for c in ((ws or {}).get("status") or {}).get("conditions") or [] if c["type"] == "Suspended"), None)
    return asleep(ws) and c is not None and c["reason"] == "Routable" and bool((ws or {})["spec"].get("routable"))


async def all_asleep(api: Kube, pods: list[Pod], component: str, timeout: float = 180) -> Pod:
    """Every one of ``pods`` (the workers of ``component``) asleep, exactly one routable (the last); that one."""
    async def done() -> Pod | None:
        wss = [await get_ws(api, p) for p in pods]
        if not all(asleep(ws) for ws in wss):
            return None
        rout = [p for p, ws in zip(pods, wss, strict=True) if routable(ws)]
        assert len(rout) <= 1, "more than one worker of the component sleeps routable"
        return rout[0] if rout else None
    found: Pod = await wait_for(f"every {component} asleep, the last routable", done, timeout=timeout, interval=0.5)
    return found


async def in_serving(cluster: LocalCluster, fe: D.FrontendClient, pod: PodRef) -> None:
    """Asleep and still in serving: pod Ready (kubelet's word), gate True,
    endpoint ready, the model listed by the frontend."""
    live = await cluster.api.get(R.PODS, pod.name, namespace=pod.namespace)
    conds = {c["type"]: c["status"] for c in live["status"].get("conditions") or []}
    assert conds.get("Ready") == "True" and conds.get(P.CONDITION_SERVING) == "True", conds
    ep = await cluster.endpoint_of(pod, label_selector=f"{P.LABEL_DISCOVERY_ENABLED}=true")  # type: ignore[arg-type]
    assert ep is not None and ep["conditions"]["ready"] is True, ep
    assert await fe.model_listed(), "the model left the frontend while its last worker sleeps"
