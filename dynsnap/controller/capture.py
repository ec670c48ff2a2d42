"""The capture phase: from ``desiredState=Suspended`` (the quiesce's end) to the agent's report.

Its record is ``status.controller.capture``, opened when the capture is asked (``started``: the
deadline counts from it). ``phases.capture_outcome`` decides how it stands, and this acts on it:

- DONE (the worker sleeps): the record closed ok, the capture's spans and metrics;
- REFUSED (the agent refused it for a reason in ``PERMANENT_REFUSALS``): the record closed with the
  refusal, a Warning Event ``CaptureRefused``, and back to serving at once (``desiredState=Active``,
  verified as a recall); once Active is asked, the refusal is remembered with what it depends on
  (``status.controller.refusal``: pod UID, the spec's generation, the policy's hash) and the planner
  does not choose this worker for sleep while they stay (``phases.refusal_holds``);
- FAILED (past ``capture_timeout``, or the worker Lost): called off the same way, Warning Event
  ``CaptureTimedOut`` (or the agent's reason); a lost worker's wake then fails with the fallback;
- CALLED_OFF (Active is wanted again): the record closed;
- WAIT: the reconcile looks again by the deadline.

Layer: ``dynsnap.controller``.
"""

from __future__ import annotations

from datetime import datetime

from dynsnap.controller import observe
from dynsnap.controller import phases as PH
from dynsnap.controller import wake as W
from dynsnap.controller.scope import NEXT, Scope, Step
from dynsnap.controller.writes import Ctx
from dynsnap.models.policy import Policy
from dynsnap.models.protocol import DesiredState, Reason
from dynsnap.models.workersnapshot import ControllerRecord, ErrorRecord, OperationRecord, WorkerSnapshot


def open_capture(ws: WorkerSnapshot, rec: ControllerRecord, now: datetime) -> bool:
    """With the capture asked (Suspended wanted after a quiesce): the quiesce closed ok and the capture's
    record opened, if not yet. Whether anything changed."""
    q = rec.quiesce
    if ws.spec.desired_state != DesiredState.SUSPENDED or q is None:
        return False
    changed = False
    if q.finished is None:
        q.finished, q.ok = now, True
        changed = True
    if rec.capture is None or rec.capture.started < q.started:
        rec.capture = OperationRecord(id=f"c{q.id.removeprefix('q')}", tier=ws.spec.tier, started=q.finished or now,
                                      trace_context=q.trace_context)
        changed = True
    return changed


async def reconcile_capture(ctx: Ctx, s: Scope, policy: Policy) -> Step:
    """The capture's end, once (see the module docstring); NEXT when it is not this phase's turn."""
    ws, rec = s.snap, s.rec
    if open_capture(ws, rec, s.now):
        await ctx.write(ws, rec)
    cap = rec.capture
    if cap is None or cap.finished is not None:
        return await remember_refusal(ctx, s, policy)
    out = PH.capture_outcome(ws, rec, now=s.now, timeout=ctx.settings.capture_timeout)
    if out.verdict == PH.Verdict.WAIT:
        if out.left is not None:
            s.until(out.left)
        return NEXT
    if out.verdict in (PH.Verdict.DONE, PH.Verdict.CALLED_OFF):
        lc = ws.status.last_capture
        done = out.verdict == PH.Verdict.DONE
        cap.finished = lc.finished if done and lc is not None and lc.finished else s.now
        cap.ok = done
        if done:
            observe.close_capture(ctx.metrics, ws, rec)
        await ctx.write(ws, rec)
        return NEXT
    assert out.reason is not None
    err = ErrorRecord(reason=out.reason, message=out.message[:4000], step=out.step, at=s.now,
                      generation=ws.metadata.generation)
    if out.verdict == PH.Verdict.REFUSED:
        note = (f"capture refused by the agent: {out.reason.value}: {out.message}; back into serving, and not "
                "asked again until the pod, its WorkerSnapshot's spec or the component's policy changes")
        return await W.request_wake(ctx, s, f"capture refused: {out.reason.value}; back to serving",
                                    event=("Warning", Reason.CAPTURE_REFUSED, note), error=err)
    reason = Reason.CAPTURE_TIMED_OUT if out.reason == Reason.CAPTURE_TIMED_OUT else out.reason
    return await W.request_wake(ctx, s, f"capture called off: {out.message}",
                                event=("Warning", reason, f"capture called off: {out.message}"), error=err)


async def remember_refusal(ctx: Ctx, s: Scope, policy: Policy) -> Step:
    """A capture that ended refused for good, once Active was asked back: the refusal on record."""
    ref = PH.refusal_to_remember(s.snap, s.rec, policy=policy)
    if ref is not None:
        s.rec.refusal = ref
        s.rec.decision, s.rec.decided = PH.refusal_note(ref), s.now
        await ctx.write(s.snap, s.rec)
    return NEXT
