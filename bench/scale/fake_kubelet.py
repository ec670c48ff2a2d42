"""fake_kubelet: stands in for kubelet's readiness-gate rule on the bench's kwok pods.

kwok marks a pod Ready once, when it starts it, and never looks at ``spec.readinessGates`` again.
kubelet computes ``Ready = ContainersReady and every readiness gate condition True`` at each status
sync, so a worker whose ``dynsnap.io/serving`` gate the controller sets False goes unready, its
EndpointSlice endpoint with it (the quiesce waits on that). This does the same for every pod of the
fleet from one pods informer: whenever a Running pod's ``Ready`` disagrees with that rule, it writes
``Ready`` (and ``ContainersReady`` True: kwok's containers are always ready) with the pod's
resourceVersion as precondition (the rule: ``dynsnap.testenv.ready_rule``).
"""

from __future__ import annotations

import datetime as dt
import logging

from dynsnap.k8s.client import Kube, Obj
from dynsnap.k8s.errors import ApiError, NotFound
from dynsnap.k8s.informer import Informer
from dynsnap.models import resources as R
from dynsnap.runtime.workqueue import WorkQueue, run_workers
from dynsnap.testenv.ready_rule import compute_ready

log = logging.getLogger("bench.fake_kubelet")


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _cond(pod: Obj, ctype: str) -> str | None:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == ctype:
            return str(c.get("status"))
    return None


def wants_write(pod: Obj) -> bool:
    if not (pod.get("spec") or {}).get("readinessGates"):
        return False
    if (pod.get("status") or {}).get("phase") != "Running" or pod["metadata"].get("deletionTimestamp"):
        return False
    want = "True" if compute_ready(pod, True) else "False"
    return _cond(pod, "Ready") != want


class FakeKubelet:
    def __init__(self, kube: Kube, pods: Informer, *, workers: int = 8) -> None:
        self.kube = kube
        self.pods = pods
        self.workers = workers
        self.queue: WorkQueue[str] = WorkQueue(base_delay=0.1, max_delay=5.0)
        self.writes = 0
        pods.add_handler(self._on_pod)

    def _on_pod(self, _typ: str, pod: Obj) -> None:
        if wants_write(pod):
            self.queue.add(f"{pod['metadata']['namespace']}/{pod['metadata']['name']}")

    async def run(self) -> None:
        await run_workers(self.queue, self._reconcile, workers=self.workers, name="fake-kubelet")

    def stop(self) -> None:
        self.queue.shutdown()

    async def _reconcile(self, key: str) -> float | None:
        pod = self.pods.store.get_key(key)
        if pod is None or not wants_write(pod):
            return None
        ready = compute_ready(pod, True)
        conds = [dict(c) for c in (pod.get("status") or {}).get("conditions") or []]
        for ctype, ok in (("ContainersReady", True), ("Ready", ready)):
            value = "True" if ok else "False"
            existing = next((c for c in conds if c.get("type") == ctype), None)
            if existing is None:
                conds.append({"type": ctype, "status": value, "lastTransitionTime": _now()})
            elif existing.get("status") != value:
                existing.update(status=value, lastTransitionTime=_now())
        meta = pod["metadata"]
        patch = {"metadata": {"resourceVersion": meta["resourceVersion"]}, "status": {"conditions": conds}}
        try:
            written = await self.kube.merge_patch(R.PODS, meta["name"], patch, namespace=meta["namespace"],
                                                  subresource="status")
        except NotFound:
            return None
        except ApiError as e:
            if e.status == 409:
                return None  # written meanwhile: its watch event brings the pod back here
            raise
        self.writes += 1
        self.pods.store.upsert(written)
        return None
