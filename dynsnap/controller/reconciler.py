"""The controller's reconcile of one worker pod: read its component from the stores, ask the
planner, take at most one side-effecting step toward what it wants, say when to look again.

Steps (docs/CONTROLLER.md): create the WorkerSnapshot; set the serving gate of a new worker;
quiesce (record identity -> gate False -> wait: endpoint not ready, frontend refusing a pinned
request, nothing in flight) -> desiredState Suspended; wake (desiredState Active) -> gate True ->
verify (identity, endpoint, pinned requests) -> Verified, or the failure with its reason and the
fallback. Every wait is a "look again after T", never a sleep; every timeout is measured from a
time recorded in status, so a restarted controller carries on where the last one stopped.

Layer: ``dynsnap.controller``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from dynsnap.controller import fleet as F
from dynsnap.controller.frontend import Frontend, FrontendError
from dynsnap.controller.plan import Decision, Demand, Phase, Want, WorkerView, plan
from dynsnap.controller.settings import ControllerSettings
from dynsnap.k8s.client import Kube
from dynsnap.k8s.errors import Conflict, NotFound
from dynsnap.k8s.informer import strip_managed_fields
from dynsnap.k8s.store import Store
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.models.dynamo import transport_from_dwm
from dynsnap.models.policy import ParsedPolicy, Policy, parse_override, parse_policy
from dynsnap.models.protocol import ConditionType, DesiredState, Reason
from dynsnap.models.workersnapshot import (
    ControllerRecord,
    OperationRecord,
    StepTiming,
    Verification,
    WorkerIdentity,
    WorkerSnapshot,
    set_condition,
)
from dynsnap.telemetry import tracing
from dynsnap.telemetry.metrics import Metrics
from dynsnap.telemetry.tracing import new_traceparent

log = logging.getLogger(__name__)
Obj = dict[str, Any]

POLL = 0.25  # look again soon: a wait on something the informers will also report


def utcnow() -> datetime:
    return datetime.now(UTC)


def _ms_id(prefix: str, now: datetime) -> str:
    return f"{prefix}{int(now.timestamp() * 1000)}"


@dataclass
class Stores:
    dgds: Store
    pods: Store
    dwms: Store
    slices: Store
    wss: Store


@dataclass
class Hooks:
    """Side channels the reconciler reports to (telemetry, tests); all optional."""

    on_verified: Callable[[WorkerSnapshot, Verification], None] | None = None
    on_decision: Callable[[str, Decision], None] | None = None
    on_operation: Callable[[str, WorkerSnapshot, OperationRecord | Verification], None] | None = None


@dataclass
class Reconciler:
    kube: Kube
    settings: ControllerSettings
    stores: Stores
    frontend: Frontend
    events: Any = None  # dynsnap.k8s.events.EventRecorder
    hooks: Hooks = field(default_factory=Hooks)
    metrics: Metrics | None = None
    demand: dict[str, Demand | None] = field(default_factory=dict)  # "ns/dgd" -> frontend demand
    models: dict[str, str] = field(default_factory=dict)  # "ns/dgd" -> model name
    _reported: dict[str, str] = field(default_factory=dict)  # what was last said as an Event, per subject
    # "ns/name" -> (resourceVersion, parsed): each WorkerSnapshot parsed once per version for planning
    _parsed: dict[str, tuple[str, WorkerSnapshot | None]] = field(default_factory=dict)

    # -- entry ------------------------------------------------------------------------------------

    async def reconcile(self, key: str) -> float | None:
        pod = self.stores.pods.get_key(key)
        if pod is None or not F.is_worker_pod(pod) or not F.opted_in(pod):
            return None  # a WorkerSnapshot is owned by its pod: the garbage collector removes it
        if pod["metadata"].get("deletionTimestamp"):
            return None
        ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
        dgd_name = F.labels(pod)[P.LABEL_DGD_NAME]
        dgd = self.stores.dgds.get(ns, dgd_name)
        if dgd is None:
            return None  # the graph is gone (its pods follow through the garbage collector)
        comp_name = F.component_of(pod)
        comp = next((c for c in F.dgd_components(dgd) if c.name == comp_name), None)
        ws = F.parse_ws(self.stores.wss.get(ns, name))
        parsed = parse_policy(F.annotations_of(dgd), comp.annotations if comp else {})
        if not parsed.ok:
            await self._bad_policy(dgd, comp_name or "?", ws, parsed)
            return await self._finish_return(pod, F.parse_ws(self.stores.wss.get(ns, name)))
        assert parsed.policy is not None
        policy = parsed.policy
        if ws is not None and ws.spec.pod_uid != F.pod_uid(pod):
            return await self._replaced(pod, ws)
        if ws is None:
            if not policy.enabled:
                return await self._serve_unmanaged(pod)
            return await self._create(pod, policy)
        if not self._policy_condition_ok(ws):
            await self._write(ws, ws.status.controller or ControllerRecord(), policy_ok=True)
            return 0.0
        _, bad = parse_override(F.annotations_of(pod).get(P.ANN_DESIRED_STATE))
        if bad:
            await self._say(pod, "Warning", Reason.INVALID_OVERRIDE, bad)
        decisions = self._plan(ns, dgd_name, comp_name or "", policy)
        decision = decisions.get(name) or Decision(Want.LEAVE, "not in the component's plan")
        if not policy.enabled:
            decision = Decision(Want.AWAKE, f"{P.ANN_ENABLED} is not true: every worker stays awake")
        if decision.refused:
            await self._say(pod, "Warning", Reason.MIN_ACTIVE, decision.why)
            rec = ws.status.controller or ControllerRecord()
            if rec.decision != decision.why:  # on the object too: `dynsnap suspend` shows it to its user
                rec.decision, rec.decided = decision.why, utcnow()
                await self._write(ws, rec)
        if self.hooks.on_decision:
            self.hooks.on_decision(key, decision)
        phase = F.phase_of(pod, ws, F.endpoint_ready(self.stores.slices, pod))
        log.debug("%s: phase %s, %s (%s)", key, phase, decision.want, decision.why)
        if phase == Phase.BROKEN:
            return None
        if ws.spec.tier != policy.tier and ws.spec.desired_state == DesiredState.ACTIVE and phase in (
                Phase.SERVING, Phase.STARTING, Phase.NEW):
            await self._apply_spec(ws, tier=policy.tier)
            return 0.0
        if decision.want == Want.AWAKE:
            return await self._awake(pod, ws, policy, phase, decision)
        if decision.want == Want.ASLEEP:
            return await self._asleep(pod, ws, policy, phase, decision)
        return None

    # -- planning ---------------------------------------------------------------------------------

    def component_pods(self, ns: str, dgd: str, component: str) -> list[Obj]:
        return [p for p in self.stores.pods.by_index("dgd", f"{ns}/{dgd}")
                if F.component_of(p) == component and F.is_worker_pod(p) and F.opted_in(p)
                and not p["metadata"].get("deletionTimestamp")]

    def peer_ws(self, ns: str, name: str) -> WorkerSnapshot | None:
        """A worker's WorkerSnapshot as the planner reads it, parsed once per resourceVersion: every
        reconcile of a component's worker plans the whole component, and parsing was most of the cost
        (docs/BENCHMARKS.md, bench/scale). Shared and read-only: a reconcile that acts on its own worker
        parses that one afresh (it edits the records it writes back)."""
        key = f"{ns}/{name}"
        obj = self.stores.wss.get(ns, name)
        if obj is None:
            self._parsed.pop(key, None)
            return None
        rv = str((obj.get("metadata") or {}).get("resourceVersion") or "")
        hit = self._parsed.get(key)
        if hit is not None and rv and hit[0] == rv:
            return hit[1]
        if len(self._parsed) > 2 * len(self.stores.wss) + 64:  # WorkerSnapshots gone since: drop theirs
            self._parsed = {k: v for k, v in self._parsed.items() if k in self.stores.wss}
        ws = F.parse_ws(obj)
        self._parsed[key] = (rv, ws)
        return ws

    def view_of(self, pod: Obj) -> WorkerView:
        """The worker as the planner sees it."""
        meta = pod["metadata"]
        ws = self.peer_ws(meta["namespace"], meta["name"])
        phase = F.phase_of(pod, ws, F.endpoint_ready(self.stores.slices, pod))
        idle = ws.status.idle if ws else None
        cap = ws.status.last_capture if ws else None
        ver = ws.status.controller.verification if ws and ws.status.controller else None
        override, _ = parse_override(F.annotations_of(pod).get(P.ANN_DESIRED_STATE))
        return WorkerView(name=meta["name"], phase=phase, idle_since=idle.idle_since if idle else None,
                          last_activity=idle.last_activity if idle else None,
                          last_capture=cap.started if cap else None, override=override,
                          serving_since=ver.finished if ver is not None and ver.ok else None)

    def _plan(self, ns: str, dgd: str, component: str, policy: Policy) -> dict[str, Decision]:
        views = [self.view_of(p) for p in self.component_pods(ns, dgd, component)]
        return plan(views, policy, self.demand.get(f"{ns}/{dgd}"), utcnow())

    # -- awake ------------------------------------------------------------------------------------

    async def _awake(self, pod: Obj, ws: WorkerSnapshot, policy: Policy, phase: Phase, d: Decision
                     ) -> float | None:
        rec = ws.status.controller or ControllerRecord()
        if ws.spec.desired_state == DesiredState.SUSPENDED:
            now = utcnow()
            asked = rec.wake if rec.wake is not None and rec.wake.finished is None and (
                rec.quiesce is None or rec.wake.started >= rec.quiesce.started) else None
            if asked is not None and asked.trace_context:
                # Already asked for (the spec write did not land, or someone set it back): ask again
                # as the same wake, so its record, trace and the agent's record stay one operation.
                tp = asked.trace_context
            else:
                tp = new_traceparent()
                self._close_capture(ws, rec, now)
                rec.wake = OperationRecord(id=_ms_id("w", now), tier=ws.spec.tier, started=now, trace_context=tp)
                rec.decision, rec.decided = f"wake: {d.why}", now
                await self._write(ws, rec)  # the wake's start and trace on record before it is asked for
            await self._apply_spec(ws, desired=DesiredState.ACTIVE, traceparent=tp)
            await self._say(pod, "Normal", Reason.WAKE_REQUESTED, f"wake: {d.why}")
            return POLL
        if phase == Phase.QUIESCING:
            assert rec.quiesce is not None
            rec.quiesce.finished, rec.quiesce.ok = utcnow(), False
            rec.decision, rec.decided = f"capture called off: {d.why}", utcnow()
            await self._write(ws, rec)
            await self._say(pod, "Normal", Reason.ACTIVE, f"capture called off: {d.why}")
            return 0.0
        if phase == Phase.WAKING:
            return None  # the agent is at it; its status write brings us back
        if ws.status.state != P.ObservedState.ACTIVE:
            return None  # not yet accepted / seen by the agent
        if F.verification_pending(ws):
            return await self._verify(pod, ws, policy, rec)
        if F.pod_condition(pod, P.CONDITION_SERVING) != "True":
            await self._gate(pod, True)
            return POLL
        return d.again_after

    # -- verification -----------------------------------------------------------------------------

    async def _verify(self, pod: Obj, ws: WorkerSnapshot, policy: Policy, rec: ControllerRecord) -> float | None:
        now = utcnow()
        wake = ws.status.last_wake
        wake_id = wake.id if wake is not None and rec.quiesce is not None and wake.started >= rec.quiesce.started \
            else f"recall-{rec.quiesce.id if rec.quiesce else 'none'}"
        v = rec.verification
        if v is None or v.wake_id != wake_id or (rec.quiesce is not None and v.started < rec.quiesce.started):
            v = Verification(wake_id=wake_id, ok=None, reason=Reason.VERIFYING, started=now,
                             message="waiting for the serving gate, the endpoint and the DWM")
            rec.verification = v
            await self._write(ws, rec, verified=(None, Reason.VERIFYING, v.message))
            return 0.0
        # Identity first: a worker whose pod or DWM changed is never put back into serving, where the
        # frontend would route unpinned requests to it (or, by its DWM, to another worker in its name).
        problem = self._identity_problem(pod, rec.identity)
        if problem is not None:
            return await self._fail(pod, ws, rec, policy, *problem)
        if F.pod_condition(pod, P.CONDITION_SERVING) != "True":
            await self._gate(pod, True)
            return POLL
        elapsed = (now - v.started).total_seconds()
        ready = F.endpoint_ready(self.stores.slices, pod)
        if not ready or not F.pod_ready(pod):
            if elapsed > self.settings.verify_timeout:
                return await self._fail(pod, ws, rec, policy, Reason.ENDPOINT_NOT_READY,
                                        f"endpoint ready={ready}, pod Ready={F.pod_ready(pod)} "
                                        f"{elapsed:.0f}s after the wake")
            return POLL
        ns = pod["metadata"]["namespace"]
        dgd = F.labels(pod)[P.LABEL_DGD_NAME]
        url = F.frontend_url(self.stores.pods, ns, dgd)
        if url is None:
            if elapsed > self.settings.verify_timeout:
                return await self._fail(pod, ws, rec, policy, Reason.FRONTEND_UNAVAILABLE,
                                        f"graph {dgd} has no ready frontend")
            return 1.0
        wid, pid, headers = self._pins(pod)
        if wid is None and pid is None:
            return await self._fail(pod, ws, rec, policy, Reason.DWM_CHANGED, "no DWM with an instance id for it")
        model = await self._model(url, f"{ns}/{dgd}")
        if model is None:
            return 1.0 if elapsed <= self.settings.verify_timeout else await self._fail(
                pod, ws, rec, policy, Reason.FRONTEND_UNAVAILABLE, f"frontend {url} lists no model")
        t0 = time.monotonic()
        answered, refused, last_err = 0, 0, ""
        role = F.role_of(pod)
        pinned_to = wid if role != F.Role.PREFILL else pid
        for _ in range(policy.verify_requests):
            a = await self.frontend.pinned(url, model, worker_id=wid if role != F.Role.PREFILL else None,
                                           prefill_id=pid)
            if a.answered_by(worker_id=wid if role != F.Role.PREFILL else None, prefill_id=pid):
                answered += 1
            elif a.ok:
                # Proof against: a pinned request never falls back, so another worker's id means the
                # frontend's idea of this instance leads elsewhere. No retry could make that right.
                v.requests, v.answered, v.headers, v.worker_id, v.prefill_id = (
                    answered + refused + 1, answered, headers, wid, pid)
                return await self._fail(pod, ws, rec, policy, Reason.ANSWERED_BY_ANOTHER_WORKER,
                                        f"a request pinned to {pinned_to} was answered by worker {a.worker_id} "
                                        f"(prefill {a.prefill_id})")
            else:
                refused += 1
                last_err = f"HTTP {a.status}: {a.error}"
                break
        seconds = time.monotonic() - t0
        v.requests, v.answered, v.headers = answered + refused, answered, headers
        v.worker_id, v.prefill_id = wid, pid
        v.steps = [StepTiming(name="identity+endpoint", seconds=max(elapsed, 0.0)),
                   StepTiming(name="pinned-requests", seconds=seconds)]
        if answered < policy.verify_requests:
            # Refused (the frontend may not have taken the instance back yet: its EndpointSlice watch
            # lags the gate): try a whole new round later, until the verify timeout says it never will.
            if elapsed + seconds > self.settings.verify_timeout:
                return await self._fail(pod, ws, rec, policy, Reason.PINNED_REQUEST_FAILED,
                                        f"{answered}/{policy.verify_requests} pinned requests answered by it within "
                                        f"{self.settings.verify_timeout:g}s; last: {last_err}")
            v.message = f"pinned request refused, trying again: {last_err}"[:4096]
            await self._write(ws, rec, verified=(None, Reason.VERIFYING, v.message))
            return 1.0
        v.ok, v.reason, v.finished = True, Reason.VERIFIED, utcnow()
        v.message = (f"{answered}/{policy.verify_requests} requests pinned with {', '.join(headers)} answered by "
                     f"instance {wid if role != F.Role.PREFILL else pid}; pod UID, IP, DWM UID and instance id "
                     "unchanged; endpoint ready")
        rec.decision, rec.decided = "verified", utcnow()
        self._close_wake(ws, rec, v)
        await self._write(ws, rec, verified=(True, Reason.VERIFIED, v.message))
        await self._say(pod, "Normal", Reason.VERIFIED, v.message)
        if self.hooks.on_verified:
            self.hooks.on_verified(ws, v)
        return None

    def _identity_problem(self, pod: Obj, ident: WorkerIdentity | None) -> tuple[Reason, str] | None:
        if ident is None:
            return None  # a worker quiesced before it had a DWM is checked by its pinned answers alone
        if ident.pod_uid != F.pod_uid(pod):
            return Reason.POD_CHANGED, f"pod UID {F.pod_uid(pod)}, was {ident.pod_uid}"
        if ident.pod_ip != F.pod_ip(pod):
            return Reason.POD_CHANGED, f"pod IP {F.pod_ip(pod)}, was {ident.pod_ip}"
        dwm = F.dwm_of(self.stores.dwms, pod)
        if dwm is None:
            return Reason.DWM_CHANGED, "its DWM is gone (or no longer owned by this pod)"
        if str(dwm["metadata"].get("uid")) != ident.dwm_uid:
            return Reason.DWM_CHANGED, f"DWM UID {dwm['metadata'].get('uid')}, was {ident.dwm_uid}"
        iid = F.instance_id(dwm)
        if iid != ident.instance_id:
            return Reason.DWM_CHANGED, f"instance id {iid}, was {ident.instance_id}"
        # The frontend names the instance it routed to, not who served: pinned answers prove this worker
        # only while its DWM still leads to it.
        transport = transport_from_dwm(dwm)
        if ident.transport is not None and transport != ident.transport:
            return Reason.DWM_CHANGED, f"its generate endpoint leads to {transport}, was {ident.transport}"
        return None

    def _pins(self, pod: Obj) -> tuple[int | None, int | None, list[str]]:
        """(worker id, prefill id, header names) for requests pinned to this worker."""
        iid = F.instance_id(F.dwm_of(self.stores.dwms, pod))
        role = F.role_of(pod)
        if iid is None:
            return None, None, []
        if role == F.Role.PREFILL:
            return None, int(iid), [P.HEADER_PREFILL_INSTANCE_ID]
        if role == F.Role.DECODE:
            prefill = self._serving_prefill(pod)
            return int(iid), prefill, [P.HEADER_WORKER_INSTANCE_ID, P.HEADER_PREFILL_INSTANCE_ID] if prefill \
                is not None else [P.HEADER_WORKER_INSTANCE_ID]
        return int(iid), None, [P.HEADER_WORKER_INSTANCE_ID]

    def _serving_prefill(self, pod: Obj) -> int | None:
        ns = pod["metadata"]["namespace"]
        for p in sorted(self.stores.pods.by_index("dgd", f"{ns}/{F.labels(pod)[P.LABEL_DGD_NAME]}"),
                        key=lambda p: p["metadata"]["name"]):
            if F.is_worker_pod(p) and F.role_of(p) == F.Role.PREFILL and F.pod_ready(p):
                iid = F.instance_id(F.dwm_of(self.stores.dwms, p))
                if iid is not None:
                    return int(iid)
        return None

    async def _model(self, url: str, dgd_key: str) -> str | None:
        if dgd_key in self.models:
            return self.models[dgd_key]
        try:
            models = await self.frontend.models(url)
        except FrontendError as e:
            log.info("%s: %s", dgd_key, e)
            return None
        if not models:
            return None
        self.models[dgd_key] = sorted(models)[0]
        return self.models[dgd_key]

    async def _fail(self, pod: Obj, ws: WorkerSnapshot, rec: ControllerRecord, policy: Policy, reason: Reason,
                    message: str) -> float | None:
        """A wake that cannot be proven: out of serving again, Verified=False, Event, fallback."""
        v = rec.verification
        assert v is not None
        v.ok, v.reason, v.message, v.finished = False, reason, message[:4096], utcnow()
        if F.pod_condition(pod, P.CONDITION_SERVING) != "False":
            await self._gate(pod, False)
        fallback = policy.on_failed_wake
        v.fallback = Reason.COLD_RESTART.value if fallback == "restart" else "none"
        rec.decision, rec.decided = f"wake failed: {reason.value}", utcnow()
        self._close_wake(ws, rec, v)
        await self._write(ws, rec, verified=(False, reason, message))
        await self._say(pod, "Warning", reason, f"wake not verified: {message}; fallback: {v.fallback}")
        if self.hooks.on_verified:
            self.hooks.on_verified(ws, v)
        if fallback == "restart":
            # Already gone or replaced: the fallback's end is reached either way.
            with contextlib.suppress(NotFound, Conflict):
                await self.kube.delete(R.PODS, pod["metadata"]["name"], namespace=pod["metadata"]["namespace"],
                                       uid=F.pod_uid(pod))
            await self._say(pod, "Warning", Reason.COLD_RESTART,
                            "pod deleted so the operator recreates it cold (on-failed-wake: restart)")
        return None

    # -- asleep -----------------------------------------------------------------------------------

    async def _asleep(self, pod: Obj, ws: WorkerSnapshot, policy: Policy, phase: Phase, d: Decision
                      ) -> float | None:
        rec = ws.status.controller or ControllerRecord()
        now = utcnow()
        if phase in (Phase.CAPTURING, Phase.ASLEEP):
            changed = False
            if rec.quiesce is not None and rec.quiesce.finished is None:
                rec.quiesce.finished, rec.quiesce.ok = now, True
                changed = True
            if phase == Phase.ASLEEP:
                changed = self._close_capture(ws, rec, now) or changed
            if changed:
                await self._write(ws, rec)
            return None
        if phase == Phase.SERVING:
            dwm = F.dwm_of(self.stores.dwms, pod)
            iid = F.instance_id(dwm)
            ip = F.pod_ip(pod)
            if dwm is None or iid is None or ip is None:
                return 1.0  # nothing to verify a wake against yet: not captured before it registered
            rec.identity = WorkerIdentity(pod_uid=F.pod_uid(pod), pod_ip=ip, dwm_uid=str(dwm["metadata"]["uid"]),
                                          instance_id=int(iid), transport=transport_from_dwm(dwm), recorded=now)
            rec.quiesce = OperationRecord(id=f"q{int(now.timestamp() * 1000)}", tier=policy.tier, started=now,
                                          trace_context=new_traceparent())
            rec.decision, rec.decided = d.why, now
            await self._write(ws, rec)
            await self._say(pod, "Normal", Reason.QUIESCING, f"taking it out of serving: {d.why}")
            return 0.0
        if phase != Phase.QUIESCING:
            return None
        q = rec.quiesce
        assert q is not None
        elapsed = (now - q.started).total_seconds()
        if elapsed > self.settings.quiesce_timeout:
            q.finished, q.ok = now, False
            rec.decision, rec.decided = "quiesce timed out; back to serving", now
            await self._write(ws, rec)
            await self._say(pod, "Warning", Reason.WORKER_SERVING,
                            f"quiesce did not finish in {self.settings.quiesce_timeout:g}s; capture called off")
            return 0.0
        if F.pod_condition(pod, P.CONDITION_SERVING) != "False":
            await self._gate(pod, False)
            self._step(q, "gate", q.started, now)
            await self._write(ws, rec)
            return POLL
        steps = len(q.steps)
        again: float | None = None
        if F.endpoint_ready(self.stores.slices, pod):
            again = POLL
        else:
            self._step(q, "endpoint-not-ready", q.started, now)
            if await self._still_routed(pod, rec):
                again = 0.5
            else:
                self._step(q, "frontend-stopped-routing", q.started, now)
                idle = ws.status.idle
                if idle is None or (idle.inflight or 0) > 0:
                    again = 0.5
                else:
                    self._step(q, "drained", q.started, now)
        if len(q.steps) != steps:
            await self._write(ws, rec)  # progress on record (a restarted controller keeps the timings)
        if again is not None:
            return again
        await self._apply_spec(ws, desired=DesiredState.SUSPENDED, traceparent=q.trace_context or new_traceparent())
        await self._say(pod, "Normal", Reason.CAPTURE_REQUESTED,
                        f"quiesced in {elapsed:.2f}s; capture ({policy.tier.value}) requested")
        return POLL

    # -- telemetry --------------------------------------------------------------------------------

    def _traced(self, rec: ControllerRecord, op_id: str) -> bool:
        """Mark ``op_id``'s spans as emitted; False if they already were (each is emitted once: the
        mark goes out with the status write that follows)."""
        if op_id in rec.traced:
            return False
        rec.traced = [*rec.traced, op_id][-8:]
        return True

    def _close_capture(self, ws: WorkerSnapshot, rec: ControllerRecord, now: datetime) -> bool:
        """Once the agent has finished the capture this quiesce led to: the controller's quiesce
        spans, the trace's root span (quiesce start -> captured) and the capture's metrics."""
        q, cap = rec.quiesce, ws.status.last_capture
        if q is None or cap is None or cap.finished is None or cap.started < q.started or not self._traced(rec, q.id):
            return False
        tp = q.trace_context
        attrs = {"dynsnap.pod": ws.spec.pod_name, "dynsnap.namespace": ws.metadata.namespace or "",
                 "dynsnap.tier": cap.tier.value}
        try:
            tracing.emit_operation(tp, "controller.quiesce", q.started, [(s.name, s.seconds) for s in q.steps],
                                   attributes=attrs)
            if tp:
                tracing.emit_root(tp, "dynsnap.capture", started=q.started, finished=cap.finished, attributes=attrs,
                                  ok=bool(cap.ok), error=cap.error.message if cap.error else None)
        except Exception:
            log.exception("capture spans not emitted")
        if self.metrics is not None:
            self.metrics.operation_finished("capture", cap.tier.value, ok=bool(cap.ok),
                                            seconds=(cap.finished - q.started).total_seconds())
        return True

    def _close_wake(self, ws: WorkerSnapshot, rec: ControllerRecord, v: Verification) -> None:
        """A verification ended: its spans and the wake's root span (wake request -> verified or
        failed) in the wake's trace, and the metrics."""
        finished = v.finished or utcnow()
        result = "verified" if v.ok else (v.reason.value if v.reason else "failed")
        if self.metrics is not None:
            self.metrics.observe_verify(result, (finished - v.started).total_seconds())
        w = rec.wake
        if w is None or not self._traced(rec, w.id):
            return
        attrs = {"dynsnap.pod": ws.spec.pod_name, "dynsnap.namespace": ws.metadata.namespace or "",
                 "dynsnap.tier": w.tier.value, "dynsnap.verify.result": result}
        try:
            tracing.emit_operation(w.trace_context, "controller.verify", v.started,
                                   [(s.name, s.seconds) for s in v.steps], attributes=attrs, ok=bool(v.ok),
                                   error=None if v.ok else v.message)
            if w.trace_context:
                tracing.emit_root(w.trace_context, "dynsnap.wake", started=w.started, finished=finished,
                                  attributes=attrs, ok=bool(v.ok), error=None if v.ok else v.message)
        except Exception:
            log.exception("wake spans not emitted")
        w.finished, w.ok = finished, bool(v.ok)
        if self.metrics is not None:
            self.metrics.operation_finished("wake", w.tier.value, ok=bool(v.ok),
                                            seconds=(finished - w.started).total_seconds())

    @staticmethod
    def _step(q: OperationRecord, name: str, start: datetime, now: datetime) -> None:
        if any(s.name == name for s in q.steps):
            return
        done = sum(s.seconds for s in q.steps)
        q.steps.append(StepTiming(name=name, seconds=max((now - start).total_seconds() - done, 0.0)))

    async def _still_routed(self, pod: Obj, rec: ControllerRecord) -> bool:
        """Whether the frontend still routes to the worker: a pinned one-token request it accepts
        says yes; refused (400 unknown instance, 500/503) says no. No frontend: nothing routes."""
        ns = pod["metadata"]["namespace"]
        dgd = F.labels(pod)[P.LABEL_DGD_NAME]
        url = F.frontend_url(self.stores.pods, ns, dgd)
        if url is None:
            return False
        wid, pid, _ = self._pins(pod)
        if wid is None and pid is None:
            return False
        model = await self._model(url, f"{ns}/{dgd}")
        if model is None:
            return False
        role = F.role_of(pod)
        a = await self.frontend.pinned(url, model, worker_id=wid if role != F.Role.PREFILL else None,
                                       prefill_id=pid, max_tokens=1)
        return a.ok

    # -- creation, replacement, policy ------------------------------------------------------------

    async def _create(self, pod: Obj, policy: Policy) -> float | None:
        node = (pod.get("spec") or {}).get("nodeName")
        if not node:
            return None  # not scheduled: the pod's next change brings it back
        meta = pod["metadata"]
        body = {"apiVersion": f"{P.DYNSNAP_GROUP}/{P.WS_VERSION}", "kind": P.WS_KIND,
                # The graph and component labels let `dynsnap status` and selectors find a worker's
                # snapshots without reading its pod.
                "metadata": {"name": meta["name"], "namespace": meta["namespace"],
                             "labels": {P.LABEL_NODE: node, P.LABEL_DGD_NAME: F.labels(pod)[P.LABEL_DGD_NAME],
                                        P.LABEL_COMPONENT: F.component_of(pod) or ""},
                             "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": meta["name"],
                                                  "uid": meta["uid"], "blockOwnerDeletion": False}]},
                "spec": {"podName": meta["name"], "podUID": meta["uid"], "container": P.DEFAULT_CONTAINER,
                         "tier": policy.tier.value, "desiredState": DesiredState.ACTIVE.value}}
        try:
            await self.kube.create(R.WORKER_SNAPSHOTS, body, namespace=meta["namespace"])
        except Conflict:
            return POLL  # exists already (our informer lags): look again
        return None

    async def _replaced(self, pod: Obj, ws: WorkerSnapshot) -> float | None:
        """A WorkerSnapshot for an earlier pod of this name: never acted on for the new one; delete it
        (UID precondition: only that object) and start afresh."""
        with contextlib.suppress(NotFound, Conflict):
            await self.kube.delete(R.WORKER_SNAPSHOTS, ws.metadata.name, namespace=ws.metadata.namespace,
                                   uid=ws.metadata.uid)
        await self._say(pod, "Normal", Reason.POD_REPLACED,
                        f"pod recreated (UID {F.pod_uid(pod)}, was {ws.spec.pod_uid}): the old capture is never "
                        "restored into it; a new WorkerSnapshot follows")
        return POLL

    async def _serve_unmanaged(self, pod: Obj) -> float | None:
        """A gated pod of a component that is not opted in: let it serve (a gate nobody sets is
        False forever, and the pod never Ready)."""
        if F.pod_condition(pod, P.CONDITION_SERVING) != "True":
            await self._gate(pod, True)
        return None

    def _policy_condition_ok(self, ws: WorkerSnapshot) -> bool:
        c = ws.condition(ConditionType.POLICY)
        return c is not None and c.status == "True"

    async def _finish_return(self, pod: Obj, ws: WorkerSnapshot | None) -> float | None:
        """While the policy does not parse nothing new is decided, but a worker on its way back to
        serving gets there: a quiesce under way is called off, a woken (or recalled) worker is verified
        and its gate set. Left alone, a typo would keep it out of serving with Active wanted for as long
        as it stands (the quiesce timeout is on the policy's path). Defaults stand in for the policy it
        cannot read, and a failed verification deletes nothing (the user's on-failed-wake is unreadable)."""
        if ws is None or ws.spec.pod_uid != F.pod_uid(pod) or ws.spec.desired_state != DesiredState.ACTIVE:
            return None
        phase = F.phase_of(pod, ws, F.endpoint_ready(self.stores.slices, pod))
        if phase not in (Phase.QUIESCING, Phase.STARTING):
            return None
        why = "the policy does not parse; the return to serving under way ends"
        return await self._awake(pod, ws, Policy(on_failed_wake="none"), phase, Decision(Want.AWAKE, why))

    async def _bad_policy(self, dgd: Obj, component: str, ws: WorkerSnapshot | None, parsed: ParsedPolicy
                          ) -> float | None:
        msg = (f"component {component}: {parsed.message()}; nothing new is decided until it is fixed (a return "
               "to serving under way still ends)")
        meta = dgd["metadata"]
        await self._say(dgd, "Warning", Reason.INVALID_POLICY, msg,
                        subject=f"policy/{meta.get('namespace')}/{meta['name']}/{component}")
        if ws is not None:
            c = ws.condition(ConditionType.POLICY)
            if c is None or c.status != "False" or c.message != msg:
                await self._write(ws, ws.status.controller or ControllerRecord(), policy_ok=False, policy_msg=msg)
        return None

    # -- writes -----------------------------------------------------------------------------------

    async def _gate(self, pod: Obj, value: bool) -> None:
        meta = pod["metadata"]
        await self.kube.apply(R.PODS, {"metadata": {"name": meta["name"], "namespace": meta["namespace"]},
                                       "status": {"conditions": [{"type": P.CONDITION_SERVING,
                                                                  "status": "True" if value else "False"}]}},
                              subresource="status", field_manager=P.FIELD_MANAGER)

    async def _apply_spec(self, ws: WorkerSnapshot, *, desired: DesiredState | None = None, tier: P.Tier | None = None,
                          traceparent: str | None = None) -> None:
        # A JSON merge patch: the controller may have created it with POST, and a person may have
        # edited the spec; an apply would fight them for fields. Only these fields change.
        patch: Obj = {"spec": {"tier": (tier or ws.spec.tier).value,
                               "desiredState": (desired or ws.spec.desired_state).value}}
        if traceparent:
            patch["metadata"] = {"annotations": {P.ANN_TRACEPARENT: traceparent}}
        try:
            written = await self.kube.merge_patch(R.WORKER_SNAPSHOTS, ws.metadata.name, patch,
                                                  namespace=ws.metadata.namespace)
        except NotFound:
            return
        # Read our own write, as _write does: a reconcile before the watch brings it back must not
        # see the old desired state and ask again (a second wake with a new trace, say).
        self.stores.wss.upsert(strip_managed_fields(written))

    async def _write(self, ws: WorkerSnapshot, rec: ControllerRecord, *,
                     verified: tuple[bool | None, Reason, str] | None = None, policy_ok: bool | None = None,
                     policy_msg: str = "") -> None:
        """The controller's whole part of the status, by server-side apply (what it stops sending
        would be dropped, so it always sends all of it). ``policy_ok`` None: PolicyValid as it stands
        (True when unset), so a write while the policy does not parse does not undo its verdict."""
        gen = ws.metadata.generation
        conds = [c for c in ws.status.conditions if c.type in P.CONTROLLER_CONDITIONS]
        if verified is not None:
            conds = set_condition(conds, ConditionType.VERIFIED, verified[0], verified[1], verified[2], generation=gen)
        invalid = next((c for c in conds if c.type == ConditionType.POLICY and c.status == "False"), None)
        if policy_ok is not None or invalid is None:
            ok = policy_ok is not False
            conds = set_condition(conds, ConditionType.POLICY, ok, Reason.POLICY_VALID if ok else Reason.INVALID_POLICY,
                                  policy_msg or "dynsnap.io/ annotations parse", generation=gen)
        status = {"controller": rec.wire(), "conditions": [c.wire() for c in conds]}
        try:
            written = await self.kube.apply(
                R.WORKER_SNAPSHOTS, {"metadata": {"name": ws.metadata.name, "namespace": ws.metadata.namespace},
                                     "status": status},
                subresource="status", field_manager=P.FIELD_MANAGER, force=True)
        except NotFound:
            return
        # Read our own write: the next reconcile must not act on stale status (stored as the informer stores it).
        self.stores.wss.upsert(strip_managed_fields(written))

    async def _say(self, regarding: Obj, kind: str, reason: Reason, note: str, *, subject: str | None = None) -> None:
        """An Event, once per distinct (subject, reason, note): a level-triggered loop would repeat it."""
        if self.events is None:
            return
        subj = subject or f"{regarding['metadata'].get('namespace')}/{regarding['metadata']['name']}/{reason.value}"
        if self._reported.get(subj) == note:
            return
        self._reported[subj] = note
        await self.events.record(regarding, type=kind, reason=reason.value, action=reason.value, note=note)

