"""The agent's status never contradicts itself: its conditions say what its state says (issue 18:
after WorkerLost a WorkerSnapshot read ``state: Unknown``, ``Accepted=Unknown/PodNotFound`` and a stale
``Suspended=True`` at once)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dynsnap.agent import status as S
from dynsnap.agent.admission import Verdict
from dynsnap.agent.executor import Observation
from dynsnap.agent.plan import Facts, Step
from dynsnap.agent.steps import StepResult
from dynsnap.agent.worker import WorkerProcs
from dynsnap.models.ids import HostPid, PodUID
from dynsnap.models.protocol import ConditionType as CT
from dynsnap.models.protocol import EntrypointState, ObservedState, Reason
from dynsnap.models.workersnapshot import STATUS_PIDS_MAX, WorkerSnapshot, set_condition

UID = "0f6c3f2e-1b2a-4c3d-8e4f-5a6b7c8d9e0f"


def _ws(state: ObservedState, *, suspended: bool) -> WorkerSnapshot:
    ws = WorkerSnapshot.model_validate({
        "apiVersion": "dynsnap.io/v1alpha1", "kind": "WorkerSnapshot",
        "metadata": {"name": "w-0", "namespace": "ns", "uid": "x", "generation": 3},
        "spec": {"podName": "w-0", "podUID": UID, "container": "main", "tier": "snapshot",
                 "desiredState": "Suspended"}})
    ws.status.state = state
    ws.status.conditions = set_condition(ws.status.conditions, CT.SUSPENDED, suspended,
                                         Reason.SNAPSHOTTED if suspended else Reason.ACTIVE, "", generation=3)
    return ws


def _obs(ep: EntrypointState, *, alive: bool) -> Observation:
    w = WorkerProcs(pod_uid=PodUID(UID), entrypoint=HostPid(100), pidns=1, control_dir=Path("/nonexistent"),
                    info={"state": ep.value}, procs=(), gpu=())
    return Observation(worker=w, facts=Facts(ep_state=ep, worker_alive=alive), gpu_states={}, capture=None,
                       staging=None)


def _cond(status: S.WorkerSnapshotStatus, ctype: CT) -> tuple[str, str]:
    c = next(c for c in status.conditions if c.type == ctype.value)
    return c.status, c.reason


@pytest.mark.parametrize(("verdict", "accepted", "want_accepted"), [
    (Verdict(False, Reason.WORKER_NOT_RUNNING, "no process of pod runs on this node"), None, "Unknown"),
    (Verdict(False, Reason.NOT_UNDER_ENTRYPOINT, "no container runs dynsnap-entrypoint"), False, "False"),
    (Verdict(False, Reason.POD_NOT_FOUND, "pod ns/w-0 does not exist"), False, "False"),
])
def test_a_worker_the_agent_cannot_see_is_not_said_to_sleep(verdict: Verdict, accepted: bool | None,
                                                            want_accepted: str) -> None:
    ws = _ws(ObservedState.SUSPENDED, suspended=True)
    st = S.refused(ws, verdict, accepted=accepted)
    assert st.state == ObservedState.UNKNOWN
    assert _cond(st, CT.ACCEPTED) == (want_accepted, verdict.reason.value)
    assert _cond(st, CT.SUSPENDED) == ("Unknown", verdict.reason.value)
    assert _cond(st, CT.PROGRESSING) == ("False", verdict.reason.value)
    assert ws.status.state == ObservedState.SUSPENDED, "the read status is not changed in place"


def test_a_lost_worker_is_not_said_to_serve_nor_to_sleep() -> None:
    ws = _ws(ObservedState.SUSPENDED, suspended=True)
    lost = _obs(EntrypointState.SNAPSHOTTED, alive=False)
    assert lost.state == ObservedState.LOST
    st = S.settled(ws, ws.status.model_copy(deep=True), lost)
    assert st.state == ObservedState.LOST
    assert _cond(st, CT.SUSPENDED) == ("False", Reason.WORKER_LOST.value)
    st = S.progressing(ws, st, Step.GIVE_UP)
    assert _cond(st, CT.SUSPENDED) == ("False", Reason.WORKER_LOST.value)
    assert _cond(st, CT.PROGRESSING) == ("True", Reason.ROLLING_BACK.value)


@pytest.mark.parametrize(("ep", "alive", "want"), [
    (EntrypointState.ACTIVE, True, ("False", "Active")),
    (EntrypointState.SUSPENDED, True, ("True", "Suspended")),
])
def test_a_settled_worker_is_suspended_exactly_when_its_state_says(ep: EntrypointState, alive: bool,
                                                                   want: tuple[str, str]) -> None:
    ws = _ws(ObservedState.UNKNOWN, suspended=not alive)
    st = S.settled(ws, ws.status.model_copy(deep=True), _obs(ep, alive=alive))
    assert _cond(st, CT.SUSPENDED) == want


def test_a_record_of_thousands_of_processes_stays_small_gpu_processes_first() -> None:
    """Status stays small (issue 39): a worker of 5000 processes, three of them on the GPU, at the end of the
    list. Its capture record lists 64, the GPU processes among them, and counts the rest; the whole object
    is a few KiB and the CRD's maxItems holds it."""
    ws = _ws(ObservedState.ACTIVE, suspended=False)
    ws.status.last_capture = S.OperationRecord(id="c1", tier="snapshot", started=S.utcnow())
    pids = [{"host": 1000 + i, "ns": 10000 + i, "gpu": i >= 4997} for i in range(5000)]
    S.record(ws.status, Step.QUIESCE, StepResult(Step.QUIESCE, 0.1, {"pids": pids}))
    rec = ws.status.last_capture
    assert len(rec.pids) == STATUS_PIDS_MAX == 64 and rec.pids_omitted == 5000 - 64
    assert [p.ns for p in rec.pids[:3]] == [14997, 14998, 14999] and all(p.gpu for p in rec.pids[:3])
    body = json.dumps(ws.model_dump(mode="json", by_alias=True, exclude_none=True))
    assert len(body) < 8 << 10, len(body)
    S.record(ws.status, Step.QUIESCE, StepResult(Step.QUIESCE, 0.1, {"pids": pids[:3]}))
    assert len(rec.pids) == 3 and rec.pids_omitted is None
