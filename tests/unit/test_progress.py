"""`dynsnap suspend|wake`'s progress tracker (pure): from the WorkerSnapshots it sees after a request, the
progress lines it prints and the outcome it exits with."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from test_userview import CAPTURED, WOKEN, cond, op, t, verification, ws

from dynsnap.controller.progress import FAILED, OK, SUSPEND, WAKE, Tracker


def evolve(base: dict[str, Any], *, desired: str | None = None, **status: Any) -> dict[str, Any]:
    out = copy.deepcopy(base)
    if desired is not None:
        out["spec"]["desiredState"] = desired
    out["status"].update(status)
    return out


ASLEEP = ws(desired="Suspended", status={
    "state": "Suspended", "lastCapture": CAPTURED, "lastWake": WOKEN,
    "controller": {"verification": verification("w1", ok=True, finished=900)},
    "conditions": [cond("Suspended", "True", "Suspended"), cond("Verified", "True", "Verified")]})


def test_wake_ends_only_with_the_verification_of_the_new_wake() -> None:
    tr = Tracker(WAKE, ASLEEP)
    steps: list[tuple[str, float]] = [("wake", 0.1)]
    waking = evolve(ASLEEP, desired="Active", state="Waking", lastWake=op("w2", steps, started=3))
    upd = tr.observe(waking)
    assert upd.lines == ["state Suspended -> Waking", "wake: wake 0.10s"] and upd.outcome is None
    steps += [("restore", 1.5), ("resume", 0.5), ("settle-active", 0.1)]
    woken = evolve(waking, state="Active", lastWake=op("w2", steps, started=3, finished=1, ok=True),
                   conditions=[cond("Suspended", "False", "Active"), cond("Verified", "True", "Verified")])
    upd = tr.observe(woken)
    # the old wake's verification (w1, ok) is no proof of this one
    assert upd.outcome is None
    assert upd.lines == ["state Waking -> Active", "wake: restore 1.50s", "wake: resume 0.50s",
                         "wake: settle-active 0.10s", "Suspended=False Active",
                         "woken in 2.20s (wake 0.10s, restore 1.50s, resume 0.50s, settle-active 0.10s)",
                         "waiting for the controller's verification"]
    verifying = evolve(woken, controller={"verification": verification("w2", ok=None, answered=1, finished=None,
                                                                        reason="Verifying")})
    upd = tr.observe(verifying)
    assert upd.lines == ["verifying: 1/3 pinned requests answered"] and upd.outcome is None
    assert tr.observe(verifying).lines == []  # nothing new, nothing printed
    done = evolve(woken, controller={"verification": verification("w2", ok=True)})
    upd = tr.observe(done)
    assert upd.outcome is not None and upd.outcome.code == OK
    assert upd.outcome.line == "verified: 3/3 pinned requests answered by worker 7 (wake w2, woken in 2.20s)"


def test_wake_whose_verification_fails_exits_1_with_reason_and_fallback() -> None:
    tr = Tracker(WAKE, ASLEEP)
    failed = evolve(ASLEEP, desired="Active", state="Active",
                    lastWake=op("w2", [("wake", 0.1), ("settle-active", 0.1)], started=3, finished=1, ok=True),
                    controller={"verification": verification("w2", ok=False, answered=0,
                                                             reason="AnsweredByAnotherWorker",
                                                             message="request 1 answered by worker 9",
                                                             fallback="ColdRestart")})
    upd = tr.observe(failed)
    assert upd.outcome is not None and upd.outcome.code == FAILED
    assert upd.outcome.line == ("verification FAILED: AnsweredByAnotherWorker: request 1 answered by worker 9; "
                                "fallback: ColdRestart (wake w2)")


def test_wake_of_a_worker_that_never_slept_is_done_at_once() -> None:
    awake = ws(status={"state": "Active", "idle": {"inflight": 0, "idleSince": t(5)}})
    upd = Tracker(WAKE, awake).observe(awake)
    assert upd.outcome is not None and upd.outcome.code == OK and "never slept" in upd.outcome.line


def test_wake_of_an_awake_worker_reports_its_last_verification() -> None:
    awake = ws(status={"state": "Active", "lastWake": WOKEN,
                       "controller": {"verification": verification("w1", ok=True)}})
    upd = Tracker(WAKE, awake).observe(awake)
    assert upd.outcome is not None and upd.outcome.code == OK
    assert upd.outcome.line.startswith("already active; verified: 3/3")


def test_wake_of_a_worker_being_quiesced_ends_with_the_proof_of_its_return() -> None:
    # The controller proves every return from a quiesce, a capture called off too (wake id
    # recall-<quiesce id>): the proof of the wake before the quiesce no longer counts.
    quiescing = ws(status={"state": "Active", "lastWake": WOKEN,
                           "controller": {"verification": verification("w1", ok=True, started=40, finished=30),
                                          "quiesce": op("q1", [("serving-gate", 0.01)], started=5)}})
    tr = Tracker(WAKE, quiescing)
    assert tr.observe(quiescing).outcome is None
    called_off = evolve(quiescing, controller={
        "verification": verification("w1", ok=True, started=40, finished=30),
        "quiesce": op("q1", [("serving-gate", 0.01)], started=5, finished=3, ok=False),
        "decision": "capture called off: manual override"})
    upd = tr.observe(called_off)
    assert upd.lines == ["state Active (quiescing) -> Active", "controller: capture called off: manual override",
                         "waiting for the controller's verification"]
    assert upd.outcome is None
    recalled = evolve(called_off, controller={
        "verification": verification("recall-q1", ok=True, started=2, finished=1),
        "quiesce": op("q1", [("serving-gate", 0.01)], started=5, finished=3, ok=False),
        "decision": "verified"})
    upd = tr.observe(recalled)
    assert upd.outcome is not None and upd.outcome.code == OK
    assert upd.outcome.line == ("already active; verified: 3/3 pinned requests answered by worker 7 "
                                "(wake recall-q1)")


def test_a_failed_verification_on_record_decides_only_for_a_settled_worker() -> None:
    failed_before = evolve(ASLEEP, controller={"verification": verification(
        "w1", ok=False, answered=0, reason="PinnedRequestFailed", fallback="ColdRestart")})
    tr = Tracker(WAKE, failed_before)
    assert tr.observe(failed_before).outcome is None  # asleep: that failure is history, a wake is coming
    upd = tr.observe(evolve(failed_before, desired="Active", state="Active",
                            lastWake=op("w2", [("wake", 0.1)], started=3, finished=2, ok=True)))
    assert upd.outcome is None and upd.lines[-1] == "waiting for the controller's verification"


def test_wake_of_a_lost_worker_fails() -> None:
    tr = Tracker(WAKE, ASLEEP)
    upd = tr.observe(evolve(ASLEEP, desired="Active", state="Lost"))
    assert upd.outcome is not None and upd.outcome.code == FAILED and "Lost" in upd.outcome.line


def test_suspend_follows_quiesce_and_capture_to_suspended() -> None:
    awake = ws(status={"state": "Active", "lastCapture": CAPTURED, "lastWake": WOKEN,
                       "controller": {"verification": verification("w1", ok=True)}})
    tr = Tracker(SUSPEND, awake)
    quiescing = evolve(awake, controller={"verification": verification("w1", ok=True),
                                          "quiesce": op("q2", [("serving-gate", 0.02)], started=5),
                                          "decision": "suspend: manual override"})
    upd = tr.observe(quiescing)
    assert upd.lines == ["state Active -> Active (quiescing)", "controller: suspend: manual override",
                         "quiesce: serving-gate 0.02s"] and upd.outcome is None
    quiesced = {"verification": verification("w1", ok=True), "decision": "suspend: manual override",
                "quiesce": op("q2", [("serving-gate", 0.02), ("endpoint-not-ready", 1.0)], started=5, finished=3,
                              ok=True)}
    capturing = evolve(quiescing, desired="Suspended", state="Capturing", controller=quiesced,
                       lastCapture=op("c2", [("quiesce", 0.2)], started=2))
    upd = tr.observe(capturing)
    assert upd.lines == ["state Active (quiescing) -> Capturing", "quiesce: endpoint-not-ready 1.00s",
                         "capture: quiesce 0.20s"] and upd.outcome is None
    asleep = evolve(capturing, state="Suspended", conditions=[cond("Suspended", "True", "Suspended")],
                    lastCapture=op("c2", [("quiesce", 0.2), ("save", 1.3), ("settle-suspended", 0.1)], started=2,
                                   finished=0, ok=True))
    upd = tr.observe(asleep)
    assert upd.outcome is not None and upd.outcome.code == OK
    assert upd.outcome.line == "suspended, tier suspend (captured in 1.60s: quiesce 0.20s, save 1.30s, " \
                               "settle-suspended 0.10s)"


def test_suspended_state_while_something_else_is_wanted_is_not_done() -> None:
    tr = Tracker(SUSPEND, evolve(ASLEEP, desired="Active"))
    assert tr.observe(evolve(ASLEEP, desired="Active")).outcome is None
    assert tr.observe(ASLEEP).outcome is not None


@pytest.mark.parametrize("stale", [False, True])
def test_suspend_fails_on_a_new_failure_only(stale: bool) -> None:
    err = {"reason": "CheckpointFailed", "message": "cuCheckpointProcessCheckpoint: 999", "step": "save", "at": t(60)}
    base = ws(status={"state": "Active"})
    if stale:  # a failure from before the command: the agent is in its backoff, not a new failure
        base = evolve(base, lastError=err, conditions=[cond("Degraded", "True", "CheckpointFailed", err["message"])])
    tr = Tracker(SUSPEND, base)
    assert tr.observe(evolve(base, desired="Suspended")).outcome is None
    again = evolve(base, desired="Suspended", lastError=err | {"at": t(1)},
                   conditions=[cond("Degraded", "True", "CheckpointFailed", err["message"])])
    upd = tr.observe(again)
    assert upd.outcome is not None and upd.outcome.code == FAILED
    assert upd.outcome.line == "capture FAILED: Degraded CheckpointFailed: cuCheckpointProcessCheckpoint: 999"
    assert "failed at save: CheckpointFailed: cuCheckpointProcessCheckpoint: 999" in upd.lines


def test_deleted_workersnapshot_fails_with_what_was_last_seen() -> None:
    tr = Tracker(WAKE, ASLEEP)
    out = tr.deleted()
    assert out.code == FAILED and "deleted" in out.line and "state Suspended" in out.line
