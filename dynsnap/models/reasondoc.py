"""The shape of a Reason's entry in the operations guide (``ReasonDoc``), its sections and
severities: what dynsnap/models/reasons_agent.py and reasons_controller.py fill in and
dynsnap/models/reasons.py joins (pure data, bottom layer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

Severity = Literal["normal", "refusal", "failure"]


@dataclass(frozen=True)
class ReasonDoc:
    section: str  # a heading of docs/operations.md
    severity: Severity  # normal: progress; refusal: nothing was changed; failure: something went wrong mid-way
    where: str  # the condition, record or Event that carries it, and who writes it
    meaning: str
    action: str
    reserved: bool = False  # declared, not reported by this version


# Sections, in the order the page shows them.
ACCEPTED: Final = "Admission: the Accepted condition (agent)"
PROGRESS: Final = "Progress and sleep: Progressing and Suspended (agent)"
REFUSED: Final = "Refusals: Degraded, nothing was changed (agent)"
FAILED: Final = "Failures mid-way: Degraded (agent)"
POLICY: Final = "Policy and decisions (controller)"
VERIFY: Final = "Proof of a wake: the Verified condition (controller)"
SECTIONS: Final = (ACCEPTED, PROGRESS, REFUSED, FAILED, POLICY, VERIFY)

RESERVED_ACTION = "Nothing: this version does not report it."
