"""The chart's privileged agent treats what a worker's container says about itself as hostile (issue 18),
on the real node (kubelet, containerd, runc; dynsnap installed by ``helm install``: realnodeenv.py),
moved from the sandbox suite test_agent_trust.py: the entrypoint's report rewritten inside a real
container, and the old helper marker forged on a process of the node.

The worker's ``/run/dynsnap/entrypoint.json`` (on the control-directory emptyDir of
examples/dgd/agg.yaml, which anything in the container can write) is replaced in one step, as the
worker could, by one that is oversized, malformed, of the wrong types, or a symlink to a file of the
node holding a right-looking report. Then the worker is asked to sleep (its override, as ``dynsnap
suspend``). The agent refuses it (``Accepted=False`` with ``EntrypointUnreadable`` or
``UnsafeContainerPath`` and what was wrong), and nothing is touched: no request reaches the
entrypoint, no driver call changes a state, the worker process and its container are the same, the
node's file is byte for byte what it was. And the worker is back in serving without anyone asking:
whether the agent's refusal came before the controller's quiesce, during it, or after the capture was
asked (all three happen; each case prints which), the controller calls the capture off (a Warning
``CaptureRefused`` naming the agent's reason), Active is asked and the return verified by pinned
requests, rather than the worker waiting out of serving for the capture's deadline (15 minutes: what
a cold .ci/run met once, the capture asked before the refusal and nothing asking Active back). Once
its genuine report is back (the override then ``active``), it is accepted and answers requests pinned
to it, the same pod.

While one worker stays refused, the agent serves the node's other workers: a peer is captured and woken
in place, verified, with a process of the node named criu carrying ``DYNSNAP_OP=<the peer's pod
UID>/criu`` (what agents before issue 18 took for their helper) beside it, never waited for nor killed.

The graph has three workers: a refused worker is counted neither awake nor asleep, so the peer may
sleep only while the third serves (``min-active: 1``). One graph for the module.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pytest
from controllerenv import cond, events_for, gate_of, get_ws
from realnodecycle import cycle, override, pinned, same_pod, wait_ws
from realnodeenv import WORKER_COMPONENT, Env, deployed
from realnodefacts import KubeletFacts, container_procs, kubelet_facts, stub_state
from refusalenv import state_changes_since
from trustenv import refused, replace_report, start_forged_on_node, start_ticks

from dynsnap.k8s.client import Obj
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.testenv import chart_node
from dynsnap.testenv.real_graph import Graph, NodePod

pytestmark = pytest.mark.cluster

RUNNING = 0  # the stub driver's state of a process that runs
TOUCHED = "dynsnap-test/touched"  # an annotation of the test's: a change of the pod, for the agent to look at once
CASES = {
    "oversized": ("EntrypointUnreadable", "is larger than 65536 bytes"),
    "malformed": ("EntrypointUnreadable", "not JSON"),
    "wrong-types": ("EntrypointUnreadable", "request_seq: Input should be a valid integer"),
    "symlink": ("UnsafeContainerPath", "/run/dynsnap/entrypoint.json' is a symlink"),
}


@dataclass
class Trio:
    graph: Graph
    work: Path

    @property
    def workers(self) -> list[NodePod]:
        return self.graph.workers(WORKER_COMPONENT)


@pytest.fixture(scope="module")
async def trio(env: Env, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Trio]:
    body = chart_node.example_body(env, name="trust", worker_replicas=3, policy={"dynsnap.io/tier": "suspend"})
    async with deployed(env, body) as g:
        yield Trio(g, tmp_path_factory.mktemp("trust-node"))


def tampered(case: str, genuine: Obj, node_file: Path) -> bytes | None:
    """What the worker puts in place of its report (None: a symlink to ``node_file``, written here)."""
    if case == "oversized":  # valid JSON, every field right, past the 64 KiB bound
        return json.dumps({**genuine, "padding": "x" * 100_000}).encode()
    if case == "malformed":
        return b'{"format": 1, "state": "act'
    if case == "wrong-types":
        return json.dumps({**genuine, "request_seq": "7", "pid_reserved": "yes", "worker_pid": -5}).encode()
    node_file.write_text(json.dumps(genuine))  # a node file holding a right-looking report
    return None


def back_in_serving(since: datetime) -> Callable[[Obj | None], bool]:
    """Active asked and no quiesce open; one begun since ``since`` closed, and the capture called off:
    the quiesce itself (ok False: the refusal came during it), or the capture asked after it (the
    quiesce ok, the capture ok False: the refusal came after). Then the return verified by pinned
    requests (the controller's verification record, begun after the quiesce)."""
    def check(ws: Obj | None) -> bool:
        if not ws or ws["spec"].get("desiredState") != "Active":
            return False
        ctl = (ws.get("status") or {}).get("controller") or {}
        q, cap, v = ctl.get("quiesce"), ctl.get("capture") or {}, ctl.get("verification") or {}
        if not q or datetime.fromisoformat(q["started"]) < since:
            return True  # refused before the controller began taking it out: it never left
        started = datetime.fromisoformat(q["started"])
        capture_off = bool(cap) and cap.get("ok") is False and datetime.fromisoformat(cap["started"]) >= started
        return bool(q.get("finished") and (q.get("ok") is False or capture_off) and v.get("ok") is True
                    and datetime.fromisoformat(v["started"]) >= started)
    return check


def order(ws: Obj, since: datetime) -> str:
    """When the agent's refusal came, as the controller's records tell it."""
    ctl = (ws.get("status") or {}).get("controller") or {}
    q, cap = ctl.get("quiesce") or {}, ctl.get("capture") or {}
    if not q or datetime.fromisoformat(q["started"]) < since:
        return "before the controller's quiesce: the worker never left serving"
    if cap and datetime.fromisoformat(cap["started"]) >= datetime.fromisoformat(q["started"]):
        return "after the capture was asked: the capture called off, the return verified"
    return "during the quiesce: the quiesce called off, the return verified"


async def serve_again(env: Env, w: NodePod, report: Path, genuine: bytes, first: KubeletFacts) -> None:
    """The override ``active`` first (``suspended`` still on the pod would have the planner capture the
    worker the moment it is accepted again), then its genuine report back and its pod touched (an
    annotation of the test's), which the agent looks at at once rather than at its next re-look (up to
    CONTAINER_RELOOK_S later). Accepted again, it answers requests pinned to it, the same pod."""
    try:
        await override(env, w, "active")
        await wait_ws(env, w, "Active asked", lambda ws: bool(ws and ws["spec"]["desiredState"] == "Active"),
                      timeout=120)
    finally:
        replace_report(report, genuine)
        await env.api.merge_patch(R.PODS, w.name, {"metadata": {"annotations": {TOUCHED: str(time.time())}}},
                                  namespace=w.namespace)
    await wait_ws(env, w, "accepted again", lambda ws: bool((c := cond(ws, "Accepted")) and c["status"] == "True"),
                  timeout=120)
    await pinned(env, w, prompt="still yours")
    await same_pod(env, w, first)
    await override(env, w, None)


@pytest.mark.parametrize("case", list(CASES))
async def test_an_unusable_entrypoint_report_in_a_real_container_is_refused_and_nothing_is_touched(
        env: Env, trio: Trio, case: str) -> None:
    reason, says = CASES[case]
    w = trio.workers[0]
    first = await kubelet_facts(env.api, w)
    procs = container_procs(w.uid, first.container_id)
    ctl = Path(f"/proc/{procs.entrypoint}/root") / P.ENTRYPOINT_CONTROL_DIR.lstrip("/")
    report = ctl / P.ENTRYPOINT_CONTROL_FILE
    genuine = report.read_bytes()
    node_file = trio.work / f"entrypoint-{case}.json"
    content = tampered(case, json.loads(genuine), node_file)
    node_before = node_file.read_bytes() if node_file.exists() else None
    mark = len(env.driver.calls())
    since = datetime.now(UTC)
    replace_report(report, node_file if content is None else content)
    try:
        await override(env, w, "suspended")
        ws = await wait_ws(env, w, f"refused {reason}", refused(reason, says), timeout=120)
        print(f"\n[{case}] Accepted=False {reason}: {(cond(ws, 'Accepted') or {}).get('message', '')[-300:]}")
        st = ws.get("status") or {}
        assert "lastCapture" not in st and st.get("state") != "Suspended", st
        assert state_changes_since(env.driver, mark) == [], "the driver was asked to change a state"
        assert P.ENTRYPOINT_REQUEST_FILE not in [p.name for p in ctl.iterdir()], "a request reached the entrypoint"
        assert stub_state(env.driver, procs.root) == RUNNING
        assert container_procs(w.uid, first.container_id).root == procs.root, "the same worker process"
        if node_before is not None:
            assert node_file.read_bytes() == node_before, "the node's file was written through the symlink"
        back = await wait_ws(env, w, "back in serving, the capture called off", back_in_serving(since), timeout=120)
        quiesce = ((back.get("status") or {}).get("controller") or {}).get("quiesce") or {}
        took_out = bool(quiesce) and datetime.fromisoformat(quiesce["started"]) >= since
        print(f"[{case}] the refusal came {order(back, since)}")
        pod = await env.api.get(R.PODS, w.name, namespace=w.namespace)
        assert gate_of(pod) == "True", pod["status"]
        if took_out:
            notes = [e.get("note", "") for e in await events_for(env.api, w.namespace, w.name)
                     if e.get("reason") == "CaptureRefused" and e.get("type") == "Warning"]
            assert any(f"does not accept the pod: {reason}" in n for n in notes), notes
        assert container_procs(w.uid, first.container_id).root == procs.root, "the same worker process"
    finally:
        await serve_again(env, w, report, genuine, first)


async def test_the_agent_serves_its_other_workers_while_one_is_refused(env: Env, trio: Trio) -> None:
    w, peer, _third = trio.workers
    first = await kubelet_facts(env.api, w)
    procs = container_procs(w.uid, first.container_id)
    report = Path(f"/proc/{procs.entrypoint}/root") / P.ENTRYPOINT_CONTROL_DIR.lstrip("/") / P.ENTRYPOINT_CONTROL_FILE
    genuine = report.read_bytes()
    forged = start_forged_on_node(trio.work, peer.uid)  # the old marker, with the peer's UID
    ticks = start_ticks(forged.pid)
    replace_report(report, b"\xff not json")
    try:
        await override(env, w, "suspended")
        await wait_ws(env, w, "refused", refused("EntrypointUnreadable", "not JSON"), timeout=120)
        steps: dict[str, list[str]] = {}

        async def still_refused(slept: Obj) -> None:
            steps["capture"] = [s["name"] for s in slept["status"]["lastCapture"]["steps"]]
            assert refused("EntrypointUnreadable", "not JSON")(await get_ws(env.api, w))
        woken = await cycle(env, peer, "suspend", still_refused)
        # no wait for a "helper", no HelperTimeout for it: the agent took the forged process for nothing
        assert steps["capture"] == ["quiesce", "save", "settle-suspended"], steps
        assert [s["name"] for s in woken["status"]["lastWake"]["steps"]] == ["wake", "resume", "settle-active"], \
            woken["status"]["lastWake"]
        assert start_ticks(forged.pid) == ticks, "the forged process was killed"
        assert refused("EntrypointUnreadable", "not JSON")(await get_ws(env.api, w)), "still refused"
    finally:
        forged.kill()
        forged.wait(timeout=10)
        await serve_again(env, w, report, genuine, first)

