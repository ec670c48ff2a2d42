"""The agent reads its own status writes (dynsnap/agent/node.py, ``NodeAgent._ws``): the next step must
not act on a store that has not yet seen the previous step's write, and must act on one that has seen a
later write of someone else.

The race CI hit (2026-12-06, node/test_agent.py[suspend]): the capture's last status write and the
controller's request for a wake 0.15 s later both reached the agent's watch before the answer to the
agent's write came back. The answer (older than the store) was kept as "our own write" and hid the
controller's ``desiredState: Active`` until the next event of the object: the wake began 60 s late, at
the controller's wake deadline. Here the API server is a stand-in whose answer to the status write comes
after it has delivered both watch events to the agent; the store is the informer's (dynsnap.k8s.store).
"""

from __future__ import annotations

import asyncio
import copy
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from dynsnap.agent.node import NodeAgent
from dynsnap.agent.settings import AgentSettings
from dynsnap.k8s.client import Obj
from dynsnap.k8s.store import Store
from dynsnap.models.protocol import ObservedState
from dynsnap.models.workersnapshot import WorkerSnapshot

KEY = "ns/w-0"


def ws_obj(rv: int, desired: str, state: str = "Suspended") -> Obj:
    return {"apiVersion": "dynsnap.io/v1alpha1", "kind": "WorkerSnapshot",
            "metadata": {"name": "w-0", "namespace": "ns", "uid": "ws-uid", "resourceVersion": str(rv),
                         "generation": 1},
            "spec": {"podName": "w-0", "podUID": "11111111-2222-3333-4444-555555555555",
                     "desiredState": desired, "tier": "suspend"},
            "status": {"state": state}}


@dataclass
class SlowAnswer:
    """The API server as the agent's client sees it: the watch events of ``before_answer`` reach the
    agent (through its informer's handler) before the status write's answer does."""

    agent: NodeAgent | None = None
    before_answer: list[Obj] = field(default_factory=list)
    answer: Obj | None = None
    on_request: Any = None

    async def apply(self, res: Any, body: Obj, **_: Any) -> Obj:
        assert self.agent is not None and self.answer is not None
        for ev in self.before_answer:
            deliver(self.agent, ev)
        return copy.deepcopy(self.answer)


def deliver(a: NodeAgent, obj: Obj) -> None:
    """A watch event of ``obj``, as the informer hands it on: stored, then the agent's handler."""
    a.ws_informer.store.upsert(obj)
    a.on_ws("MODIFIED", obj)


def suspended_written(tmp_path: Path, kube: SlowAnswer) -> NodeAgent:
    """An agent whose store holds the worker Capturing (resourceVersion 95), after it wrote Suspended
    through ``kube``."""
    a = NodeAgent(kube=cast(Any, kube), settings=AgentSettings(node_name="n", images_root=tmp_path),
                  executor=cast(Any, None), ws_informer=SimpleNamespace(store=Store()))
    kube.agent = a
    capturing = ws_obj(95, "Suspended", state="Capturing")
    a.ws_informer.store.upsert(capturing)
    ws = WorkerSnapshot.model_validate(capturing)
    asyncio.run(a._write(ws, ws.status.model_copy(update={"state": ObservedState.SUSPENDED})))
    return a


def test_a_later_write_delivered_before_our_answer_is_what_the_next_step_reads(tmp_path: Path) -> None:
    ours, theirs = ws_obj(100, "Suspended"), ws_obj(101, "Active")
    a = suspended_written(tmp_path, SlowAnswer(before_answer=[ours, theirs], answer=ours))

    seen = a._ws(KEY)
    assert seen is not None and seen["metadata"]["resourceVersion"] == "101"
    assert seen["spec"]["desiredState"] == "Active", "the controller's request for a wake is seen at once"


def test_our_write_not_yet_in_the_store_is_what_the_next_step_reads(tmp_path: Path) -> None:
    a = suspended_written(tmp_path, SlowAnswer(answer=ws_obj(100, "Suspended")))  # not yet on the watch

    seen = a._ws(KEY)
    assert seen is not None and seen["metadata"]["resourceVersion"] == "100"
    assert seen["status"]["state"] == "Suspended", "not the store's older Capturing"
    # Once the watch delivers it, the store is read again (and what it holds next).
    deliver(a, ws_obj(100, "Suspended"))
    deliver(a, ws_obj(101, "Active"))
    later = a._ws(KEY)
    assert later is not None and later["spec"]["desiredState"] == "Active"
