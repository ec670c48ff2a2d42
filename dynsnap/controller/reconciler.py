"""The controller's reconcile of one worker pod: the driver. It reads the worker's scope once
(``scope.py``), runs the phases in order, each deciding its own end from the record
(``phases.py``) and taking at most one side-effecting step (``writes.py``), and says when to look
again: never later than the soonest deadline an open phase waits on.

Order (docs/CONTROLLER.md): admission (``admission.py``: create or replace the WorkerSnapshot, a
policy that does not parse); the capture asked for (``capture.py``: done, refused for good, called
off, past its deadline); the wake asked for (``wake.py``: lost, past its deadline); then the
planner's word (``plan.py``) for a worker that is not broken (one the agent does not accept goes
back to serving if it was being taken out: ``wake.unaccepted``): awake (``wake.awake``: ask the wake,
call off a quiesce, verify the return: ``verify.py``) or asleep (``quiesce.py``). Every wait is a
"look again after T", never a sleep; every deadline is measured from a time recorded in status,
so a restarted controller carries on where the last one stopped. Telemetry is emitted from the
record when an operation ends (``observe.py``).

Reconciles run concurrently (``--workers``), and each plans the whole component from the stores, so
a serving worker's plan and its first step out of serving (the quiesce's record, read back into the
store as written) are one turn per component: the next serving worker's plan sees that one already
quiescing. Two plans made side by side while the agent's activity facts moved between them could
otherwise each keep a different worker and, between them, put every one out of serving, below
``min-active`` (the frontend then drops the model and answers 404).

Layer: ``dynsnap.controller``.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from dynsnap.controller import admission as A
from dynsnap.controller import capture as C
from dynsnap.controller import fleet as F
from dynsnap.controller import phases as PH
from dynsnap.controller import quiesce as Q
from dynsnap.controller import wake as W
from dynsnap.controller.frontend import Frontend
from dynsnap.controller.plan import Decision, Demand, Phase, Want, WorkerView, plan
from dynsnap.controller.routing import ModelCache
from dynsnap.controller.scope import Next, Scope, Stores, read_scope, utcnow
from dynsnap.controller.settings import ControllerSettings
from dynsnap.controller.writes import Ctx, Hooks
from dynsnap.k8s.client import Kube
from dynsnap.models import protocol as P
from dynsnap.models.policy import Policy
from dynsnap.models.protocol import Reason
from dynsnap.models.workersnapshot import WorkerSnapshot
from dynsnap.telemetry.metrics import Metrics

__all__ = ["Hooks", "Reconciler", "Stores"]

log = logging.getLogger(__name__)
Obj = dict[str, Any]


def _soonest(a: float | None, b: float | None) -> float | None:
    """The earlier of two "look again after" answers (None: no need)."""
    if a is None:
        return b
    return a if b is None else min(a, b)


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
    # "ns/name" -> (resourceVersion, parsed): each WorkerSnapshot parsed once per version for planning
    _parsed: dict[str, tuple[str, WorkerSnapshot | None]] = field(default_factory=dict)
    # "ns/dgd/component" -> the turn its serving workers take to plan and leave serving (module doc)
    _turns: dict[str, asyncio.Lock] = field(default_factory=dict)
    ctx: Ctx = field(init=False)

    def __post_init__(self) -> None:
        self.ctx = Ctx(kube=self.kube, settings=self.settings, stores=self.stores, frontend=self.frontend,
                       events=self.events, hooks=self.hooks, metrics=self.metrics, models=ModelCache())

    # -- entry ------------------------------------------------------------------------------------

    async def reconcile(self, key: str) -> float | None:
        pod = self.stores.pods.get_key(key)
        if pod is None:
            self.forget(key)  # the pod is gone: what was said about it, and its parse, go too
            return None
        if not F.is_worker_pod(pod) or not F.opted_in(pod) or pod["metadata"].get("deletionTimestamp"):
            return None  # a WorkerSnapshot is owned by its pod: the garbage collector removes it
        s = read_scope(self.stores, key, pod)
        if s is None:
            return None  # the graph is gone (its pods follow through the garbage collector)
        if not s.parsed.ok:
            await A.bad_policy(self.ctx, s)
            s.reread(self.stores)
            return await A.finish_return(self.ctx, s)
        policy = s.policy
        if s.ws is not None and s.ws.spec.pod_uid != s.pod_uid:
            return await A.replaced(self.ctx, s)
        if s.ws is None:
            return await (A.create(self.ctx, s, policy) if policy.enabled else A.serve_unmanaged(self.ctx, s))
        if not A.policy_condition_ok(s):
            await self.ctx.write(s.snap, s.rec, policy_ok=True)
            return 0.0
        _, bad, deprecated = F.override_of(pod, s.ws)
        if bad:
            await self.ctx.say(pod, "Warning", Reason.INVALID_OVERRIDE, bad)
        elif deprecated:
            await self.ctx.say(pod, "Warning", Reason.DEPRECATED_OVERRIDE, (
                f"{P.ANN_DESIRED_STATE} on the pod is deprecated and read only while the WorkerSnapshot has no "
                f"{P.ANN_OVERRIDE}: use `dynsnap suspend|wake` (it writes that), then remove the pod's annotation"),
                occurrence=s.pod_uid)
        for phase_step in (W.reconcile_request_wake, C.reconcile_capture, W.reconcile_wake):
            done = await phase_step(self.ctx, s, policy)
            if not isinstance(done, Next):
                return _soonest(done, s.again)
        return _soonest(await self._decided(s, policy), s.again)

    async def _decided(self, s: Scope, policy: Policy) -> float | None:
        """The planner's word for the worker, and the step toward it; a serving worker's in its
        component's turn (module doc)."""
        if s.phase != Phase.SERVING:
            return await self._step(s, policy)
        turn = self._turns.setdefault(f"{s.dgd_key}/{s.component}", asyncio.Lock())
        async with turn:
            return await self._step(s, policy)

    async def _step(self, s: Scope, policy: Policy) -> float | None:
        decision = await self.decide(s, policy)
        phase = s.phase
        if log.isEnabledFor(logging.DEBUG):  # every reconcile passes here: what only the log reads, only for it
            held = F.starting_why(s.pod, s.snap, s.endpoint_ready) if phase == Phase.STARTING else []
            log.debug("%s: phase %s%s, %s (%s)", s.key, phase, f" ({', '.join(held)})" if held else "",
                      decision.want, decision.why)
        if phase == Phase.BROKEN:
            return await W.unaccepted(self.ctx, s, policy)
        ws = s.snap
        # The tier (and the engine's sleep level) of the policy reach the spec only while the worker is
        # awake and asked to stay so: a wake follows the tier of the capture it wakes from.
        if (ws.spec.tier, ws.spec.engine_sleep_level) != (policy.tier, policy.engine_sleep_level) and \
                ws.spec.desired_state == P.DesiredState.ACTIVE and phase in (Phase.SERVING, Phase.STARTING, Phase.NEW):
            await self.ctx.apply_spec(ws, tier=policy.tier, engine_sleep_level=policy.engine_sleep_level)
            return 0.0
        if decision.want == Want.AWAKE:
            return await W.awake(self.ctx, s, policy, decision)
        if decision.want == Want.ASLEEP:
            return await Q.asleep(self.ctx, s, policy, decision)
        return None

    async def decide(self, s: Scope, policy: Policy) -> Decision:
        """The component's plan for this worker (a refused override said and put on record)."""
        decisions = self._plan(s.ns, s.dgd_name, s.component, policy)
        decision = decisions.get(s.name) or Decision(Want.LEAVE, "not in the component's plan")
        if not policy.enabled:
            decision = Decision(Want.AWAKE, f"{P.ANN_ENABLED} is not true: every worker stays awake")
        if decision.refused:
            await self.ctx.say(s.pod, "Warning", decision.reason, decision.why)
            rec = s.rec
            if rec.decision != decision.why:  # on the object too: `dynsnap suspend` shows it to its user
                rec.decision, rec.decided = decision.why, utcnow()
                await self.ctx.write(s.snap, rec)
        if self.hooks.on_decision:
            self.hooks.on_decision(s.key, decision)
        return decision

    def forget(self, key: str) -> None:
        """A pod is gone: drop what the reconciler kept about it."""
        self._parsed.pop(key, None)
        self.ctx.forget(f"{key}/")

    def forget_graph(self, key: str) -> None:
        """A graph is gone: its model, its demand, what was said about its policy."""
        self.ctx.models.drop(key)
        self.demand.pop(key, None)
        self.ctx.forget(f"policy/{key}/")
        for turn in [t for t in self._turns if t.startswith(f"{key}/")]:
            del self._turns[turn]

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

    def view_of(self, pod: Obj, policy: Policy | None = None) -> WorkerView:
        """The worker as the planner sees it (``policy``: its component's, for a refusal on record)."""
        meta = pod["metadata"]
        ws = self.peer_ws(meta["namespace"], meta["name"])
        phase = F.phase_of(pod, ws, F.endpoint_ready(self.stores.slices, pod))
        idle = ws.status.idle if ws else None
        cap = ws.status.last_capture if ws else None
        rec = ws.status.controller if ws else None
        ver = rec.verification if rec is not None else None
        ref = rec.refusal if rec is not None else None
        refused = None
        # Without the policy (the event handlers' change detection) a refusal on record counts as
        # standing: what they compare is whether the view changed, and a refusal recorded is a change.
        if ws is not None and ref is not None and (policy is None or PH.refusal_holds(
                ref, pod_uid=F.pod_uid(pod), generation=ws.metadata.generation, policy=policy)):
            refused = PH.refusal_note(ref)
        override, _, _ = F.override_of(pod, ws)
        return WorkerView(name=meta["name"], phase=phase, idle_since=idle.idle_since if idle else None,
                          last_activity=idle.last_activity if idle else None,
                          last_capture=cap.started if cap else None, override=override,
                          serving_since=ver.finished if ver is not None and ver.ok else None,
                          sleep_refused=refused,
                          routable=ws is not None and ws.spec.routable
                          and ws.spec.desired_state == P.DesiredState.SUSPENDED)

    def _plan(self, ns: str, dgd: str, component: str, policy: Policy) -> dict[str, Decision]:
        views = [self.view_of(p, policy) for p in self.component_pods(ns, dgd, component)]
        return plan(views, policy, self.demand.get(f"{ns}/{dgd}"), utcnow())
