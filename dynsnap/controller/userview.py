"""What `dynsnap status` shows of a worker: a WorkerSnapshot (and its pod) as one table row (layer:
controller; pure).

``row(ws, pod)`` reads the WorkerSnapshot's status as the agent and the controller wrote it
(docs/CONTROLLER.md: who owns what) into a ``Row`` of plain values; ``cells(row, now)`` renders it
for a person, ``as_json(row, now)`` for a program, ``table(rows, now)`` lines them up. Nothing here
talks to the API server: the times are rendered against the ``now`` given, so the same objects
always give the same text.

The columns:

- DGD, COMPONENT: the Dynamo graph and component, from the labels Dynamo's operator puts on the
  worker pod (``nvidia.com/dynamo-graph-deployment-name``, ``nvidia.com/dynamo-component``), read
  from the WorkerSnapshot first when it carries them, else from the pod.
- STATE: ``status.state`` (Active, Capturing, Suspended, Waking, Lost, Unknown), with ``routable: its
  first request wakes it`` while it sleeps routable (wake on request: still in serving), ``quiescing``
  while the controller's quiesce record is open (the worker is being taken out of serving before a
  capture), ``degraded <Reason>`` while the Degraded condition is True, ``capture refused <Reason>``
  while the controller's record holds a refusal of the agent's for this pod and spec
  (``status.controller.refusal``: the worker is not asked to sleep again until the pod, its spec or
  the policy changes), ``pod replaced`` when the pod's UID is not the one the WorkerSnapshot names.
- IDLE FOR: since ``status.idle.idleSince``, the agent's last seen request ("-" while busy).
- LAST CAPTURE, LAST WAKE: the total of the per-step seconds and how long ago it finished;
  ``running <step>`` while under way, ``FAILED <Reason>`` when it failed.
- VERIFIED BY: the controller's proof (``status.controller.verification``) that the worker serves
  again after it was last taken out of serving: ``3/3 pinned 12s ago``, ``verifying 1/3``,
  ``FAILED <Reason> (fallback ColdRestart)``; ``pending`` while a worker back in Active still owes
  one; the ``Verified`` condition when there is no record. The controller proves every return from
  a quiesce, a wake or a capture called off before it began (then the record's ``wakeId`` is
  ``recall-<quiesce id>``), so a verification counts only if it started after the last quiesce;
  with no quiesce on record (a worker woken by hand), only if it names the last wake. A sleeping
  worker shows the proof of its last return (history).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from pydantic import ValidationError

from dynsnap.models import protocol as P
from dynsnap.models.protocol import ConditionType, ObservedState
from dynsnap.models.workersnapshot import Condition, OperationRecord, Refusal, Verification, WorkerSnapshot

Obj = dict[str, Any]

HEADER: Final = ("DGD", "COMPONENT", "POD", "STATE", "TIER", "IDLE FOR", "LAST CAPTURE", "LAST WAKE", "VERIFIED BY")
NONE: Final = "-"


@dataclass(frozen=True)
class Op:
    """One capture or wake as the table shows it."""

    id: str
    started: datetime
    finished: datetime | None
    ok: bool | None
    seconds: float  # the sum of the recorded steps: what the agent measured, not wall time
    steps: tuple[tuple[str, float], ...]
    reason: str | None  # why it failed

    @classmethod
    def of(cls, rec: OperationRecord | None) -> Op | None:
        if rec is None:
            return None
        steps = tuple((s.name, s.seconds) for s in rec.steps)
        return cls(id=rec.id, started=rec.started, finished=rec.finished, ok=rec.ok,
                   seconds=round(sum(s for _, s in steps), 4), steps=steps,
                   reason=rec.error.reason.value if rec.error is not None else None)

    @property
    def open(self) -> bool:
        return self.finished is None


@dataclass(frozen=True)
class Proof:
    """The controller's verification of a wake, or the Verified condition when there is no record."""

    wake_id: str | None
    ok: bool | None
    reason: str
    message: str
    requests: int
    answered: int
    worker_id: int | None
    fallback: str | None
    when: datetime | None  # finished, else started (a record) / the condition's last transition

    @classmethod
    def of(cls, v: Verification) -> Proof:
        return cls(wake_id=v.wake_id, ok=v.ok, reason=v.reason.value, message=v.message, requests=v.requests,
                   answered=v.answered, worker_id=v.worker_id, fallback=v.fallback, when=v.finished or v.started)

    @classmethod
    def of_condition(cls, c: Condition) -> Proof:
        ok = {"True": True, "False": False}.get(c.status)
        return cls(wake_id=None, ok=ok, reason=c.reason, message=c.message, requests=0, answered=0, worker_id=None,
                   fallback=None, when=c.last_transition_time)


@dataclass(frozen=True)
class Row:
    namespace: str
    pod: str
    dgd: str | None
    component: str | None
    state: str | None  # status.state; None before the agent wrote any status
    desired: str
    tier: str
    quiescing: bool
    degraded: str | None  # the Degraded condition's reason while it is True
    pod_replaced: bool
    idle_since: datetime | None
    inflight: int | None
    last_capture: Op | None
    last_wake: Op | None
    proof: Proof | None
    pending: bool  # back in Active, and no verification of that return yet
    proof_current: bool  # ``proof`` is of the worker's latest return to serving (not history)
    invalid: str | None = None  # the object did not parse: why
    refusal: Refusal | None = None  # a capture refused for good, standing for this pod and spec
    routable: bool = False  # asleep routable (wake on request): still in serving, its first request wakes it

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.pod}"


def parse(ws: Obj) -> WorkerSnapshot:
    return WorkerSnapshot.model_validate(ws)


def row(ws: Obj, pod: Obj | None = None) -> Row:
    """One row for one WorkerSnapshot; ``pod`` is its pod (None: not read, or gone)."""
    meta = ws.get("metadata") or {}
    try:
        snap = parse(ws)
    except ValidationError as e:
        # Not one of ours as the CRD defines it: show that it is there and why it is not readable.
        return Row(namespace=str(meta.get("namespace", "")), pod=str(meta.get("name", "")), dgd=None, component=None,
                   state=None, desired=NONE, tier=NONE, quiescing=False, degraded=None, pod_replaced=False,
                   idle_since=None, inflight=None, last_capture=None, last_wake=None, proof=None, pending=False,
                   proof_current=False,
                   invalid=f"{e.error_count()} invalid field(s): {e.errors()[0]['loc']}")
    labels = dict((pod or {}).get("metadata", {}).get("labels") or {})
    labels.update(snap.metadata.labels)  # the WorkerSnapshot's own copy wins: it needs no pod read
    st = snap.status
    ctl = st.controller
    degraded = snap.condition(ConditionType.DEGRADED)
    wake = Op.of(st.last_wake)
    proof, pending, current = _proof(snap, wake)
    pod_uid = (pod or {}).get("metadata", {}).get("uid")
    return Row(
        namespace=snap.metadata.namespace or "", pod=snap.spec.pod_name,
        dgd=labels.get(P.LABEL_DGD_NAME), component=labels.get(P.LABEL_COMPONENT),
        state=st.state.value if st.state is not None else None, desired=snap.spec.desired_state.value,
        tier=snap.spec.tier.value,
        quiescing=ctl is not None and ctl.quiesce is not None and ctl.quiesce.finished is None,
        degraded=degraded.reason if degraded is not None and degraded.status == "True" else None,
        pod_replaced=pod_uid is not None and pod_uid != snap.spec.pod_uid,
        idle_since=st.idle.idle_since if st.idle is not None else None,
        inflight=st.idle.inflight if st.idle is not None else None,
        last_capture=Op.of(st.last_capture), last_wake=wake, proof=proof, pending=pending,
        proof_current=current, refusal=_refusal(snap),
        routable=_routable(snap),
    )


def _routable(snap: WorkerSnapshot) -> bool:
    """Asleep routable: the agent's Suspended condition says so (reason Routable)."""
    sus = snap.condition(ConditionType.SUSPENDED)
    return sus is not None and sus.status == "True" and sus.reason == P.Reason.ROUTABLE.value


def _refusal(snap: WorkerSnapshot) -> Refusal | None:
    """The controller's refusal on record, while it is for this pod and this spec."""
    ref = snap.status.controller.refusal if snap.status.controller is not None else None
    if ref is None or ref.pod_uid != snap.spec.pod_uid or ref.generation != snap.metadata.generation:
        return None
    return ref


def _proof(snap: WorkerSnapshot, wake: Op | None) -> tuple[Proof | None, bool, bool]:
    """(the proof to show, whether one is owed, whether the one shown is current); see the module doc."""
    st = snap.status
    ctl = st.controller
    v = ctl.verification if ctl is not None else None
    q = ctl.quiesce if ctl is not None else None
    if v is not None and (v.started >= q.started if q is not None else wake is None or v.wake_id == wake.id):
        return Proof.of(v), False, True
    back = (st.state == ObservedState.ACTIVE and (wake is None or not wake.open)
            and (q is None or q.finished is not None) and (st.last_capture is None or st.last_capture.finished
                                                           is not None))
    if back and (q is not None or wake is not None):
        return None, True, False
    if v is not None:
        return Proof.of(v), False, False
    cond = snap.condition(ConditionType.VERIFIED)
    return (Proof.of_condition(cond) if cond is not None else None), False, False


# -- rendering ------------------------------------------------------------------------------------

def age(seconds: float) -> str:
    """A short age: 42s, 5m3s, 2h5m, 3d4h (kubectl's style, two units at most)."""
    s = max(int(seconds), 0)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60}s" if s % 60 else f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60}m" if s % 3600 // 60 else f"{s // 3600}h"
    return f"{s // 86400}d{s % 86400 // 3600}h" if s % 86400 // 3600 else f"{s // 86400}d"


def ago(when: datetime | None, now: datetime) -> str:
    return f"{age((now - when).total_seconds())} ago" if when is not None else ""


def state_cell(r: Row) -> str:
    if r.invalid is not None:
        return f"Invalid ({r.invalid})"
    notes = []
    if r.routable:
        notes.append("routable: its first request wakes it")
    if r.quiescing:
        notes.append("quiescing")
    if r.degraded:
        notes.append(f"degraded {r.degraded}")
    if r.refusal is not None:
        notes.append(f"capture refused {r.refusal.reason.value}")
    if r.pod_replaced:
        notes.append("pod replaced")
    base = r.state or NONE
    return f"{base} ({', '.join(notes)})" if notes else base


def idle_cell(r: Row, now: datetime) -> str:
    if r.idle_since is None or (r.inflight or 0) > 0:
        return NONE
    return age((now - r.idle_since).total_seconds())


def op_cell(op: Op | None, now: datetime) -> str:
    if op is None:
        return NONE
    if op.open:
        return f"running {op.steps[-1][0]}" if op.steps else "starting"
    if op.ok is False:
        return f"FAILED {op.reason or ''} {ago(op.finished, now)}".replace("  ", " ")
    return f"{op.seconds:.2f}s, {ago(op.finished, now)}"


def proof_cell(r: Row, now: datetime) -> str:
    if r.pending:
        return "pending"
    p = r.proof
    if p is None:
        return NONE
    if p.ok is False:
        return f"FAILED {p.reason}" + (f" (fallback {p.fallback})" if p.fallback else "")
    if p.ok is None:
        return f"verifying {p.answered}/{p.requests}" if p.wake_id is not None else f"verifying ({p.reason})"
    if p.wake_id is None:  # only the condition: no counts to show
        return f"verified {ago(p.when, now)}"
    return f"{p.answered}/{p.requests} pinned {ago(p.when, now)}"


def cells(r: Row, now: datetime, *, namespaced: bool = False) -> tuple[str, ...]:
    pod = f"{r.namespace}/{r.pod}" if namespaced else r.pod
    return (r.dgd or NONE, r.component or NONE, pod, state_cell(r), r.tier, idle_cell(r, now),
            op_cell(r.last_capture, now), op_cell(r.last_wake, now), proof_cell(r, now))


def sort_key(r: Row) -> tuple[str, str, str, str]:
    return (r.namespace, r.dgd or "", r.component or "", r.pod)


def widths(lines: list[tuple[str, ...]]) -> list[int]:
    return [max(len(line[i]) for line in lines) for i in range(len(HEADER))]


def format_line(line: tuple[str, ...], w: list[int]) -> str:
    return "  ".join(c.ljust(w[i]) for i, c in enumerate(line)).rstrip()


def table(rows: list[Row], now: datetime, *, namespaced: bool = False) -> list[str]:
    """The header and one line per row, columns aligned, sorted by namespace, graph, component, pod."""
    lines = [HEADER, *(cells(r, now, namespaced=namespaced) for r in sorted(rows, key=sort_key))]
    w = widths(lines)
    return [format_line(line, w) for line in lines]


def _iso(when: datetime | None) -> str | None:
    return when.isoformat().replace("+00:00", "Z") if when is not None else None


def _op_json(op: Op | None) -> Obj | None:
    if op is None:
        return None
    return {"id": op.id, "seconds": op.seconds, "started": _iso(op.started), "finished": _iso(op.finished),
            "ok": op.ok, "reason": op.reason, "steps": [{"name": n, "seconds": s} for n, s in op.steps]}


def as_json(r: Row, now: datetime) -> Obj:
    """The row for programs: raw values (seconds, RFC 3339 times), no rendering."""
    p = r.proof
    return {
        "namespace": r.namespace, "pod": r.pod, "dgd": r.dgd, "component": r.component, "state": r.state,
        "desiredState": r.desired, "tier": r.tier, "quiescing": r.quiescing, "degraded": r.degraded,
        "podReplaced": r.pod_replaced, "invalid": r.invalid, "routable": r.routable,
        "captureRefused": None if r.refusal is None else {
            "reason": r.refusal.reason.value, "message": r.refusal.message, "at": _iso(r.refusal.at)},
        "idleSince": _iso(r.idle_since), "inflight": r.inflight,
        "idleSeconds": round((now - r.idle_since).total_seconds(), 3) if r.idle_since and not r.inflight else None,
        "lastCapture": _op_json(r.last_capture), "lastWake": _op_json(r.last_wake),
        "verificationPending": r.pending, "verificationCurrent": r.proof_current,
        "verification": None if p is None else {
            "wakeId": p.wake_id, "ok": p.ok, "reason": p.reason, "message": p.message, "requests": p.requests,
            "answered": p.answered, "workerId": p.worker_id, "fallback": p.fallback, "at": _iso(p.when)},
    }


def summary(r: Row, now: datetime) -> str:
    """One line of what a row says, for progress output and timeouts."""
    return (f"state {state_cell(r)}, desired {r.desired}; last capture {op_cell(r.last_capture, now)}; "
            f"last wake {op_cell(r.last_wake, now)}; verified by {proof_cell(r, now)}")
