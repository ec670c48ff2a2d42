"""The controller's part of a WorkerSnapshot's status, computed from its record and the verdicts of
this reconcile: ``status.controller`` and the controller's conditions (``Verified``, ``PolicyValid``),
always all of it (a server-side apply drops what a manager stops sending). Pure.

Layer: ``dynsnap.controller``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from dynsnap.models import protocol as P
from dynsnap.models.protocol import ConditionType, Reason
from dynsnap.models.workersnapshot import ControllerRecord, WorkerSnapshot, set_condition

Obj = dict[str, Any]
Verdict = tuple[bool | None, Reason, str]  # Verified's status, reason and message


def controller_status(ws: WorkerSnapshot, rec: ControllerRecord, *, verified: Verdict | None = None,
                      policy_ok: bool | None = None, policy_msg: str = "", now: datetime | None = None) -> Obj:
    """The status body the controller applies. ``verified`` None leaves Verified as it stands;
    ``policy_ok`` None leaves PolicyValid as it stands (True when unset), so a write while the policy
    does not parse does not undo its verdict."""
    gen = ws.metadata.generation
    conds = [c for c in ws.status.conditions if c.type in P.CONTROLLER_CONDITIONS]
    if verified is not None:
        conds = set_condition(conds, ConditionType.VERIFIED, verified[0], verified[1], verified[2], generation=gen,
                              now=now)
    invalid = next((c for c in conds if c.type == ConditionType.POLICY and c.status == "False"), None)
    if policy_ok is not None or invalid is None:
        ok = policy_ok is not False
        conds = set_condition(conds, ConditionType.POLICY, ok, Reason.POLICY_VALID if ok else Reason.INVALID_POLICY,
                              policy_msg or "dynsnap.io/ annotations parse", generation=gen, now=now)
    return {"controller": rec.wire(), "conditions": [c.wire() for c in conds]}
