"""The agent's part of a WorkerSnapshot's status, computed from what it read and what a step did:
conditions (Accepted, Progressing, Suspended, Degraded), the observed state, the capture and wake
records with each step's timing, the last error.

One rule holds every write together: the conditions say what the state says. A worker the agent
cannot see (refused, or its processes gone) is ``state: Unknown`` with ``Suspended`` Unknown for the
same reason, never a ``Suspended=True`` left from before; a worker that is lost is ``Suspended=False``
for ``WorkerLost``, never "serving" (issue 18: after WorkerLost a status read Unknown, PodNotFound and a
stale Suspended=True at once).

Layer: ``dynsnap.agent`` (pure: status in, status out; the driver in node.py writes it).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from dynsnap.agent.admission import Verdict
from dynsnap.agent.images import new_capture_id
from dynsnap.agent.plan import CAPTURE_STEPS, WAKE_STEPS, Step
from dynsnap.agent.steps import Observation, StepFailure, StepResult
from dynsnap.models import protocol as P
from dynsnap.models.protocol import ConditionType as CT
from dynsnap.models.protocol import DesiredState, ObservedState, Reason, Tier
from dynsnap.models.workersnapshot import (
    STATUS_PIDS_MAX,
    ErrorRecord,
    GpuMemory,
    IdleFacts,
    ImageRef,
    OperationRecord,
    PidRecord,
    StepTiming,
    WorkerSnapshot,
    WorkerSnapshotStatus,
    set_condition,
    utcnow,
)

Obj = dict[str, Any]

# The steps that end a capture (the worker asleep) and those that end a wake (serving again).
FINAL_STEPS = frozenset({Step.SETTLE_SUSPENDED, Step.SETTLE_SNAPSHOTTED, Step.ENGINE_SLEEP})
ACTIVE_STEPS = frozenset({Step.SETTLE_ACTIVE, Step.ENGINE_WAKE})


def is_open(rec: OperationRecord | None) -> bool:
    return rec is not None and rec.finished is None


def woken_by_request(ws: WorkerSnapshot, status: WorkerSnapshotStatus | None = None) -> bool:
    """The latest wake is the agent's own, for a request that reached the worker asleep routable, under
    the spec it still has: until the controller writes the spec again (Active, then maybe Suspended),
    the worker stays awake whatever the spec's Suspended says."""
    w = (status or ws.status).last_wake
    return w is not None and w.trigger == "request" and w.generation == ws.metadata.generation


def accepted(ws: WorkerSnapshot, status: WorkerSnapshotStatus) -> WorkerSnapshotStatus:
    status.observed_generation = ws.metadata.generation
    status.conditions = set_condition(status.conditions, CT.ACCEPTED, True, Reason.ACCEPTED,
                                      "the pod runs here under dynsnap-entrypoint",
                                      generation=ws.metadata.generation)
    return status


def refused(ws: WorkerSnapshot, v: Verdict, *, accepted: bool | None = False) -> WorkerSnapshotStatus:
    """The status of a worker the agent does not act on (``accepted`` False) or cannot see now (None):
    its state and whether it sleeps are unknown, for that reason; nothing of the agent's is under way."""
    status = ws.status.model_copy(deep=True)
    gen = ws.metadata.generation
    status.observed_generation = gen
    status.state = ObservedState.UNKNOWN
    status.conditions = set_condition(status.conditions, CT.ACCEPTED, accepted, v.reason, v.message, generation=gen)
    status.conditions = set_condition(status.conditions, CT.SUSPENDED, None, v.reason,
                                      "unknown: the agent does not see the worker", generation=gen)
    status.conditions = set_condition(status.conditions, CT.PROGRESSING, False, v.reason, "", generation=gen)
    return status


def _suspended(ws: WorkerSnapshot, status: WorkerSnapshotStatus, ep_state: P.EntrypointState | None) -> None:
    """The Suspended condition as the state says; ``ep_state`` None: mid-operation (no settled words)."""
    gen = ws.metadata.generation
    if status.state == ObservedState.LOST:
        status.conditions = set_condition(status.conditions, CT.SUSPENDED, False, Reason.WORKER_LOST,
                                          "the worker is gone and cannot come back in place: its container "
                                          "starts it cold", generation=gen)
        return
    asleep = status.state == ObservedState.SUSPENDED
    if ep_state is None:
        status.conditions = set_condition(status.conditions, CT.SUSPENDED, asleep,
                                          Reason.SUSPENDED if asleep else Reason.ACTIVE, "", generation=gen)
        return
    words = {P.EntrypointState.SNAPSHOTTED: (Reason.SNAPSHOTTED, "asleep: GPU memory freed"),
             P.EntrypointState.ROUTABLE: (Reason.ROUTABLE, "asleep, routable: GPU memory freed, still in serving; "
                                          "its first request wakes it")}
    reason, text = words.get(ep_state, (Reason.SUSPENDED, "asleep: GPU memory freed")) if asleep else (
        Reason.ACTIVE, "serving")
    status.conditions = set_condition(status.conditions, CT.SUSPENDED, asleep, reason, text, generation=gen)


def settled(ws: WorkerSnapshot, status: WorkerSnapshotStatus, obs: Observation) -> WorkerSnapshotStatus:
    status.state = obs.state
    _suspended(ws, status, obs.worker.state)
    status.conditions = set_condition(status.conditions, CT.PROGRESSING, False, Reason.IDLE, "",
                                      generation=ws.metadata.generation)
    return status


def progressing(ws: WorkerSnapshot, status: WorkerSnapshotStatus, step: Step) -> WorkerSnapshotStatus:
    reason = Reason.CAPTURING if step in CAPTURE_STEPS else Reason.WAKING
    if step in (Step.GPU_ROLLBACK, Step.GIVE_UP):
        reason = Reason.ROLLING_BACK
    status.conditions = set_condition(status.conditions, CT.PROGRESSING, True, reason, f"last step: {step.value}",
                                      generation=ws.metadata.generation)
    _suspended(ws, status, None)
    return status


def open_record(status: WorkerSnapshotStatus, obs: Observation, step: Step, *, tier: Tier, want: DesiredState,
                trace_context: str | None) -> None:
    """The record a step starts: a capture's at its quiesce from active, a wake's at its wake; else the
    record of an operation an agent that died had started (:func:`adopt`)."""
    if step == Step.QUIESCE and obs.worker.state == P.EntrypointState.ACTIVE:
        status.last_capture = OperationRecord(id=new_capture_id(), tier=tier, started=utcnow(),
                                              trace_context=trace_context)
        status.image = None
    elif step == Step.WAKE:
        status.last_wake = OperationRecord(id=new_capture_id(), tier=tier, started=utcnow(),
                                           trace_context=trace_context)
    else:
        adopt(status, obs, step, tier=tier, want=want, trace_context=trace_context)


def adopt(status: WorkerSnapshotStatus, obs: Observation, step: Step, *, tier: Tier, want: DesiredState,
          trace_context: str | None = None) -> None:
    """Open a record for a capture or wake that an agent which died started. Quiesce and wake open
    theirs, but status is written only after the entrypoint acknowledged them: an agent killed in
    between leaves the operation under way and no record of it. This agent's steps then go into a
    record of their own, so their outcome is reported, not lost."""
    if is_open(status.last_capture) or is_open(status.last_wake):
        return
    if step in CAPTURE_STEPS and want == DesiredState.SUSPENDED:
        status.last_capture = OperationRecord(id=new_capture_id(), tier=tier, started=utcnow(),
                                              trace_context=trace_context)
        status.image = None
    elif step in WAKE_STEPS and obs.worker.state in (P.EntrypointState.RESTORING, P.EntrypointState.ROUTABLE):
        # (a wake from routable has no `wake` step: it is resumed where it sleeps, still in serving)
        status.last_wake = OperationRecord(id=new_capture_id(), tier=tier, started=utcnow(),
                                           trace_context=trace_context)


def close_settled(status: WorkerSnapshotStatus, obs: Observation) -> bool | None:
    """Close the open record of an operation the worker has completed with nothing left to do: the
    entrypoint applied the last request (suspended, snapshotted, active) of an agent that died
    before recording it. Returns whether the closed one was a capture; None when none was open."""
    if obs.state == ObservedState.SUSPENDED and is_open(status.last_capture) and not is_open(status.last_wake):
        rec, asleep = status.last_capture, True
    elif obs.state == ObservedState.ACTIVE and is_open(status.last_wake):
        rec, asleep = status.last_wake, False
    else:
        return None
    assert rec is not None
    rec.finished = utcnow()
    rec.ok = True
    return asleep


def end_wait(status: WorkerSnapshotStatus, seconds: float) -> None:
    """The wait for a helper is over: its one entry in the open record gets the time it took."""
    for rec in (status.last_wake, status.last_capture):
        if is_open(rec) and rec is not None and rec.steps and rec.steps[-1].name == Step.WAIT_HELPER.value:
            rec.steps[-1].seconds = round(max(seconds, 0.0), 4)
            return


def record(status: WorkerSnapshotStatus, step: Step, result: StepResult) -> None:
    """A step's timing and findings in the open record (the wake's, else the capture's)."""
    rec = status.last_wake if is_open(status.last_wake) else None
    if rec is None and is_open(status.last_capture):
        rec = status.last_capture
    if rec is None:
        return
    rec.steps.append(StepTiming(name=step.value, seconds=round(result.seconds, 4)))
    info = result.info
    if "pids" in info:
        every = sorted(info["pids"], key=lambda p: not p["gpu"])  # GPU processes first (a stable sort)
        rec.pids = [PidRecord(host=p["host"], ns=p["ns"], gpu=p["gpu"]) for p in every[:STATUS_PIDS_MAX]]
        rec.pids_omitted = max(len(every) - STATUS_PIDS_MAX, 0) or None
    if "gpus" in info:
        rec.gpus = [GpuMemory(uuid=g["uuid"], free_before=g.get("freeBefore"), free_after=g.get("freeAfter"))
                    for g in info["gpus"]]
    if "imageBytes" in info:
        rec.image_bytes = int(info["imageBytes"])
    if "image" in info:
        rec.image = ImageRef(**info["image"])
        status.image = rec.image
    if step in FINAL_STEPS or step in ACTIVE_STEPS:
        rec.finished = utcnow()
        rec.ok = True
    if step == Step.CLEANUP:
        status.image = None


def failed(ws: WorkerSnapshot, status: WorkerSnapshotStatus, step: Step, f: StepFailure) -> None:
    """A step's failure on record: the last error, the count, the open records (a capture ends at a
    failure of one of its steps or at any refusal; a wake stays open and is retried), Degraded."""
    now = utcnow()
    err = ErrorRecord(reason=f.reason, message=f.message[:4000], step=step.value, at=now,
                      generation=ws.metadata.generation)
    status.last_error = err
    status.consecutive_failures = (status.consecutive_failures or 0) + 1
    for rec in (status.last_capture, status.last_wake):
        if rec is not None and rec.finished is None:
            rec.steps.append(StepTiming(name=step.value, seconds=0.0))
            rec.error = err
            if step in CAPTURE_STEPS or f.changed is False:
                rec.finished = now
                rec.ok = False
    status.conditions = set_condition(status.conditions, CT.DEGRADED, True, f.reason, f.message,
                                      generation=ws.metadata.generation)


def interrupted(ws: WorkerSnapshot, status: WorkerSnapshotStatus, obs: Observation, step: Step,
                want: DesiredState) -> str | None:
    """Why a GPU rollback is needed with no failure on record, or None: GPU processes mid-way with no
    helper running for them, so the agent (and its helper) died during a save. Named, not silently
    redone (Degraded=True, Interrupted)."""
    if step != Step.GPU_ROLLBACK or status.last_error is not None:
        return None
    if not (want == DesiredState.SUSPENDED or obs.worker.state == P.EntrypointState.ACTIVE
            or any(s in ("locked", "failed") for s in obs.gpu_states.values())):
        return None
    stuck = {str(p): s for p, s in obs.gpu_states.items() if s != "running"}
    why = (f"GPU processes found {stuck} with no helper running for them: a save was interrupted (the "
           "agent or its dynsnap-cuda died mid-way); rolling them back to running")
    status.conditions = set_condition(status.conditions, CT.DEGRADED, True, Reason.INTERRUPTED, why,
                                      generation=ws.metadata.generation)
    return why


def finished(ws: WorkerSnapshot, status: WorkerSnapshotStatus, *, asleep: bool) -> str:
    """A capture (``asleep``) or a wake reached its state: failures are behind it, Degraded says what
    was recovered from, if anything was. Returns the note of its Event."""
    prior = next((c for c in status.conditions if c.type == CT.DEGRADED.value and c.status == "True"), None)
    note = f"recovered from {prior.reason}: {prior.message}" if prior is not None else ""
    status.consecutive_failures = 0
    status.last_error = None
    status.conditions = set_condition(status.conditions, CT.DEGRADED, False, Reason.RECOVERED, note,
                                      generation=ws.metadata.generation)
    return done_note(status, asleep=asleep)


def done_note(status: WorkerSnapshotStatus, *, asleep: bool) -> str:
    rec = status.last_capture if asleep else status.last_wake
    if rec is None:
        return "asleep" if asleep else "active"
    total = sum(s.seconds for s in rec.steps)
    steps = ", ".join(f"{s.name} {s.seconds:.2f}s" for s in rec.steps)
    return f"{'captured' if asleep else 'woken'} in {total:.2f}s ({steps})"


def agent_owned(status: WorkerSnapshotStatus) -> Obj:
    """The status fields the agent applies: everything but the controller's record and conditions.
    Sending those back (even unchanged, from a stale read) would take them over under force and
    could undo a verification the controller wrote meanwhile."""
    wire = status.wire()
    wire.pop("controller", None)
    wire["conditions"] = [c for c in wire.get("conditions", []) if c["type"] not in P.CONTROLLER_CONDITIONS]
    return wire


def gpu_bytes_freed(capture: Obj | None) -> int:
    """Bytes of GPU memory a capture freed (free memory after minus before, per GPU), from its record."""
    total = 0
    for g in (capture or {}).get("gpus") or []:
        before, after = g.get("freeBefore"), g.get("freeAfter")
        if isinstance(before, int) and isinstance(after, int) and after > before:
            total += after - before
    return total


def idle_for(facts: IdleFacts | None, now: datetime | None = None) -> float | None:
    if facts is None or facts.idle_since is None:
        return None
    return ((now or datetime.now(UTC)) - facts.idle_since).total_seconds()
