"""The controller's per-worker phases and their ends, decided in one place each (pure).

Every phase that waits on someone else has its start in the controller's record
(``status.controller``), a deadline from the settings, and one function here that tells, from
that record and the WorkerSnapshot alone, whether it still waits (and for how long at most), is
done, or is over with a terminal outcome. A restarted controller reads the same record and comes
to the same answer.

====================  ===========================  =======================  =================================
phase                 starts (record)              deadline (setting)       ends
====================  ===========================  =======================  =================================
quiesce               ``quiesce.started``          ``quiesce_timeout``      capture asked; called off (demand,
                                                                            override); FAILED ``WorkerServing``
capture               ``capture.started``          ``capture_timeout``      DONE (Suspended); REFUSED (a
                                                                            permanent refusal); CALLED_OFF
                                                                            (Active wanted); FAILED
                                                                            ``CaptureTimedOut`` or the agent's
                                                                            reason for a worker Lost
wake                  ``wake.started``             ``wake_timeout``         DONE (verified); FAILED
                                                                            ``WakeFailed`` (Lost, or not Active
                                                                            and verified in time)
verify                ``verification.started``     ``verify_timeout``       verified; the failure's reason
====================  ===========================  =======================  =================================

The driver (``reconciler.py``) acts on these answers: FAILED and REFUSED captures are called off
(desiredState Active, back into serving by the recall path), a FAILED wake is a failed return with
the policy's fallback, and a refusal is remembered (:func:`refusal_holds`) so the planner does not
choose that worker for sleep again until its pod, its spec or its component's policy changes.

Layer: ``dynsnap.controller`` (pure: no I/O).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

from dynsnap.models.policy import Policy
from dynsnap.models.protocol import (
    PERMANENT_REFUSALS,
    ConditionType,
    DesiredState,
    ObservedState,
    Reason,
)
from dynsnap.models.workersnapshot import ControllerRecord, ErrorRecord, OperationRecord, Refusal, WorkerSnapshot


class Verdict(StrEnum):
    WAIT = "Wait"  # not over: look again within ``left`` seconds
    DONE = "Done"
    REFUSED = "Refused"  # the agent refused the capture for good (PERMANENT_REFUSALS)
    CALLED_OFF = "CalledOff"  # Active is wanted again before the capture ended
    FAILED = "Failed"  # past its deadline, or the worker is lost


@dataclass(frozen=True)
class Outcome:
    verdict: Verdict
    reason: Reason | None = None
    message: str = ""
    left: float | None = None  # WAIT: seconds until the deadline
    step: str | None = None  # the agent's step that failed, when it said


def left_of(started: datetime, timeout: float, now: datetime) -> float:
    """Seconds until ``started + timeout`` (negative once past)."""
    return timeout - (now - started).total_seconds()


def _wait_or_fail(started: datetime, timeout: float, now: datetime, reason: Reason, message: str) -> Outcome:
    left = left_of(started, timeout, now)
    if left < 0:
        return Outcome(Verdict.FAILED, reason, message)
    return Outcome(Verdict.WAIT, left=left)


def _said(err: ErrorRecord | None, limit: int = 400) -> str:
    """The agent's error, its message cut to ``limit`` characters (a CRIU log's tail is most of one)."""
    if err is None:
        return ""
    msg = err.message if len(err.message) <= limit else err.message[:limit] + "…"
    return f"{err.reason.value}: {msg}"


# -- quiesce ----------------------------------------------------------------------------------------

def quiesce_outcome(q: OperationRecord, *, now: datetime, timeout: float) -> Outcome:
    """An open quiesce: WAIT (its steps are the quiesce's own business), or FAILED past its deadline."""
    return _wait_or_fail(q.started, timeout, now, Reason.WORKER_SERVING,
                         f"quiesce did not finish in {timeout:g}s; capture called off")


# -- capture ----------------------------------------------------------------------------------------

def capture_error(ws: WorkerSnapshot, since: datetime) -> ErrorRecord | None:
    """What the agent reported against the capture asked for since ``since`` (the quiesce's start: the
    agent's clock is compared with one taken seconds earlier, not with the request's instant): the
    error of its capture record, or its last error."""
    lc = ws.status.last_capture
    if lc is not None and lc.started >= since and lc.finished is not None and lc.ok is False and lc.error:
        return lc.error
    err = ws.status.last_error
    return err if err is not None and err.at >= since else None


def asleep(ws: WorkerSnapshot) -> bool:
    sus = ws.condition(ConditionType.SUSPENDED)
    return (ws.spec.desired_state == DesiredState.SUSPENDED and ws.status.state == ObservedState.SUSPENDED
            and sus is not None and sus.status == "True")


def capture_outcome(ws: WorkerSnapshot, rec: ControllerRecord, *, now: datetime, timeout: float) -> Outcome:
    """The open capture ``rec.capture`` (asked at its ``started``, after the quiesce ``rec.quiesce``)."""
    cap = rec.capture
    assert cap is not None and cap.finished is None
    since = rec.quiesce.started if rec.quiesce is not None else cap.started
    if ws.spec.desired_state == DesiredState.ACTIVE:
        return Outcome(Verdict.CALLED_OFF, message="desiredState is Active again")
    if asleep(ws):
        return Outcome(Verdict.DONE)
    err = capture_error(ws, since)
    if ws.status.state == ObservedState.LOST:
        return Outcome(Verdict.FAILED, err.reason if err else Reason.WORKER_LOST,
                       "the agent lost the worker during the capture" + (f": {_said(err)}" if err else ""),
                       step=err.step if err else None)
    if err is not None and err.reason in PERMANENT_REFUSALS:
        return Outcome(Verdict.REFUSED, err.reason, err.message, step=err.step)
    return _wait_or_fail(cap.started, timeout, now, Reason.CAPTURE_TIMED_OUT,
                         f"the agent did not report the capture finished within {timeout:g}s"
                         + (f"; its last error: {_said(err)}" if err else ""))


# -- wake -------------------------------------------------------------------------------------------

def _wake_error(ws: WorkerSnapshot, since: datetime) -> ErrorRecord | None:
    lw = ws.status.last_wake
    if lw is not None and lw.started >= since and lw.error is not None:
        return lw.error
    err = ws.status.last_error
    return err if err is not None and err.at >= since else None


def wake_outcome(ws: WorkerSnapshot, rec: ControllerRecord, *, now: datetime, timeout: float) -> Outcome:
    """The open wake ``rec.wake``: it ends when its return is verified (the verification closes the
    wake record), or FAILED when the agent lost the worker or it is not Active and verified in time."""
    w = rec.wake
    assert w is not None and w.finished is None
    since = rec.quiesce.started if rec.quiesce is not None and rec.quiesce.started <= w.started else w.started
    err = _wake_error(ws, since)
    # Given up: Lost, or WorkerLost said (its entrypoint then exits, and the agent may see no worker
    # at all: state Unknown). No deadline need pass for that.
    if ws.status.state == ObservedState.LOST or (err is not None and err.reason == Reason.WORKER_LOST):
        return Outcome(Verdict.FAILED, Reason.WAKE_FAILED,
                       f"the agent gave up on the wake: {_said(err) or 'worker Lost'}")
    v = rec.verification
    where = f"state {ws.status.state.value if ws.status.state else 'unknown'}"
    if ws.status.state == ObservedState.ACTIVE and v is not None and v.started >= w.started:
        where += f", verification: {v.message}"
    elif err is not None:
        where += f", the agent's last error: {_said(err)}"
    return _wait_or_fail(w.started, timeout, now, Reason.WAKE_FAILED,
                         f"not Active and verified within {timeout:g}s of the wake request ({where})")


# -- the refusal, remembered ------------------------------------------------------------------------

def policy_hash(policy: Policy) -> str:
    """A short, stable hash of a component's parsed policy: equal policies, equal hashes."""
    text = json.dumps(dataclasses.asdict(policy), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def refusal_to_remember(ws: WorkerSnapshot, rec: ControllerRecord, *, policy: Policy) -> Refusal | None:
    """The refusal to record once Active was asked back: the controller's capture record ended with a
    permanent refusal not yet on record. Its generation is the spec's as it is now (Active asked)."""
    cap = rec.capture
    if (cap is None or cap.finished is None or cap.ok is not False or cap.error is None
            or cap.error.reason not in PERMANENT_REFUSALS or ws.spec.desired_state != DesiredState.ACTIVE):
        return None
    if rec.refusal is not None and rec.refusal.capture_id == cap.id:
        return None
    if rec.quiesce is not None and cap.started < rec.quiesce.started:
        return None  # a capture before the latest quiesce: the planner has asked again since
    return Refusal(reason=cap.error.reason, message=cap.error.message, at=cap.error.at, capture_id=cap.id,
                   pod_uid=ws.spec.pod_uid, generation=ws.metadata.generation, policy_hash=policy_hash(policy))


def refusal_holds(ref: Refusal | None, *, pod_uid: str, generation: int | None, policy: Policy) -> bool:
    """A recorded refusal still stands: same pod, same spec, same policy (any change asks again)."""
    return (ref is not None and ref.pod_uid == pod_uid and ref.generation == generation
            and ref.policy_hash == policy_hash(policy))


def refusal_note(ref: Refusal) -> str:
    return (f"capture refused by the agent: {ref.reason.value} ({ref.message}); not asked again until the pod, "
            "its WorkerSnapshot's spec or the component's dynsnap.io/ policy changes")
