"""The quiesce phase: a serving worker taken out of serving before any capture.

1. record the worker's identity (pod UID and IP, DWM UID, instance id, the DWM's generate transport)
   and open the quiesce record (``status.controller.quiesce``: its start is the deadline's);
2. set the pod's ``dynsnap.io/serving`` condition False;
3. wait until the controller's EndpointSlice shows the endpoint not ready, the frontend refuses a
   request pinned to the recorded instance (``routing``: only its explicit refusal counts; any
   other answer, or no frontend to ask, is asked again), and the agent's idle facts show nothing in
   flight; each condition passed is a step of the record;
4. ``desiredState=Suspended`` (and the quiesce's traceparent), the quiesce closed and the capture's
   record opened (``capture.open_capture``).

Past ``quiesce_timeout`` (``phases.quiesce_outcome``) the quiesce is called off and the worker put
back into serving (Warning Event ``WorkerServing``).

Layer: ``dynsnap.controller``.
"""

from __future__ import annotations

import logging
from datetime import datetime

from dynsnap.controller import capture as C
from dynsnap.controller import fleet as F
from dynsnap.controller import phases as PH
from dynsnap.controller import routing as RT
from dynsnap.controller import verify as V
from dynsnap.controller.plan import Decision, Phase
from dynsnap.controller.scope import Scope
from dynsnap.controller.writes import Ctx
from dynsnap.models import protocol as P
from dynsnap.models.dynamo import transport_from_dwm
from dynsnap.models.policy import Policy
from dynsnap.models.protocol import DesiredState, Reason
from dynsnap.models.workersnapshot import OperationRecord, StepTiming, WorkerIdentity
from dynsnap.telemetry.tracing import new_traceparent

log = logging.getLogger(__name__)
POLL = 0.25
ASK_AGAIN = 0.5  # a condition the frontend or the agent has yet to meet: look again soon


def step(q: OperationRecord, name: str, now: datetime) -> None:
    """The quiesce's step ``name`` passed now (once; each step's seconds since the one before)."""
    if any(s.name == name for s in q.steps):
        return
    done = sum(s.seconds for s in q.steps)
    q.steps.append(StepTiming(name=name, seconds=max((now - q.started).total_seconds() - done, 0.0)))


async def routing(ctx: Ctx, s: Scope) -> RT.Routed:
    """Whether the frontend still routes to the instance recorded when the quiesce began (fail closed:
    routing.Routed.UNKNOWN unless the frontend answered or refused it)."""
    ident = s.rec.identity
    url = F.frontend_url(ctx.stores.pods, s.ns, s.dgd_name)
    if ident is None or url is None:
        return RT.Routed.UNKNOWN
    model = await V.model_of(ctx, s, url)
    if model is None:
        return RT.Routed.UNKNOWN
    wid, pid = RT.probe_pins(s.pod, ident.instance_id)
    a = await ctx.frontend.pinned(url, model, worker_id=wid, prefill_id=pid, max_tokens=1)
    if a.status == RT.MODEL_NOT_FOUND:
        ctx.models.drop(s.dgd_key)  # the cached model is no longer listed: read it again next time
    verdict = RT.routed(a)
    if verdict == RT.Routed.UNKNOWN:
        log.info("%s: quiesce: the frontend's answer proves nothing (%s); asking again", s.key, RT.describe(a))
    return verdict


async def begin(ctx: Ctx, s: Scope, policy: Policy, d: Decision) -> float | None:
    """Steps 1: the identity and the quiesce's record (a refusal no longer standing is dropped)."""
    rec, now = s.rec, s.now
    dwm = F.dwm_of(ctx.stores.dwms, s.pod)
    iid = F.instance_id(dwm)
    ip = F.pod_ip(s.pod)
    if dwm is None or iid is None or ip is None:
        return 1.0  # nothing to verify a wake against yet: not captured before it registered
    rec.identity = WorkerIdentity(pod_uid=s.pod_uid, pod_ip=ip, dwm_uid=str(dwm["metadata"]["uid"]),
                                  instance_id=int(iid), transport=transport_from_dwm(dwm), recorded=now)
    rec.quiesce = OperationRecord(id=f"q{int(now.timestamp() * 1000)}", tier=policy.tier, started=now,
                                  trace_context=new_traceparent())
    rec.refusal = None  # the planner chose it: a refusal on record no longer stands
    rec.decision, rec.decided = d.why, now
    await ctx.write(s.snap, rec)
    await ctx.say(s.pod, "Normal", Reason.QUIESCING, f"taking it out of serving: {d.why}", occurrence=rec.quiesce.id)
    return 0.0


async def asleep(ctx: Ctx, s: Scope, policy: Policy, d: Decision) -> float | None:
    """The worker should sleep: one step of its quiesce (the capture's own phase follows the request)."""
    phase = s.phase
    if phase == Phase.SERVING and d.routable:
        # The component's last worker, under wake on request: it sleeps routable, kept in serving (gate
        # True, endpoint ready, registration kept, the model listed): nothing to take it out of. The
        # agent saves it only with nothing in flight; a request after that waits in it and wakes it.
        again = await begin(ctx, s, policy, d)
        if again != 0.0:
            return again
        s.reread(ctx.stores)
        return await _request_capture(ctx, s, policy, routable=True)
    if phase == Phase.SERVING:
        return await begin(ctx, s, policy, d)
    if phase != Phase.QUIESCING:
        return None  # capturing or asleep: the capture phase has it; otherwise not ready to be quiesced
    rec, now = s.rec, s.now
    q = rec.quiesce
    assert q is not None
    out = PH.quiesce_outcome(q, now=now, timeout=ctx.settings.quiesce_timeout)
    if out.verdict == PH.Verdict.FAILED:
        q.finished, q.ok = now, False
        rec.decision, rec.decided = "quiesce timed out; back to serving", now
        await ctx.write(s.snap, rec)
        await ctx.say(s.pod, "Warning", Reason.WORKER_SERVING, out.message, occurrence=q.id)
        return 0.0
    if out.left is not None:
        s.until(out.left)
    if F.pod_condition(s.pod, P.CONDITION_SERVING) != "False":
        await ctx.gate(s.pod, False)
        step(q, "gate", now)
        await ctx.write(s.snap, rec)
        return POLL
    steps = len(q.steps)
    again = await _conditions(ctx, s, q)
    if len(q.steps) != steps:
        await ctx.write(s.snap, rec)  # progress on record (a restarted controller keeps the timings)
    if again is not None:
        return again
    return await _request_capture(ctx, s, policy)


async def _conditions(ctx: Ctx, s: Scope, q: OperationRecord) -> float | None:
    """Step 3, each condition waited for itself; None once all hold."""
    if s.endpoint_ready:
        return POLL
    step(q, "endpoint-not-ready", s.now)
    if await routing(ctx, s) != RT.Routed.NO:
        return ASK_AGAIN
    step(q, "frontend-stopped-routing", s.now)
    idle = s.snap.status.idle
    if idle is None or (idle.inflight or 0) > 0:
        return ASK_AGAIN
    step(q, "drained", s.now)
    return None


async def _request_capture(ctx: Ctx, s: Scope, policy: Policy, *, routable: bool = False) -> float:
    """Step 4: the capture asked, the quiesce closed and the capture's record opened."""
    q = s.rec.quiesce
    assert q is not None
    elapsed = (s.now - q.started).total_seconds()
    written = await ctx.apply_spec(s.snap, desired=DesiredState.SUSPENDED, routable=routable,
                                   traceparent=q.trace_context or new_traceparent())
    what = "routable capture (suspend, kept in serving)" if routable else f"capture ({policy.tier.value})"
    await ctx.say(s.pod, "Normal", Reason.CAPTURE_REQUESTED,
                  f"quiesced in {elapsed:.2f}s; {what} requested", occurrence=q.id)
    if written is not None:
        s.reread(ctx.stores)
        if s.ws is not None and C.open_capture(s.snap, s.rec, s.now):
            await ctx.write(s.snap, s.rec)
    return POLL
