"""The controller's phase machine (dynsnap/controller/phases.py), table by table: for each phase, what
its record and the WorkerSnapshot say decides whether it still waits (and until when), is done, or is
over with a terminal outcome; and a refusal is remembered against the pod, the spec and the policy."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from dynsnap.controller import phases as PH
from dynsnap.models.policy import Policy
from dynsnap.models.protocol import PERMANENT_REFUSALS, Reason, Tier
from dynsnap.models.workersnapshot import (
    ControllerRecord,
    ErrorRecord,
    OperationRecord,
    Refusal,
    Verification,
    WorkerSnapshot,
)

UID = "00000001-2222-3333-4444-555555555555"
T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def ws(*, desired: str = "Suspended", state: str | None = "Active", suspended: str | None = None,
       last_capture: dict[str, Any] | None = None, last_wake: dict[str, Any] | None = None,
       last_error: dict[str, Any] | None = None, generation: int = 3) -> WorkerSnapshot:
    conds = [] if suspended is None else [{"type": "Suspended", "status": suspended, "reason": "Suspended",
                                           "lastTransitionTime": "2026-12-01T12:00:00Z"}]
    status: dict[str, Any] = {"state": state, "conditions": conds}
    for k, v in (("lastCapture", last_capture), ("lastWake", last_wake), ("lastError", last_error)):
        if v is not None:
            status[k] = v
    return WorkerSnapshot.model_validate({
        "metadata": {"name": "w-0", "namespace": "ns", "generation": generation},
        "spec": {"podName": "w-0", "podUID": UID, "tier": "snapshot", "desiredState": desired},
        "status": status})


def op(started: float, finished: float | None = None, ok: bool | None = None, op_id: str = "x") -> OperationRecord:
    return OperationRecord(id=op_id, tier=Tier.SNAPSHOT, started=at(started),
                           finished=at(finished) if finished is not None else None, ok=ok)


def err(reason: Reason, when: float, message: str = "why") -> dict[str, Any]:
    return {"reason": reason.value, "message": message, "step": "Quiesce", "at": at(when).isoformat()}


def agent_op(started: float, *, finished: float | None = None, ok: bool | None = None,
             error: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"id": "a1", "tier": "snapshot", "started": at(started).isoformat()}
    if finished is not None:
        out["finished"] = at(finished).isoformat()
    if ok is not None:
        out["ok"] = ok
    if error is not None:
        out["error"] = error
    return out


# -- quiesce ------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("now", "verdict", "left"), [(0, PH.Verdict.WAIT, 60), (59.5, PH.Verdict.WAIT, 0.5),
                                                      (60, PH.Verdict.WAIT, 0), (60.1, PH.Verdict.FAILED, None)])
def test_a_quiesce_waits_until_its_deadline_then_fails_worker_serving(now: float, verdict: PH.Verdict,
                                                                     left: float | None) -> None:
    out = PH.quiesce_outcome(op(0), now=at(now), timeout=60)
    assert out.verdict == verdict
    if left is not None:
        assert out.left == pytest.approx(left)
    else:
        assert out.reason == Reason.WORKER_SERVING and "60s" in out.message


# -- capture ------------------------------------------------------------------------------------------

def capture_rec() -> ControllerRecord:
    # quiesced from t=0, capture asked at t=10, deadline 100 s
    return ControllerRecord(quiesce=op(0, 10, True, "q1"), capture=op(10, op_id="c1"))


CAPTURES = [
    # (case, WorkerSnapshot, now, verdict, reason)
    ("agent still at it", ws(state="Capturing", last_capture=agent_op(11)), 50, PH.Verdict.WAIT, None),
    ("captured", ws(state="Suspended", suspended="True", last_capture=agent_op(11, finished=30, ok=True)), 50,
     PH.Verdict.DONE, None),
    ("captured, even past the deadline", ws(state="Suspended", suspended="True"), 500, PH.Verdict.DONE, None),
    ("suspended but the condition not yet", ws(state="Suspended", suspended="False"), 50, PH.Verdict.WAIT, None),
    *[(f"refused {r.value}", ws(last_capture=agent_op(11, finished=11, ok=False, error=err(r, 11)),
                                last_error=err(r, 11)), 12, PH.Verdict.REFUSED, r)
      for r in sorted(PERMANENT_REFUSALS)],
    ("refused for good, seen from lastError alone", ws(last_error=err(Reason.SECCOMP_OFF, 11)), 12,
     PH.Verdict.REFUSED, Reason.SECCOMP_OFF),
    ("a refusal from before this quiesce is not this capture's",
     ws(last_capture=agent_op(-50, finished=-50, ok=False, error=err(Reason.SECCOMP_OFF, -50)),
        last_error=err(Reason.SECCOMP_OFF, -50)), 12, PH.Verdict.WAIT, None),
    ("a refusal that can heal waits for the agent's retry",
     ws(last_capture=agent_op(11, finished=11, ok=False, error=err(Reason.WORKER_SERVING, 11)),
        last_error=err(Reason.WORKER_SERVING, 11)), 50, PH.Verdict.WAIT, None),
    ("a failure mid-way waits for the agent's rollback and retry",
     ws(state="Capturing", last_error=err(Reason.CHECKPOINT_FAILED, 20)), 50, PH.Verdict.WAIT, None),
    ("past the deadline", ws(state="Capturing", last_capture=agent_op(11)), 110.1, PH.Verdict.FAILED,
     Reason.CAPTURE_TIMED_OUT),
    ("past the deadline, retrying a failure", ws(last_error=err(Reason.CHECKPOINT_FAILED, 90)), 111,
     PH.Verdict.FAILED, Reason.CAPTURE_TIMED_OUT),
    ("the worker lost", ws(state="Lost", last_error=err(Reason.WORKER_LOST, 20)), 21, PH.Verdict.FAILED,
     Reason.WORKER_LOST),
    ("Active wanted again", ws(desired="Active", state="Capturing"), 20, PH.Verdict.CALLED_OFF, None),
]


@pytest.mark.parametrize(("snap", "now", "verdict", "reason"), [c[1:] for c in CAPTURES], ids=[c[0] for c in CAPTURES])
def test_a_capture_ends_once_by_what_the_agent_reports_or_its_deadline(snap: WorkerSnapshot, now: float,
                                                                       verdict: PH.Verdict,
                                                                       reason: Reason | None) -> None:
    out = PH.capture_outcome(snap, capture_rec(), now=at(now), timeout=100)
    assert (out.verdict, out.reason) == (verdict, reason), out
    if verdict == PH.Verdict.WAIT:
        assert out.left == pytest.approx(110 - now)
    if reason == Reason.CAPTURE_TIMED_OUT:
        assert "within 100s" in out.message


# -- wake ---------------------------------------------------------------------------------------------

def wake_rec(verification: Verification | None = None) -> ControllerRecord:
    # quiesced at t=-100, the wake asked at t=0, deadline 60 s
    return ControllerRecord(quiesce=op(-100, -90, True, "q1"), wake=op(0, op_id="w1"), verification=verification)


WAKES = [
    ("the agent waking", ws(desired="Active", state="Waking", last_wake=agent_op(1)), 30, PH.Verdict.WAIT, ""),
    ("restore failing, retried", ws(desired="Active", state="Waking",
                                    last_wake=agent_op(1, error=err(Reason.CRIU_RESTORE_FAILED, 20, "bad image"))),
     59, PH.Verdict.WAIT, ""),
    ("restore failing past the deadline", ws(desired="Active", state="Waking",
                                             last_wake=agent_op(1, error=err(Reason.CRIU_RESTORE_FAILED, 50,
                                                                             "bad image"))),
     60.5, PH.Verdict.FAILED, "CriuRestoreFailed: bad image"),
    ("never seen by the agent", ws(desired="Active", state="Suspended", suspended="True"), 61, PH.Verdict.FAILED,
     "state Suspended"),
    ("Active, verifying too long", ws(desired="Active", state="Active", last_wake=agent_op(1, finished=5, ok=True)),
     61, PH.Verdict.FAILED, "state Active"),
    ("the agent gave up: Lost", ws(desired="Active", state="Lost",
                                   last_wake=agent_op(1, finished=2, ok=False,
                                                      error=err(Reason.WORKER_LOST, 2, "image gone")),
                                   last_error=err(Reason.WORKER_LOST, 2, "image gone")),
     3, PH.Verdict.FAILED, "WorkerLost: image gone"),
    ("the agent gave up: WorkerLost, the worker no longer found",
     ws(desired="Active", state="Unknown", last_wake=agent_op(1, finished=2, ok=False,
                                                              error=err(Reason.WORKER_LOST, 2, "tree gone"))),
     3, PH.Verdict.FAILED, "the agent gave up on the wake: WorkerLost: tree gone"),
    ("a WorkerLost from before this wake is not this wake's",
     ws(desired="Active", state="Waking", last_error=err(Reason.WORKER_LOST, -200, "long ago")), 3,
     PH.Verdict.WAIT, ""),
]


@pytest.mark.parametrize(("snap", "now", "verdict", "said"), [c[1:] for c in WAKES], ids=[c[0] for c in WAKES])
def test_a_wake_fails_when_lost_or_not_active_and_verified_by_its_deadline(snap: WorkerSnapshot, now: float,
                                                                          verdict: PH.Verdict, said: str) -> None:
    out = PH.wake_outcome(snap, wake_rec(), now=at(now), timeout=60)
    assert out.verdict == verdict, out
    if verdict == PH.Verdict.FAILED:
        assert out.reason == Reason.WAKE_FAILED and said in out.message, out.message
    else:
        assert out.left == pytest.approx(60 - now)


def test_a_wake_past_its_deadline_names_the_verification_it_was_at() -> None:
    v = Verification(wake_id="a1", reason=Reason.VERIFYING, started=at(10),
                     message="pinned request refused, trying again: HTTP 400")
    out = PH.wake_outcome(ws(desired="Active", state="Active"), wake_rec(v), now=at(61), timeout=60)
    assert out.verdict == PH.Verdict.FAILED and "pinned request refused" in out.message


# -- the refusal, remembered --------------------------------------------------------------------------

def refused_rec(reason: Reason = Reason.SECCOMP_OFF) -> ControllerRecord:
    cap = op(10, 12, False, "c1")
    cap.error = ErrorRecord(reason=reason, message="filter off", at=at(11))
    return ControllerRecord(quiesce=op(0, 10, True, "q1"), capture=cap)


def test_a_permanent_refusal_is_remembered_once_active_was_asked_back_with_what_it_depends_on() -> None:
    policy = Policy(enabled=True, tier=Tier.SNAPSHOT)
    assert PH.refusal_to_remember(ws(desired="Suspended"), refused_rec(), policy=policy) is None  # not yet
    ref = PH.refusal_to_remember(ws(desired="Active", generation=4), refused_rec(), policy=policy)
    assert ref is not None
    assert (ref.reason, ref.capture_id, ref.pod_uid, ref.generation) == (Reason.SECCOMP_OFF, "c1", UID, 4)
    assert ref.policy_hash == PH.policy_hash(policy)
    # once on record, not again; a refusal that can heal never
    remembered = refused_rec()
    remembered.refusal = ref
    assert PH.refusal_to_remember(ws(desired="Active"), remembered, policy=policy) is None
    assert PH.refusal_to_remember(ws(desired="Active"), refused_rec(Reason.WORKER_SERVING), policy=policy) is None
    # asked again since (a quiesce after that capture, the refusal dropped from the record): not again
    again = refused_rec()
    again.quiesce = op(20, op_id="q2")
    assert PH.refusal_to_remember(ws(desired="Active"), again, policy=policy) is None


def test_a_refusal_holds_until_the_pod_the_spec_or_the_policy_changes() -> None:
    policy = Policy(enabled=True, tier=Tier.SNAPSHOT)
    ref = Refusal(reason=Reason.PID_RESERVATION_MISSING, at=T0, capture_id="c1", pod_uid=UID, generation=4,
                  policy_hash=PH.policy_hash(policy))
    assert PH.refusal_holds(ref, pod_uid=UID, generation=4, policy=Policy(enabled=True, tier=Tier.SNAPSHOT))
    assert not PH.refusal_holds(ref, pod_uid="00000001-2222-3333-4444-666666666666", generation=4, policy=policy)
    assert not PH.refusal_holds(ref, pod_uid=UID, generation=5, policy=policy)
    assert not PH.refusal_holds(ref, pod_uid=UID, generation=4, policy=Policy(enabled=True, tier=Tier.SUSPEND))
    assert not PH.refusal_holds(ref, pod_uid=UID, generation=4,
                                policy=Policy(enabled=True, tier=Tier.SNAPSHOT, idle_after=60))
    assert not PH.refusal_holds(None, pod_uid=UID, generation=4, policy=policy)
