"""What a step of a capture or wake works on and how it ends: the worker to act on (:class:`Subject`),
what the node showed of it (:class:`Observation`), the call a handler gets (:class:`StepCall`), its
result (:class:`StepResult`), and its failure (:class:`StepFailure`): a refusal (``changed`` False: a
guard said no before anything changed) or a failure mid-way (the next steps roll back), each with a
reason from ``models/protocol.py``.

Layer: ``dynsnap.agent`` (types only; the handlers are in capture_steps.py and wake_steps.py, the table
that dispatches them in executor.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynsnap.agent import worker as W
from dynsnap.agent.images import Capture
from dynsnap.agent.plan import Facts, Step, observed
from dynsnap.models.ids import HostPid, PodUID
from dynsnap.models.protocol import ObservedState, Reason, Tier

PIDS_FILE = "pids.json"  # written into a staging dir before the dump: the tree is gone afterwards
GPU_FILE = "gpu.json"  # GPU bytes the save freed, per GPU UUID
# Written into the images a restore reads from right before CRIU starts (the node's clock ticks since boot
# then), removed once the restored tree is the agent's: while it stands, no CRIU runs and CRIU's log does
# not say the restore finished, the restore was cut off (CRIU killed by the pod, by its bound, by the OOM
# killer) and what it left of the tree, every process of the pod's namespace started since, is no worker
# but a remnant holding the capture's pids.
RESTORE_MARKER = "restore.started"

# Asked before a capture starts: None if the worker is out of serving, else why it is not.
ServingGate = Callable[["W.WorkerProcs"], Awaitable[str | None]]


async def no_gate(_: W.WorkerProcs) -> str | None:
    return None


class StepFailure(Exception):
    """A step refused (``changed`` False: nothing was touched) or failed mid-way."""

    def __init__(self, reason: Reason, message: str, *, changed: bool = True) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.changed = changed


@dataclass(frozen=True)
class Subject:
    """The worker container to act on: its pod's identity (the UID is what finds it)."""

    namespace: str
    pod: str
    uid: PodUID
    container_id: str | None = None
    entrypoint: HostPid | None = None  # found by pod UID in /proc when None
    system_url: str | None = None  # the worker's Dynamo system port (http://<pod ip>:9090): its engine routes


@dataclass
class Observation:
    worker: W.WorkerProcs
    facts: Facts
    gpu_states: dict[HostPid, str]
    capture: Capture | None
    staging: Path | None

    @property
    def state(self) -> ObservedState:
        return observed(self.facts)


@dataclass
class StepCall:
    """One run of one step's handler: whom it acts on, what the node showed, and where it says what it
    did (``info``: the step's findings, recorded with its timing)."""

    subject: Subject
    obs: Observation
    tier: Tier
    gate: ServingGate = no_gate
    capture_id: str | None = None
    engine_sleep_level: int = 1  # tier engine: the level the engine sleeps at (the spec's)
    routable: bool = False  # a sleep that keeps the worker in serving (wake on request; the spec's)
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class StepResult:
    step: Step
    seconds: float
    info: dict[str, Any] = field(default_factory=dict)


def pid_records(w: W.WorkerProcs) -> list[dict[str, Any]]:
    """Every process of the worker with its host and in-namespace pid, and whether it is on the GPU."""
    gpu = set(w.gpu)
    return [{"host": p.pid, "ns": p.ns_pid, "gpu": p.pid in gpu} for p in w.procs]
