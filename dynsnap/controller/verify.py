"""The verify phase: the proof that a worker back in Active serves again (DESIGN.md section 4), and
the failed return with the policy's fallback.

A return is verified in this order, one step per reconcile where it waits: the identity recorded
when the worker was taken out of serving (same pod UID and IP, the same DWM with the same instance
id and generate transport: the frontend names the instance it routed to, not who served, so a DWM
that leads elsewhere would have every pinned answer come back in this worker's name), then the
serving gate True, then the EndpointSlice endpoint ready and the pod Ready, then ``verify-requests``
requests through the frontend pinned to the worker, each answered by its id. Past
``verify_timeout`` from the verification's start, or on proof against (another worker answered, the
identity changed), the return fails: gate False, ``Verified=False`` with the reason, a Warning
Event, and the fallback (``restart``: the pod deleted with its UID as precondition).

Layer: ``dynsnap.controller``.
"""

from __future__ import annotations

import time

from dynsnap.controller import fleet as F
from dynsnap.controller import observe
from dynsnap.controller import routing as RT
from dynsnap.controller.frontend import FrontendError
from dynsnap.controller.phases import left_of
from dynsnap.controller.scope import Obj, Scope, utcnow
from dynsnap.controller.writes import Ctx
from dynsnap.models import protocol as P
from dynsnap.models.dynamo import transport_from_dwm
from dynsnap.models.policy import Policy
from dynsnap.models.protocol import Reason
from dynsnap.models.workersnapshot import ControllerRecord, StepTiming, Verification, WorkerIdentity, WorkerSnapshot

POLL = 0.25


def return_id(ws: WorkerSnapshot, rec: ControllerRecord) -> str:
    """The id a verification of the worker's latest return names: the agent's wake when it woke the
    worker after the last quiesce, else the recall of that quiesce (it never left)."""
    wake = ws.status.last_wake
    if wake is not None and rec.quiesce is not None and wake.started >= rec.quiesce.started:
        return wake.id
    return f"recall-{rec.quiesce.id if rec.quiesce else 'none'}"


def current(ws: WorkerSnapshot, rec: ControllerRecord) -> Verification | None:
    """The verification of the latest return, when one is on record."""
    v = rec.verification
    if v is None or v.wake_id != return_id(ws, rec) or (rec.quiesce is not None and v.started < rec.quiesce.started):
        return None
    return v


def identity_problem(s: Scope, ident: WorkerIdentity | None, dwm: Obj | None) -> tuple[Reason, str] | None:
    if ident is None:
        return None  # a worker quiesced before it had a DWM is checked by its pinned answers alone
    if ident.pod_uid != s.pod_uid:
        return Reason.POD_CHANGED, f"pod UID {s.pod_uid}, was {ident.pod_uid}"
    if ident.pod_ip != F.pod_ip(s.pod):
        return Reason.POD_CHANGED, f"pod IP {F.pod_ip(s.pod)}, was {ident.pod_ip}"
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


async def model_of(ctx: Ctx, s: Scope, url: str) -> str | None:
    """The model the graph's frontend serves (cached per graph version: routing.ModelCache)."""
    model = ctx.models.get(s.dgd_key, s.dgd)
    if model is not None:
        return model
    try:
        models = await ctx.frontend.models(url)
    except FrontendError:
        return None
    if not models:
        return None
    ctx.models.put(s.dgd_key, s.dgd, sorted(models)[0])
    return sorted(models)[0]


async def verify(ctx: Ctx, s: Scope, policy: Policy) -> float | None:
    """One step of the verification of the worker's return (see the module docstring)."""
    rec, now = s.rec, utcnow()
    v = current(s.snap, rec)
    if v is None:
        v = Verification(wake_id=return_id(s.snap, rec), ok=None, reason=Reason.VERIFYING, started=now,
                         message="waiting for the serving gate, the endpoint and the DWM")
        rec.verification = v
        await ctx.write(s.snap, rec, verified=(None, Reason.VERIFYING, v.message))
        return 0.0
    # Identity first: a worker whose pod or DWM changed is never put back into serving, where the
    # frontend would route unpinned requests to it (or, by its DWM, to another worker in its name).
    problem = identity_problem(s, rec.identity, F.dwm_of(ctx.stores.dwms, s.pod))
    if problem is not None:
        return await fail(ctx, s, policy, *problem)
    if F.pod_condition(s.pod, P.CONDITION_SERVING) != "True":
        await ctx.gate(s.pod, True)
        return POLL
    late = left_of(v.started, ctx.settings.verify_timeout, now) < 0
    elapsed = (now - v.started).total_seconds()
    if not s.endpoint_ready or not F.pod_ready(s.pod):
        if late:
            return await fail(ctx, s, policy, Reason.ENDPOINT_NOT_READY,
                              f"endpoint ready={s.endpoint_ready}, pod Ready={F.pod_ready(s.pod)} "
                              f"{elapsed:.0f}s after the wake")
        return POLL
    url = F.frontend_url(ctx.stores.pods, s.ns, s.dgd_name)
    if url is None:
        return await fail(ctx, s, policy, Reason.FRONTEND_UNAVAILABLE,
                          f"graph {s.dgd_name} has no ready frontend") if late else 1.0
    wid, pid, headers = RT.pins(ctx.stores.pods, ctx.stores.dwms, s.pod)
    if wid is None and pid is None:
        return await fail(ctx, s, policy, Reason.DWM_CHANGED, "no DWM with an instance id for it")
    model = await model_of(ctx, s, url)
    if model is None:
        return await fail(ctx, s, policy, Reason.FRONTEND_UNAVAILABLE,
                          f"frontend {url} lists no model") if late else 1.0
    v.headers, v.worker_id, v.prefill_id = headers, wid, pid
    return await _pinned_round(ctx, s, policy, v, url=url, model=model, elapsed=elapsed)


async def _pinned_round(ctx: Ctx, s: Scope, policy: Policy, v: Verification, *, url: str, model: str,
                        elapsed: float) -> float | None:
    """``verify-requests`` pinned requests; all answered by this worker: verified."""
    t0 = time.monotonic()
    answered, refused, last_err = 0, 0, ""
    wid, pid = v.worker_id, v.prefill_id
    decode = wid if F.role_of(s.pod) != F.Role.PREFILL else None
    pinned_to = decode if decode is not None else pid
    for _ in range(policy.verify_requests):
        a = await ctx.frontend.pinned(url, model, worker_id=decode, prefill_id=pid)
        if a.answered_by(worker_id=decode, prefill_id=pid):
            answered += 1
        elif a.ok:
            # Proof against: a pinned request never falls back, so another worker's id means the
            # frontend's idea of this instance leads elsewhere. No retry could make that right.
            v.requests, v.answered = answered + refused + 1, answered
            return await fail(ctx, s, policy, Reason.ANSWERED_BY_ANOTHER_WORKER,
                              f"a request pinned to {pinned_to} was answered by worker {a.worker_id} "
                              f"(prefill {a.prefill_id})")
        else:
            if a.status == RT.MODEL_NOT_FOUND:
                ctx.models.drop(s.dgd_key)  # the model named is no longer listed: ask the frontend again
            refused += 1
            last_err = f"HTTP {a.status}: {a.error}"
            break
    seconds = time.monotonic() - t0
    v.requests, v.answered = answered + refused, answered
    v.steps = [StepTiming(name="identity+endpoint", seconds=max(elapsed, 0.0)),
               StepTiming(name="pinned-requests", seconds=seconds)]
    if answered < policy.verify_requests:
        # Refused (the frontend may not have taken the instance back yet: its EndpointSlice watch
        # lags the gate): try a whole new round later, until the verify timeout says it never will.
        if elapsed + seconds > ctx.settings.verify_timeout:
            return await fail(ctx, s, policy, Reason.PINNED_REQUEST_FAILED,
                              f"{answered}/{policy.verify_requests} pinned requests answered by it within "
                              f"{ctx.settings.verify_timeout:g}s; last: {last_err}")
        v.message = f"pinned request refused, trying again: {last_err}"[:4096]
        await ctx.write(s.snap, s.rec, verified=(None, Reason.VERIFYING, v.message))
        return 1.0
    return await _verified(ctx, s, v, pinned_to)


async def _verified(ctx: Ctx, s: Scope, v: Verification, pinned_to: int | None) -> float | None:
    rec = s.rec
    v.ok, v.reason, v.finished = True, Reason.VERIFIED, utcnow()
    v.message = (f"{v.answered}/{v.requests} requests pinned with {', '.join(v.headers)} answered by "
                 f"instance {pinned_to}; pod UID, IP, DWM UID and instance id unchanged; endpoint ready")
    rec.decision, rec.decided = "verified", utcnow()
    observe.close_wake(ctx.metrics, s.snap, rec, v)
    await ctx.write(s.snap, rec, verified=(True, Reason.VERIFIED, v.message))
    await ctx.say(s.pod, "Normal", Reason.VERIFIED, v.message, occurrence=v.wake_id)
    if ctx.hooks.on_verified:
        ctx.hooks.on_verified(s.snap, v)
    return None


async def fail(ctx: Ctx, s: Scope, policy: Policy, reason: Reason, message: str) -> float | None:
    """A return that cannot be proven (a verification that failed, or a wake past its deadline or
    lost): out of serving again, ``Verified=False``, a Warning Event, and the policy's fallback."""
    rec, now = s.rec, utcnow()
    v = current(s.snap, rec)
    if v is None:  # a wake that never got as far as its verification: named by the agent's wake, or ours
        rid = return_id(s.snap, rec)
        if rid.startswith("recall-") and rec.wake is not None:
            rid = rec.wake.id  # the agent never opened a wake record for it
        v = Verification(wake_id=rid, reason=reason, started=rec.wake.started if rec.wake is not None else now)
        rec.verification = v
    v.ok, v.reason, v.message, v.finished = False, reason, message[:4096], now
    if F.pod_condition(s.pod, P.CONDITION_SERVING) != "False":
        await ctx.gate(s.pod, False)
    fallback = policy.on_failed_wake
    v.fallback = Reason.COLD_RESTART.value if fallback == "restart" else "none"
    rec.decision, rec.decided = f"wake failed: {reason.value}", now
    observe.close_wake(ctx.metrics, s.snap, rec, v)
    await ctx.write(s.snap, rec, verified=(False, reason, message))
    # The fallback first: a long message (a CRIU log's tail) is cut at the Event note's 1 KiB.
    await ctx.say(s.pod, "Warning", reason, f"wake not verified; fallback: {v.fallback}; {message}",
                  occurrence=v.wake_id)
    if ctx.hooks.on_verified:
        ctx.hooks.on_verified(s.snap, v)
    if fallback == "restart":
        await ctx.delete_pod(s.pod)
        await ctx.say(s.pod, "Warning", Reason.COLD_RESTART,
                      "pod deleted so the operator recreates it cold (on-failed-wake: restart)", occurrence=v.wake_id)
    return None
