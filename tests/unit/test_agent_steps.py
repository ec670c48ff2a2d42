"""Every step the agent's planner can pick has its handler in the executor's typed table (no handler
looked up by a name built from the step's string)."""

from __future__ import annotations

from dynsnap.agent.executor import HANDLERS
from dynsnap.agent.plan import Step


def test_every_step_has_a_handler() -> None:
    assert set(HANDLERS) == set(Step)
    assert all(callable(h) for h in HANDLERS.values())
