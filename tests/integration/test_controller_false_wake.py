"""A woken worker that cannot answer ends ``Verified=False PinnedRequestFailed``, even while a healthy
peer answers the unpinned traffic: the controller never takes "the agent says Active" or "a request
through the frontend got an answer" for proof.

Two workers, ``min-active: 1``: one is captured (suspend tier: its processes stay), then load through
the frontend wakes it, and before the wake its worker process tree is stopped (SIGSTOP) while it
sleeps, so it cannot answer. The agent still wakes it (the driver state and the entrypoint do not need
the worker to run) and the pod stays Ready for kubelet's readiness window (the stub kubelet times
readiness as kubelet does here, with a window of minutes), so only the pinned requests show it: each
gets the frontend's 504 -> ``PinnedRequestFailed``. With ``on-failed-wake: none`` the pod is left to
be inspected; with ``restart`` it is deleted (``ColdRestart``), and the delete carries the pod's UID as
a precondition: held at the API server's door while the test replaces the pod under the same name, it
deletes nothing.

In every case the failed worker's serving gate is False afterwards, its ``Verified`` condition False
with that reason, a Warning Event says so, and the unpinned requests were answered by the peer (a
frozen worker answers nothing; requests the frontend routed to it while it was being verified end in
504, and none after the verdict). The woken worker whose DWM changed while it slept (``DwmChanged``)
is node/test_controller_false_wake.py, on the real node.

Sandbox, why: a frozen worker is Ready only under the stub kubelet's readiness window; on the real node
the example's probes answer 503 through the entrypoint for a frozen worker, so kubelet takes it out of
Ready and, by the liveness probe (every 5 s, failureThreshold 1), restarts the container (seen on the
real node, 2026-12-06: Events "Liveness probe failed ... 503" and "Killing", restartCount 1 35 s after
the freeze), before a pinned request could show it.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from controllerenv import CtlEnv, Load, cond, events_for, gate_of, history, one_asleep, policy, running, wait_verdict

from dynsnap.k8s.client import Obj
from dynsnap.k8s.errors import NotFound
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.models.dynamo import instance_id_from_dwm
from dynsnap.testenv import dynamo as D
from dynsnap.testenv.cluster import LocalCluster, RunningPod, wait_for
from dynsnap.testenv.dynsnap_parts import StubDriver
from dynsnap.testenv.fake_apiproxy import FakeApiProxy, Fault

pytestmark = pytest.mark.cluster

VERIFY_TIMEOUT = 8  # seconds from the wake to a verdict: one round of pinned requests (504 after 5 s)
READY_WINDOW = 60  # readiness failureThreshold (x periodSeconds 10): kubelet's window, ten minutes here


def graph(name: str, on_failed_wake: str) -> Any:
    def make(driver: StubDriver) -> Obj:
        worker = D.mocker_component("worker", replicas=2, dynsnap=True, speedup_ratio=1,
                                    env={"LD_PRELOAD": str(driver.libcuda)})
        worker["extraPodSpec"]["mainContainer"]["readinessProbe"]["failureThreshold"] = READY_WINDOW
        worker["annotations"] = policy(min_active=1, verify_requests=3, on_failed_wake=on_failed_wake)
        body = D.dgd(name, [D.frontend_component(), worker])
        body["metadata"]["annotations"] = policy(enabled=True, idle_after="2s", tier="suspend", wake_at_inflight=1)
        return body
    return make


@contextlib.asynccontextmanager
async def env_through_proxy(cluster: LocalCluster, name: str, on_failed_wake: str) -> AsyncIterator[
        tuple[CtlEnv, FakeApiProxy]]:
    """The graph, the agents, and the controller reaching the API server through fake_apiproxy (so a
    test can hold one of its requests at the door)."""
    assert cluster.cp is not None
    async with FakeApiProxy.in_front_of(cluster.cp) as proxy, running(
            cluster, graph(name, on_failed_wake), controller_server=proxy.url,
            controller_args=["--verify-timeout", str(VERIFY_TIMEOUT)]) as env:
        yield env, proxy


def worker_tree(pod: RunningPod) -> list[int]:
    """Host pids of every process under the pod's entrypoint (the worker and its descendants)."""
    out: list[int] = []
    todo = [pod.sandbox.pid]
    while todo and len(out) < 10_000:
        pid = todo.pop()
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError):
                    kids = [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
                    out += kids
                    todo += kids
    return out


def state_of(pid: int) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("State:"):
            return line.split()[1]
    return "?"


@contextlib.contextmanager
def frozen(pod: RunningPod) -> Any:
    """The worker's processes stopped (SIGSTOP) for the block, the entrypoint (PID 1) left running."""
    pids = worker_tree(pod)
    assert pids, f"{pod.name}: no worker process under the entrypoint"
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 10
        while not all(state_of(p) == "T" for p in pids):  # a stop is delivered, not done, by kill()
            assert time.monotonic() < deadline, [(p, state_of(p)) for p in pids]
            time.sleep(0.05)
        yield pids
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


async def replace_pod(env: CtlEnv, pod: RunningPod) -> str:
    """The pod gone and another in its place under the same name (the operator's replacement, as the
    API server sees it: a new UID). Returns the new UID."""
    await env.cluster.delete_pod(pod.namespace, pod.name)  # its sandbox stopped, the object deleted at once

    async def gone() -> bool:
        try:
            await env.api.get(R.PODS, pod.name, namespace=pod.namespace)
        except NotFound:
            return True
        return False
    await wait_for(f"{pod.name} gone", gone, timeout=60)
    created = await env.api.create(R.PODS, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod.name, "namespace": pod.namespace},
        "spec": {"nodeName": pod.node, "containers": [{"name": "main", "image": "replacement"}]}})
    return str(created["metadata"]["uid"])


async def live_pod(env: CtlEnv, pod: RunningPod) -> Obj | None:
    with contextlib.suppress(NotFound):
        return await env.api.get(R.PODS, pod.name, namespace=pod.namespace)
    return None


CASES = [("frozen", "none"), ("frozen", "restart"), ("frozen-replaced", "restart")]


@pytest.mark.parametrize(("case", "on_failed_wake"), CASES, ids=[f"{c}-{f}" for c, f in CASES])
async def test_a_wake_that_does_not_serve_is_not_verified_while_the_peer_serves(
        cluster: LocalCluster, case: str, on_failed_wake: str) -> None:
    async with env_through_proxy(cluster, f"false-{case}-{on_failed_wake}", on_failed_wake) as (env, proxy):
        for p in env.graph.workers("worker"):
            p.kubelet.readiness_window = True  # a worker that stops answering stays Ready for a while
        pod, peer = await one_asleep(env.api, env.graph.workers("worker"))
        peer_id = instance_id_from_dwm(await env.api.get(R.DWMS, peer.name, namespace=peer.namespace))
        reason = "PinnedRequestFailed"
        async with contextlib.AsyncExitStack() as stack:
            pods = await stack.enter_async_context(history(env.api, R.PODS, pod))
            wss = await stack.enter_async_context(history(env.api, R.WORKER_SNAPSHOTS, pod))
            stack.enter_context(frozen(pod))
            if case == "frozen-replaced":
                # The controller's fallback delete is held at the API server's door until the pod is replaced.
                proxy.add(Fault("stall", method="DELETE",
                                path_contains=f"/namespaces/{pod.namespace}/pods/{pod.name}"))
            load = Load(env.fe, concurrency=4, max_tokens=30)  # demand over one worker's share: wakes the sleeper
            load.start()
            try:
                ws = await wait_verdict(wss, reason)
                decided = time.time()
                replacement = None
                if case == "frozen-replaced":
                    await proxy.wait_stalled(1, timeout=60)
                    replacement = await replace_pod(env, pod)
                    proxy.release()
                if on_failed_wake == "restart":
                    async def restarted() -> bool:
                        return "ColdRestart" in {e["reason"] for e in await events_for(env.api, pod.namespace,
                                                                                         pod.name)}
                    await wait_for("the ColdRestart Event (after the fallback's delete returned)", restarted,
                                   timeout=60)

                async def after_verdict() -> bool:  # unpinned answers after the verdict, to look at below
                    return sum(1 for r in load.results if r[0] > decided + 7) >= 4
                await wait_for("unpinned answers after the verdict", after_verdict, timeout=60)
            finally:
                await load.stop()

        v = ws["status"]["controller"]["verification"]
        assert v["ok"] is False and v["reason"] == reason, v
        verified = cond(ws, "Verified")
        assert verified is not None and verified["status"] == "False" and verified["reason"] == reason
        # The agent did wake it: the failure is the controller's finding, not the agent's.
        assert ws["status"]["state"] == "Active" and ws["status"]["lastWake"]["ok"] is True
        # Pinned requests were sent and none was answered: the frontend's deadline for a frozen worker
        # (504 after 5 s), or its 500 once a request to the instance has failed that way.
        assert v["answered"] == 0 and v["requests"] >= 1, v
        assert v["headers"] == [P.HEADER_WORKER_INSTANCE_ID], v
        assert "0/3 pinned requests answered" in v["message"], v["message"]
        assert re.search(r"; last: HTTP 50[04]: ", v["message"]), v["message"]

        events = await events_for(env.api, pod.namespace, pod.name)
        warned = [e for e in events if e["type"] == "Warning" and e["reason"] == reason]
        assert warned and f"fallback: {v['fallback']}" in warned[-1]["note"], events

        live = await live_pod(env, pod)
        gate: list[str | None] = []  # the values the failed pod's gate took, in order
        for version in pods:
            if version["metadata"]["uid"] == pod.uid and (not gate or gate_of(version) != gate[-1]):
                gate.append(gate_of(version))
        # Back into serving for the pinned requests (the frontend routes only to a ready endpoint), then out.
        assert gate[0] == "False" and "True" in gate and gate[-1] == "False", gate
        if on_failed_wake == "none":
            assert v["fallback"] == "none"
            assert live is not None and live["metadata"]["uid"] == pod.uid, "the pod is left to be inspected"
            assert gate_of(live) == "False", "taken out of serving again"
            assert not [e for e in events if e["reason"] == "ColdRestart"]
        else:
            assert v["fallback"] == "ColdRestart"
            assert [e for e in events if e["type"] == "Warning" and e["reason"] == "ColdRestart"], events
            if case == "frozen-replaced":
                # The delete named the failed pod's UID: the pod now under that name survives it.
                assert [s for s in proxy.seen(method="DELETE", path_contains=f"/pods/{pod.name}")]
                assert live is not None and live["metadata"]["uid"] == replacement, live
                assert not live["metadata"].get("deletionTimestamp"), live["metadata"]
            else:
                assert live is None or live["metadata"].get("deletionTimestamp") or \
                    live["metadata"]["uid"] != pod.uid, "the failed pod was deleted"

        # The peer answered the unpinned traffic throughout; the failed worker answered none of it.
        answered = [r for r in load.results if r[1] == 200]
        assert len(answered) >= 4 and {r[2] for r in answered} == {peer_id}, {r[2] for r in answered}
        failed = load.failures()
        # What the frontend routed to the frozen worker between its gate going True (pinned requests
        # need the frontend to route to it) and the verdict (plus the frontend's lag in seeing its
        # endpoint go) failed: the frontend's deadline (504), its 500 for an instance a request already
        # failed on, or 503 when the pod was deleted under the request. None later than a deadline after.
        assert all(r[1] in (500, 503, 504) for r in failed), failed[:5]
        assert not [r for r in failed if r[0] > decided + 7], failed[:5]
