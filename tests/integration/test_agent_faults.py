"""The node agent under failing parts (issue 8's fault matrix): CRIU failing on io_uring, and a
permanent refusal not retried. (The CUDA helper hanging past its bound, a lock that never comes back
for one or both of a worker's GPU processes, a debugger attached to the worker, a capture over the
image budget, a disk full mid-dump, a GPU process outside the worker's tree, and a restore whose pid
a squatter took, of the worker or of another process of its tree, run on the real node:
node/test_agent_faults.py; the pod deleted mid-capture: node/test_agent_restart.py; a worker whose
entrypoint does not refuse io_uring, refused SeccompOff before any change:
node/test_controller_refusals.py.) Each test causes the fault for real (or through a named fake where it
cannot be had on demand), asserts the Reason and the error text the agent reports for it, and ends with
the worker running or restorable: the entrypoint active, every GPU process running in the (stub) driver,
no process stopped, no half-written image left to be reused, and a request pinned to the worker answered
by it.

The agent (node-a's; every worker of the module runs there) runs as its own process with short
bounds: ``--failure-backoff 1``, ``--helper-timeout 3``, ``--lock-timeout-ms 1000``,
``--gc-interval 2``.

Sandbox, why: these faults need a worker the example does not ship (faults_launcher.py's io_uring fd
holder, driven from the node through the pod's namespaces), a worker whose entrypoint is started
without its filter and that the agent alone, with no controller, keeps asked to sleep (the permanent
refusal's retry).
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from agentenv import (
    AGENT_NS,
    AGENT_SA,
    AgentProc,
    StubDriver,
    build_stub_driver,
    condition,
    deploy_serving,
    install_dynsnap,
    quiesce,
    set_desired,
    state_is,
    token_kubeconfig,
    wait_ws,
    ws_body,
)
from faultsenv import (
    assert_running,
    ep_info,
    error_is,
    fault_worker,
    fd_holder,
    gpu_states,
    image_entries,
    io_uring_fds,
    io_uring_maps,
    stub_calls,
)

from dynsnap.k8s.client import Obj
from dynsnap.k8s.errors import NotFound
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.testenv import dynamo as D
from dynsnap.testenv.cluster import NODES, LocalCluster, RunningPod

pytestmark = pytest.mark.cluster

HOLDER = "dynsnap-faults-holder"  # the abstract socket of the plain worker's fd holder
NODE = NODES[0]  # every replica 0 runs there (testenv.dynamo.deploy)


@dataclass
class Env:
    cluster: LocalCluster
    graph: D.Graph
    fe: D.FrontendClient
    agent: AgentProc
    driver: StubDriver
    work: Path
    base: list[str]  # the agent's extra flags for this module
    ids: dict[str, int]

    def pod(self, component: str) -> RunningPod:
        return self.graph.workers(component)[0]

    @property
    def api(self) -> Any:
        return self.cluster.api


@pytest.fixture(scope="module")
async def env(cluster: LocalCluster) -> AsyncIterator[Env]:
    work = Path(tempfile.mkdtemp(prefix="dynsnap-faults-"))
    driver = build_stub_driver(work / "stubcuda")
    base = ["--failure-backoff", "1", "--helper-timeout", "3", "--lock-timeout-ms", "1000", "--gc-interval", "2"]
    await install_dynsnap(cluster)
    kubeconfig = await token_kubeconfig(cluster, namespace=AGENT_NS, sa=AGENT_SA, path=work / "agent.kubeconfig")
    agent = AgentProc(NODE, kubeconfig, work / NODE, driver, extra=list(base))
    g = await deploy_serving(cluster, D.dgd("flt", [
        D.frontend_component(),
        fault_worker("plain", driver, launcher=["--fd-holder", HOLDER]),  # row 1 (io_uring, CRIU)
        fault_worker("noseccomp", driver, entrypoint=["--no-seccomp"]),  # row 1 (seccomp off, retried)
    ]))
    fe = D.FrontendClient(g.frontend)
    try:
        await agent.start()
        await fe.wait_model()
        ids = {}
        for comp in ("plain", "noseccomp"):
            pod = g.workers(comp)[0]
            ids[pod.name] = await D.instance_id(cluster, pod)
            await fe.wait_routable(ids[pod.name])
        yield Env(cluster, g, fe, agent, driver, work, base, ids)
    finally:
        await fe.close()
        await agent.stop()
        await D.teardown(cluster, g)


# -- shared steps ---------------------------------------------------------------------------------------

async def _wait(env: Env, pod: RunningPod, what: str, check: Any, timeout: float = 120) -> Obj:
    ws: Obj = await wait_ws(env.api, pod, what, check, timeout=timeout, agents=[env.agent])
    return ws


async def _start(env: Env, pod: RunningPod, tier: str) -> None:
    """A WorkerSnapshot for the worker, Active and accepted; then the worker is quiesced and asked to sleep."""
    await env.api.create(R.WORKER_SNAPSHOTS, ws_body(pod, tier=tier))
    await _wait(env, pod, "Accepted, Active", state_is("Active"))
    await quiesce(env.cluster, pod, serving=False)
    await set_desired(env.api, pod, "Suspended")


async def _pinned(env: Env, pod: RunningPod, n: int = 2) -> None:
    wid = env.ids[pod.name]
    await env.fe.wait_routable(wid)
    for i in range(n):
        res = await env.fe.chat(f"after the fault {i}", worker_id=wid)
        assert res.status == 200 and res.worker_id == wid, res.body


async def _back_to_serving(env: Env, pod: RunningPod) -> Obj:
    """Active wanted: the worker back Active (Suspended False), in serving again, pinned requests served."""
    await set_desired(env.api, pod, "Active")
    ws = await _wait(env, pod, "Active", state_is("Active", suspended=False))
    assert_running(pod, env.driver)
    await quiesce(env.cluster, pod, serving=True)
    await _pinned(env, pod)
    return ws


async def _finish(env: Env, pod: RunningPod) -> None:
    """Best-effort end of a test: Active wanted, in serving, the WorkerSnapshot deleted."""
    with contextlib.suppress(NotFound):
        await set_desired(env.api, pod, "Active")
        with contextlib.suppress(TimeoutError):
            await _wait(env, pod, "Active", state_is("Active"), timeout=60)
    with contextlib.suppress(Exception):
        await quiesce(env.cluster, pod, serving=True)
    with contextlib.suppress(NotFound):
        await env.api.delete(R.WORKER_SNAPSHOTS, pod.name, namespace=pod.namespace)
    env.driver.clear_faults()


def _degraded(ws: Obj, reason: str) -> Obj:
    cond = condition(ws, "Degraded")
    assert cond is not None and cond["status"] == "True" and cond["reason"] == reason, cond
    err = (ws.get("status") or {}).get("lastError") or {}
    print(f"\n[{reason}] step {err.get('step')}: {cond['message'][-600:]}")  # shown with -s: what an operator reads
    return cond


def _nothing_changed(env: Env, pod: RunningPod, ws: Obj, lock_calls_before: dict[int, int]) -> None:
    """A refusal before any change: the capture ended at its first step, the worker active, not one
    driver call that changes a state, no image."""
    cap = ws["status"]["lastCapture"]
    assert cap["ok"] is False and [s["name"] for s in cap["steps"]] == ["quiesce"], cap
    assert_running(pod, env.driver)
    for pid, n in lock_calls_before.items():
        assert len(stub_calls(env.driver, "cuCheckpointProcessLock", pid)) == n, "the driver was asked to lock"
    assert image_entries(env.agent, pod) == []


def host_alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def _lock_calls(env: Env, pod: RunningPod) -> dict[int, int]:
    return {pid: len(stub_calls(env.driver, "cuCheckpointProcessLock", pid)) for pid in gpu_states(env.driver, pod)}


# -- row 1: CRIU failing; io_uring --------------------------------------------------------------------

async def test_a_permanent_refusal_is_not_retried_until_the_spec_changes(env: Env) -> None:
    """SeccompOff will not go away while the container runs (issue 18: the agent retried it seven times
    in 160 s, with doubling backoff). Refused once, the worker stays active and the capture is not asked
    again for that spec, over a time in which this module's 1 s backoff would have retried it several
    times; a new spec generation (the controller asking anew) is tried once more, and refused again."""
    pod = env.pod("noseccomp")
    before = _lock_calls(env, pod)
    try:
        await _start(env, pod, "snapshot")
        ws = await _wait(env, pod, "SeccompOff", error_is("SeccompOff", step="quiesce"))
        first = ws["status"]["lastCapture"]["id"]
        assert ws["status"]["consecutiveFailures"] == 1
        for _ in range(8):  # 8 s: with the 1 s backoff, 1+2+4 s of waits would have brought three retries
            await asyncio.sleep(1.0)
            now = await env.api.get(R.WORKER_SNAPSHOTS, pod.name, namespace=pod.namespace)
            st = now["status"]
            assert st["consecutiveFailures"] == 1 and st["lastCapture"]["id"] == first, st
            assert st["state"] == "Active", st
        assert_running(pod, env.driver)
        # A new intent (the spec written again: a new generation) is tried once, and refused again.
        await set_desired(env.api, pod, "Active")
        await set_desired(env.api, pod, "Suspended")
        ws = await _wait(env, pod, "refused again", lambda o: (o.get("status") or {}).get("consecutiveFailures") == 2)
        assert ws["status"]["lastCapture"]["id"] != first
        assert ws["status"]["lastError"]["reason"] == "SeccompOff"
        _nothing_changed(env, pod, ws, before)
        await _back_to_serving(env, pod)
    finally:
        await _finish(env, pod)


async def test_io_uring_ring_in_the_worker_tree_is_refused_and_criu_names_a_mapped_one(env: Env) -> None:
    """With the filter on, a ring can still reach the worker: made by a process of the pod outside the
    filter and copied in with pidfd_getfd(2) (the kernel refuses to pass one over a unix socket).
    Held as a descriptor, the preflight refuses it (IoUringInUse, nothing changed). Held only as a
    mapping (its descriptor closed, as liburing's io_uring_close_ring_fd allows), the preflight,
    which looks at descriptors, does not see it, and CRIU's own dump fails on it: CRIU resumes the
    tree, the agent names the cause from CRIU's log (IoUringInUse) and rolls the worker back."""
    pod = env.pod("plain")
    assert ep_info(pod)["seccomp"] == "on"
    answer = fd_holder(pod, HOLDER, "hold")
    holder = answer["pid"]  # in the pod's namespace
    holder_host = pod.sandbox.host_pid(holder)
    assert holder_host is not None and io_uring_fds(holder_host)
    before = _lock_calls(env, pod)
    try:
        await _start(env, pod, "snapshot")
        ws = await _wait(env, pod, "IoUringInUse (preflight)", error_is("IoUringInUse", step="quiesce"))
        err = ws["status"]["lastError"]
        assert "processes holding io_uring" in err["message"] and str(holder_host) in err["message"], err
        _degraded(ws, "IoUringInUse")
        _nothing_changed(env, pod, ws, before)

        answer = fd_holder(pod, HOLDER, "map")
        assert answer["mapped"] == 1 and answer["held"] == []
        assert not io_uring_fds(holder_host) and io_uring_maps(holder_host)
        # The next attempt (after the backoff) passes the preflight; CRIU's dump fails on the ring.
        ws = await _wait(env, pod, "IoUringInUse (CRIU)", error_is("IoUringInUse", step="dump"))
        err = ws["status"]["lastError"]
        assert "CRIU dump failed (io_uring)" in err["message"], err
        assert "anon_inode:[io_uring]" in err["message"], err
        _degraded(ws, "IoUringInUse")
        assert ws["status"]["lastCapture"]["ok"] is False
        assert [s["name"] for s in ws["status"]["lastCapture"]["steps"]] == ["quiesce", "save", "dump"]
        await _back_to_serving(env, pod)
        assert not any(n.startswith(P.STAGING_PREFIX) for n in image_entries(env.agent, pod)), \
            "the failed dump's staging directory is removed, never reused"
        assert host_alive(holder_host), "CRIU resumed the tree it could not dump: the same processes run"
    finally:
        with contextlib.suppress(Exception):
            fd_holder(pod, HOLDER, "release")
        await _finish(env, pod)
