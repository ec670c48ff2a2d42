"""The node agent (``dynsnap agent``): watches its node's WorkerSnapshots and pods and drives each
worker towards its desired state, one step per reconcile, level-triggered from the stores.

Layer: ``dynsnap.agent``. A reconcile of ``namespace/name``:

1. reads the WorkerSnapshot and its pod from the informers' stores;
2. refuses (condition ``Accepted=False`` with a reason, nothing touched) a pod that is missing,
   has another UID than the spec, runs on another node, did not opt in (no ``dynsnap.io/serving``
   readiness gate), does not run under dynsnap-entrypoint, or whose container shows the agent an
   unsafe path or an unusable control file (dynsnap/agent/container.py, the trust boundary);
3. observes the worker on the node (executor), plans one step towards the wanted state, runs it;
4. writes status (server-side apply under its own field manager): conditions, observed state,
   the capture or wake record with this step's duration, the last error; emits an Event; once a
   capture or wake is recorded finished, emits its steps as spans of the trace the WorkerSnapshot's
   ``dynsnap.io/traceparent`` names (``traceContext`` in the record) and counts it in the metrics;
5. returns when to look again: at once while a capture or wake goes on, after the backoff after
   a failure (during which the worker is rolled back to active), after the scrape interval while
   active (idle facts), never while asleep and settled.

A failed capture is never left half-done: the failure counts (``consecutiveFailures``), and
until the backoff has passed the wanted state is Active, so the next steps roll the worker back.
On start the agent relists and reconciles everything, so whatever an earlier agent left (staging
directories, a helper still running, an entrypoint mid-request) is finished or rolled back.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic import ValidationError

from dynsnap.agent import idle as I
from dynsnap.agent import worker as W
from dynsnap.agent.container import ContainerRefused
from dynsnap.agent.executor import Executor, Observation, StepFailure, StepResult, Subject
from dynsnap.agent.images import new_capture_id
from dynsnap.agent.plan import CAPTURE_STEPS, WAKE_STEPS, Step
from dynsnap.agent.settings import AgentSettings
from dynsnap.k8s.client import Kube, Obj
from dynsnap.k8s.errors import ApiError, NotFound
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.models.ids import PodUID
from dynsnap.models.protocol import ConditionType as CT
from dynsnap.models.protocol import DesiredState, ObservedState, Reason, Tier
from dynsnap.models.workersnapshot import (
    ErrorRecord,
    GpuMemory,
    IdleFacts,
    ImageRef,
    OperationRecord,
    PidRecord,
    StepTiming,
    WorkerSnapshot,
    WorkerSnapshotStatus,
    set_condition,
    utcnow,
)
from dynsnap.runtime.workqueue import WorkQueue, run_workers
from dynsnap.telemetry import tracing
from dynsnap.telemetry.metrics import Metrics

log = logging.getLogger(__name__)

FINAL_STEPS = {Step.SETTLE_SUSPENDED: ObservedState.SUSPENDED, Step.SETTLE_SNAPSHOTTED: ObservedState.SUSPENDED}


def _open(rec: OperationRecord | None) -> bool:
    return rec is not None and rec.finished is None


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


@dataclass
class Verdict:
    """Whether a WorkerSnapshot may be acted on; ``reason`` names why not."""

    ok: bool
    reason: Reason
    message: str


def admit(ws: WorkerSnapshot, pod: Obj | None, *, node: str) -> Verdict:
    """The checks before the agent touches anything (pure)."""
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
    return Verdict(True, Reason.ACCEPTED, "")


@dataclass
class NodeAgent:
    kube: Kube
    settings: AgentSettings
    executor: Executor
    events: Any = None  # dynsnap.k8s.events.EventRecorder (optional: Events are best effort)
    queue: WorkQueue[str] = field(default_factory=WorkQueue)
    ws_informer: Any = None
    pod_informer: Any = None
    # key -> the object the server returned for our last status write, until the informer shows it
    _written: dict[str, Obj] = field(default_factory=dict)
    # key -> a status a step produced that could not be written (API server away): the next
    # reconcile builds on it and writes it, so no step's record is lost to an outage
    _unwritten: dict[str, WorkerSnapshotStatus] = field(default_factory=dict)
    # key -> when this agent began waiting for a helper an earlier agent left running (monotonic)
    _waiting: dict[str, float] = field(default_factory=dict)
    # served on the health port's /metrics (main.py passes its render to the health server)
    metrics: Metrics = field(default_factory=Metrics)
    # traceparents this agent made for operations no controller traced: their root span is ours to emit
    _own_traces: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.metrics.add_refresh(self._refresh_metrics)
        if self.kube.on_request is None:  # this process's client: its requests are the agent's
            self.kube.on_request = self.metrics.api_request

    # -- stores -------------------------------------------------------------------------------

    def _ws(self, key: str) -> Obj | None:
        """The WorkerSnapshot as of the agent's own last write. One step follows another at once, and
        the informer's store may not have seen the status the previous step wrote yet; reconciling
        from that older copy would redo a step or drop its record. The watch delivers an object's
        changes in order, so until the store shows our write, nothing newer than it exists."""
        ns, name = key.split("/", 1)
        obj: Obj | None = self.ws_informer.store.get(ns, name)
        written = self._written.get(key)
        if obj is None or written is None:
            return obj
        if obj["metadata"].get("uid") != written["metadata"].get("uid"):
            self._written.pop(key, None)  # deleted and recreated: another object
            return obj
        return written

    def _caught_up(self, key: str, obj: Obj) -> None:
        """The informer delivered ``obj``: drop our copy once the store has our write or something newer."""
        written = self._written.get(key)
        if written is None:
            return
        have, mine = obj["metadata"].get("resourceVersion", ""), written["metadata"].get("resourceVersion", "")
        # Equal: the event of our own write. Greater: a relist skipped it (resourceVersions are etcd
        # revisions; where one is not a number, any event is taken as newer, as before this cache).
        if have == mine or not (have.isdigit() and mine.isdigit()) or int(have) > int(mine):
            self._written.pop(key, None)

    def _pod(self, ns: str, name: str) -> Obj | None:
        obj: Obj | None = self.pod_informer.store.get(ns, name)
        return obj

    async def _pod_off_node(self, ns: str, name: str) -> Obj | None:
        """The pod as the API server has it, for one this node's store lacks. The store holds only the
        pods bound here, so without this a pod on another node would be refused as missing
        (PodNotFound, "does not exist") instead of as WrongNode."""
        try:
            obj: Obj = await self.kube.get(R.PODS, name, namespace=ns)
        except NotFound:
            return None
        return obj

    def on_ws(self, _type: str, obj: Obj) -> None:
        key = f"{obj['metadata']['namespace']}/{obj['metadata']['name']}"
        self._caught_up(key, obj)
        self.queue.add(key)

    def on_pod(self, _type: str, obj: Obj) -> None:
        # A WorkerSnapshot is named after its pod.
        key = f"{obj['metadata']['namespace']}/{obj['metadata']['name']}"
        if self.ws_informer.store.get(obj["metadata"]["namespace"], obj["metadata"]["name"]) is not None:
            self.queue.add(key)

    # -- reconcile ------------------------------------------------------------------------------

    async def reconcile(self, key: str) -> float | None:
        raw = self._ws(key)
        if raw is None:
            return None
        try:
            ws = WorkerSnapshot.model_validate(raw)
        except ValidationError as e:
            # The API server validates the spec; this only catches a CRD older than this agent.
            log.warning("%s: spec unreadable: %s", key, e)
            return None
        pending = self._unwritten.get(key)
        if pending is not None:
            ws = ws.model_copy(update={"status": pending})
        pod = self._pod(ws.metadata.namespace or "", ws.spec.pod_name)
        if pod is None:
            pod = await self._pod_off_node(ws.metadata.namespace or "", ws.spec.pod_name)
        verdict = admit(ws, pod, node=self.settings.node_name)
        if not verdict.ok:
            await self._write(ws, self._refused(ws, verdict))
            return None
        assert pod is not None
        subject = Subject(namespace=ws.metadata.namespace or "", pod=ws.spec.pod_name, uid=PodUID(ws.spec.pod_uid),
                          container_id=container_id(pod, ws.spec.container))
        try:
            obs = await self.executor.observe(subject)
        except W.WorkerNotFound as e:
            await self._write(ws, self._refused(ws, Verdict(False, Reason.POD_NOT_FOUND, str(e)), accepted=None))
            return 5.0  # the pod's processes may not be up yet
        except W.NotUnderEntrypoint as e:
            await self._write(ws, self._refused(ws, Verdict(False, Reason.NOT_UNDER_ENTRYPOINT, str(e))))
            return None
        except ContainerRefused as e:  # an unsafe path or an unusable control file inside the container
            await self._write(ws, self._refused(ws, Verdict(False, e.reason, str(e))))
            return None
        want, backoff_left = self._effective(ws)
        tier = self._tier(ws, obs)
        step = self.executor.next_step(obs, want=want, tier=tier)
        status = ws.status.model_copy(deep=True)
        status = self._accepted(ws, status)
        waited = self._waiting.pop(key, None) if step != Step.WAIT_HELPER else None
        if waited is not None:  # the helper this agent waited for is gone
            self._end_wait(status, time.monotonic() - waited)
        if step == Step.NONE:
            status = self._settled(ws, status, obs, want)
            asleep = self._close_settled(status, obs)
            if asleep is not None:
                await self._finish(ws, status, asleep=asleep)
            again = await self._idle(ws, status, pod, obs)
            await self._write(ws, status)
            if backoff_left is not None:
                return backoff_left
            return again
        wait = self._retry_wait(ws, step)
        if wait is not None:
            return wait
        return await self._do(ws, status, subject, obs, step, tier=tier, want=want, pod=pod)

    def _tier(self, ws: WorkerSnapshot, obs: Observation) -> Tier:
        # A wake follows the tier of the capture it wakes from, not a tier changed meanwhile.
        return ws.spec.tier

    def _effective(self, ws: WorkerSnapshot) -> tuple[DesiredState, float | None]:
        """The wanted state now, and the seconds of failure backoff left. After a failed capture the
        worker is rolled back to Active and stays so until the backoff has passed."""
        n = ws.status.consecutive_failures or 0
        err = ws.status.last_error
        if ws.spec.desired_state != DesiredState.SUSPENDED or n == 0 or err is None or self._new_intent(ws):
            return ws.spec.desired_state, None
        left = (err.at + timedelta(seconds=self._backoff(n)) - utcnow()).total_seconds()
        if left > 0:
            return DesiredState.ACTIVE, left
        return ws.spec.desired_state, None

    async def _gate(self, pod: Obj) -> Any:
        async def gate(w: W.WorkerProcs) -> str | None:
            current = self._pod(pod["metadata"]["namespace"], pod["metadata"]["name"]) or pod
            serving = pod_serving_gate(current)
            if serving != "False":
                return (f"the pod's {P.CONDITION_SERVING} condition is {serving or 'unset'}, not False: the "
                        "controller quiesces a worker before it is captured")
            ip = (current.get("status") or {}).get("podIP")
            try:
                sample = await I.scrape(f"http://{ip}:{self.settings.metrics_port}/metrics")
            except I.MetricsUnavailable as e:
                return f"cannot tell the worker has no requests in flight: {e}"
            if sample.inflight > 0:
                return f"{sample.inflight} requests in flight"
            return None
        return gate

    async def _do(self, ws: WorkerSnapshot, status: WorkerSnapshotStatus, subject: Subject, obs: Observation,
                  step: Step, *, tier: Tier, want: DesiredState, pod: Obj) -> float | None:
        # The trace this capture or wake joins is the one asked for when it starts (a later request
        # brings a new traceparent, which must not take over this operation's spans).
        trace = traceparent_of(ws)
        if step == Step.QUIESCE and obs.worker.state == P.EntrypointState.ACTIVE:
            status.last_capture = OperationRecord(id=new_capture_id(), tier=tier, started=utcnow(),
                                                  trace_context=trace)
            status.image = None
        elif step == Step.WAKE:
            status.last_wake = OperationRecord(id=new_capture_id(), tier=tier, started=utcnow(), trace_context=trace)
        else:
            self._adopt(status, obs, step, tier=tier, want=want, trace_context=trace)
        capture_id = status.last_capture.id if status.last_capture and _open(status.last_capture) else None
        if step in (Step.WAIT_HELPER,):
            status.state = obs.state
        if step == Step.GPU_ROLLBACK and status.last_error is None and (
                want == DesiredState.SUSPENDED or obs.worker.state == P.EntrypointState.ACTIVE
                or any(s in ("locked", "failed") for s in obs.gpu_states.values())):
            # No failure was recorded, yet GPU processes are mid-way with no helper running for them: the
            # agent (and its helper) died during a save. Named, not silently redone.
            stuck = {str(p): s for p, s in obs.gpu_states.items() if s != "running"}
            why = (f"GPU processes found {stuck} with no helper running for them: a save was interrupted (the "
                   "agent or its dynsnap-cuda died mid-way); rolling them back to running")
            status.conditions = set_condition(status.conditions, CT.DEGRADED, True, Reason.INTERRUPTED, why,
                                              generation=ws.metadata.generation)
            await self._event(ws, "Warning", Reason.INTERRUPTED, why)
        try:
            result = await self.executor.run_step(subject, obs, step, tier=tier, gate=await self._gate(pod),
                                                  capture_id=capture_id)
        except StepFailure as f:
            return await self._failed(ws, status, step, f)
        except Exception as e:  # a bug or an unexpected OS error: reported, never swallowed
            log.exception("%s: step %s", ws.key, step)
            return await self._failed(ws, status, step, StepFailure(Reason.INTERRUPTED, f"{type(e).__name__}: {e}"))
        if step != Step.WAIT_HELPER or ws.key not in self._waiting:
            # One entry for the whole wait: an entry per look would change status on every look, and
            # each write would start the next reconcile at once (a status write storm while CRIU runs).
            self._record(status, step, result)
        if step == Step.WAIT_HELPER:
            self._waiting.setdefault(ws.key, time.monotonic() - result.seconds)
        if step in FINAL_STEPS or (step == Step.SETTLE_ACTIVE and ws.spec.desired_state == DesiredState.ACTIVE):
            # A settle-active that ends the rollback of a failed capture (Suspended still wanted) is no
            # success: the failure stays on record, so the backoff holds and grows. Cleared there, the
            # capture was retried at once, in a loop without backoff while the fault lasted.
            await self._finish(ws, status, asleep=step in FINAL_STEPS)
        elif step in (Step.QUIESCE, Step.WAKE):
            await self._event(ws, "Normal", Reason.CAPTURING if step == Step.QUIESCE else Reason.WAKING,
                              f"{step.value} ({tier.value})")
        after = await self._reobserve(subject)
        status.state = after.state if after is not None else status.state
        status = self._progressing(ws, status, step)
        await self._write(ws, status)
        return 0.0 if step != Step.WAIT_HELPER else 1.0

    async def _finish(self, ws: WorkerSnapshot, status: WorkerSnapshotStatus, *, asleep: bool) -> None:
        """A capture (``asleep``) or a wake reached its state: failures are behind it. Degraded says
        what was recovered from, if anything was."""
        prior = next((c for c in status.conditions if c.type == CT.DEGRADED.value and c.status == "True"), None)
        note = f"recovered from {prior.reason}: {prior.message}" if prior is not None else ""
        status.consecutive_failures = 0
        status.last_error = None
        status.conditions = set_condition(status.conditions, CT.DEGRADED, False, Reason.RECOVERED, note,
                                          generation=ws.metadata.generation)
        await self._event(ws, "Normal", Reason.SUSPENDED if asleep else Reason.ACTIVE,
                          self._done_note(status, asleep=asleep))

    def _done_note(self, status: WorkerSnapshotStatus, *, asleep: bool) -> str:
        rec = status.last_capture if asleep else status.last_wake
        if rec is None:
            return "asleep" if asleep else "active"
        total = sum(s.seconds for s in rec.steps)
        steps = ", ".join(f"{s.name} {s.seconds:.2f}s" for s in rec.steps)
        return f"{'captured' if asleep else 'woken'} in {total:.2f}s ({steps})"

    @staticmethod
    def _adopt(status: WorkerSnapshotStatus, obs: Observation, step: Step, *, tier: Tier,
               want: DesiredState, trace_context: str | None = None) -> None:
        """Open a record for a capture or wake that an agent which died started. Quiesce and wake open
        theirs, but status is written only after the entrypoint acknowledged them: an agent killed in
        between leaves the operation under way and no record of it. This agent's steps then go into a
        record of their own, so their outcome is reported, not lost."""
        if _open(status.last_capture) or _open(status.last_wake):
            return
        if step in CAPTURE_STEPS and want == DesiredState.SUSPENDED:
            status.last_capture = OperationRecord(id=new_capture_id(), tier=tier, started=utcnow(),
                                                  trace_context=trace_context)
            status.image = None
        elif step in WAKE_STEPS and obs.worker.state == P.EntrypointState.RESTORING:
            status.last_wake = OperationRecord(id=new_capture_id(), tier=tier, started=utcnow(),
                                               trace_context=trace_context)

    @staticmethod
    def _close_settled(status: WorkerSnapshotStatus, obs: Observation) -> bool | None:
        """Close the open record of an operation the worker has completed with nothing left to do: the
        entrypoint applied the last request (suspended, snapshotted, active) of an agent that died
        before recording it. Returns whether the closed one was a capture; None when none was open."""
        if obs.state == ObservedState.SUSPENDED and _open(status.last_capture) and not _open(status.last_wake):
            rec, asleep = status.last_capture, True
        elif obs.state == ObservedState.ACTIVE and _open(status.last_wake):
            rec, asleep = status.last_wake, False
        else:
            return None
        assert rec is not None
        rec.finished = utcnow()
        rec.ok = True
        return asleep

    @staticmethod
    def _end_wait(status: WorkerSnapshotStatus, seconds: float) -> None:
        """The wait for a helper is over: its one entry in the open record gets the time it took."""
        for rec in (status.last_wake, status.last_capture):
            if _open(rec) and rec is not None and rec.steps and rec.steps[-1].name == Step.WAIT_HELPER.value:
                rec.steps[-1].seconds = round(max(seconds, 0.0), 4)
                return

    async def _reobserve(self, subject: Subject) -> Observation | None:
        try:
            return await self.executor.observe(subject)
        except (W.WorkerNotFound, W.NotUnderEntrypoint):
            return None

    def _record(self, status: WorkerSnapshotStatus, step: Step, result: StepResult) -> None:
        rec = status.last_wake if (status.last_wake and status.last_wake.finished is None) else None
        if rec is None and status.last_capture and status.last_capture.finished is None:
            rec = status.last_capture
        if rec is None:
            return
        rec.steps.append(StepTiming(name=step.value, seconds=round(result.seconds, 4)))
        info = result.info
        if "pids" in info:
            rec.pids = [PidRecord(host=p["host"], ns=p["ns"], gpu=p["gpu"]) for p in info["pids"]]
        if "gpus" in info:
            rec.gpus = [GpuMemory(uuid=g["uuid"], free_before=g.get("freeBefore"), free_after=g.get("freeAfter"))
                        for g in info["gpus"]]
        if "imageBytes" in info:
            rec.image_bytes = int(info["imageBytes"])
        if "image" in info:
            rec.image = ImageRef(**info["image"])
            status.image = rec.image
        if step in FINAL_STEPS or step == Step.SETTLE_ACTIVE:
            rec.finished = utcnow()
            rec.ok = True
        if step == Step.CLEANUP:
            status.image = None

    async def _failed(self, ws: WorkerSnapshot, status: WorkerSnapshotStatus, step: Step, f: StepFailure
                      ) -> float | None:
        now = utcnow()
        err = ErrorRecord(reason=f.reason, message=f.message[:4000], step=step.value, at=now,
                          generation=ws.metadata.generation)
        status.last_error = err
        status.consecutive_failures = (status.consecutive_failures or 0) + 1
        for rec in (status.last_capture, status.last_wake):
            if rec is not None and rec.finished is None:
                rec.steps.append(StepTiming(name=step.value, seconds=0.0))
                rec.error = err
                if step in CAPTURE_STEPS or f.changed is False:
                    rec.finished = now
                    rec.ok = False
        status.conditions = set_condition(status.conditions, CT.DEGRADED, True, f.reason, f.message,
                                          generation=ws.metadata.generation)
        await self._event(ws, "Warning", f.reason, f"{step.value}: {f.message}")
        await self._write(ws, status)
        return 0.0 if f.changed else self._backoff(status.consecutive_failures)

    @staticmethod
    def _new_intent(ws: WorkerSnapshot) -> bool:
        """The spec changed since the last failure: a new request is tried at once, not after a backoff."""
        err = ws.status.last_error
        return err is not None and err.generation is not None and err.generation != ws.metadata.generation

    def _backoff(self, failures: int | None) -> float:
        n = min(max(failures or 1, 1), 30)
        return min(self.settings.failure_backoff * 2.0 ** (n - 1), self.settings.failure_backoff_max)

    def _retry_wait(self, ws: WorkerSnapshot, step: Step) -> float | None:
        """Seconds before ``step`` may run again after it failed last (None: go ahead). Our own status
        writes wake the reconcile at once; the backoff is kept here, not by the queue's timing."""
        err = ws.status.last_error
        if err is None or err.step != step.value or not ws.status.consecutive_failures or self._new_intent(ws):
            return None
        left = (err.at + timedelta(seconds=self._backoff(ws.status.consecutive_failures)) - utcnow()).total_seconds()
        return left if left > 0 else None

    # -- status ---------------------------------------------------------------------------------

    def _accepted(self, ws: WorkerSnapshot, status: WorkerSnapshotStatus) -> WorkerSnapshotStatus:
        status.observed_generation = ws.metadata.generation
        status.conditions = set_condition(status.conditions, CT.ACCEPTED, True, Reason.ACCEPTED,
                                          "the pod runs here under dynsnap-entrypoint",
                                          generation=ws.metadata.generation)
        return status

    def _refused(self, ws: WorkerSnapshot, v: Verdict, *, accepted: bool | None = False) -> WorkerSnapshotStatus:
        status = ws.status.model_copy(deep=True)
        status.observed_generation = ws.metadata.generation
        status.state = ObservedState.UNKNOWN
        status.conditions = set_condition(status.conditions, CT.ACCEPTED, accepted, v.reason, v.message,
                                          generation=ws.metadata.generation)
        return status

    def _settled(self, ws: WorkerSnapshot, status: WorkerSnapshotStatus, obs: Observation, want: DesiredState
                 ) -> WorkerSnapshotStatus:
        status.state = obs.state
        asleep = obs.state == ObservedState.SUSPENDED
        reason = (Reason.SNAPSHOTTED if obs.worker.state == P.EntrypointState.SNAPSHOTTED else Reason.SUSPENDED
                  ) if asleep else Reason.ACTIVE
        status.conditions = set_condition(status.conditions, CT.SUSPENDED, asleep, reason,
                                          "asleep: GPU memory freed" if asleep else "serving",
                                          generation=ws.metadata.generation)
        status.conditions = set_condition(status.conditions, CT.PROGRESSING, False, Reason.IDLE, "",
                                          generation=ws.metadata.generation)
        return status

    def _progressing(self, ws: WorkerSnapshot, status: WorkerSnapshotStatus, step: Step) -> WorkerSnapshotStatus:
        reason = Reason.CAPTURING if step in CAPTURE_STEPS else Reason.WAKING
        if step in (Step.GPU_ROLLBACK, Step.GIVE_UP):
            reason = Reason.ROLLING_BACK
        status.conditions = set_condition(status.conditions, CT.PROGRESSING, True, reason, f"last step: {step.value}",
                                          generation=ws.metadata.generation)
        asleep = status.state == ObservedState.SUSPENDED
        status.conditions = set_condition(status.conditions, CT.SUSPENDED, asleep,
                                          Reason.SUSPENDED if asleep else Reason.ACTIVE, "",
                                          generation=ws.metadata.generation)
        return status

    async def _idle(self, ws: WorkerSnapshot, status: WorkerSnapshotStatus, pod: Obj, obs: Observation
                    ) -> float | None:
        if obs.state != ObservedState.ACTIVE:
            return None
        ip = (pod.get("status") or {}).get("podIP")
        if not ip:
            return self.settings.scrape_interval
        try:
            sample = await I.scrape(f"http://{ip}:{self.settings.metrics_port}/metrics")
        except I.MetricsUnavailable as e:
            log.debug("%s: %s", ws.key, e)
            return self.settings.scrape_interval
        facts = I.advance(status.idle, sample, now=utcnow(), granularity=self.settings.activity_granularity)
        if facts is not None:
            status.idle = facts
        return self.settings.scrape_interval

    async def _write(self, ws: WorkerSnapshot, status: WorkerSnapshotStatus) -> None:
        if status == ws.status and ws.key not in self._unwritten:
            return  # nothing changed: no write (a quiet fleet costs the API server nothing)
        ended = self._ended(ws.key, status)
        body = {"metadata": {"name": ws.metadata.name, "namespace": ws.metadata.namespace},
                "status": agent_owned(status)}
        try:
            written = await self.kube.apply(R.WORKER_SNAPSHOTS, body, subresource="status",
                                            field_manager=P.AGENT_FIELD_MANAGER, force=True)
        except ApiError as e:
            if e.status == 404:
                self._unwritten.pop(ws.key, None)
                return  # deleted meanwhile (its pod went): nothing left to report on
            self._unwritten[ws.key] = status
            raise
        except Exception:
            self._unwritten[ws.key] = status  # the step happened; its record goes out with the next write
            raise
        self._unwritten.pop(ws.key, None)
        self._written[ws.key] = written
        for operation, rec in ended:
            self._report(ws, operation, rec)

    def _ended(self, key: str, status: WorkerSnapshotStatus) -> list[tuple[str, OperationRecord]]:
        """The captures and wakes this write records as finished that the API server does not yet hold
        finished: reported (spans, metrics) once that write succeeds, so each is reported once, also
        across agent restarts (a record the server holds finished was reported by whoever wrote it).
        One no controller traced gets a trace of its own, recorded with it."""
        prior = (self._ws(key) or {}).get("status") or {}
        out = []
        for operation, rec, was in (("capture", status.last_capture, prior.get("lastCapture")),
                                    ("wake", status.last_wake, prior.get("lastWake"))):
            if rec is None or rec.finished is None:
                continue
            if isinstance(was, dict) and was.get("id") == rec.id and was.get("finished"):
                continue
            if rec.trace_context is None and tracing.current().enabled:
                rec.trace_context = tracing.new_traceparent()
                self._own_traces.add(rec.trace_context)
            out.append((operation, rec))
        return out

    def _report(self, ws: WorkerSnapshot, operation: str, rec: OperationRecord) -> None:
        """A finished capture or wake: its steps as spans, its outcome and duration in the metrics.
        Telemetry never fails a reconcile."""
        err = rec.error
        attrs: dict[str, str | int | float | bool] = {
            "k8s.namespace.name": ws.metadata.namespace or "", "k8s.pod.name": ws.spec.pod_name,
            "k8s.pod.uid": ws.spec.pod_uid, "k8s.node.name": self.settings.node_name,
            "dynsnap.tier": rec.tier.value, "dynsnap.operation.id": rec.id, "dynsnap.ok": bool(rec.ok)}
        if err is not None:
            attrs["dynsnap.error.reason"] = err.reason.value
        error = f"{err.reason.value}: {err.message}" if err is not None else None
        try:
            if rec.trace_context in self._own_traces:
                self._own_traces.discard(rec.trace_context)
                assert rec.trace_context is not None and rec.finished is not None
                tracing.emit_root(rec.trace_context, operation, started=rec.started, finished=rec.finished,
                                  attributes=attrs, ok=bool(rec.ok), error=error)
            tracing.emit_operation(rec.trace_context, operation, rec.started, [(s.name, s.seconds) for s in rec.steps],
                                   attributes=attrs, ok=bool(rec.ok), error=error,
                                   failed_step=err.step if err is not None else None)
        except Exception:
            log.exception("%s: emitting the spans of %s %s", ws.key, operation, rec.id)
        seconds = (rec.finished - rec.started).total_seconds() if rec.finished is not None else None
        self.metrics.operation_finished("capture" if operation == "capture" else "wake", rec.tier.value,
                                        ok=bool(rec.ok), seconds=seconds)

    def _refresh_metrics(self) -> None:
        """The gauges that describe this node now: queue depth, workers by state, GPU memory freed."""
        self.metrics.set_queue_depth("agent", self.queue.depth)
        if self.ws_informer is None:
            return
        counts: dict[str, int] = {}
        freed = 0
        for obj in self.ws_informer.store.list():
            key = f"{obj['metadata'].get('namespace')}/{obj['metadata'].get('name')}"
            st = (self._ws(key) or obj).get("status") or {}
            state = str(st.get("state") or ObservedState.UNKNOWN.value)
            counts[state] = counts.get(state, 0) + 1
            if state == ObservedState.SUSPENDED.value:
                freed += gpu_bytes_freed(st.get("lastCapture"))
        self.metrics.set_workers(counts)
        self.metrics.set_gpu_bytes_freed(freed)

    async def _event(self, ws: WorkerSnapshot, kind: str, reason: Reason, note: str) -> None:
        if self.events is None:
            return
        await self.events.record(ws_object(ws), type=kind, reason=reason.value, action=reason.value, note=note)

    # -- housekeeping -------------------------------------------------------------------------

    def gc_images(self) -> list[str]:
        """Delete the images of pods that no longer exist on this node."""
        live = {PodUID(p["metadata"]["uid"]) for p in self.pod_informer.store.list()}
        return [str(p) for p in self.executor.images.gc(live)]

    async def run(self) -> None:
        await run_workers(self.queue, self._counted, workers=self.settings.workers, name="agent")

    async def _counted(self, key: str) -> float | None:
        try:
            again = await self.reconcile(key)
        except Exception:
            self.metrics.reconciled("agent", "error")
            raise
        self.metrics.reconciled("agent", "ok")
        return again


def agent_owned(status: WorkerSnapshotStatus) -> Obj:
    """The status fields the agent applies: everything but the controller's record and conditions.
    Sending those back (even unchanged, from a stale read) would take them over under force and
    could undo a verification the controller wrote meanwhile."""
    wire = status.wire()
    wire.pop("controller", None)
    wire["conditions"] = [c for c in wire.get("conditions", []) if c["type"] not in P.CONTROLLER_CONDITIONS]
    return wire


def traceparent_of(ws: WorkerSnapshot) -> str | None:
    """The W3C traceparent the controller put on the WorkerSnapshot, None when absent or malformed (a
    bad annotation costs the trace, never the operation)."""
    tp = tracing.parse_traceparent(ws.metadata.annotations.get(P.ANN_TRACEPARENT))
    return str(tp) if tp is not None else None


def gpu_bytes_freed(capture: Obj | None) -> int:
    """Bytes of GPU memory a capture freed (free memory after minus before, per GPU), from its record."""
    total = 0
    for g in (capture or {}).get("gpus") or []:
        before, after = g.get("freeBefore"), g.get("freeAfter")
        if isinstance(before, int) and isinstance(after, int) and after > before:
            total += after - before
    return total


def ws_object(ws: WorkerSnapshot) -> Obj:
    """What an Event's ``regarding`` is built from (EventRecorder never raises into a reconcile)."""
    return {"apiVersion": f"{P.DYNSNAP_GROUP}/{P.WS_VERSION}", "kind": P.WS_KIND,
            "metadata": {"name": ws.metadata.name, "namespace": ws.metadata.namespace, "uid": ws.metadata.uid,
                         "resourceVersion": ws.metadata.resource_version}}


def idle_for(facts: IdleFacts | None, now: datetime | None = None) -> float | None:
    if facts is None or facts.idle_since is None:
        return None
    return ((now or datetime.now(UTC)) - facts.idle_since).total_seconds()

