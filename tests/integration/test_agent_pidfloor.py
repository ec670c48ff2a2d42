"""The pid-reservation guard: a worker whose entrypoint could not reserve the pid range (here: its
container has no capabilities, so writing /proc/sys/kernel/ns_last_pid is refused, as in a pod
without the securityContext examples/dgd/ asks for, and the entrypoint was told not to cycle pids
instead) is never snapshotted: CRIU restores pids exactly, and an unreserved worker's pids could be
taken by anything that enters the pod's pid namespace while it sleeps. The refusal comes before any
change. The suspend tier, which restores no pids, still works on the same worker.

And the way a pod with no privilege gets there anyway (a container runtime mounts /proc/sys
read-only in a container that is not privileged, whatever its capabilities): the entrypoint moves
the counter past the floor by starting and reaping short-lived children, and that worker is
snapshotted and woken in place."""

from __future__ import annotations

import json
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from agentenv import (
    AGENT_NS,
    AGENT_SA,
    AgentProc,
    StubDriver,
    build_stub_driver,
    condition,
    deploy_serving,
    gather_stop,
    install_dynsnap,
    quiesce,
    set_desired,
    state_is,
    token_kubeconfig,
    wait_ws,
    worker_component,
    ws_body,
)

from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.runtime.command import find_tool
from dynsnap.testenv import dynamo as D
from dynsnap.testenv.cluster import NODES, LocalCluster, RunningPod

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
async def capless(cluster: LocalCluster) -> AsyncIterator[tuple[RunningPod, list[AgentProc], StubDriver,
                                                                RunningPod]]:
    work = Path(tempfile.mkdtemp(prefix="dynsnap-pidfloor-"))
    driver = build_stub_driver(work / "stubcuda")
    await install_dynsnap(cluster)
    kubeconfig = await token_kubeconfig(cluster, namespace=AGENT_NS, sa=AGENT_SA, path=work / "agent.kubeconfig")
    comp = worker_component("capless", replicas=1, driver=driver)
    _capless(comp)
    _no_cycle(comp)
    cycled = worker_component("cycled", replicas=1, driver=driver)
    _capless(cycled)
    g = await deploy_serving(cluster, D.dgd("pidfloor", [D.frontend_component(), comp, cycled]))
    agents = [AgentProc(node, kubeconfig, work / node, driver, extra=["--failure-backoff", "1"]) for node in NODES]
    try:
        for a in agents:
            await a.start()
        yield g.workers("capless")[0], agents, driver, g.workers("cycled")[0]
    finally:
        await gather_stop(agents)
        await D.teardown(cluster, g)


def _no_cycle(comp: dict[str, object]) -> None:
    """The entrypoint told to reserve only by writing ns_last_pid (the refusal path's premise)."""
    cmd: list[str] = comp["extraPodSpec"]["mainContainer"]["command"]  # type: ignore[index]
    at = next(i for i, a in enumerate(cmd) if a.endswith("dynsnap-entrypoint"))
    cmd.insert(at + 1, "--no-pid-cycle")


def _capless(comp: dict[str, object]) -> None:
    main = comp["extraPodSpec"]["mainContainer"]  # type: ignore[index]
    # The whole container without capabilities (bounding, inheritable and ambient sets emptied).
    main["command"] = [find_tool("setpriv"), "--bounding-set", "-all", "--inh-caps", "-all", "--ambient-caps", "-all",
                       "--", *main["command"]]


def _control(pod: RunningPod) -> dict[str, object]:
    path = Path(f"/proc/{pod.sandbox.pid}/root") / P.ENTRYPOINT_CONTROL_DIR.lstrip("/") / P.ENTRYPOINT_CONTROL_FILE
    info: dict[str, object] = json.loads(path.read_text())
    return info


async def test_snapshot_is_refused_without_the_pid_reservation(
        cluster: LocalCluster, capless: tuple[RunningPod, list[AgentProc], StubDriver, RunningPod]) -> None:
    pod, agents, driver, _ = capless
    api = cluster.api
    info = _control(pod)
    assert info["pid_reserved"] is False, "the capability-less entrypoint could not reserve the range"
    assert "PID RESERVATION FAILED" in pod.sandbox.log_path.read_text(errors="replace")
    await api.create(R.WORKER_SNAPSHOTS, ws_body(pod, tier="snapshot"))
    try:
        await wait_ws(api, pod, "Active", state_is("Active"), agents=agents)
        await quiesce(cluster, pod, serving=False)
        await set_desired(api, pod, "Suspended")

        def refused(ws: dict[str, object]) -> bool:
            err = (ws.get("status") or {}).get("lastError") or {}  # type: ignore[attr-defined]
            return bool(err.get("reason") == "PidReservationMissing")
        ws = await wait_ws(api, pod, "refused: PidReservationMissing", refused, agents=agents)
        err = ws["status"]["lastError"]
        assert err["step"] == "quiesce" and "pid_reserved is false" in err["message"]
        degraded = condition(ws, "Degraded")
        assert degraded is not None and degraded["status"] == "True" and degraded["reason"] == "PidReservationMissing"
        # Nothing changed: the entrypoint was never asked for anything, no GPU process was touched,
        # nothing was written to the node's image directory.
        assert _control(pod)["state"] == "active" and _control(pod)["request_seq"] == 0
        assert not any(c.startswith("cuCheckpointProcessLock") for c in driver.calls())
        assert not any(a.images_root.exists() and any(a.images_root.iterdir()) for a in agents)
        assert ws["status"]["state"] == "Active"

        # The suspend tier restores no pids: the same worker is suspended and woken.
        await api.merge_patch(R.WORKER_SNAPSHOTS, pod.name, {"spec": {"tier": "suspend"}}, namespace=pod.namespace)
        asleep = await wait_ws(api, pod, "Suspended (tier suspend)", state_is("Suspended", suspended=True),
                               agents=agents)
        assert asleep["status"]["lastCapture"]["tier"] == "suspend"
        await set_desired(api, pod, "Active")
        await wait_ws(api, pod, "Active", state_is("Active", suspended=False), agents=agents)
    finally:
        await api.delete(R.WORKER_SNAPSHOTS, pod.name, namespace=pod.namespace)


async def test_a_pod_with_no_privilege_reserves_by_cycling_pids_and_is_snapshotted(
        cluster: LocalCluster, capless: tuple[RunningPod, list[AgentProc], StubDriver, RunningPod]) -> None:
    _, agents, _, pod = capless
    api = cluster.api
    info = _control(pod)
    log = pod.sandbox.log_path.read_text(errors="replace")
    assert "moved the pid counter to the floor by starting and reaping" in log and "RESERVATION FAILED" not in log
    assert info["pid_reserved"] is True and int(info["worker_pid"]) >= P.PID_FLOOR  # type: ignore[call-overload]
    await api.create(R.WORKER_SNAPSHOTS, ws_body(pod, tier="snapshot"))
    try:
        await wait_ws(api, pod, "Active", state_is("Active"), agents=agents)
        await quiesce(cluster, pod, serving=False)
        await set_desired(api, pod, "Suspended")
        asleep = await wait_ws(api, pod, "Suspended (tier snapshot)", state_is("Suspended", suspended=True),
                               agents=agents)
        assert asleep["status"]["lastCapture"]["tier"] == "snapshot" and asleep["status"]["image"]["bytes"] > 0
        await set_desired(api, pod, "Active")
        woken = await wait_ws(api, pod, "Active", state_is("Active", suspended=False), agents=agents)
        assert [s["name"] for s in woken["status"]["lastWake"]["steps"]][:3] == ["wake", "restore", "resume"]
        assert _control(pod)["worker_pid"] == info["worker_pid"]  # restored in place, same pid
    finally:
        await api.delete(R.WORKER_SNAPSHOTS, pod.name, namespace=pod.namespace)
