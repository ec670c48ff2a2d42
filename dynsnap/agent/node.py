"""The node agent (``dynsnap agent``): watches its node's WorkerSnapshots and pods and drives each
worker towards its desired state, one step per reconcile, level-triggered from the stores.

Layer: ``dynsnap.agent``. This module is the thin driver; what it decides comes from pure modules
and what it reports from the observation one:

1. read the WorkerSnapshot and its pod from the informers' stores;
2. admission (``admission.py``): a pod that is missing, has another UID than the spec, runs on another
   node or did not opt in is refused (``Accepted=False``, nothing touched), as is one that does not run
   under dynsnap-entrypoint, or whose container shows the agent an unsafe path or an unusable control
   file (the executor's findings on the node; ``container.py`` is the trust boundary);
3. observe the worker on the node and plan one step towards the wanted state (``executor.py``,
   ``plan.py``; the wanted state after a failure from ``attempts.py``), run it;
4. write status (``status.py``, by server-side apply under the agent's field manager): conditions, the
   observed state, the capture or wake record with this step's duration, the last error; an Event;
   once a capture or wake is recorded finished, its spans and metrics (``report.py``);
5. return when to look again: at once while a capture or wake goes on, after the backoff after a
   failure (during which the worker is rolled back to active), after the scrape interval while
   active (idle facts), never while asleep and settled.

A failed capture is never left half-done: the failure counts (``consecutiveFailures``), and until the
backoff has passed the wanted state is Active, so the next steps roll the worker back. On start the
agent relists and reconciles everything, so whatever an earlier agent left (staging directories, a
helper still running, an entrypoint mid-request) is finished or rolled back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from dynsnap.agent import attempts as A
from dynsnap.agent import edge as E
from dynsnap.agent import idle as I
from dynsnap.agent import status as S
from dynsnap.agent import worker as W
from dynsnap.agent.admission import Verdict, admit, container_id
from dynsnap.agent.container import ContainerRefused
from dynsnap.agent.executor import Executor, Observation, StepFailure, Subject
from dynsnap.agent.plan import WAKE_STEPS, Step
from dynsnap.agent.report import Reporter, traceparent_of, ws_object
from dynsnap.agent.serving import serving_gate
from dynsnap.agent.settings import AgentSettings
from dynsnap.k8s.client import Kube, Obj
from dynsnap.k8s.errors import ApiError, NotFound
from dynsnap.k8s.store import older
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.models.ids import PodUID
from dynsnap.models.protocol import DesiredState, ObservedState, Reason, Tier
from dynsnap.models.workersnapshot import WorkerSnapshot, WorkerSnapshotStatus, utcnow
from dynsnap.runtime.workqueue import WorkQueue, run_workers
from dynsnap.telemetry.metrics import Metrics

log = logging.getLogger(__name__)

# A worker refused for what its container holds (an unsafe path, an unusable entrypoint.json) is looked
# at again this often: the container may put it right (its entrypoint rewrites its report at each
# change), and nothing else brings the agent back to a worker whose pod and WorkerSnapshot stay as they
# are. A look reads one bounded file; the status is written only when it changes.
CONTAINER_RELOOK_S = 10.0


def _holds(obj: Obj, written: Obj) -> bool:
    """``obj`` (the informer's copy) holds our write ``written`` or something newer: the same
    resourceVersion (the event of our own write), or a greater one (a later write, or a relist that
    skipped ours; resourceVersions are etcd revisions, compared as dynsnap.k8s.store does)."""
    return obj["metadata"].get("resourceVersion") == written["metadata"].get("resourceVersion") or \
        older(written, obj)


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
    # key -> when a request was seen reaching the worker while it slept routable (wake on request): the
    # reconcile wakes it; dropped once its wake is on record (its trigger says it from then on)
    _requests: dict[str, float] = field(default_factory=dict)
    # key -> the bound (deadline, size) the worker's last metrics answer passed: said once per episode
    _unbounded: dict[str, str] = field(default_factory=dict)
    # Events sent off a loop that must not wait for them (the wake-on-request watch's)
    _background: set[asyncio.Task[None]] = field(default_factory=set)
    # served on the health port's /metrics (main.py passes its render to the health server)
    metrics: Metrics = field(default_factory=Metrics)
    reporter: Reporter = field(init=False)

    def __post_init__(self) -> None:
        self.reporter = Reporter(self.settings.node_name, self.metrics)
        self.metrics.add_refresh(self._refresh_metrics)
        if self.kube.on_request is None:  # this process's client: its requests are the agent's
            self.kube.on_request = self.metrics.api_request

    # -- stores -------------------------------------------------------------------------------

    def _ws(self, key: str) -> Obj | None:
        """The WorkerSnapshot as of the agent's own last write. One step follows another at once, and
        the informer's store may not have seen the status the previous step wrote yet; reconciling
        from that older copy would redo a step or drop its record. The watch delivers an object's
        changes in order, so until the store shows our write, nothing newer than it exists. But the
        watch may deliver our write, and someone's write after it, before our write's answer comes
        back (the controller asking for a wake 0.15 s after the capture's last write did, in CI): the
        store is then newer than that answer and is what counts; kept, the answer hid the controller's
        request until the next event of the object (its wake deadline, 60 s later)."""
        ns, name = key.split("/", 1)
        obj: Obj | None = self.ws_informer.store.get(ns, name)
        written = self._written.get(key)
        if obj is None or written is None:
            return obj
        if obj["metadata"].get("uid") != written["metadata"].get("uid") or _holds(obj, written):
            self._written.pop(key, None)  # deleted and recreated (another object), or the store caught up
            return obj
        return written

    def _caught_up(self, key: str, obj: Obj) -> None:
        """The informer delivered ``obj``: drop our copy once the store has our write or something newer."""
        written = self._written.get(key)
        if written is None:
            return
        have, mine = obj["metadata"].get("resourceVersion", ""), written["metadata"].get("resourceVersion", "")
        # Another object (recreated: a later revision), or a resourceVersion that is not a number: any
        # event is taken as newer, as before this cache.
        if _holds(obj, written) or obj["metadata"].get("uid") != written["metadata"].get("uid") or \
                not (have.isdigit() and mine.isdigit()):
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

    async def _read(self, key: str) -> tuple[WorkerSnapshot, Obj | None] | None:
        """The WorkerSnapshot (with any status not yet written) and its pod; None when there is none."""
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
        ns = ws.metadata.namespace or ""
        pod = self._pod(ns, ws.spec.pod_name) or await self._pod_off_node(ns, ws.spec.pod_name)
        return ws, pod

    async def reconcile(self, key: str) -> float | None:
        read = await self._read(key)
        if read is None:
            self._unbounded.pop(key, None)
            return None
        ws, pod = read
        verdict = admit(ws, pod, node=self.settings.node_name)
        if not verdict.ok:
            await self._write(ws, S.refused(ws, verdict))
            return None
        assert pod is not None
        ip = (pod.get("status") or {}).get("podIP")
        subject = Subject(namespace=ws.metadata.namespace or "", pod=ws.spec.pod_name, uid=PodUID(ws.spec.pod_uid),
                          container_id=container_id(pod, ws.spec.container),
                          system_url=f"http://{ip}:{self.settings.metrics_port}" if ip else None)
        try:
            obs = await self.executor.observe(subject)
        except W.WorkerNotFound as e:
            await self._write(ws, S.refused(ws, Verdict(False, Reason.WORKER_NOT_RUNNING, str(e)), accepted=None))
            return 5.0  # the pod's processes may not be up yet
        except W.NotUnderEntrypoint as e:
            await self._write(ws, S.refused(ws, Verdict(False, Reason.NOT_UNDER_ENTRYPOINT, str(e))))
            return None
        except ContainerRefused as e:  # an unsafe path or an unusable control file inside the container
            await self._write(ws, S.refused(ws, Verdict(False, e.reason, str(e))))
            return CONTAINER_RELOOK_S
        want, backoff_left = A.effective(ws, self.settings, utcnow())
        if want == DesiredState.SUSPENDED and (key in self._requests or S.woken_by_request(ws)):
            want = DesiredState.ACTIVE  # a request reached it asleep routable: awake until the spec says again
        tier = await self._tier(ws, obs, subject)
        step = self.executor.next_step(obs, want=want, tier=tier, routable=ws.spec.routable)
        status = S.accepted(ws, ws.status.model_copy(deep=True))
        waited = self._waiting.pop(key, None) if step != Step.WAIT_HELPER else None
        if waited is not None:  # the helper this agent waited for is gone
            S.end_wait(status, time.monotonic() - waited)
        if step == Step.NONE:
            return await self._settle(ws, status, pod, obs, backoff_left)
        wait = A.retry_wait(ws, step, self.settings, utcnow())
        if wait is not None:
            return wait
        return await self._do(ws, status, subject, obs, step, tier=tier, want=want, pod=pod)

    async def _tier(self, ws: WorkerSnapshot, obs: Observation, subject: Subject) -> Tier:
        """The tier the next step works at. A wake follows the tier of the capture it wakes from (the
        controller does not change the spec's while a worker sleeps); ``auto`` is resolved here: the tier
        the capture under way or asleep picked, else (an active worker asked to sleep) ``engine`` where
        its engine has the sleep routes and ``suspend`` where not."""
        if ws.spec.tier != Tier.AUTO:
            return ws.spec.tier
        cap = ws.status.last_capture
        if obs.worker.state != P.EntrypointState.ACTIVE and cap is not None and cap.tier in P.CAPTURE_TIERS:
            return cap.tier
        if ws.spec.desired_state != DesiredState.SUSPENDED:
            return Tier.SUSPEND  # nothing to pick while no capture is asked for (an active worker plans alike)
        return await self.executor.auto_tier(subject)

    async def _settle(self, ws: WorkerSnapshot, status: WorkerSnapshotStatus, pod: Obj, obs: Observation,
                      backoff_left: float | None) -> float | None:
        """Nothing to do: status as the node shows it, the record of an operation an earlier agent
        completed closed, the idle facts of an active worker."""
        status = S.settled(ws, status, obs)
        asleep = S.close_settled(status, obs)
        if asleep is not None:
            await self._event(ws, "Normal", Reason.SUSPENDED if asleep else Reason.ACTIVE,
                              S.finished(ws, status, asleep=asleep))
        again = await self._idle(ws, status, pod, obs)
        await self._write(ws, status)
        return backoff_left if backoff_left is not None else again

    async def _do(self, ws: WorkerSnapshot, status: WorkerSnapshotStatus, subject: Subject, obs: Observation,
                  step: Step, *, tier: Tier, want: DesiredState, pod: Obj) -> float | None:
        # The trace this capture or wake joins is the one asked for when it starts (a later request
        # brings a new traceparent, which must not take over this operation's spans).
        woken = S.is_open(status.last_wake)
        S.open_record(status, obs, step, tier=tier, want=want, trace_context=traceparent_of(ws))
        if not woken and S.is_open(status.last_wake) and status.last_wake is not None:
            status.last_wake.generation = ws.metadata.generation
            if ws.key in self._requests:  # the agent's own wake, for the request that reached the worker
                status.last_wake.trigger = "request"
        # This step ends (settle-active, engine-wake) the agent's own wake for a request: told by the request
        # still pending here, not only by the spec's generation, which the controller may have moved on
        # (its desiredState Active) while the wake ran.
        for_request = S.is_open(status.last_wake) and self._for_request(ws, status)
        capture_id = status.last_capture.id if S.is_open(status.last_capture) and status.last_capture else None
        if step == Step.WAIT_HELPER:
            status.state = obs.state
        why = S.interrupted(ws, status, obs, step, want)
        if why is not None:
            await self._event(ws, "Warning", Reason.INTERRUPTED, why)
        meta = pod["metadata"]
        gate = serving_gate(self.kube, lambda: self._pod(meta["namespace"], meta["name"]) or pod,
                            metrics_port=self.settings.metrics_port, routable=ws.spec.routable)
        try:
            result = await self.executor.run_step(subject, obs, step, tier=tier, gate=gate, capture_id=capture_id,
                                                  engine_sleep_level=ws.spec.engine_sleep_level,
                                                  routable=ws.spec.routable)
        except StepFailure as f:
            return await self._failed(ws, status, step, f, obs)
        except Exception as e:  # a bug or an unexpected OS error: reported, never swallowed
            log.exception("%s: step %s", ws.key, step)
            return await self._failed(ws, status, step, StepFailure(Reason.INTERRUPTED, f"{type(e).__name__}: {e}"),
                                      obs)
        if step != Step.WAIT_HELPER:  # the operator's account, beside the status record and the Events
            log.info("%s: step %s done in %.3fs (%s, %s wanted)", ws.key, step.value, result.seconds, tier.value,
                     want.value)
        if step != Step.WAIT_HELPER or ws.key not in self._waiting:
            # One entry for the whole wait: an entry per look would change status on every look, and
            # each write would start the next reconcile at once (a status write storm while CRIU runs).
            S.record(status, step, result)
        if step == Step.WAIT_HELPER:
            self._waiting.setdefault(ws.key, time.monotonic() - result.seconds)
        if step in S.ACTIVE_STEPS:
            # Awake: the request that reached it asleep is answered, its wake on record (its trigger says it).
            # Kept, it would hold the worker awake against every later Suspended (the reconcile's want).
            self._requests.pop(ws.key, None)
        if step in S.ACTIVE_STEPS and for_request:
            await self._event(ws, "Normal", Reason.WOKEN_BY_REQUEST, S.finished(ws, status, asleep=False))
        elif step in S.FINAL_STEPS or (step in S.ACTIVE_STEPS and ws.spec.desired_state == DesiredState.ACTIVE):
            # A settle-active that ends the rollback of a failed capture (Suspended still wanted) is no
            # success: the failure stays on record, so the backoff holds and grows. Cleared there, the
            # capture was retried at once, in a loop without backoff while the fault lasted.
            asleep = step in S.FINAL_STEPS
            await self._event(ws, "Normal", Reason.SUSPENDED if asleep else Reason.ACTIVE,
                              S.finished(ws, status, asleep=asleep))
        elif step in (Step.QUIESCE, Step.WAKE):
            await self._event(ws, "Normal", Reason.CAPTURING if step == Step.QUIESCE else Reason.WAKING,
                              f"{step.value} ({tier.value})")
        after = await self._reobserve(subject)
        status.state = after.state if after is not None else status.state
        await self._write(ws, S.progressing(ws, status, step))
        return 0.0 if step != Step.WAIT_HELPER else 1.0

    def _for_request(self, ws: WorkerSnapshot, status: WorkerSnapshotStatus) -> bool:
        """The wake under way is the agent's own, for a request: the request still pending here, or on record
        under the spec's generation (S.woken_by_request), which the controller may have moved on meanwhile."""
        return ws.key in self._requests or S.woken_by_request(ws, status)

    async def _reobserve(self, subject: Subject) -> Observation | None:
        try:
            return await self.executor.observe(subject)
        except (W.WorkerNotFound, W.NotUnderEntrypoint, ContainerRefused):
            return None

    async def _failed(self, ws: WorkerSnapshot, status: WorkerSnapshotStatus, step: Step, f: StepFailure,
                      obs: Observation | None = None) -> float | None:
        if step in WAKE_STEPS and self._for_request(ws, status) and obs is not None:
            # A wake on request that failed: the requests the worker holds wait in its CUDA calls for a
            # wake that is not coming. Stopping the worker ends them with an error (their connections
            # close) within this bound, never a hang; its container starts it cold, and the controller
            # records the failed wake (the worker Lost: at once) and its fallback.
            await self._event(ws, "Warning", f.reason, f"{step.value}: {f.message}")
            self._requests.pop(ws.key, None)
            why = await self.executor.stop_worker(obs)
            f = StepFailure(Reason.WORKER_LOST, f"wake on request failed ({f.reason.value}: {f.message[:2000]}); {why}")
            status.state = ObservedState.LOST
        S.failed(ws, status, step, f)
        log.warning("%s: step %s failed: %s: %s%s", ws.key, step.value, f.reason.value, f.message[:1000],
                    "" if f.changed else " (nothing changed)")
        await self._event(ws, "Warning", f.reason, f"{step.value}: {f.message}")
        await self._write(ws, status)
        return A.after_failure(self.settings, f.reason, changed=f.changed,
                               failures=status.consecutive_failures or 1)

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
            if e.cause in ("deadline", "size") and self._unbounded.get(ws.key) != e.cause:
                # once per episode: a worker whose answers trickle or swell, said, its idle facts left as
                # they were (a capture still asks its in-flight count first, and is refused without one)
                self._unbounded[ws.key] = e.cause
                await self._event(ws, "Warning", Reason.METRICS_OUT_OF_BOUNDS, str(e))
            return self.settings.scrape_interval
        self._unbounded.pop(ws.key, None)
        facts = I.advance(status.idle, sample, now=utcnow(), granularity=self.settings.activity_granularity)
        if facts is not None:
            status.idle = facts
        return self.settings.scrape_interval

    # -- writes -----------------------------------------------------------------------------------

    async def _write(self, ws: WorkerSnapshot, status: WorkerSnapshotStatus) -> None:
        if status == ws.status and ws.key not in self._unwritten:
            return  # nothing changed: no write (a quiet fleet costs the API server nothing)
        ended = self.reporter.ended((self._ws(ws.key) or {}).get("status") or {}, status)
        body = {"metadata": {"name": ws.metadata.name, "namespace": ws.metadata.namespace},
                "status": S.agent_owned(status)}
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
            self.reporter.report(ws, operation, rec)

    async def _event(self, ws: WorkerSnapshot, kind: str, reason: Reason, note: str) -> None:
        if self.events is None:
            return
        await self.events.record(ws_object(ws), type=kind, reason=reason.value, action=reason.value, note=note)

    def _refresh_metrics(self) -> None:
        statuses = []
        if self.ws_informer is not None:
            for obj in self.ws_informer.store.list():
                key = f"{obj['metadata'].get('namespace')}/{obj['metadata'].get('name')}"
                statuses.append((self._ws(key) or obj).get("status") or {})
        self.reporter.node_gauges(statuses, self.queue.depth)

    # -- wake on request -----------------------------------------------------------------------

    def on_request(self, key: str) -> None:
        """A request reached a worker asleep routable (edge.py): wake it now."""
        self._requests.setdefault(key, time.monotonic())
        self.queue.add(key)

    async def watch_routable(self, stop: asyncio.Event) -> None:
        def pod_ip(ns: str, name: str) -> str | None:
            pod = self._pod(ns, name)
            ip = ((pod or {}).get("status") or {}).get("podIP")
            return str(ip) if ip else None

        def sleepers() -> list[E.Sleeper]:
            objs = [self._ws(f"{o['metadata']['namespace']}/{o['metadata']['name']}") or o
                    for o in self.ws_informer.store.list()] if self.ws_informer is not None else []
            return E.routable_sleepers(objs, pod_ip, port=self.settings.metrics_port)
        await E.watch(sleepers, self.on_request, interval=self.settings.routable_poll_interval, stop=stop,
                      on_unbounded=self.on_unbounded)

    def on_unbounded(self, key: str, e: Exception) -> None:
        """A routable sleeper's in-flight gauge trickled or swelled past its bound (edge.py, once per
        episode): a Warning Event for it alone, sent off the watch's loop; it wakes nothing."""
        obj = self._ws(key)
        try:
            ws = WorkerSnapshot.model_validate(obj)
        except ValidationError:
            return
        log.warning("%s: asleep routable, its in-flight gauge out of bounds: %s", key, e)
        task = asyncio.create_task(self._event(ws, "Warning", Reason.METRICS_OUT_OF_BOUNDS,
                                               f"wake-on-request watch: {e}"))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

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
