"""fake_agent: stands in for the node agents (``dynsnap agent``, one per GPU node) of the whole bench
fleet, in one process: no worker runs on a kwok node, so there is nothing to capture, wake or scrape.

What it keeps from the real agent is what the controller sees: it watches every WorkerSnapshot and
writes the agent's part of the status by server-side apply under the agent's field manager
(``dynsnap-agent``, ``dynsnap.agent.status.agent_owned``: never the controller's record or
conditions), under the agent's shipped RBAC (``deploy/rbac/agent.yaml``) when given its token:

- a new WorkerSnapshot is accepted (``Accepted=True``), the worker ``Active`` and busy;
- ``spec.desiredState=Suspended`` on an active worker: a capture recorded as done at once
  (``lastCapture`` finished ok, ``state=Suspended``, ``Suspended=True``);
- ``spec.desiredState=Active`` on a sleeping one: a wake recorded as done (``lastWake``, ``Active``),
  and the worker busy again (the load that woke it);
- idle facts (``status.idle``) as the scenario says: busy (in flight 1, ``idleSince`` unset) or quiet
  since a time :meth:`FakeAgent.go_idle` names, written only when they change (as the real agent).

It also notes when each spec change reached it (``seen``): the moment the real agent would start.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime, timedelta

from pydantic import ValidationError

from dynsnap.agent.status import agent_owned
from dynsnap.k8s.client import Kube, Obj
from dynsnap.k8s.errors import NotFound
from dynsnap.k8s.informer import Informer
from dynsnap.k8s.store import label
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.models.protocol import ConditionType as CT
from dynsnap.models.protocol import DesiredState, ObservedState, Reason
from dynsnap.models.workersnapshot import (
    Condition,
    IdleFacts,
    OperationRecord,
    StepTiming,
    WorkerSnapshot,
    WorkerSnapshotStatus,
    set_condition,
)
from dynsnap.runtime.workqueue import WorkQueue, run_workers

log = logging.getLogger("bench.fake_agent")


def utcnow() -> datetime:
    return datetime.now(UTC)


class FakeAgent:
    def __init__(self, kube: Kube, *, namespace: str, workers: int = 16) -> None:
        self.kube = kube
        self.informer = Informer(kube, R.WORKER_SNAPSHOTS, namespace=namespace,
                                 indexers={"node": label(P.LABEL_NODE)}, name="fake-agent-ws")
        self.informer.add_handler(self._on_ws)
        self.workers = workers
        self.queue: WorkQueue[str] = WorkQueue(base_delay=0.1, max_delay=10.0)
        self.idle: dict[str, IdleFacts] = {}  # key -> the idle facts the worker shows now
        self.requests: dict[str, float] = {}
        self.seen: dict[str, tuple[str, float]] = {}  # key -> (desiredState, time.time() it was first seen)
        self.writes = 0

    def _on_ws(self, _typ: str, obj: Obj) -> None:
        key = f"{obj['metadata']['namespace']}/{obj['metadata']['name']}"
        desired = str((obj.get("spec") or {}).get("desiredState") or "")
        if self.seen.get(key, ("", 0.0))[0] != desired:
            self.seen[key] = (desired, time.time())
        self.queue.add(key)

    def busy(self, key: str, now: datetime | None = None) -> None:
        """The worker serves traffic: in flight 1, a recent activity, not idle."""
        now = now or utcnow()
        self.requests[key] = self.requests.get(key, 0.0) + 1.0
        self.idle[key] = IdleFacts(inflight=1, requests_total=self.requests[key], last_activity=now, idle_since=None)
        self.queue.add(key)

    def go_idle(self, key: str, since: datetime) -> None:
        """The worker went quiet at ``since`` (nothing in flight, the counter still)."""
        self.idle[key] = IdleFacts(inflight=0, requests_total=self.requests.get(key, 0.0), last_activity=since,
                                   idle_since=since)
        self.queue.add(key)

    async def run(self) -> None:
        await run_workers(self.queue, self._reconcile, workers=self.workers, name="fake-agent")

    def stop(self) -> None:
        self.queue.shutdown()

    async def _reconcile(self, key: str) -> float | None:
        obj = self.informer.store.get_key(key)
        if obj is None:
            return None
        try:
            ws = WorkerSnapshot.model_validate(obj)
        except ValidationError:
            log.warning("%s: not a WorkerSnapshot this bench understands", key)
            return None
        st = ws.status.model_copy(deep=True)
        now = utcnow()
        gen = ws.metadata.generation
        accepted = ws.condition(CT.ACCEPTED)
        if accepted is None or accepted.status != "True":
            st.observed_generation = gen
            st.conditions = set_condition(st.conditions, CT.ACCEPTED, True, Reason.ACCEPTED,
                                          "the pod runs here under dynsnap-entrypoint", generation=gen)
            st.state = ObservedState.ACTIVE
            st.conditions = self._settled(st, asleep=False, gen=gen)
            if key not in self.idle:
                self.busy(key, now)
        elif ws.spec.desired_state == DesiredState.SUSPENDED and st.state == ObservedState.ACTIVE:
            st.last_capture = OperationRecord(id=f"c{int(now.timestamp() * 1000)}", tier=ws.spec.tier, started=now,
                                              finished=now + timedelta(milliseconds=1), ok=True,
                                              steps=[StepTiming(name="save", seconds=0.001)],
                                              trace_context=ws.metadata.annotations.get(P.ANN_TRACEPARENT))
            st.state = ObservedState.SUSPENDED
            st.observed_generation = gen
            st.conditions = self._settled(st, asleep=True, gen=gen)
        elif ws.spec.desired_state == DesiredState.ACTIVE and st.state == ObservedState.SUSPENDED:
            st.last_wake = OperationRecord(id=f"w{int(now.timestamp() * 1000)}", tier=ws.spec.tier, started=now,
                                           finished=now + timedelta(milliseconds=1), ok=True,
                                           steps=[StepTiming(name="resume", seconds=0.001)],
                                           trace_context=ws.metadata.annotations.get(P.ANN_TRACEPARENT))
            st.state = ObservedState.ACTIVE
            st.observed_generation = gen
            st.conditions = self._settled(st, asleep=False, gen=gen)
            self.busy(key, now)
        if st.state == ObservedState.ACTIVE and key in self.idle:
            st.idle = self.idle[key]
        if st == ws.status:
            return None
        body = {"metadata": {"name": ws.metadata.name, "namespace": ws.metadata.namespace},
                "status": agent_owned(st)}
        try:
            written = await self.kube.apply(R.WORKER_SNAPSHOTS, body, subresource="status",
                                            field_manager=P.AGENT_FIELD_MANAGER, force=True)
        except NotFound:
            return None
        self.writes += 1
        self.informer.store.upsert(written)  # our own write, read back: no second write from a stale read
        return None

    @staticmethod
    def _settled(st: WorkerSnapshotStatus, *, asleep: bool, gen: int | None) -> list[Condition]:
        conds = set_condition(st.conditions, CT.SUSPENDED, asleep, Reason.SUSPENDED if asleep else Reason.ACTIVE,
                              "asleep: GPU memory freed" if asleep else "serving", generation=gen)
        return set_condition(conds, CT.PROGRESSING, False, Reason.IDLE, "", generation=gen)
