"""Whether a worker is out of serving, asked right before its capture starts: its pod's
``dynsnap.io/serving`` gate is False (the controller quiesced it) and its own system port reports
nothing in flight.

The gate is read from the pod informer's store first. That copy can lag the controller's gate write by
a watch event; refusing on it would turn a harmless race into a counted failure, a backoff and a
Warning, so anything but False there is read again from the API server (the same pod, by UID) before
the capture is refused. A failed read leaves the cached answer: never capture on a guess.

Layer: ``dynsnap.agent`` (I/O: one API read, one scrape).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from dynsnap.agent import idle as I
from dynsnap.agent import worker as W
from dynsnap.agent.admission import pod_serving_gate
from dynsnap.agent.steps import ServingGate
from dynsnap.k8s.client import Kube
from dynsnap.k8s.errors import K8sError
from dynsnap.models import protocol as P
from dynsnap.models import resources as R

log = logging.getLogger(__name__)
Obj = dict[str, Any]


async def confirmed_serving_gate(kube: Kube, cached: Obj) -> tuple[str | None, Obj]:
    """The pod's dynsnap.io/serving status and the pod it was read from: the cached copy when it says
    False, else the API server's copy of the same pod (same UID)."""
    serving = pod_serving_gate(cached)
    if serving == "False":
        return serving, cached
    meta = cached["metadata"]
    try:
        live: Obj = await kube.get(R.PODS, meta["name"], namespace=meta.get("namespace"))
    except K8sError as e:
        log.info("pod %s/%s: serving gate not confirmed from the API server: %s", meta.get("namespace"),
                 meta["name"], e)
        return serving, cached
    if live["metadata"].get("uid") != meta.get("uid"):
        return serving, cached  # another pod of that name: the admission refuses it next
    return pod_serving_gate(live), live


def serving_gate(kube: Kube, cached: Callable[[], Obj], *, metrics_port: int, routable: bool = False) -> ServingGate:
    """The executor's gate for one pod: None when it is out of serving, else why not. ``cached``
    returns the pod as the informer's store holds it now. ``routable``: a sleep that keeps the worker
    in serving (wake on request): only nothing in flight is asked for; a request that comes after is
    held by the worker and wakes it."""
    async def gate(_: W.WorkerProcs) -> str | None:
        serving, current = await confirmed_serving_gate(kube, cached())
        if serving != "False" and not routable:
            return (f"the pod's {P.CONDITION_SERVING} condition is {serving or 'unset'}, not False: the "
                    "controller quiesces a worker before it is captured")
        ip = (current.get("status") or {}).get("podIP")
        try:
            sample = await I.scrape(f"http://{ip}:{metrics_port}/metrics")
        except I.MetricsUnavailable as e:
            return f"cannot tell the worker has no requests in flight: {e}"
        if sample.inflight > 0:
            return f"{sample.inflight} requests in flight"
        return None
    return gate
