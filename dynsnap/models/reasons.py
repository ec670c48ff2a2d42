"""What every :class:`~dynsnap.models.protocol.Reason` means and what to do about it (pure data,
bottom layer).

``docs/operations.md`` is generated from this table (``python -m dynsnap docs operations``), and the
unit tests fail when a Reason has no entry here, when the committed page differs from the generated
one, or when a reason marked ``reserved`` (declared, but not reported by this version) starts being
reported by the code, or one not so marked stops being. Keep each entry next to the code that
reports it in mind: ``where`` names the condition, record or Event that carries it and who writes it.
"""

from __future__ import annotations

from typing import Final

from dynsnap.models.protocol import Reason
from dynsnap.models.reasondoc import ACCEPTED, FAILED, POLICY, PROGRESS, REFUSED, SECTIONS, VERIFY, ReasonDoc, Severity
from dynsnap.models.reasons_agent import AGENT_REASON_DOCS
from dynsnap.models.reasons_controller import CONTROLLER_REASON_DOCS

__all__ = ["ACCEPTED", "FAILED", "POLICY", "PROGRESS", "REASON_DOCS", "REFUSED", "SECTIONS", "VERIFY", "ReasonDoc",
           "Severity"]

# The agent's entries (admission, progress, refusals, failures) and the controller's (policy, proof).
REASON_DOCS: Final[dict[Reason, ReasonDoc]] = {**AGENT_REASON_DOCS, **CONTROLLER_REASON_DOCS}
