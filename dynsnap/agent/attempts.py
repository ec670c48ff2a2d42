"""When a failed capture or wake may be tried again, from the WorkerSnapshot alone (its last error,
its count of consecutive failures, its spec's generation), so a restarted agent keeps the same
schedule.

- A failure mid-way (something changed) is rolled back at once; its step is tried again only after
  the backoff (``failure_backoff``, doubling per consecutive failure up to ``failure_backoff_max``),
  and until then a capture's wanted state is Active, so the next steps roll the worker back.
- A refusal (nothing changed) waits out the same backoff, except one in ``PERMANENT_REFUSALS``: no
  retry can cure it, so it is not asked again until the spec changes.
- A new spec (another generation than the failure's) is a new request: tried at once.

Layer: ``dynsnap.agent`` (pure).
"""

from __future__ import annotations

from datetime import datetime, timedelta

from dynsnap.agent.plan import Step
from dynsnap.agent.settings import AgentSettings
from dynsnap.models import protocol as P
from dynsnap.models.protocol import DesiredState, Reason
from dynsnap.models.workersnapshot import WorkerSnapshot


def backoff(settings: AgentSettings, failures: int | None) -> float:
    n = min(max(failures or 1, 1), 30)
    return float(min(settings.failure_backoff * 2.0 ** (n - 1), settings.failure_backoff_max))


def new_intent(ws: WorkerSnapshot) -> bool:
    """The spec changed since the last failure: a new request is tried at once, not after a backoff."""
    err = ws.status.last_error
    return err is not None and err.generation is not None and err.generation != ws.metadata.generation


def effective(ws: WorkerSnapshot, settings: AgentSettings, now: datetime) -> tuple[DesiredState, float | None]:
    """The wanted state now, and the seconds of failure backoff left. After a failed capture the
    worker is rolled back to Active and stays so until the backoff has passed; after a refusal that no
    retry can cure (``PERMANENT_REFUSALS``) it stays Active until the spec changes (a new generation:
    the controller asks anew once the pod or the policy changed)."""
    n = ws.status.consecutive_failures or 0
    err = ws.status.last_error
    if ws.spec.desired_state != DesiredState.SUSPENDED or n == 0 or err is None or new_intent(ws):
        return ws.spec.desired_state, None
    if err.reason in P.PERMANENT_REFUSALS:
        return DesiredState.ACTIVE, None
    left = (err.at + timedelta(seconds=backoff(settings, n)) - now).total_seconds()
    if left > 0:
        return DesiredState.ACTIVE, left
    return ws.spec.desired_state, None


def retry_wait(ws: WorkerSnapshot, step: Step, settings: AgentSettings, now: datetime) -> float | None:
    """Seconds before ``step`` may run again after it failed last (None: go ahead). Our own status
    writes wake the reconcile at once; the backoff is kept here, not by the queue's timing."""
    err = ws.status.last_error
    if err is None or err.step != step.value or not ws.status.consecutive_failures or new_intent(ws):
        return None
    left = (err.at + timedelta(seconds=backoff(settings, ws.status.consecutive_failures)) - now).total_seconds()
    return left if left > 0 else None


def after_failure(settings: AgentSettings, reason: Reason, *, changed: bool, failures: int) -> float | None:
    """When to look again after a step failed: at once to roll back what it changed; never (until the
    spec changes: its write wakes the reconcile) after a permanent refusal; else after the backoff."""
    if changed:
        return 0.0
    if reason in P.PERMANENT_REFUSALS:
        return None
    return backoff(settings, failures)
