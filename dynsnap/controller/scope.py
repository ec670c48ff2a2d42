"""What one reconcile of a worker reads, once, from the informers' stores: its pod, its graph and
component, the component's parsed policy, its WorkerSnapshot (with the controller's record, which
the phases edit and the driver writes back) and its EndpointSlice endpoint (after Cluster API's
``scope``: the phases get it, not the stores). Pure reads.

Layer: ``dynsnap.controller``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from dynsnap.controller import fleet as F
from dynsnap.controller.plan import Phase
from dynsnap.k8s.store import Store
from dynsnap.models import protocol as P
from dynsnap.models.policy import ParsedPolicy, Policy, parse_policy
from dynsnap.models.workersnapshot import ControllerRecord, WorkerSnapshot

Obj = dict[str, Any]


def utcnow() -> datetime:
    return datetime.now(UTC)


class Next:
    """A phase's answer that this reconcile is not its to end: the driver goes on to the next phase."""

    def __repr__(self) -> str:
        return "NEXT"


NEXT = Next()
Step = float | None | Next  # look again after T seconds, done (None), or the next phase's turn


@dataclass
class Stores:
    dgds: Store
    pods: Store
    dwms: Store
    slices: Store
    wss: Store


@dataclass
class Scope:
    """One worker, as this reconcile read it."""

    key: str
    pod: Obj
    dgd: Obj
    component: str
    ws: WorkerSnapshot | None
    parsed: ParsedPolicy
    endpoint_ready: bool | None
    now: datetime
    again: float | None = None  # the soonest deadline an open phase waits on (seconds from now)

    @property
    def ns(self) -> str:
        return str(self.pod["metadata"]["namespace"])

    @property
    def name(self) -> str:
        return str(self.pod["metadata"]["name"])

    @property
    def dgd_name(self) -> str:
        return F.labels(self.pod)[P.LABEL_DGD_NAME]

    @property
    def dgd_key(self) -> str:
        return f"{self.ns}/{self.dgd_name}"

    @property
    def pod_uid(self) -> str:
        return F.pod_uid(self.pod)

    @property
    def policy(self) -> Policy:
        assert self.parsed.policy is not None, "the policy does not parse"
        return self.parsed.policy

    @property
    def snap(self) -> WorkerSnapshot:
        assert self.ws is not None
        return self.ws

    @property
    def rec(self) -> ControllerRecord:
        """The controller's record on the WorkerSnapshot (attached when there was none): the phases edit
        it in place, so the phase read after an edit is the edited one's."""
        ws = self.snap
        if ws.status.controller is None:
            ws.status.controller = ControllerRecord()
        return ws.status.controller

    @property
    def phase(self) -> Phase:
        return F.phase_of(self.pod, self.ws, self.endpoint_ready)

    def until(self, seconds: float) -> None:
        """Look again no later than ``seconds`` from now (a deadline an open phase waits on)."""
        seconds = max(seconds, 0.05)
        self.again = seconds if self.again is None else min(self.again, seconds)

    def reread(self, stores: Stores) -> None:
        """The WorkerSnapshot afresh from the store (after a write outside the record)."""
        self.ws = F.parse_ws(stores.wss.get(self.ns, self.name))


def read_scope(stores: Stores, key: str, pod: Obj, now: datetime | None = None) -> Scope | None:
    """The scope of the worker ``pod`` (a worker pod, opted in, not being deleted); None when its graph
    is gone (its pods follow through the garbage collector)."""
    ns = pod["metadata"]["namespace"]
    dgd = stores.dgds.get(ns, F.labels(pod)[P.LABEL_DGD_NAME])
    if dgd is None:
        return None
    comp_name = F.component_of(pod) or ""
    comp = next((c for c in F.dgd_components(dgd) if c.name == comp_name), None)
    return Scope(key=key, pod=pod, dgd=dgd, component=comp_name,
                 ws=F.parse_ws(stores.wss.get(ns, pod["metadata"]["name"])),
                 parsed=parse_policy(F.annotations_of(dgd), comp.annotations if comp else {}),
                 endpoint_ready=F.endpoint_ready(stores.slices, pod), now=now or utcnow())
