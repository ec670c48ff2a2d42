"""Bad ``dynsnap.io/`` policy on a graph (issue 9) on the real node (kubelet, containerd, runc; dynsnap
installed by ``helm install``: realnodeenv.py), examples/dgd/agg.yaml under the local overlay (a
frontend and two workers): each case ends consistent and explained, and no worker is touched.

- bad annotations on a serving graph, on the DGD and on a component, one after another, while both
  workers are idle past ``idle-after``: a Warning Event ``InvalidPolicy`` on the DGD naming key, value
  and why, ``PolicyValid=False`` with that message on every WorkerSnapshot, and nothing else moves (the
  same spec and generation, no quiesce, no trace, the serving gate True and kubelet's Ready True);
  fixed, the worker beyond min-active is captured;
- a graph whose component carries a misspelt key from the start: the Event names it, no WorkerSnapshot
  is created and no serving gate set (kubelet has the containers ready, the gate keeps the pods not
  Ready); fixed, the controller takes the graph up from scratch.

The rest of the controller's faults (the DGD deleted mid-cycle, the controller killed at each step,
watches answered 410) are still in the sandboxes: tests/integration/test_controller_faults.py says why.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime

import pytest
from controllerenv import asleep, cond, events_for, gate_of, get_ws, policy, wait_ws
from realnodeenv import WORKER_COMPONENT, Env, component_policy, deployed, edit_dgd

from dynsnap.k8s.client import Obj
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.testenv import chart_node
from dynsnap.testenv.cluster import wait_for
from dynsnap.testenv.real_graph import Graph, NodePod

pytestmark = pytest.mark.cluster

DGD_POLICY = policy(enabled=True, idle_after="2s", tier="suspend", wake_at_inflight=1)
TYPO = "dynsnap.io/min-actve"

# (where, key, bad value, a part of the why the message must give)
BAD = [
    ("component", P.ANN_MIN_ACTIVE, "0", "must be at least 1: a model with no live worker disappears from the "
     "frontend and answers 404"),
    ("dgd", P.ANN_IDLE_AFTER, "soon", "not a duration"),
    ("dgd", P.ANN_TIER, "deep", "must be one of suspend, snapshot"),
    ("component", TYPO, "1", "unknown dynsnap.io/ annotation"),
]


def graph(env: Env, name: str, component: dict[str, str]) -> Obj:
    """examples/dgd/agg.yaml with the graph's policy and ``component``'s on the worker's pod template."""
    return component_policy(chart_node.example_body(env, name=name, policy=DGD_POLICY), WORKER_COMPONENT, component)


async def edit(env: Env, g: Graph, *, dgd: dict[str, str | None] | None = None,
               component: dict[str, str | None] | None = None) -> None:
    """The user's ``kubectl edit`` of the graph's annotations (None removes one)."""
    def change(obj: Obj) -> None:
        comp = next(c for c in obj["spec"]["components"] if c["name"] == WORKER_COMPONENT)
        for ann, edits in ((obj["metadata"].setdefault("annotations", {}), dgd),
                           (comp["podTemplate"].setdefault("metadata", {}).setdefault("annotations", {}), component)):
            for k, v in (edits or {}).items():
                ann.pop(k, None) if v is None else ann.__setitem__(k, v)
    await edit_dgd(env, g, change)


def _since(ts: str) -> float:
    return (datetime.now(UTC) - datetime.fromisoformat(ts)).total_seconds()


def idle_past(seconds: float) -> Callable[[Obj | None], bool]:
    """Active, PolicyValid=True, and idle (nothing in flight) for more than ``seconds`` by the agent's
    idle facts (the worker's own metrics)."""
    def check(ws: Obj | None) -> bool:
        st = (ws or {}).get("status") or {}
        idle = st.get("idle") or {}
        c = cond(ws, "PolicyValid")
        return bool(st.get("state") == "Active" and c and c["status"] == "True" and idle.get("idleSince")
                    and not idle.get("inflight") and _since(idle["idleSince"]) > seconds)
    return check


def _policy_invalid(problem: str) -> Callable[[Obj | None], bool]:
    def check(ws: Obj | None) -> bool:
        c = cond(ws, "PolicyValid")
        return bool(c and c["status"] == "False" and problem in c["message"])
    return check


def _policy_valid(ws: Obj | None) -> bool:
    c = cond(ws, "PolicyValid")
    return bool(c and c["status"] == "True" and c["reason"] == "PolicyValid")


async def _pod(env: Env, pod: NodePod) -> Obj:
    obj: Obj = await env.api.get(R.PODS, pod.name, namespace=pod.namespace)
    return obj


async def _in_serving(env: Env, pod: NodePod) -> None:
    """Its serving gate True and kubelet's Ready True."""
    async def check() -> bool:
        live = await _pod(env, pod)
        return gate_of(live) == "True" and chart_node.pod_ready(live)
    await wait_for(f"{pod.name}: serving gate True, Ready", check, timeout=60, interval=0.5)


async def _invalid_policy_event(env: Env, g: Graph, problem: str, why: str) -> Obj:
    name, ns = g.dgd["metadata"]["name"], g.dgd["metadata"]["namespace"]

    async def find() -> Obj | None:
        return next((e for e in await events_for(env.api, ns, name)
                     if e.get("reason") == "InvalidPolicy" and problem in e.get("note", "")
                     and (e.get("regarding") or {}).get("kind") == "DynamoGraphDeployment"), None)
    ev: Obj = await wait_for(f"Event InvalidPolicy on DGD {name} naming {problem}", find, timeout=60, interval=0.5)
    assert ev["type"] == "Warning" and why in ev["note"] and f"component {WORKER_COMPONENT}" in ev["note"], ev
    assert "nothing new is decided until it is fixed" in ev["note"], ev
    return ev


def _unchanged(ws: Obj, before: Obj | None) -> None:
    """Nothing the controller decides moved: same spec (and generation), no quiesce opened, no trace
    started, no capture, the agent's state Active."""
    assert before is not None
    assert ws["metadata"]["generation"] == before["metadata"]["generation"], "the spec was written"
    assert ws["spec"] == before["spec"] and ws["spec"]["desiredState"] == "Active", ws["spec"]
    assert (ws["metadata"].get("annotations") or {}).get(P.ANN_TRACEPARENT) == \
        (before["metadata"].get("annotations") or {}).get(P.ANN_TRACEPARENT)
    rec, was = ws["status"].get("controller") or {}, before["status"].get("controller") or {}
    assert rec.get("quiesce") == was.get("quiesce") is None and rec.get("identity") == was.get("identity"), rec
    assert ws["status"]["state"] == "Active" and not ws["status"].get("lastCapture"), ws["status"]


async def _captured_to_one(env: Env, g: Graph) -> None:
    """One worker captured (min-active 1), the other in serving."""
    workers = g.workers(WORKER_COMPONENT)

    async def one_asleep() -> bool:
        return sum([asleep(await get_ws(env.api, p)) for p in workers]) == 1
    await wait_for("captured down to min-active 1", one_asleep, timeout=180, interval=0.5)
    awake = [p for p in workers if not asleep(await get_ws(env.api, p))]
    assert len(awake) == 1
    await _in_serving(env, awake[0])


async def test_bad_annotations_on_a_serving_graph_change_nothing_until_fixed(env: Env) -> None:
    """Each bad value in turn while both workers are idle past idle-after (with a valid policy of the
    same keys one worker would be captured at once); fixed, the worker beyond min-active is captured."""
    good = policy(min_active=2, verify_requests=2)  # both stay awake until the policy is fixed to min-active 1
    async with deployed(env, graph(env, "badpol", good)) as g:
        workers = g.workers(WORKER_COMPONENT)
        for p in workers:
            await wait_ws(env, p, "Active, PolicyValid=True, idle past idle-after", idle_past(3.0))
        before = {p.name: await get_ws(env.api, p) for p in workers}
        prev: tuple[str, str] | None = None
        for where, key, value, why in BAD:
            edits: dict[str, dict[str, str | None]] = {"dgd": {}, "component": {}}
            if prev is not None:  # the row before's key back to its good value (or away)
                pwhere, pkey = prev
                edits[pwhere][pkey] = (DGD_POLICY if pwhere == "dgd" else good).get(pkey)
            edits[where][key] = value
            await edit(env, g, dgd=edits["dgd"], component=edits["component"])
            problem = f"{key}={value!r}: {why}"
            for p in workers:
                ws = await wait_ws(env, p, f"PolicyValid=False naming {key}", _policy_invalid(problem), timeout=60)
                c = cond(ws, "PolicyValid")
                assert c is not None and c["reason"] == "InvalidPolicy", c
                assert c["message"].startswith(f"component {WORKER_COMPONENT}: ") and \
                    "nothing new is decided" in c["message"], c
                _unchanged(ws, before[p.name])
                assert _since(ws["status"]["idle"]["idleSince"]) > 2.0  # idle past idle-after: would be captured
                await _in_serving(env, p)
            await _invalid_policy_event(env, g, problem, why)
            prev = (where, key)
        # Fixed: the misspelt key removed and min-active 1: the policy is valid again and one worker sleeps.
        assert prev is not None
        await edit(env, g, component={prev[1]: None, P.ANN_MIN_ACTIVE: "1"})
        for p in workers:
            await wait_ws(env, p, "PolicyValid=True", _policy_valid)
        await _captured_to_one(env, g)


async def test_graph_never_valid_gets_no_workersnapshot_and_no_gate_until_fixed(env: Env) -> None:
    """A misspelt key on the component from the start; fixed, the graph is taken up from scratch."""
    async with deployed(env, graph(env, "neverpol", {**policy(min_active=1, verify_requests=2), TYPO: "1"}),
                        ready=False) as g:
        problem = f"{TYPO}='1': unknown dynsnap.io/ annotation"
        await _invalid_policy_event(env, g, problem, "unknown dynsnap.io/ annotation")
        workers = g.workers(WORKER_COMPONENT)
        for p in workers:
            async def held_by_the_gate(p: NodePod = p) -> bool:  # kubelet: containers ready, the pod not
                conds = {c["type"]: c["status"] for c in (await _pod(env, p))["status"].get("conditions") or []}
                return conds.get("ContainersReady") == "True" and conds.get("Ready") == "False"
            await wait_for(f"{p.name}: containers ready, the pod not Ready", held_by_the_gate, timeout=180,
                           interval=0.5)
        for p in workers:
            assert await get_ws(env.api, p) is None, f"{p.name}: a WorkerSnapshot for a graph never valid"
            live = await _pod(env, p)
            assert gate_of(live) is None and not chart_node.pod_ready(live), live["status"]
        await edit(env, g, component={TYPO: None})
        for p in workers:
            def taken_up(ws: Obj | None, uid: str = p.uid) -> bool:
                return bool(ws and ws["spec"]["podUID"] == uid and _policy_valid(ws))
            ws = await wait_ws(env, p, "a WorkerSnapshot for it, PolicyValid=True", taken_up)
            assert ws["spec"]["desiredState"] in ("Active", "Suspended")
        await _captured_to_one(env, g)
