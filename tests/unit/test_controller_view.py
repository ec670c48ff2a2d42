"""What the planner sees of a worker (dynsnap.controller.reconciler.Reconciler.view_of): the agent's
idle facts, and the worker's last verified return to serving, from which its idleness counts (a
failed or unfinished verification is no return)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from dynsnap.controller.frontend import Frontend
from dynsnap.controller.reconciler import Reconciler, Stores
from dynsnap.controller.settings import ControllerSettings
from dynsnap.k8s.store import Store

UID = "00000001-2222-3333-4444-555555555555"
IDLE_SINCE = "2026-12-01T06:44:55Z"
VERIFIED = "2026-12-01T06:45:02.500000Z"


def _ws(verification: dict[str, Any] | None) -> dict[str, Any]:
    controller = {"verification": verification} if verification else {}
    return {"apiVersion": "dynsnap.io/v1alpha1", "kind": "WorkerSnapshot",
            "metadata": {"name": "w-0", "namespace": "ns", "resourceVersion": "10", "uid": "ws-uid", "generation": 1},
            "spec": {"podName": "w-0", "podUID": UID, "tier": "snapshot", "desiredState": "Active"},
            "status": {"state": "Active", "conditions": [], "controller": controller,
                       "idle": {"inflight": 0, "requestsTotal": 7, "lastActivity": IDLE_SINCE,
                                "idleSince": IDLE_SINCE}}}


def _verification(ok: bool | None, finished: str | None) -> dict[str, Any]:
    return {"wakeId": "w1", "ok": ok, "reason": "Verified" if ok else "Verifying",
            "started": "2026-12-01T06:45:02Z", "finished": finished}


@pytest.mark.parametrize(("verification", "since"), [
    (_verification(True, VERIFIED), datetime(2026, 12, 1, 6, 45, 2, 500000, tzinfo=UTC)),
    (_verification(None, None), None),  # still verifying: not back yet
    (_verification(False, VERIFIED), None),  # not verified: no return to serving
    (None, None),  # never quiesced
], ids=["verified", "verifying", "failed", "none"])
def test_the_planner_sees_the_last_verified_return_to_serving(verification: dict[str, Any] | None,
                                                              since: datetime | None) -> None:
    wss = Store()
    wss.upsert(_ws(verification))
    r = Reconciler(kube=None, settings=ControllerSettings(leader_elect=False),  # type: ignore[arg-type]
                   stores=Stores(dgds=Store(), pods=Store(), dwms=Store(), slices=Store({"target": lambda o: []}),
                                 wss=wss),
                   frontend=Frontend(timeout=1.0))
    view = r.view_of({"metadata": {"name": "w-0", "namespace": "ns", "uid": UID}})
    assert view.idle_since == datetime(2026, 12, 1, 6, 44, 55, tzinfo=UTC)
    assert view.serving_since == since


@pytest.mark.parametrize(("generation", "tier", "refused"), [
    (1, "snapshot", True),  # as it was refused: it stands
    (2, "snapshot", False),  # the spec changed since
    (1, "suspend", False),  # the component's policy changed since
], ids=["standing", "spec-changed", "policy-changed"])
def test_the_planner_sees_a_refusal_while_it_stands(generation: int, tier: str, refused: bool) -> None:
    from dynsnap.controller.phases import policy_hash
    from dynsnap.models.policy import Policy
    from dynsnap.models.protocol import Tier

    as_refused = Policy(enabled=True, tier=Tier.SNAPSHOT)
    obj = _ws(None)
    obj["metadata"]["generation"] = generation
    obj["status"]["controller"] = {"refusal": {"reason": "SeccompOff", "message": "filter off",
                                               "at": "2026-12-01T06:45:00Z", "captureId": "c1", "podUID": UID,
                                               "generation": 1, "policyHash": policy_hash(as_refused)}}
    wss = Store()
    wss.upsert(obj)
    r = Reconciler(kube=None, settings=ControllerSettings(leader_elect=False),  # type: ignore[arg-type]
                   stores=Stores(dgds=Store(), pods=Store(), dwms=Store(), slices=Store({"target": lambda o: []}),
                                 wss=wss),
                   frontend=Frontend(timeout=1.0))
    view = r.view_of({"metadata": {"name": "w-0", "namespace": "ns", "uid": UID}},
                     Policy(enabled=True, tier=Tier(tier)))
    assert (view.sleep_refused is not None) == refused
    if refused:
        assert view.sleep_refused is not None and "SeccompOff" in view.sleep_refused
