"""The wake phase, and the way back to serving of an awake worker.

- :func:`request_wake`: ``desiredState=Active`` with a traceparent, after the wake's record
  (``status.controller.wake``: its start, its trace) is on record; asked again as the same wake
  while the spec still says Suspended (a write that did not land, a reconcile that read the old
  spec), so the record, the trace and the agent's record stay one operation.
- :func:`reconcile_wake`: the wake's deadline (``phases.wake_outcome``): a wake whose worker is
  Lost, or that is not Active and verified within ``wake_timeout``, is a failed return
  (``WakeFailed``, the fallback), and the planner no longer counts the worker as awake.
- :func:`awake`: what the planner's *awake* means for the worker where it is: ask the wake, call
  off a quiesce, verify a return, or set the serving gate of a worker that never left.
- :func:`unaccepted`: a worker the agent does not accept (``Accepted=False``) that this controller
  was taking out of serving goes back at once, not at the capture's deadline; one refused from its
  start is let serve (its gate opened, a Warning saying why), uncaptured.

Layer: ``dynsnap.controller``.
"""

from __future__ import annotations

from dynsnap.controller import fleet as F
from dynsnap.controller import observe
from dynsnap.controller import phases as PH
from dynsnap.controller import verify as V
from dynsnap.controller.plan import Decision, Phase
from dynsnap.controller.scope import NEXT, Scope, Step, utcnow
from dynsnap.controller.writes import Ctx
from dynsnap.models import protocol as P
from dynsnap.models.policy import Policy
from dynsnap.models.protocol import DesiredState, Reason
from dynsnap.models.workersnapshot import ControllerRecord, ErrorRecord, OperationRecord, WorkerSnapshot
from dynsnap.telemetry.tracing import new_traceparent

POLL = 0.25


def _ms_id(prefix: str, s: Scope) -> str:
    return f"{prefix}{int(s.now.timestamp() * 1000)}"


def asked_wake(rec: ControllerRecord) -> OperationRecord | None:
    """The wake on record that is still to happen: open, and asked after the last quiesce."""
    w = rec.wake
    if w is None or w.finished is not None or (rec.quiesce is not None and w.started < rec.quiesce.started):
        return None
    return w


def close_capture_record(ws: WorkerSnapshot, rec: ControllerRecord, *, error: ErrorRecord | None = None) -> None:
    """The capture asked for ends with the wake: ok when the worker was captured, else with ``error``."""
    cap = rec.capture
    if cap is None or cap.finished is not None:
        return
    cap.finished = utcnow()
    cap.ok = PH.asleep(ws) and error is None
    if error is not None:
        cap.error = error


async def request_wake(ctx: Ctx, s: Scope, why: str, *, event: tuple[str, Reason, str] | None = None,
                       error: ErrorRecord | None = None) -> float:
    """Ask the agent for Active as one wake (see the module docstring); ``error`` is how the capture
    under way ended (a refusal, its deadline), ``event`` the Event that says why."""
    rec = s.rec
    asked = asked_wake(rec)
    if asked is not None and asked.trace_context:
        # Already asked for (the spec write did not land, or someone set it back): ask again as the
        # same wake, so its record, trace and the agent's record stay one operation.
        tp = asked.trace_context
    else:
        tp = new_traceparent()
        observe.close_capture(ctx.metrics, s.snap, rec)
        close_capture_record(s.snap, rec, error=error)
        rec.wake = OperationRecord(id=_ms_id("w", s), tier=s.snap.spec.tier, started=s.now, trace_context=tp)
        rec.decision, rec.decided = why, s.now
        await ctx.write(s.snap, rec)  # the wake's start and trace on record before it is asked for
    await ctx.apply_spec(s.snap, desired=DesiredState.ACTIVE, traceparent=tp)
    kind, reason, note = event or ("Normal", Reason.WAKE_REQUESTED, why)
    await ctx.say(s.pod, kind, reason, note, occurrence=rec.wake.id if rec.wake else None)
    return POLL


async def reconcile_request_wake(ctx: Ctx, s: Scope, policy: Policy) -> Step:
    """A worker asleep routable that the agent woke for a request that reached it (its wake's trigger,
    under the spec's current generation): the spec follows (Active, as one wake), and the return is
    verified as any wake's. The controller is told by the status, not asked."""
    ws = s.snap
    w = ws.status.last_wake
    if ws.spec.desired_state != DesiredState.SUSPENDED or w is None or w.trigger != "request" or \
            w.generation != ws.metadata.generation:
        return NEXT
    note = f"woken by a request that reached it asleep routable (the agent's wake {w.id}); verifying it"
    return await request_wake(ctx, s, note, event=("Normal", Reason.WOKEN_BY_REQUEST, note))


async def reconcile_wake(ctx: Ctx, s: Scope, policy: Policy) -> Step:
    """The open wake's deadline and end (``phases.wake_outcome``); NEXT while it is not over."""
    rec = s.rec
    w = asked_wake(rec)
    if w is None:
        return NEXT
    if s.snap.spec.desired_state == DesiredState.SUSPENDED:
        return await request_wake(ctx, s, rec.decision or "wake")  # asked, not yet in the spec
    out = PH.wake_outcome(s.snap, rec, now=s.now, timeout=ctx.settings.wake_timeout)
    if out.verdict == PH.Verdict.FAILED:
        assert out.reason is not None
        return await V.fail(ctx, s, policy, out.reason, out.message)
    if out.left is not None:
        s.until(out.left)
    return NEXT


async def _call_off_quiesce(ctx: Ctx, s: Scope, why: str, *, event: tuple[str, Reason, str]) -> float:
    """The open quiesce closed as called off (``why``), on record, and said: ``event`` is the Event's
    kind, reason and what its note adds after ``capture called off: <why>``. The return is verified next."""
    rec = s.rec
    assert rec.quiesce is not None
    rec.quiesce.finished, rec.quiesce.ok = utcnow(), False
    rec.decision, rec.decided = f"capture called off: {why}", utcnow()
    await ctx.write(s.snap, rec)
    kind, reason, more = event
    await ctx.say(s.pod, kind, reason, f"capture called off: {why}{more}", occurrence=rec.quiesce.id)
    return 0.0


def _untouched_since_quiesce(ws: WorkerSnapshot, rec: ControllerRecord) -> bool:
    """The agent has not captured the worker, nor begun to, since the last quiesce (see :func:`unaccepted`)."""
    if ws.status.state in (P.ObservedState.SUSPENDED, P.ObservedState.CAPTURING, P.ObservedState.WAKING,
                           P.ObservedState.LOST):
        return False
    lc, q = ws.status.last_capture, rec.quiesce
    return lc is None or q is None or lc.started < q.started or (lc.finished is not None and lc.ok is False)


async def unaccepted(ctx: Ctx, s: Scope, policy: Policy) -> float | None:
    """The agent does not accept the pod (``Accepted=False``: what its container holds or says about
    itself, its annotations): it captures nothing while that stands, and the planner counts the
    worker nowhere. One this controller was taking out of serving and that the agent has not begun to
    capture goes back now rather than at the capture's deadline (``capture_timeout``, minutes): the
    capture asked for is called off (a Warning ``CaptureRefused`` naming the agent's reason), an open
    quiesce is closed, and the return is verified like any recall. A worker captured or on its way
    (only its agent can wake it), or one that never left serving, is left alone. The agent's state of
    a refused pod is mostly ``Unknown`` (it could not read what the container says), so "not begun"
    is its records': no capture since the quiesce but one that failed (and so was rolled back)."""
    ws, rec = s.snap, s.rec
    acc = ws.condition(P.ConditionType.ACCEPTED)
    if acc is None or acc.status != "False" or not _untouched_since_quiesce(ws, rec):
        return None
    why = f"the agent does not accept the pod: {acc.reason}: {acc.message}"
    if ws.spec.desired_state == DesiredState.SUSPENDED:
        try:
            reason = Reason(acc.reason)
        except ValueError:
            reason = Reason.CAPTURE_REFUSED
        err = ErrorRecord(reason=reason, message=why[:4000], at=s.now, generation=ws.metadata.generation)
        note = f"capture called off: {why}; back into serving"
        return await request_wake(ctx, s, note, event=("Warning", Reason.CAPTURE_REFUSED, note), error=err)
    if rec.quiesce is not None and rec.quiesce.finished is None:
        return await _call_off_quiesce(ctx, s, why, event=("Warning", Reason.CAPTURE_REFUSED, "; back into serving"))
    # It serves uncaptured, and is told so once (per pod and reason: the same note is not said again).
    try:
        reason = Reason(acc.reason)
    except ValueError:
        reason = Reason.CAPTURE_REFUSED
    await ctx.say(s.pod, "Warning", reason, f"serving uncaptured: {why}", occurrence=s.pod_uid)
    if F.verification_pending(ws):
        return await V.verify(ctx, s, policy)
    if F.pod_condition(s.pod, P.CONDITION_SERVING) != "True":
        # Refused from its start (never captured, e.g. shareProcessNamespace): the gate is otherwise opened
        # only for a worker the agent reports awake, so the pod would never turn Ready.
        await ctx.gate(s.pod, True)
    return None


async def awake(ctx: Ctx, s: Scope, policy: Policy, d: Decision) -> float | None:
    """The worker should be awake: one step toward serving, proven."""
    ws = s.snap
    if ws.spec.desired_state == DesiredState.SUSPENDED:
        return await request_wake(ctx, s, f"wake: {d.why}", event=("Normal", Reason.WAKE_REQUESTED, f"wake: {d.why}"))
    phase = s.phase
    if phase == Phase.QUIESCING:
        return await _call_off_quiesce(ctx, s, d.why, event=("Normal", Reason.ACTIVE, ""))
    if phase == Phase.WAKING:
        return None  # the agent is at it; its status write (or the wake's deadline) brings us back
    if ws.status.state != P.ObservedState.ACTIVE:
        return None  # not yet accepted / seen by the agent
    if F.verification_pending(ws):
        return await V.verify(ctx, s, policy)
    if F.pod_condition(s.pod, P.CONDITION_SERVING) != "True":
        await ctx.gate(s.pod, True)
        return POLL
    return d.again_after
