"""Every write the controller makes, and the parts they need (the I/O side of the reconcile).

``Ctx`` is what the phase functions are handed: the API client, the settings, the stores, the
frontend client, and the writes: the serving gate (pod status), the WorkerSnapshot's spec (merge
patch) and status (server-side apply of the controller's whole part, :mod:`status`), the fallback's
pod delete (UID precondition), and Events. Each write is read back into the store (read your own
write: the next reconcile must not act on what it replaced).

Events. A level-triggered loop says the same thing on every look; an operation repeated is news.
So an Event is dropped only when its note *and its occurrence* (the id of the quiesce, capture,
wake or verification it is about; None for standing conditions like an invalid policy) equal the
last said for that subject; another occurrence with the same note goes to the recorder, which folds
it into the Event's ``series.count`` (three quiesces: one Quiescing Event, count 3). What was said
about a pod is forgotten with the pod (:meth:`Ctx.forget`).

Layer: ``dynsnap.controller``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dynsnap.controller.frontend import Frontend
from dynsnap.controller.plan import Decision
from dynsnap.controller.routing import ModelCache
from dynsnap.controller.scope import Stores
from dynsnap.controller.settings import ControllerSettings
from dynsnap.controller.status import Verdict, controller_status
from dynsnap.k8s.client import Kube
from dynsnap.k8s.errors import Conflict, Invalid, NotFound
from dynsnap.k8s.informer import strip_managed_fields
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.models.protocol import DesiredState, Reason
from dynsnap.models.workersnapshot import ControllerRecord, OperationRecord, Verification, WorkerSnapshot
from dynsnap.telemetry.metrics import Metrics

log = logging.getLogger(__name__)
Obj = dict[str, Any]


@dataclass
class Hooks:
    """Side channels the reconciler reports to (telemetry, tests); all optional."""

    on_verified: Callable[[WorkerSnapshot, Verification], None] | None = None
    on_decision: Callable[[str, Decision], None] | None = None
    on_operation: Callable[[str, WorkerSnapshot, OperationRecord | Verification], None] | None = None


@dataclass
class Ctx:
    kube: Kube
    settings: ControllerSettings
    stores: Stores
    frontend: Frontend
    events: Any = None  # dynsnap.k8s.events.EventRecorder
    hooks: Hooks = field(default_factory=Hooks)
    metrics: Metrics | None = None
    models: ModelCache = field(default_factory=ModelCache)
    # subject -> (note, occurrence) last said as an Event; pruned with the pod or graph (forget)
    reported: dict[str, tuple[str, str | None]] = field(default_factory=dict)

    async def gate(self, pod: Obj, value: bool) -> bool:
        """The pod's ``dynsnap.io/serving`` condition (SSA of pod status, manager ``dynsnap``), for this pod
        alone: its UID is in the applied object, which the API server holds to the stored pod's, so a pod
        recreated under the name since ``pod`` was read never receives it (its own reconcile sets its
        gate). False when it did not reach this pod (gone, or another pod by now)."""
        meta = pod["metadata"]
        ident = {"name": meta["name"], "namespace": meta["namespace"]}
        if meta.get("uid"):
            ident["uid"] = meta["uid"]
        try:
            await self.kube.apply(R.PODS, {"metadata": ident,
                                           "status": {"conditions": [{"type": P.CONDITION_SERVING,
                                                                      "status": "True" if value else "False"}]}},
                                  subresource="status", field_manager=P.FIELD_MANAGER)
        except (NotFound, Conflict, Invalid) as e:
            if isinstance(e, Invalid) and "uid" not in str(e):
                raise
            log.info("%s/%s: the gate not written: the pod of UID %s is gone (%s)", meta["namespace"], meta["name"],
                     meta.get("uid"), e.reason or e.status)
            return False
        return True

    async def apply_spec(self, ws: WorkerSnapshot, *, desired: DesiredState | None = None,
                         tier: P.Tier | None = None, engine_sleep_level: int | None = None,
                         routable: bool | None = None, traceparent: str | None = None) -> Obj | None:
        """A JSON merge patch of only these spec fields (the controller may have created it with POST,
        and a person may have edited the spec: an apply would fight them for fields); the object
        written (None: it is gone)."""
        want = desired or ws.spec.desired_state
        # routable is a way to sleep: asked with Suspended (else as it was), and never left set on Active
        keep = ws.spec.routable if want == DesiredState.SUSPENDED else False
        patch: Obj = {"spec": {"tier": (tier or ws.spec.tier).value, "desiredState": want.value,
                               "engineSleepLevel": engine_sleep_level or ws.spec.engine_sleep_level,
                               "routable": routable if routable is not None else keep}}
        if traceparent:
            patch["metadata"] = {"annotations": {P.ANN_TRACEPARENT: traceparent}}
        try:
            written: Obj = await self.kube.merge_patch(R.WORKER_SNAPSHOTS, ws.metadata.name, patch,
                                                       namespace=ws.metadata.namespace)
        except NotFound:
            return None
        # Read our own write: a reconcile before the watch brings it back must not see the old desired
        # state and ask again (a second wake with a new trace, say).
        self.stores.wss.upsert(strip_managed_fields(written))
        return written

    async def write(self, ws: WorkerSnapshot, rec: ControllerRecord, *, verified: Verdict | None = None,
                    policy_ok: bool | None = None, policy_msg: str = "") -> None:
        """The controller's whole part of the status, by server-side apply (:func:`controller_status`)."""
        status = controller_status(ws, rec, verified=verified, policy_ok=policy_ok, policy_msg=policy_msg)
        try:
            written = await self.kube.apply(
                R.WORKER_SNAPSHOTS, {"metadata": {"name": ws.metadata.name, "namespace": ws.metadata.namespace},
                                     "status": status},
                subresource="status", field_manager=P.FIELD_MANAGER, force=True)
        except NotFound:
            return
        # Read our own write: the next reconcile must not act on stale status (stored as the informer stores it).
        self.stores.wss.upsert(strip_managed_fields(written))

    async def delete_pod(self, pod: Obj) -> None:
        """Delete the pod with its UID as precondition: that pod or none (gone or replaced: the end the
        fallback wants is reached either way)."""
        with contextlib.suppress(NotFound, Conflict):
            await self.kube.delete(R.PODS, pod["metadata"]["name"], namespace=pod["metadata"]["namespace"],
                                   uid=str(pod["metadata"].get("uid", "")))

    async def delete_ws(self, ws: WorkerSnapshot) -> None:
        with contextlib.suppress(NotFound, Conflict):
            await self.kube.delete(R.WORKER_SNAPSHOTS, ws.metadata.name, namespace=ws.metadata.namespace,
                                   uid=ws.metadata.uid)

    async def create_ws(self, body: Obj) -> bool:
        """Create a WorkerSnapshot; False when one exists already (our informer lags)."""
        try:
            await self.kube.create(R.WORKER_SNAPSHOTS, body, namespace=body["metadata"]["namespace"])
        except Conflict:
            return False
        return True

    async def say(self, regarding: Obj, kind: str, reason: Reason, note: str, *, occurrence: str | None = None,
                  subject: str | None = None) -> None:
        """An Event, unless this very note was last said about this occurrence (see the module doc)."""
        if self.events is None:
            return
        subj = subject or f"{regarding['metadata'].get('namespace')}/{regarding['metadata']['name']}/{reason.value}"
        if self.reported.get(subj) == (note, occurrence):
            return
        self.reported[subj] = (note, occurrence)
        await self.events.record(regarding, type=kind, reason=reason.value, action=reason.value, note=note)

    def forget(self, prefix: str) -> None:
        """Drop what was said about the subjects under ``prefix`` ("ns/pod/", "policy/ns/dgd/")."""
        for subj in [s for s in self.reported if s.startswith(prefix)]:
            del self.reported[subj]
