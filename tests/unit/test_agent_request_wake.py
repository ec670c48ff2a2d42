"""The agent's own wake of a routable sleeper for a request (dynsnap/agent/node.py, ``NodeAgent._do``)
when the controller writes the spec while that wake runs.

The race two lanes of CI hit (2026-12-07, node/test_wake_on_request.py and the demo): the agent's resume
step was on record (Waking), the controller wrote ``desiredState: Active`` (a new generation) at once, and
the agent's settle-active read that generation. The wake then no longer matched the generation it began
under, so the request that asked for it was never forgotten: every later Suspended was taken for Active
and the worker stayed awake for good (and its Event said Active, not WokenByRequest). Here the settle-
active step runs against a stand-in executor; the status, the request book-keeping and the Event are
the agent's own.
"""

from __future__ import annotations

import asyncio
import copy
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from dynsnap.agent.node import NodeAgent
from dynsnap.agent.plan import Step
from dynsnap.agent.settings import AgentSettings
from dynsnap.agent.steps import StepResult
from dynsnap.k8s.client import Obj
from dynsnap.k8s.store import Store
from dynsnap.models.protocol import DesiredState, EntrypointState, ObservedState, Tier
from dynsnap.models.workersnapshot import OperationRecord, WorkerSnapshot, utcnow

KEY = "ns/w-0"


def ws_obj(generation: int, desired: str) -> Obj:
    return {"apiVersion": "dynsnap.io/v1alpha1", "kind": "WorkerSnapshot",
            "metadata": {"name": "w-0", "namespace": "ns", "uid": "ws-uid", "resourceVersion": str(90 + generation),
                         "generation": generation},
            "spec": {"podName": "w-0", "podUID": "11111111-2222-3333-4444-555555555555",
                     "desiredState": desired, "tier": "suspend", "routable": True},
            "status": {"state": "Waking"}}


@dataclass
class Recorded:
    events: list[str] = field(default_factory=list)

    async def record(self, _obj: Obj, *, type: str, reason: str, action: str, note: str) -> None:
        self.events.append(reason)


@dataclass
class Kube:
    on_request: Any = None

    async def apply(self, _res: Any, body: Obj, **_: Any) -> Obj:
        return copy.deepcopy(body)


def settle_active(tmp_path: Path, *, began_under: int, now: WorkerSnapshot) -> tuple[NodeAgent, Recorded]:
    """The agent's settle-active of a wake it began for a request under spec generation ``began_under``,
    run with the WorkerSnapshot ``now`` (the spec as the agent's store holds it at that step)."""
    rec = Recorded()
    obs = SimpleNamespace(state=ObservedState.ACTIVE, worker=SimpleNamespace(state=EntrypointState.ACTIVE),
                          gpu_states={})

    async def run_step(*_: Any, **__: Any) -> StepResult:
        return StepResult(step=Step.SETTLE_ACTIVE, seconds=0.01)

    async def observe(_: Any) -> Any:
        return obs

    a = NodeAgent(kube=cast(Any, Kube()), settings=AgentSettings(node_name="n", images_root=tmp_path),
                  executor=cast(Any, SimpleNamespace(run_step=run_step, observe=observe)),
                  ws_informer=SimpleNamespace(store=Store()), events=cast(Any, rec))
    a._requests[KEY] = 0.0  # the request that reached the worker asleep routable (edge.py)
    status = now.status.model_copy(deep=True)
    status.last_wake = OperationRecord(id="w1", tier=Tier.SUSPEND, started=utcnow(), generation=began_under,
                                       trigger="request")
    pod = {"metadata": {"name": "w-0", "namespace": "ns"}, "status": {}}
    asyncio.run(a._do(now, status, cast(Any, None), cast(Any, obs), Step.SETTLE_ACTIVE, tier=Tier.SUSPEND,
                      want=DesiredState.ACTIVE, pod=pod))
    return a, rec


def test_a_wake_for_a_request_forgets_it_when_the_controller_wrote_the_spec_meanwhile(tmp_path: Path) -> None:
    a, rec = settle_active(tmp_path, began_under=1, now=WorkerSnapshot.model_validate(ws_obj(2, "Active")))
    assert KEY not in a._requests, "the request outlived its wake: every later Suspended would be taken for Active"
    assert rec.events == ["WokenByRequest"], rec.events


def test_a_wake_for_a_request_under_the_same_spec_forgets_it_too(tmp_path: Path) -> None:
    a, rec = settle_active(tmp_path, began_under=1, now=WorkerSnapshot.model_validate(ws_obj(1, "Suspended")))
    assert KEY not in a._requests
    assert rec.events == ["WokenByRequest"], rec.events
