"""The node agent killed while CRIU itself is in flight, in the sandbox (the agent-killed matrix's CRIU
rows: restartmatrix.py says what every row holds and checks): a dump held before it starts and after
it exited (``seal``), a restore held the same two ways (``restore``, ``restore-exited``), and a dump
held so that the entrypoint can be stopped before the settle that follows (``settle-snapshotted``).
The other rows run on the real node (node/test_agent_restart.py).

Sandbox, why: CRIU is held by fake_slow_criu, a script that runs the real CRIU by its node path, which
resolves only where the worker shares the node's file system (a real container's mount namespace
does not: the agent hands a real CRIU to it as descriptors).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from agentenv import (
    AGENT_NS,
    AGENT_SA,
    AgentProc,
    StubDriver,
    build_stub_driver,
    deploy_serving,
    install_dynsnap,
    quiesce,
    token_kubeconfig,
    worker_component,
)
from restart_faults import SlowCriu
from restartmatrix import ROWS, Container, Row, run_row

from dynsnap.k8s.client import Kube
from dynsnap.testenv import dynamo as D
from dynsnap.testenv.cluster import LocalCluster, RunningPod

pytestmark = pytest.mark.cluster


@dataclass
class SandboxRig:
    """restartmatrix.Rig in a pod sandbox: the stub kubelet's pod, one agent process for its node."""

    cluster: LocalCluster
    graph: D.Graph
    fe: D.FrontendClient
    pod: RunningPod
    agent: AgentProc
    driver: StubDriver
    criu: SlowCriu | None
    wid: int

    @property
    def api(self) -> Kube:
        return self.cluster.api

    @property
    def images_root(self) -> Path:
        return self.agent.images_root

    def container(self) -> Container:
        inode = self.pod.sandbox.pid_namespace
        assert inode is not None
        return Container(self.pod.sandbox.pid, inode)

    async def serving(self, on: bool) -> None:
        await quiesce(self.cluster, self.pod, serving=on)

    async def restarts(self) -> int:
        return self.pod.kubelet.restarts

    async def answered(self, prompt: str) -> None:
        await self.fe.wait_routable(self.wid)
        res = await self.fe.chat(prompt, worker_id=self.wid)
        assert res.status == 200 and res.worker_id == self.wid, res.body


@pytest.fixture(scope="module")
async def rig(cluster: LocalCluster) -> AsyncIterator[SandboxRig]:
    work = Path(tempfile.mkdtemp(prefix="dynsnap-restart-"))
    driver = build_stub_driver(work / "stubcuda")
    criu = SlowCriu.install(work)
    await install_dynsnap(cluster)
    kubeconfig = await token_kubeconfig(cluster, namespace=AGENT_NS, sa=AGENT_SA, path=work / "agent.kubeconfig")
    g = await deploy_serving(cluster, D.dgd("rst", [D.frontend_component(),
                                                    worker_component("worker", replicas=1, driver=driver)]))
    pod = g.workers("worker")[0]
    # One agent, for the worker's node: the one killed and started again in every row.
    agent = AgentProc(pod.node, kubeconfig, work / pod.node, driver, extra=["--criu", str(criu.path)])
    fe = D.FrontendClient(g.frontend)
    try:
        await agent.start()
        await fe.wait_model()
        wid = await D.instance_id(cluster, pod)
        await fe.wait_routable(wid)
        yield SandboxRig(cluster, g, fe, pod, agent, driver, criu, wid)
    finally:
        await fe.close()
        await agent.stop()
        criu.reset()
        await D.teardown(cluster, g)
        shutil.rmtree(work, ignore_errors=True)


@pytest.mark.parametrize("row", [r for r in ROWS if r.holds_criu], ids=str)
async def test_agent_killed_during(rig: SandboxRig, row: Row) -> None:
    await run_row(rig, row, restarts_in_stops=False)
