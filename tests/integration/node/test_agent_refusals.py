"""The chart's agent on the real node refuses what it must not act on, and names why, with nobody else
acting on its workers: moved from the sandbox suite test_agent_refusals.py. The module deploys
examples/dgd/agg.yaml (two workers, the mocker slowed so a long request stays in flight), then scales
the chart's controller Deployment to 0 (``kubectl scale``; the chart's schema rightly refuses
``controller.replicas: 0``) and plays the controller itself (the WorkerSnapshots' ``desiredState`` and
the serving gate), as the sandbox suite did; scaled back to 1 after.

- Specs the API server accepts but that name the wrong pod (a pod whose UID is another's, a pod of
  another namespace, the frontend's pod, which did not opt in, a gated pod not under
  dynsnap-entrypoint, a pod of a kwok node) are refused (``Accepted=False`` with the reason), also
  when ``Suspended`` is asked with the pods out of serving, and the workers they could reach stay as
  they were: the same process under an active entrypoint, its stand-in driver state running, no
  driver state change, no image of theirs on the node; then back in serving, answering pinned
  requests.
- The serving guard: a capture of a worker still in serving (its ``dynsnap.io/serving`` gate True, or
  requests in flight by its own metrics) is refused before any change, and goes ahead once it is not;
  the worker woken after is the same, answering.
- Idle facts at the edge: ``status.idle`` follows the worker's own metrics, and a quiet worker's
  WorkerSnapshot is not rewritten however often the agent scrapes it.
- A worker's ``entrypoint.json`` overwritten and then put right inside its container, with nothing
  else changing: the agent refuses it, then accepts it, by looking again on its own.
- What a pod author controls inside the container (issue 18, moved from the sandbox's
  test_agent_trust.py): two more pods of the graph's worker spec whose launcher gives the entrypoint a
  control directory that is a symlink to a node directory's path, or reaches it through ``..``
  (refused ``UnsafeContainerPath``, the node directory untouched); a symlink planted in a worker's
  control-directory emptyDir at an agent's former temp name (never followed); and the graph's workers
  started by a launcher that forges the old helper marker in their own tree (nothing waits for it or
  kills it).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest
import yaml
from controllerenv import cond, history
from realnodecycle import pinned, state_is, wait_ws
from realnodeenv import WORKER_COMPONENT, Env, chart_pod, launched_by, scale_controller
from realnodefacts import container_pid, container_procs, control_file_at, kubelet_facts, stub_state
from refusalenv import (
    StreamedChat,
    connections_to,
    hostile_ws,
    metric_names,
    metric_sum,
    observed,
    refused_or_capturing,
    state_changes_since,
    stream_chat,
    wait_ws_at,
    worker_metrics,
)
from trustenv import FORGE_IN_TREE, hostile_control_dir, marked_in, refused, replace_report, start_ticks, tree_bytes

from dynsnap.agent.idle import INFLIGHT, REQUESTS
from dynsnap.k8s.client import Obj
from dynsnap.k8s.errors import Conflict, NotFound
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.models.dynamo import instance_id_from_dwm
from dynsnap.runtime import procfs
from dynsnap.testenv import chart_node, real_graph
from dynsnap.testenv.cluster import NODES, TEST_NAMESPACE, wait_for
from dynsnap.testenv.real_graph import Graph, NodePod

pytestmark = pytest.mark.cluster

OTHER_NS = "refusal-other"  # a namespace with no pods: a WorkerSnapshot there names none of them
SLOW = 0.2  # the mocker's speed: 1000 tokens take about 30 s, a pinned 2-token answer well under one
LONG_TOKENS = 1000
RUNNING = 0  # the stand-in driver's state of a process that runs
QUIET_S = 6.0  # a pod and WorkerSnapshot unchanged this long, with nobody else acting on them: quiet


@dataclass
class Alone:
    graph: Graph
    bare: NodePod  # gated (dynsnap.io/serving) but not under dynsnap-entrypoint
    kwok: NodePod  # a pod of a kwok node
    hostile: dict[str, NodePod]  # CONTROL_DIRS case -> a worker whose control directory leads to a node path
    node_dirs: dict[str, Path]  # CONTROL_DIRS case -> that directory of the node
    noseccomp: NodePod  # a worker whose entrypoint installs no io_uring filter (refused SeccompOff, for good)

    def worker(self, i: int) -> NodePod:
        return self.graph.workers(WORKER_COMPONENT)[i]


def _pod(env: Env, name: str, *, node: str, gated: bool) -> Obj:
    spec: Obj = {"nodeName": node, "terminationGracePeriodSeconds": 1, "containers": [{
        "name": "main", "image": env.images["dynsnap-entrypoint"], "imagePullPolicy": "Never",
        "command": ["/bin/busybox", "sleep", "100000"]}]}
    if gated:
        spec["readinessGates"] = [{"conditionType": P.CONDITION_SERVING}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": TEST_NAMESPACE}, "spec": spec}


# The control directory a worker's container gives its entrypoint, leading to a node directory's path:
# case -> (made a symlink to it?, the agent's message). {dir} is that node directory.
CONTROL_DIRS = {
    "symlinked": (True, f"{P.ENTRYPOINT_CONTROL_DIR}/ctl", f"{P.ENTRYPOINT_CONTROL_DIR}/ctl is a symlink"),
    "dotdot": (False, f"{P.ENTRYPOINT_CONTROL_DIR}/../..{{dir}}", "it has a '..' component"),
}


def _pod_like(live: Obj, name: str, change: Callable[[Obj], object]) -> Obj:
    """A copy of the worker pod ``live`` (its spec, labels: the same graph's Service, so the frontend
    routes to it once Ready) named ``name``, owned by nobody, its ``main`` container changed by
    ``change``: what a pod author could deploy."""
    spec = copy.deepcopy(live["spec"])
    change(next(c for c in spec["containers"] if c["name"] == "main"))
    meta = live["metadata"]
    return {"apiVersion": "v1", "kind": "Pod", "spec": spec,
            "metadata": {"name": name, "namespace": meta["namespace"], "labels": dict(meta.get("labels") or {})}}


def _hostile_pod(live: Obj, name: str, case: str, node_dir: Path) -> Obj:
    """A copy of the worker pod whose entrypoint's control directory is CONTROL_DIRS[case]
    (trustenv.hostile_control_dir)."""
    symlink, control, _ = CONTROL_DIRS[case]
    return _pod_like(live, name, lambda main: hostile_control_dir(main, control.format(dir=node_dir), node_dir,
                                                                  symlink=symlink))


def _no_seccomp(main: Obj) -> None:
    """The entrypoint told not to install its io_uring filter (as test_controller_refusals.py's)."""
    cmd: list[str] = main["command"]
    cmd.insert(cmd.index("--"), "--no-seccomp")


async def _running(env: Env, name: str) -> NodePod:
    async def up() -> Obj | None:
        p = await env.api.get(R.PODS, name, namespace=TEST_NAMESPACE)
        status = p["status"]
        if status.get("phase") == "Failed":  # kubelet refused it (e.g. OutOfnvidia.com/gpu): no wait helps
            raise AssertionError(f"pod {name} failed: {status.get('reason')}: {status.get('message')}")
        running = any("running" in (c.get("state") or {}) for c in status.get("containerStatuses") or [])
        return p if running and status.get("podIP") else None
    p = await wait_for(f"pod {name} running", up, timeout=120, interval=0.5)
    return NodePod(name, TEST_NAMESPACE, p["metadata"]["uid"], p["status"]["podIP"], p["spec"]["nodeName"])


@pytest.fixture(scope="module")
async def alone(env: Env, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Alone]:
    body = launched_by(chart_node.example_body(env, name="rfs", worker_replicas=2, speedup_ratio=SLOW,
                                               policy={"dynsnap.io/tier": "suspend"}), FORGE_IN_TREE)
    graph = await chart_node.deploy_example(env, body)
    extra = {"rfs-bare": _pod(env, "rfs-bare", node=env.node.name, gated=True),
             "rfs-kwok": _pod(env, "rfs-kwok", node=NODES[0], gated=False)}
    node_dirs = {case: tmp_path_factory.mktemp(f"rfs-node-{case}") for case in CONTROL_DIRS}
    try:
        with contextlib.suppress(Conflict):
            await env.api.create(R.NAMESPACES, {"apiVersion": "v1", "kind": "Namespace",
                                                "metadata": {"name": OTHER_NS}})
        for pod in extra.values():
            await env.api.create(R.PODS, pod)
        bare, kwok = [await _running(env, n) for n in extra]
        # The controller made each worker's WorkerSnapshot and set its gate; now nobody but the test does.
        await scale_controller(env, 0)
        live = await env.api.get(R.PODS, graph.workers(WORKER_COMPONENT)[0].name, namespace=TEST_NAMESPACE)
        hostile = {}
        for case, node_dir in node_dirs.items():
            # A file of the node where the agent, following the container's path on the node, would look.
            (node_dir / P.ENTRYPOINT_CONTROL_FILE).write_bytes(b'{"format": 1, "state": "active"}')
            name = f"rfs-{case}"
            extra[name] = _hostile_pod(live, name, case, node_dir)
            await env.api.create(R.PODS, extra[name])
            hostile[case] = await _running(env, name)
        extra["rfs-noseccomp"] = _pod_like(live, "rfs-noseccomp", _no_seccomp)
        await env.api.create(R.PODS, extra["rfs-noseccomp"])
        yield Alone(graph, bare, kwok, hostile, node_dirs, await _running(env, "rfs-noseccomp"))
    except BaseException:
        print(await chart_node.graph_logs(env, graph))
        raise
    finally:
        for name in extra:
            with contextlib.suppress(NotFound):
                await env.api.delete(R.PODS, name, namespace=TEST_NAMESPACE)
        chart_node.keep_pod_logs(env)
        await real_graph.teardown(env.api, graph)
        env.graphs.remove(graph)
        with contextlib.suppress(NotFound):
            await env.api.delete(R.NAMESPACES, OTHER_NS)
        await scale_controller(env, 1)



async def gate(env: Env, pod: NodePod, serving: bool) -> None:
    """Play the controller: the worker out of serving (or back in) by its gate, as kubelet then says."""
    await env.cluster.set_serving_gate(pod, serving)
    await env.cluster.wait_ready(pod.namespace, pod.name, ready=serving, timeout=60)


async def set_desired(env: Env, pod: NodePod, desired: str) -> Obj:
    patched: Obj = await env.api.merge_patch(R.WORKER_SNAPSHOTS, pod.name, {"spec": {"desiredState": desired}},
                                             namespace=pod.namespace)
    return patched


@dataclass(frozen=True)
class Look:
    """A worker as the kernel, its entrypoint and the stand-in driver show it."""

    container_id: str
    root: int

    @classmethod
    async def of(cls, env: Env, pod: NodePod) -> Look:
        facts = await kubelet_facts(env.api, pod)
        return cls(facts.container_id, container_procs(pod.uid, facts.container_id).root)


def untouched(env: Env, pods: dict[NodePod, Look], mark: int, *, control_dir: str = P.ENTRYPOINT_CONTROL_DIR
              ) -> None:
    """Nothing was done to ``pods``: the same process runs each under an active entrypoint (its control
    file, in ``control_dir`` of its container, says so), its driver state running; no driver call changed
    a state since ``mark``; no image of theirs on the node."""
    for pod, look in pods.items():
        procs = container_procs(pod.uid, look.container_id)
        assert procs.root == look.root, f"{pod.name}: another worker process"
        info = control_file_at(procs.entrypoint, control_dir)
        assert info["state"] == P.EntrypointState.ACTIVE.value and info["worker_alive"] is True, info
        assert stub_state(env.driver, look.root) == RUNNING
    assert state_changes_since(env.driver, mark) == []
    images = env.paths.images
    mine = [p.name for p in images.iterdir() if any(pod.uid in p.name for pod in pods)] if images.is_dir() else []
    assert mine == [], mine


# -- specs the API accepts and the agent refuses -----------------------------------------------------

@dataclass(frozen=True)
class Hostile:
    body: Obj
    targets: list[NodePod]  # the workers it could reach (by name or UID): none of them may change
    gated: list[NodePod]  # the pods it names that have the gate: taken out of serving while it is asked
    reason: str
    message: str  # what the Accepted condition's message must say


def hostile(env: Env, a: Alone, case: str) -> Hostile:
    w0, w1, node = a.worker(0), a.worker(1), env.node.name
    if case == "uid-of-another-pod":
        # Acted on, it would capture worker-1: the agent finds a pod's processes by its UID in /proc.
        return Hostile(hostile_ws(name=a.bare.name, namespace=a.bare.namespace, node=node, pod_name=a.bare.name,
                                  pod_uid=w1.uid), [w1], [a.bare, w1], P.Reason.POD_UID_MISMATCH.value,
                       f"pod {a.bare.name} has UID {a.bare.uid}, the spec names {w1.uid}")
    if case == "pod-of-another-namespace":
        return Hostile(hostile_ws(name=w0.name, namespace=OTHER_NS, node=node, pod_name=w0.name, pod_uid=w0.uid),
                       [w0], [w0], P.Reason.POD_NOT_FOUND.value, f"pod {OTHER_NS}/{w0.name} does not exist")
    if case == "not-opted-in":
        fe = a.graph.frontend
        return Hostile(hostile_ws(name=fe.name, namespace=fe.namespace, node=node, pod_name=fe.name,
                                  pod_uid=fe.uid), [], [], P.Reason.NOT_OPTED_IN.value,
                       f"pod has no readiness gate {P.CONDITION_SERVING}")
    if case == "not-under-entrypoint":
        return Hostile(hostile_ws(name=a.bare.name, namespace=a.bare.namespace, node=node, pod_name=a.bare.name,
                                  pod_uid=a.bare.uid), [], [a.bare], P.Reason.NOT_UNDER_ENTRYPOINT.value,
                       "no container runs dynsnap-entrypoint as its PID 1")
    assert case == "pod-on-another-node"
    # Labelled for the real node, whose agent refuses it: the pod runs on a kwok node.
    return Hostile(hostile_ws(name=a.kwok.name, namespace=a.kwok.namespace, node=node, pod_name=a.kwok.name,
                              pod_uid=a.kwok.uid), [], [], P.Reason.WRONG_NODE.value,
                   f"pod runs on {a.kwok.node!r}, this agent serves {node!r}")


@pytest.mark.parametrize("case", ["uid-of-another-pod", "pod-of-another-namespace", "not-opted-in",
                                  "not-under-entrypoint", "pod-on-another-node"])
async def test_the_agent_refuses_a_spec_naming_the_wrong_pod_and_changes_nothing(env: Env, alone: Alone,
                                                                                 case: str) -> None:
    api = env.api
    h = hostile(env, alone, case)
    ns, name = h.body["metadata"]["namespace"], h.body["metadata"]["name"]
    looks = {p: await Look.of(env, p) for p in h.targets}
    mark = len(env.driver.calls())
    created = await api.create(R.WORKER_SNAPSHOTS, h.body)
    try:
        ws = await wait_ws_at(api, ns, name, "refused", observed(created["metadata"]["generation"]))
        accepted = cond(ws, "Accepted")
        assert accepted is not None and (accepted["status"], accepted["reason"]) == ("False", h.reason), accepted
        assert h.message in accepted["message"], accepted["message"]
        assert ws["status"]["state"] == P.ObservedState.UNKNOWN.value
        # Asked to sleep, with every gated pod it names out of serving, as the controller would leave
        # them: only the refusal stands between the spec and a capture.
        for pod in h.gated:
            await env.cluster.set_serving_gate(pod, False)
        patched = await api.merge_patch(R.WORKER_SNAPSHOTS, name, {"spec": {"desiredState": "Suspended"}},
                                        namespace=ns)
        ws = await wait_ws_at(api, ns, name, "Suspended refused", observed(patched["metadata"]["generation"]))
        accepted = cond(ws, "Accepted")
        assert accepted is not None and (accepted["status"], accepted["reason"]) == ("False", h.reason), accepted
        assert "lastCapture" not in ws["status"] and "lastError" not in ws["status"], ws["status"]
        untouched(env, looks, mark)
    finally:
        with contextlib.suppress(NotFound):
            await api.delete(R.WORKER_SNAPSHOTS, name, namespace=ns)
        for pod in h.gated:
            await env.cluster.set_serving_gate(pod, True)
    for pod in h.targets:
        await env.cluster.wait_ready(pod.namespace, pod.name, timeout=60)
        await pinned(env, pod, n=1)
    untouched(env, looks, mark)


# -- paths and markers inside the container (issue 18; moved from the sandbox's test_agent_trust.py) --------

@pytest.mark.parametrize("case", list(CONTROL_DIRS))
async def test_a_control_directory_leading_to_a_node_directory_is_refused_and_that_directory_untouched(
        env: Env, alone: Alone, case: str) -> None:
    """A worker whose container gives its entrypoint a control directory that is a symlink to a node
    directory's path, or reaches it through ``..``: refused (``Accepted=False UnsafeContainerPath``), also
    once it is out of serving and asked to sleep; the node directory byte for byte as it was (no state
    request, nothing written), no driver call changing a state; the worker serves on, untouched (its own
    control file, inside its container, still says active)."""
    pod, node_dir = alone.hostile[case], alone.node_dirs[case]
    says = CONTROL_DIRS[case][2]
    before = tree_bytes(node_dir)
    look = await Look.of(env, pod)
    mark = len(env.driver.calls())
    created = await env.api.create(R.WORKER_SNAPSHOTS, hostile_ws(
        name=pod.name, namespace=pod.namespace, node=env.node.name, pod_name=pod.name, pod_uid=pod.uid,
        tier="suspend"))
    try:
        check = refused(P.Reason.UNSAFE_CONTAINER_PATH.value, says)
        ws = await wait_ws(env, pod, "refused", lambda ws: bool(ws and observed(created["metadata"]["generation"])(
            ws) and check(ws)), timeout=90)
        await gate(env, pod, False)
        patched = await set_desired(env, pod, "Suspended")
        ws = await wait_ws(env, pod, "Suspended refused", lambda ws: bool(ws and observed(
            patched["metadata"]["generation"])(ws) and check(ws)), timeout=90)
        assert "lastCapture" not in ws["status"] and "lastError" not in ws["status"], ws["status"]
        assert tree_bytes(node_dir) == before, "the agent wrote into the node directory"
        assert P.ENTRYPOINT_REQUEST_FILE not in os.listdir(node_dir)
        untouched(env, {pod: look}, mark, control_dir=str(node_dir))
    finally:
        with contextlib.suppress(NotFound):
            await env.api.delete(R.WORKER_SNAPSHOTS, pod.name, namespace=pod.namespace)
        await gate(env, pod, True)
    await pinned(env, pod, n=1)  # the worker serves on
    untouched(env, {pod: look}, mark, control_dir=str(node_dir))


async def test_a_symlink_planted_at_the_agents_former_temp_name_is_never_followed(
        env: Env, alone: Alone, tmp_path: Path) -> None:
    """A symlink to a file of the node planted in the worker's control directory at the name agents
    before issue 18 wrote its state request through (``.state-request.<the agent's pid>``): the capture
    and the wake go on, the file of the node is as it was, the symlink too, and the agent's temp files are
    gone (nothing else appeared)."""
    pod = alone.worker(1)
    agent_pid = container_pid(await chart_pod(env, "agent"), "agent")
    ctl = (env.node.layout.kubelet_root / "pods" / pod.uid / "volumes" / "kubernetes.io~empty-dir" /
           "dynsnap-control")  # the control-directory emptyDir, as kubelet keeps it on the node
    victim = tmp_path / "victim"
    victim.write_bytes(b"a file of the node\n")
    planted = ctl / f".{P.ENTRYPOINT_REQUEST_FILE}.{agent_pid}"
    planted.symlink_to(victim)
    look = await Look.of(env, pod)
    try:
        await gate(env, pod, False)
        await set_desired(env, pod, "Suspended")
        await sleep_then_wake(env, pod, look)
        assert victim.read_bytes() == b"a file of the node\n", "the agent wrote through the planted symlink"
        assert os.readlink(planted) == str(victim)
        left = sorted(os.listdir(ctl))
        assert left == sorted([P.ENTRYPOINT_CONTROL_FILE, P.ENTRYPOINT_REQUEST_FILE, planted.name, "worker.log"]), \
            f"the agent's temp files are gone, nothing else appeared: {left}"
    finally:
        planted.unlink(missing_ok=True)
        await release(env, pod)


async def test_a_helper_marker_forged_inside_the_worker_changes_nothing(env: Env, alone: Alone) -> None:
    """The worker's launcher started a process in its own tree carrying ``DYNSNAP_OP=<its pod UID>/criu``
    (trustenv.FORGE_IN_TREE): captured and woken, no step waits for a helper and the process is never
    killed (the same start time)."""
    pod = alone.worker(1)
    look = await Look.of(env, pod)
    ns = procfs.pid_ns(container_procs(pod.uid, look.container_id).entrypoint)
    assert ns is not None
    forged = {pid: start_ticks(pid) for pid in marked_in(ns, pod.uid)}
    assert len(forged) == 1, f"the worker's own forged helper runs in its tree: {forged}"
    try:
        await gate(env, pod, False)
        await set_desired(env, pod, "Suspended")
        await sleep_then_wake(env, pod, look)  # the capture's steps: quiesce, save, settle-suspended
        ws = await wait_ws(env, pod, "Active", state_is("Active", suspended=False), timeout=60)
        assert [s["name"] for s in ws["status"]["lastWake"]["steps"]] == ["wake", "resume", "settle-active"], \
            ws["status"]["lastWake"]
        assert {pid: start_ticks(pid) for pid in forged} == forged, "a forged process was killed"
    finally:
        await release(env, pod)


# -- the serving guard ---------------------------------------------------------------------------------

async def sleep_then_wake(env: Env, pod: NodePod, look: Look) -> None:
    """Once nothing holds the capture: asleep (the capture's steps), woken, back in serving, the same
    worker answering requests pinned to it."""
    asleep = await wait_ws(env, pod, "Suspended", state_is("Suspended", suspended=True), timeout=120)
    cap = asleep["status"]["lastCapture"]
    assert cap["ok"] is True and [s["name"] for s in cap["steps"]] == ["quiesce", "save", "settle-suspended"], cap
    degraded = cond(asleep, "Degraded")
    assert degraded is not None and degraded["status"] == "False", degraded
    await set_desired(env, pod, "Active")
    await wait_ws(env, pod, "Active", state_is("Active", suspended=False), timeout=120)
    await gate(env, pod, True)
    await pinned(env, pod)
    assert (await Look.of(env, pod)) == look, "the same container and worker process, woken in place"


async def test_a_capture_of_a_worker_still_in_serving_is_refused_until_it_is_out(env: Env, alone: Alone) -> None:
    pod = alone.worker(0)
    look = await Look.of(env, pod)
    mark = len(env.driver.calls())
    try:
        await set_desired(env, pod, "Suspended")  # nobody took it out of serving: its gate is still True
        ws = await wait_ws(env, pod, "refused: WorkerServing",
                           refused_or_capturing(P.Reason.WORKER_SERVING.value), timeout=120)
        err = ws["status"].get("lastError") or {}
        assert err.get("reason") == P.Reason.WORKER_SERVING.value and err["step"] == "quiesce", ws["status"]
        assert f"the pod's {P.CONDITION_SERVING} condition is True, not False" in err["message"], err
        degraded = cond(ws, "Degraded")
        assert degraded is not None and (degraded["status"], degraded["reason"]) == (
            "True", P.Reason.WORKER_SERVING.value), degraded
        assert ws["status"]["lastCapture"]["ok"] is False
        await pinned(env, pod)  # refused before any change: it still serves
        untouched(env, {pod: look}, mark)
        await gate(env, pod, False)
        await sleep_then_wake(env, pod, look)
        assert state_changes_since(env.driver, mark), "the capture locked and checkpointed the worker"
    finally:
        await release(env, pod)


async def test_a_capture_is_refused_while_requests_are_in_flight_by_the_workers_own_metrics(
        env: Env, alone: Alone) -> None:
    pod = alone.worker(1)
    assert env.fe is not None
    wid = instance_id_from_dwm(await env.api.get(R.DWMS, pod.name, namespace=pod.namespace))
    names = metric_names(await worker_metrics(pod))
    assert INFLIGHT in names and REQUESTS in names, names  # the series the agent reads exist
    look = await Look.of(env, pod)
    streams: list[asyncio.Task[StreamedChat]] = []
    try:
        await env.fe.wait_routable(wid, timeout=120)
        started = [asyncio.Event(), asyncio.Event()]
        streams = [asyncio.create_task(stream_chat(env.fe, worker_id=wid, max_tokens=LONG_TOKENS, started=s))
                   for s in started]
        for s in started:
            await asyncio.wait_for(s.wait(), 60)

        async def two_in_flight() -> bool:
            return metric_sum(await worker_metrics(pod), INFLIGHT) == 2
        await wait_for("two requests in flight on the worker", two_in_flight, timeout=30, interval=0.5)
        mark = len(env.driver.calls())
        await gate(env, pod, False)  # out of serving, but the requests go on
        await set_desired(env, pod, "Suspended")
        ws = await wait_ws(env, pod, "refused: requests in flight", refused_or_capturing(
            P.Reason.WORKER_SERVING.value, containing="requests in flight"), timeout=120)
        err = ws["status"].get("lastError") or {}
        assert re.fullmatch(r"2 requests in flight", err["message"]), err
        untouched(env, {pod: look}, mark)
        for t in streams:  # answered in full by this worker; then the capture goes ahead
            res = await asyncio.wait_for(t, 300)
            assert res.status == 200 and res.done and res.finish_reason == "length", res
            assert res.chunks >= LONG_TOKENS // 2 and res.worker_ids == {wid}, (res.chunks, res.worker_ids)
        await sleep_then_wake(env, pod, look)
    finally:
        for t in streams:
            t.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
        await release(env, pod)


async def release(env: Env, pod: NodePod) -> None:
    """End of a test on ``pod``: whatever an assertion left, the worker asked Active and back in serving
    (bounded), so the next test starts from a serving worker."""
    with contextlib.suppress(Exception):
        await set_desired(env, pod, "Active")
        await wait_ws(env, pod, "Active (cleanup)", state_is("Active"), timeout=60)
    await gate(env, pod, True)


# -- a refusal for good, with nobody else asking -----------------------------------------------------------

def _failure_backoff(env: Env) -> float:
    """The install's agent.failureBackoff (the chart's default unless the install sets it)."""
    chart = yaml.safe_load((chart_node.CHART / "values.yaml").read_text())
    return float((env.values.get("agent") or {}).get("failureBackoff", chart["agent"]["failureBackoff"]))


async def test_a_permanent_refusal_is_not_retried_by_the_agent_until_the_spec_changes(env: Env, alone: Alone) -> None:
    """SeccompOff will not go away while the container runs (issue 18: the agent retried it seven times in
    160 s, with doubling backoff). With nobody else acting on the worker (the controller scaled to 0, its
    WorkerSnapshot asked Suspended and left so), refused once, the worker stays active and the capture is
    not tried again for that spec over two and a half failure backoffs, in which the backoff would have
    retried it; a new spec generation (the spec written anew) is tried once more, refused again, and
    nothing of the worker ever changed: it serves on."""
    pod = alone.noseccomp
    look = await Look.of(env, pod)
    mark = len(env.driver.calls())
    created = await env.api.create(R.WORKER_SNAPSHOTS, hostile_ws(
        name=pod.name, namespace=pod.namespace, node=env.node.name, pod_name=pod.name, pod_uid=pod.uid))
    try:
        accepted = lambda ws: bool((c := cond(ws, "Accepted")) and c["status"] == "True")  # noqa: E731
        await wait_ws(env, pod, "accepted", lambda ws: bool(
            ws and observed(created["metadata"]["generation"])(ws) and accepted(ws)), timeout=90)
        await gate(env, pod, False)
        await set_desired(env, pod, "Suspended")
        ws = await wait_ws(env, pod, "SeccompOff", lambda ws: bool(
            ((ws or {}).get("status") or {}).get("lastError", {}).get("reason") == "SeccompOff"), timeout=120)
        err, first = ws["status"]["lastError"], ws["status"]["lastCapture"]["id"]
        assert err["step"] == "quiesce" and ws["status"]["consecutiveFailures"] == 1, ws["status"]
        window = 2.5 * _failure_backoff(env)  # the backoff's first retry would have come after one
        for _ in range(int(window)):
            await asyncio.sleep(1.0)
            st = (await env.api.get(R.WORKER_SNAPSHOTS, pod.name, namespace=pod.namespace))["status"]
            assert st["consecutiveFailures"] == 1 and st["lastCapture"]["id"] == first, st
            assert st["state"] == P.ObservedState.ACTIVE.value, st
        untouched(env, {pod: look}, mark)
        # A new intent (the spec written again: a new generation) is tried once, and refused again.
        await set_desired(env, pod, "Active")
        await set_desired(env, pod, "Suspended")
        ws = await wait_ws(env, pod, "refused again", lambda ws: bool(
            ((ws or {}).get("status") or {}).get("consecutiveFailures") == 2), timeout=120)
        assert ws["status"]["lastCapture"]["id"] != first
        assert ws["status"]["lastError"]["reason"] == "SeccompOff"
        cap = ws["status"]["lastCapture"]
        assert cap["ok"] is False and [s["name"] for s in cap["steps"]] == ["quiesce"], cap
        untouched(env, {pod: look}, mark)
    finally:
        with contextlib.suppress(NotFound):
            await env.api.delete(R.WORKER_SNAPSHOTS, pod.name, namespace=pod.namespace)
        await gate(env, pod, True)
    await pinned(env, pod)  # never changed: it serves on
    untouched(env, {pod: look}, mark)


# -- idle facts at the edge ------------------------------------------------------------------------------

def _ts(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


async def test_idle_facts_follow_the_workers_own_metrics_and_a_quiet_worker_is_not_rewritten(
        env: Env, alone: Alone) -> None:
    """``status.idle`` from the worker's own metrics, scraped by the agent pod every second (the shared
    install's ``agent.scrapeInterval``); nobody else writes the WorkerSnapshot while the controller is
    scaled to 0, so an unchanged resourceVersion over three scrapes is the agent writing nothing."""
    pod = alone.worker(0)

    def quiet(ws: Obj | None) -> bool:
        return bool((((ws or {}).get("status") or {}).get("idle") or {}).get("idleSince"))
    ws = await wait_ws(env, pod, "idleSince set", quiet, timeout=120)
    accepted = cond(ws, "Accepted")
    assert accepted is not None and accepted["status"] == "True", accepted
    idle0, rv0 = ws["status"]["idle"], ws["metadata"]["resourceVersion"]
    assert idle0["inflight"] == 0
    assert idle0["requestsTotal"] == metric_sum(await worker_metrics(pod), REQUESTS)
    # Quiet: the agent scrapes the worker (one TCP connection each, in the agent pod's network
    # namespace) and writes nothing.
    agent = container_pid(await chart_pod(env, "agent"), "agent")
    seen = connections_to(pod.ip, P.DYNAMO_SYSTEM_PORT, netns_of=agent)

    async def scraped_thrice() -> bool:
        return len(connections_to(pod.ip, P.DYNAMO_SYSTEM_PORT, netns_of=agent) - seen) >= 3
    await wait_for("three more scrapes of the quiet worker", scraped_thrice, timeout=60, interval=0.5)
    again = await env.api.get(R.WORKER_SNAPSHOTS, pod.name, namespace=pod.namespace)
    assert again["metadata"]["resourceVersion"] == rv0, "a quiet worker's WorkerSnapshot was rewritten"
    # Activity: requests move the worker's counter; lastActivity follows, and idleSince is set anew
    # from it once the worker is quiet again.
    await pinned(env, pod, n=3)

    def quiet_again(ws: Obj | None) -> bool:
        idle = ((ws or {}).get("status") or {}).get("idle") or {}
        return (idle.get("requestsTotal", 0) >= idle0["requestsTotal"] + 3 and bool(idle.get("idleSince"))
                and idle.get("lastActivity") is not None)
    ws = await wait_ws(env, pod, "activity seen, then quiet again", quiet_again, timeout=120)
    idle1 = ws["status"]["idle"]
    assert _ts(idle1["lastActivity"]) > _ts(idle0["idleSince"])
    assert idle1["idleSince"] == idle1["lastActivity"], "idle since its last activity"
    assert idle1["inflight"] == 0


# -- a refusal for what the container holds is looked at again ----------------------------------------------

async def test_a_worker_whose_report_turns_unusable_and_right_again_is_refused_and_accepted_by_the_agent_alone(
        env: Env, alone: Alone) -> None:
    """The worker's entrypoint.json overwritten inside its container, then put right, while nobody changes
    its pod or WorkerSnapshot (the controller is scaled to 0, the worker quiet): the agent notices each by
    looking again on its own (CONTAINER_RELOOK_S, dynsnap/agent/node.py), so the first change to either
    object after each replacement is the agent's refusal, then its acceptance."""
    pod = alone.worker(0)
    look = await Look.of(env, pod)
    procs = container_procs(pod.uid, look.container_id)
    report = Path(f"/proc/{procs.entrypoint}/root") / P.ENTRYPOINT_CONTROL_DIR.lstrip("/") / P.ENTRYPOINT_CONTROL_FILE
    genuine = report.read_bytes()
    accepted_now = lambda ws: bool((c := cond(ws, "Accepted")) and c["status"] == "True")  # noqa: E731
    await wait_ws(env, pod, "accepted", accepted_now, timeout=60)
    mark = len(env.driver.calls())
    try:
        for what, content, check in (("refused", b"\xff not json", refused("EntrypointUnreadable", "not JSON")),
                                     ("accepted again", genuine, accepted_now)):
            await wait_for(f"{pod.name}'s pod and WorkerSnapshot unchanged for {QUIET_S:g}s", quiet(env, pod),
                           timeout=120, interval=QUIET_S)
            async with history(env.api, R.PODS, pod) as pods, history(env.api, R.WORKER_SNAPSHOTS, pod) as wss:
                replace_report(report, content)
                ws = await wait_ws(env, pod, what, check, timeout=60)
                at = int(ws["metadata"]["resourceVersion"])

                async def caught_up(at: int = at) -> bool:
                    return any(int(v["metadata"]["resourceVersion"]) >= at for v in wss)
                await wait_for(f"the watch on the WorkerSnapshot at the {what} version", caught_up, timeout=30)
            first = next(v for v in wss[1:] if int(v["metadata"]["resourceVersion"]) > int(
                wss[0]["metadata"]["resourceVersion"]))
            assert check(first), (f"the WorkerSnapshot changed before the agent found the worker {what}",
                                  cond(first, "Accepted"))
            assert all(int(p["metadata"]["resourceVersion"]) > at for p in pods[1:]), f"the pod changed first ({what})"
        untouched(env, {pod: look}, mark)
    finally:
        if report.read_bytes() != genuine:
            replace_report(report, genuine)
    await pinned(env, pod)


def quiet(env: Env, pod: NodePod) -> Callable[[], Awaitable[bool]]:
    """True once ``pod`` and its WorkerSnapshot are as they were at the previous call."""
    last: list[tuple[str, str]] = []

    async def check() -> bool:
        now = ((await env.api.get(R.PODS, pod.name, namespace=pod.namespace))["metadata"]["resourceVersion"],
               (await env.api.get(R.WORKER_SNAPSHOTS, pod.name, namespace=pod.namespace))["metadata"]
               ["resourceVersion"])
        same = bool(last) and last[-1] == now
        last.append(now)
        return same
    return check
