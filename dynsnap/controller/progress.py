"""How `dynsnap suspend|wake` tell progress and outcome from a worker's WorkerSnapshot (layer:
controller; pure).

``Tracker(action, initial)`` is made from the WorkerSnapshot as it was before the request; each
``observe(ws)`` after it gives the lines that are news since the last one (state changes, each new
step of the controller's quiesce and of the agent's capture or wake with the seconds it took,
condition changes, failures, the verification as it goes) and, once there is one, the ``Outcome``:

- suspend: ``state`` Suspended with the ``Suspended`` condition True while Suspended is wanted
  (exit 0); a failure newer than the one on record at the start (the ``Degraded`` condition and
  ``status.lastError``), or the worker Lost (exit 1).
- wake: the worker back in Active (Active wanted, nothing under way, no quiesce open) and the
  controller's verification of that return (``dynsnap.controller.userview``: one that started after
  the last quiesce, or, with none on record, one naming the last wake): ``ok`` true (exit 0), false
  (exit 1, with the reason and the fallback). A worker that was awake and proven all along is done at
  once ("already active"); one that never slept too; one whose capture the override called off ends
  with the controller's proof of its return (wake id ``recall-<quiesce id>``). Lost: exit 1.

A verification on record before the request decides nothing unless the worker is settled in
Active; a Verified condition without the record never does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

from dynsnap.controller import userview as U
from dynsnap.k8s.times import now as utcnow
from dynsnap.models.protocol import ConditionType, DesiredState, ObservedState
from dynsnap.models.workersnapshot import WorkerSnapshot

Obj = dict[str, Any]

OK: Final = 0
FAILED: Final = 1
USAGE: Final = 2  # bad input or a refused request: nothing was changed
TIMEOUT: Final = 3

SUSPEND: Final = "suspend"
WAKE: Final = "wake"
OVERRIDE_VALUE: Final = {SUSPEND: "Suspended", WAKE: "Active"}  # the WorkerSnapshot's dynsnap.io/override


@dataclass(frozen=True)
class Outcome:
    code: int
    line: str


@dataclass
class Update:
    lines: list[str] = field(default_factory=list)
    outcome: Outcome | None = None


def _error_mark(ws: WorkerSnapshot) -> tuple[str, str] | None:
    """What identifies the failure on record: a new failure has another (a repeat moves ``at``)."""
    cond = ws.condition(ConditionType.DEGRADED)
    if cond is None or cond.status != "True":
        return None
    err = ws.status.last_error
    return (cond.reason, err.at.isoformat() if err is not None else cond.last_transition_time.isoformat())


def _steps_note(op: U.Op) -> str:
    return ", ".join(f"{n} {s:.2f}s" for n, s in op.steps)


class Tracker:
    """Follows one worker's WorkerSnapshot after a suspend or wake request: each observation gives
    the lines that are new since the last one and, once there is one, the outcome (pure)."""

    def __init__(self, action: str, initial: Obj) -> None:
        if action not in OVERRIDE_VALUE:
            raise ValueError(f"unknown action {action!r}")
        self.action = action
        first = U.parse(initial)
        lw = first.status.last_wake
        # A wake already finished when the command started is not the one it asked for; an open one is.
        self.baseline_wake = lw.id if lw is not None and lw.finished is not None else None
        self.baseline_error = _error_mark(first)
        p0 = self.last_proof = U.row(initial).proof
        # A final verification on record before the request decides nothing unless the worker is
        # awake and settled (then it is the answer: nothing to wake).
        self.baseline_proof = (p0.wake_id, p0.when) if p0 is not None and p0.ok is not None else None
        self._woken_noted: str | None = None
        self._printed: dict[str, int] = {}  # operation id -> steps already printed
        self._conditions: dict[str, tuple[str, str]] = {c.type: (c.status, c.reason) for c in first.status.conditions}
        self._state = U.state_cell(U.row(initial))
        self._decision = first.status.controller.decision if first.status.controller else None
        self._verify: tuple[Any, ...] | None = None
        self._error = self.baseline_error
        self.last: U.Row = U.row(initial)
        for op in (first.status.last_capture, first.status.last_wake,
                   first.status.controller.quiesce if first.status.controller else None):
            if op is not None:  # what was on record before the request is not news
                self._printed[op.id] = len(op.steps)

    def deleted(self) -> Outcome:
        return Outcome(FAILED, "the WorkerSnapshot was deleted (the pod is gone, or dynsnap stopped managing it); "
                               f"last seen: {U.summary(self.last, utcnow())}")

    def observe(self, obj: Obj) -> Update:
        ws = U.parse(obj)
        r = U.row(obj)
        self.last = r
        out = Update()
        state = U.state_cell(r)
        if state != self._state:
            out.lines.append(f"state {self._state} -> {state}")
            self._state = state
        ctl = ws.status.controller
        if ctl is not None and ctl.decision and ctl.decision != self._decision:
            out.lines.append(f"controller: {ctl.decision}")
            self._decision = ctl.decision
        if ctl is not None and ctl.quiesce is not None:
            self._steps(out, "quiesce", U.Op.of(ctl.quiesce))
        self._steps(out, "capture", r.last_capture)
        self._steps(out, "wake", r.last_wake)
        for c in ws.status.conditions:
            if c.type == ConditionType.PROGRESSING.value:
                continue  # the steps say it better
            if self._conditions.get(c.type) != (c.status, c.reason):
                self._conditions[c.type] = (c.status, c.reason)
                out.lines.append(f"{c.type}={c.status} {c.reason}" + (f": {c.message}" if c.message else ""))
        mark = _error_mark(ws)
        new_error = mark is not None and mark != self._error
        self._error = mark
        if new_error and ws.status.last_error is not None:
            e = ws.status.last_error
            out.lines.append(f"failed at {e.step or '?'}: {e.reason.value}: {e.message}")
        out.outcome = self._suspend_outcome(ws, r) if self.action == SUSPEND else self._wake_outcome(ws, r, out)
        return out

    def _steps(self, out: Update, what: str, op: U.Op | None) -> None:
        if op is None:
            return
        done = self._printed.get(op.id, 0)
        for name, seconds in op.steps[done:]:
            out.lines.append(f"{what}: {name} {seconds:.2f}s")
        self._printed[op.id] = len(op.steps)

    def _suspend_outcome(self, ws: WorkerSnapshot, r: U.Row) -> Outcome | None:
        suspended = ws.condition(ConditionType.SUSPENDED)
        if (ws.status.state == ObservedState.SUSPENDED and suspended is not None and suspended.status == "True"
                and ws.spec.desired_state == DesiredState.SUSPENDED
                and (r.last_capture is None or not r.last_capture.open)):
            how = (f" (captured in {r.last_capture.seconds:.2f}s: {_steps_note(r.last_capture)})"
                   if r.last_capture is not None and r.last_capture.steps else "")
            return Outcome(OK, f"suspended, tier {r.tier}{how}")
        mark = _error_mark(ws)
        if mark is not None and mark != self.baseline_error:
            cond = ws.condition(ConditionType.DEGRADED)
            assert cond is not None
            return Outcome(FAILED, f"capture FAILED: Degraded {cond.reason}: {cond.message}")
        if ws.status.state == ObservedState.LOST:
            return Outcome(FAILED, f"the worker is Lost: it cannot come back in place ({U.summary(r, utcnow())})")
        return None

    def _wake_outcome(self, ws: WorkerSnapshot, r: U.Row, out: Update) -> Outcome | None:
        if ws.status.state == ObservedState.LOST:
            return Outcome(FAILED, f"the worker is Lost: it cannot be woken in place ({U.summary(r, utcnow())})")
        wake = r.last_wake
        followed = wake is not None and wake.id != self.baseline_wake
        if followed and wake is not None and not wake.open and self._woken_noted != wake.id:
            self._woken_noted = wake.id
            out.lines.append(f"woken in {wake.seconds:.2f}s ({_steps_note(wake)})")
        settled = (ws.status.state == ObservedState.ACTIVE and ws.spec.desired_state == DesiredState.ACTIVE
                   and not r.quiescing and (r.last_capture is None or not r.last_capture.open)
                   and (wake is None or not wake.open))
        p = r.proof if r.proof_current else None
        sig = (r.pending, p.wake_id if p else None, p.ok if p else None, p.answered if p else None)
        if sig != self._verify:
            self._verify = sig
            if r.pending and settled:
                out.lines.append("waiting for the controller's verification")
            elif p is not None and p.ok is None:
                out.lines.append(f"verifying: {p.answered}/{p.requests} pinned requests answered")
        if p is not None and p.ok is not None and (settled or (p.wake_id, p.when) != self.baseline_proof):
            prefix = "" if followed else "already active; "
            took = f", woken in {wake.seconds:.2f}s" if followed and wake is not None else ""
            if p.ok:
                by = f" by worker {p.worker_id}" if p.worker_id is not None else ""
                return Outcome(OK, f"{prefix}verified: {p.answered}/{p.requests} pinned requests answered{by} "
                                   f"(wake {p.wake_id}{took})")
            return Outcome(FAILED, f"{prefix}verification FAILED: {p.reason}: {p.message or '(no message)'}; "
                                   f"fallback: {p.fallback or 'none'} (wake {p.wake_id})")
        if settled and not r.pending and p is None and wake is None and r.proof is None:
            return Outcome(OK, "active: the worker never slept, nothing to wake")
        return None
