"""`dynsnap status` rows from WorkerSnapshot dicts, by table (pure): what each column says for a
worker being quiesced, capturing, asleep, verified, failed; and the JSON a program gets."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from dynsnap.controller import userview as U
from dynsnap.models import protocol as P

NOW = datetime(2026, 5, 4, 12, 0, 0, tzinfo=UTC)
UID = "0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0"
OTHER_UID = "ffffffff-4f50-6172-8394-a5b6c7d8e9f0"


def t(seconds_ago: float) -> str:
    return (NOW - timedelta(seconds=seconds_ago)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def cond(ctype: str, status: str, reason: str, message: str = "", ago: float = 100) -> dict[str, Any]:
    return {"type": ctype, "status": status, "reason": reason, "message": message, "lastTransitionTime": t(ago)}


def op(op_id: str, steps: list[tuple[str, float]], *, started: float, finished: float | None = None,
       ok: bool | None = None, error: str | None = None) -> dict[str, Any]:
    rec: dict[str, Any] = {"id": op_id, "tier": "suspend", "started": t(started),
                           "steps": [{"name": n, "seconds": s} for n, s in steps]}
    if finished is not None:
        rec["finished"] = t(finished)
    if ok is not None:
        rec["ok"] = ok
    if error is not None:
        rec["error"] = {"reason": error, "message": "boom", "step": steps[-1][0] if steps else None, "at": t(0)}
    return rec


def verification(wake_id: str, *, ok: bool | None, requests: int = 3, answered: int = 3, finished: float | None = 12,
                 reason: str = "Verified", fallback: str | None = None, message: str = "",
                 started: float = 20) -> dict[str, Any]:
    v: dict[str, Any] = {"wakeId": wake_id, "ok": ok, "reason": reason, "message": message, "started": t(started),
                         "requests": requests, "answered": answered, "workerId": 7}
    if ok is None:
        v["ok"] = None
        del v["ok"]
    if finished is not None:
        v["finished"] = t(finished)
    if fallback is not None:
        v["fallback"] = fallback
    return v


def ws(*, name: str = "worker-0", status: dict[str, Any] | None = None, tier: str = "suspend",
       desired: str = "Active", labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {"apiVersion": "dynsnap.io/v1alpha1", "kind": "WorkerSnapshot",
            "metadata": {"name": name, "namespace": "dynamo", "labels": {P.LABEL_NODE: "node-a", **(labels or {})}},
            "spec": {"podName": name, "podUID": UID, "tier": tier, "desiredState": desired},
            "status": status or {}}


def pod(*, uid: str = UID, dgd: str = "graph-a", component: str = "decode") -> dict[str, Any]:
    return {"metadata": {"name": "worker-0", "namespace": "dynamo", "uid": uid,
                         "labels": {P.LABEL_DGD_NAME: dgd, P.LABEL_COMPONENT: component}}}


CAPTURED = op("c1", [("quiesce", 0.25), ("save", 1.5), ("settle-suspended", 0.25)], started=400, finished=300,
              ok=True)
WOKEN = op("w1", [("wake", 0.1), ("resume", 0.6), ("settle-active", 0.05)], started=60, finished=30, ok=True)
ALL_COLUMNS = ("graph-a", "decode", "worker-0")

CASES = [
    pytest.param(  # the controller is taking it out of serving: the quiesce record is open
        {"state": "Active", "idle": {"inflight": 0, "idleSince": t(600)},
         "controller": {"quiesce": op("q1", [("serving-gate", 0.01)], started=5)}},
        "Active", ("Active (quiescing)", "suspend", "10m", "-", "-", "-"), id="quiescing"),
    pytest.param(  # the agent is capturing: the capture shows its step under way
        {"state": "Capturing", "idle": {"inflight": 0, "idleSince": t(610)},
         "lastCapture": op("c2", [("quiesce", 0.2), ("save", 1.1)], started=3),
         "controller": {"quiesce": op("q1", [("serving-gate", 0.01)], started=30, finished=4, ok=True)}},
        "Suspended", ("Capturing", "suspend", "10m10s", "running save", "-", "-"), id="capturing-with-steps"),
    pytest.param(  # asleep: idle for since the last request, the capture's total and when
        {"state": "Suspended", "idle": {"inflight": 0, "idleSince": t(7260)}, "lastCapture": CAPTURED,
         "conditions": [cond("Suspended", "True", "Suspended")]},
        "Suspended", ("Suspended", "suspend", "2h1m", "2.00s, 5m ago", "-", "-"), id="suspended-idle-for"),
    pytest.param(  # woken and proven by pinned requests
        {"state": "Active", "idle": {"inflight": 2, "idleSince": t(90)}, "lastCapture": CAPTURED,
         "lastWake": WOKEN, "controller": {"verification": verification("w1", ok=True)},
         "conditions": [cond("Verified", "True", "Verified")]},
        "Active", ("Active", "suspend", "-", "2.00s, 5m ago", "0.75s, 30s ago", "3/3 pinned 12s ago"),
        id="verified"),
    pytest.param(  # the wake did not serve: the reason and what was done about it
        {"state": "Active", "lastCapture": CAPTURED, "lastWake": WOKEN,
         "controller": {"verification": verification("w1", ok=False, answered=1, reason="PinnedRequestFailed",
                                                     fallback="ColdRestart")},
         "conditions": [cond("Verified", "False", "PinnedRequestFailed")]},
        "Active", ("Active", "suspend", "-", "2.00s, 5m ago", "0.75s, 30s ago",
                   "FAILED PinnedRequestFailed (fallback ColdRestart)"), id="failed-verification-with-fallback"),
    pytest.param(  # verification under way
        {"state": "Active", "lastWake": WOKEN,
         "controller": {"verification": verification("w1", ok=None, answered=1, finished=None,
                                                     reason="Verifying")}},
        "Active", ("Active", "suspend", "-", "-", "0.75s, 30s ago", "verifying 1/3"), id="verifying"),
    pytest.param(  # a newer wake than the one verified: not proven yet
        {"state": "Active", "lastWake": op("w2", [("wake", 0.1), ("settle-active", 0.1)], started=9, finished=8,
                                           ok=True),
         "controller": {"verification": verification("w1", ok=True, finished=600)},
         "conditions": [cond("Verified", "True", "Verified")]},
        "Active", ("Active", "suspend", "-", "-", "0.20s, 8s ago", "pending"), id="newer-wake-pending"),
    pytest.param(  # a capture called off: back in Active, its return not proven yet (the earlier proof is stale)
        {"state": "Active", "lastWake": WOKEN,
         "controller": {"verification": verification("w1", ok=True, started=20),
                        "quiesce": op("q1", [("serving-gate", 0.01)], started=10, finished=8, ok=False)}},
        "Active", ("Active", "suspend", "-", "-", "0.75s, 30s ago", "pending"), id="called-off-pending"),
    pytest.param(  # ... and proven: the controller's recall verification, started after the quiesce
        {"state": "Active", "lastWake": WOKEN,
         "controller": {"verification": verification("recall-q1", ok=True, started=5, finished=4),
                        "quiesce": op("q1", [("serving-gate", 0.01)], started=10, finished=8, ok=False)}},
        "Active", ("Active", "suspend", "-", "-", "0.75s, 30s ago", "3/3 pinned 4s ago"), id="called-off-recalled"),
    pytest.param(  # asleep: the proof of its last return is history, and shown
        {"state": "Suspended", "lastCapture": CAPTURED, "lastWake": WOKEN,
         "controller": {"verification": verification("w1", ok=True, started=900, finished=890),
                        "quiesce": op("q2", [("serving-gate", 0.01)], started=400, finished=300, ok=True)},
         "conditions": [cond("Suspended", "True", "Suspended")]},
        "Suspended", ("Suspended", "suspend", "-", "2.00s, 5m ago", "0.75s, 30s ago", "3/3 pinned 14m50s ago"),
        id="asleep-history"),
    pytest.param(  # a wake under way
        {"state": "Waking", "lastCapture": CAPTURED, "lastWake": op("w3", [("wake", 0.1), ("restore", 2.0)],
                                                                    started=3)},
        "Active", ("Waking", "suspend", "-", "2.00s, 5m ago", "running restore", "-"), id="waking"),
    pytest.param(  # a failed capture: the state says degraded, the capture says why
        {"state": "Active", "lastCapture": op("c3", [("quiesce", 0.2), ("save", 0.0)], started=50, finished=45,
                                              ok=False, error="CheckpointFailed"),
         "lastError": {"reason": "CheckpointFailed", "message": "boom", "step": "save", "at": t(45)},
         "conditions": [cond("Degraded", "True", "CheckpointFailed", "boom")]},
        "Suspended", ("Active (degraded CheckpointFailed)", "suspend", "-", "FAILED CheckpointFailed 45s ago",
                      "-", "-"), id="degraded"),
    pytest.param(  # nothing written yet by the agent
        {}, "Active", ("-", "suspend", "-", "-", "-", "-"), id="no-status-yet"),
    pytest.param(  # no verification record, only the condition
        {"state": "Active", "conditions": [cond("Verified", "True", "Verified", ago=65)]},
        "Active", ("Active", "suspend", "-", "-", "-", "verified 1m5s ago"), id="verified-condition-only"),
]


@pytest.mark.parametrize(("status", "desired", "expected"), CASES)
def test_row_cells(status: dict[str, Any], desired: str, expected: tuple[str, ...]) -> None:
    r = U.row(ws(status=status, desired=desired), pod())
    assert U.cells(r, NOW) == (*ALL_COLUMNS, *expected)


def test_graph_and_component_come_from_the_workersnapshot_first_then_the_pod() -> None:
    own = ws(labels={P.LABEL_DGD_NAME: "graph-ws", P.LABEL_COMPONENT: "prefill"})
    assert U.cells(U.row(own, pod()), NOW)[:2] == ("graph-ws", "prefill")
    assert U.cells(U.row(ws(), None), NOW)[:3] == ("-", "-", "worker-0")  # pod unreadable or gone


def test_a_pod_with_another_uid_is_shown_as_replaced() -> None:
    r = U.row(ws(status={"state": "Suspended"}), pod(uid=OTHER_UID))
    assert U.state_cell(r) == "Suspended (pod replaced)"


def test_an_object_that_does_not_parse_is_shown_not_dropped() -> None:
    bad = ws()
    bad["spec"]["tier"] = "deep-freeze"
    r = U.row(bad, None)
    assert r.pod == "worker-0" and U.state_cell(r).startswith("Invalid (1 invalid field(s): ('spec', 'tier')")


def test_table_aligns_columns_and_sorts_by_graph_component_pod() -> None:
    decode = {P.LABEL_DGD_NAME: "g", P.LABEL_COMPONENT: "decode"}
    rows = [U.row(ws(name="b", labels=decode, status={"state": "Active"})),
            U.row(ws(name="a-long-name", labels=decode, status={"state": "Suspended"})),
            U.row(ws(name="c", labels={P.LABEL_DGD_NAME: "g", P.LABEL_COMPONENT: "prefill"}, status={}))]
    lines = U.table(rows, NOW)
    assert lines[0].split() == ["DGD", "COMPONENT", "POD", "STATE", "TIER", "IDLE", "FOR", "LAST", "CAPTURE",
                                "LAST", "WAKE", "VERIFIED", "BY"]
    assert [line.split()[2] for line in lines[1:]] == ["a-long-name", "b", "c"]
    state_col = lines[0].index("STATE")
    assert all(line[state_col - 2:state_col] == "  " for line in lines)  # aligned: the column starts together
    assert U.table(rows, NOW, namespaced=True)[1].split()[2] == "dynamo/a-long-name"


def test_json_row_carries_raw_values() -> None:
    status = {"state": "Active", "idle": {"inflight": 0, "idleSince": t(90)}, "lastCapture": CAPTURED,
              "lastWake": WOKEN, "controller": {"verification": verification("w1", ok=False, answered=2,
                                                                             reason="AnsweredByAnotherWorker",
                                                                             fallback="ColdRestart",
                                                                             message="request 3 answered by 9")}}
    j = U.as_json(U.row(ws(status=status), pod()), NOW)
    assert (j["dgd"], j["component"], j["state"], j["tier"], j["idleSeconds"]) == ("graph-a", "decode", "Active",
                                                                                   "suspend", 90.0)
    assert j["lastCapture"]["seconds"] == 2.0 and [s["name"] for s in j["lastCapture"]["steps"]] == [
        "quiesce", "save", "settle-suspended"]
    assert j["lastWake"]["id"] == "w1" and j["lastWake"]["ok"] is True
    assert j["verification"] == {"wakeId": "w1", "ok": False, "reason": "AnsweredByAnotherWorker",
                                 "message": "request 3 answered by 9", "requests": 3, "answered": 2, "workerId": 7,
                                 "fallback": "ColdRestart", "at": "2026-05-04T11:59:48Z"}


@pytest.mark.parametrize(("seconds", "text"), [(0, "0s"), (59.9, "59s"), (60, "1m"), (61, "1m1s"), (3600, "1h"),
                                               (3661, "1h1m"), (86400, "1d"), (90000, "1d1h"), (-5, "0s")])
def test_age(seconds: float, text: str) -> None:
    assert U.age(seconds) == text


def test_a_capture_refused_for_good_is_shown_in_the_state_while_it_stands() -> None:
    refusal = {"reason": "SeccompOff", "message": "the entrypoint's io_uring filter is 'off'", "at": t(30),
               "captureId": "c1", "podUID": UID, "generation": 4, "policyHash": "0123456789abcdef"}
    status = {"state": "Active", "controller": {"refusal": refusal},
              "conditions": [cond("Degraded", "True", "SeccompOff")]}
    snap = ws(status=status)
    snap["metadata"]["generation"] = 4
    r = U.row(snap)
    assert U.state_cell(r) == "Active (degraded SeccompOff, capture refused SeccompOff)"
    assert U.as_json(r, NOW)["captureRefused"] == {"reason": "SeccompOff", "message": refusal["message"],
                                                   "at": t(30).replace(".000000Z", "Z")}
    # the spec changed since (another generation): the refusal no longer stands, and is not shown
    snap["metadata"]["generation"] = 5
    assert "capture refused" not in U.state_cell(U.row(snap)) and U.as_json(U.row(snap), NOW)["captureRefused"] is None
