"""The node agent killed in the middle of every step of a capture and of a wake, and replaced by the
next release's while a worker sleeps, on the real node (kubelet, containerd, runc).

- The agent-killed matrix's rows, every one (restartmatrix.py says what each row holds and checks).
  SIGKILL with a step in flight, a new agent for the node, and the worker in its own container
  consistent after: the capture or wake finished or rolled back, recorded, the same
  container (kubelet's restartCount, its PID 1 and start), answering a request pinned to it.
- A rolling upgrade across a capture format bump (issue 18: a format bump sent every snapshotted
  worker to a cold restart): the next release's agent (``fake_next_agent``: this checkout's agent
  with its capture format one newer and this one's still read, as that release's
  ``IMAGE_FORMATS_READ`` would say) wakes the worker in place from the capture its predecessor wrote,
  and its own captures carry its format.
- The worker's pod deleted while its dump's exit is held (the module's last test): no images left,
  the agent carrying on (moved from the sandbox's faults suite).

The agent killed at any instant and started again within a second is a process of the test's: the
chart's agent DaemonSet is kept off the node for the module (realnodeenv.agent_off_node) and ``dynsnap
agent`` runs on the node under the chart's agent service account, with the chart's host directories
(images, state) and its driver, as the node's one agent (it also keeps the long sleep's worker asleep
meanwhile, as any next agent would). Its ``--criu`` is the slow CRIU: a copy of the real one that
loads tests/native/fake_slow_criu, holding a run only when a row asks (its files in the worker's
control emptyDir), an ELF binary the agent hands to the container as descriptors, as it hands CRIU.
Deleting the agent's pod at a step instead, the DaemonSet's next pod finishing the work, is
test_real_node_faults.py's. The chart's controller is scaled to 0 and the test plays it (each row's
WorkerSnapshot, the serving gate), as the sandbox suite did.

The worker is examples/dgd/agg.yaml's (one replica, the local overlay) with one change: its liveness
probe's failureThreshold is 6, not 3. The rows that stop the entrypoint (SIGSTOP, the test's doing)
hold it for a second or two, and a margin of 30 s keeps kubelet from restarting the container for
what the test did however the stops fall (node/test_long_sleep.py keeps the example's
probe, with nothing stopped).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from realnodecycle import pinned, state_is
from realnodeenv import NS, WORKER_COMPONENT, Env, agent_off_node, deployed, instance_id, scale_controller
from realnodefacts import container_procs, kubelet_facts
from restart_faults import (
    FAKE_SLOW_CRIU_DIR,
    FAKE_SLOW_CRIU_ENV,
    SlowCriu,
    build_slow_criu,
    ep_info,
    helpers,
    kill_agent,
    unhang,
)
from restartmatrix import ROWS, Container, Row, identity, run_row, set_desired, wait_ws, ws_body
from trustenv import plant_cuda_checkpoint

from dynsnap.agent.helpers import REGISTRY_DIR
from dynsnap.k8s.client import Kube, Obj
from dynsnap.k8s.errors import NotFound
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.runtime import procfs
from dynsnap.testenv import chart_node, real_graph
from dynsnap.testenv.cluster import wait_for
from dynsnap.testenv.dynsnap_parts import ROOT, AgentProc, StubDriver, token_kubeconfig
from dynsnap.testenv.real_graph import Graph, NodePod

pytestmark = pytest.mark.cluster

NEXT_AGENT = Path(__file__).resolve().parent.parent / "fake_next_agent"
NEXT_FORMAT = P.IMAGE_FORMAT + 1
SLOW_CRIU_ENV = {FAKE_SLOW_CRIU_ENV: FAKE_SLOW_CRIU_DIR}  # the agent's: the slow CRIU's directory (a node path)
LIVENESS_FAILURES = 6  # the worker's liveness failureThreshold here (the example ships 3): see the docstring


def stop_tolerant(body: Obj) -> Obj:
    """``body`` with its worker's liveness probe failing the container only after LIVENESS_FAILURES probes."""
    comp = next(c for c in body["spec"]["components"] if c["name"] == WORKER_COMPONENT)
    main = next(c for c in comp["podTemplate"]["spec"]["containers"] if c["name"] == "main")
    main["livenessProbe"]["failureThreshold"] = LIVENESS_FAILURES
    return body


@dataclass
class NodeRig:
    """restartmatrix.Rig on the real node: the worker's real container, the node's agent as a process."""

    env: Env
    pod: NodePod
    container_id: str  # kubelet's, at the start: a restarted container would have another
    agent: AgentProc
    driver: StubDriver
    wid: int
    graph: Graph
    criu: SlowCriu  # its control directory, in CRIU's mount namespace (a copy of the agent's: the node's here)
    agent_flags: list[str]  # the module's agent's extra flags (its environment: SLOW_CRIU_ENV)

    @property
    def api(self) -> Kube:
        return self.env.api

    @property
    def images_root(self) -> Path:
        return self.env.paths.images

    def container(self) -> Container:
        ep = container_procs(self.pod.uid, self.container_id).entrypoint
        ns = procfs.pid_ns(ep)
        assert ns is not None
        return Container(ep, ns)

    async def agent_with(self, extra: Sequence[str] = (), env: Mapping[str, str] | None = None) -> None:
        """The node's agent started again (stopped first, if it runs) with the module's flags and environment
        and ``extra`` and ``env`` besides; with neither, the module's agent again (left as is if it runs)."""
        flags, environ = [*self.agent_flags, *extra], {**SLOW_CRIU_ENV, **(env or {})}
        if self.agent.proc is not None and (self.agent.extra, self.agent.env) == (flags, environ):
            return
        await self.agent.stop()
        self.agent.extra, self.agent.env = flags, environ
        await self.agent.start()

    async def serving(self, on: bool) -> None:
        await self.env.cluster.set_serving_gate(self.pod, on)
        await self.env.cluster.wait_ready(self.pod.namespace, self.pod.name, ready=on, timeout=60)

    async def restarts(self) -> int:
        facts = await kubelet_facts(self.env.api, self.pod)
        assert facts.container_id == self.container_id and facts.running, facts
        return facts.restart_count

    async def answered(self, prompt: str) -> None:
        await pinned(self.env, self.pod, 1, prompt=prompt)


async def _ws_gone(api: Kube, pod: NodePod, what: str) -> None:
    async def gone() -> bool:
        try:
            await api.get(R.WORKER_SNAPSHOTS, pod.name, namespace=pod.namespace)
        except NotFound:
            return True
        return False
    await wait_for(what, gone, timeout=60, interval=0.5)


@pytest.fixture(scope="module")
async def rig(env: Env, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[NodeRig]:
    work = Path(tmp_path_factory.mktemp("agent-restart"))
    body = stop_tolerant(chart_node.example_body(env, name="rst", worker_replicas=1,
                                                 policy={"dynsnap.io/tier": "suspend"}))
    async with deployed(env, body) as graph:
        w = graph.workers(WORKER_COMPONENT)[0]
        wid = await instance_id(env, w)
        # The controller made the worker's WorkerSnapshot and set its gate; now nobody but the test does.
        await scale_controller(env, 0)
        try:
            async with agent_off_node(env) as ds:
                await env.api.delete(R.WORKER_SNAPSHOTS, w.name, namespace=w.namespace)  # each row makes its own
                await _ws_gone(env.api, w, "the controller's WorkerSnapshot gone")
                sa = ds["spec"]["template"]["spec"]["serviceAccountName"]
                kubeconfig = await token_kubeconfig(env.cluster, namespace=NS, sa=sa, path=work / "agent.kubeconfig")
                flags = ["--criu", str(build_slow_criu(work)), "--gc-interval", "2"]
                agent = AgentProc(env.node.name, kubeconfig, work, env.driver, images=env.paths.images,
                                  cuda_state=env.paths.cuda_state, extra=list(flags), env=dict(SLOW_CRIU_ENV))
                await agent.start()
                try:
                    facts = await kubelet_facts(env.api, w)
                    slow = SlowCriu.at(FAKE_SLOW_CRIU_DIR)
                    yield NodeRig(env, w, facts.container_id, agent, env.driver, wid, graph, slow, flags)
                except BaseException:
                    print(f"--- the node's agent (a process of the test's) ---\n{agent.tail(120)}")
                    raise
                finally:
                    await agent.stop()
        finally:
            await scale_controller(env, 1)


@pytest.mark.parametrize("row", ROWS, ids=str)
async def test_agent_killed_during(rig: NodeRig, row: Row) -> None:
    await run_row(rig, row)


# The helper bound of the agent that finds a helper its predecessor left (the rows run with the default,
# longer than any hang of theirs); a save held HELPER_HANG_MS outlives it.
HELPER_BOUND_S = 20
HELPER_HANG_MS = 120_000


async def test_a_helper_an_earlier_agent_left_past_its_bound_is_killed_through_the_registry(rig: NodeRig) -> None:
    """The agent dies while its dynsnap-cuda save is held by the driver; the next agent (``--helper-timeout``
    HELPER_BOUND_S) finds the save on the agent's registry, waits for it within its bound, then kills it
    (``HelperTimeout`` at ``wait-helper``, naming the helper) and rolls the worker back to serving in the
    same container. (A process in the worker's own tree carrying the helper's ``DYNSNAP_OP`` marker is
    never taken for one: node/test_agent_refusals.py.)"""
    api, pod, agent = rig.api, rig.pod, rig.agent
    pid1 = rig.container().pid1
    before, restarts = await identity(rig), await rig.restarts()
    await api.create(R.WORKER_SNAPSHOTS, ws_body(pod, tier="suspend"))
    try:
        await wait_ws(rig, "Accepted, Active", state_is("Active"))
        await rig.serving(False)
        rig.driver.control(f"hang cuCheckpointProcessCheckpoint * {HELPER_HANG_MS}")
        await set_desired(rig, "Suspended")
        c = rig.container()

        async def saving() -> list[int] | None:
            return [h.pid for h in helpers(c.pidns, c.pid1) if h.op == "save"] or None
        save: list[int] = await wait_for("the save's dynsnap-cuda running", saving, timeout=60, interval=0.2)

        async def recorded() -> bool:
            # A helper the earlier agent left on record is what this is about: killed before its record is
            # written (right after the exec), the next agent could not know it and would save anew.
            records = (agent.state_dir / REGISTRY_DIR).glob("*.json")
            return any(json.loads(r.read_text()).get("pid") in save for r in records)
        await wait_for("the save's dynsnap-cuda on the agent's registry", recorded, timeout=30, interval=0.2)
        await kill_agent(agent)
        # The next agent finds the save through the registry, waits, then kills it past its bound.
        await rig.agent_with(["--helper-timeout", str(HELPER_BOUND_S), "--criu-timeout", str(HELPER_BOUND_S)])
        ws = await wait_ws(rig, "HelperTimeout", lambda ws: ((ws.get("status") or {}).get("lastError") or {})
                           .get("reason") == P.Reason.HELPER_TIMEOUT.value, timeout=HELPER_BOUND_S + 90)
        err = ws["status"]["lastError"]
        assert err["step"] == "wait-helper" and f"past its {HELPER_BOUND_S} s bound; killed" in err["message"], err
        assert f"{pod.uid}/save" in err["message"], err
        assert not [h for h in helpers(c.pidns, c.pid1) if h.pid in save], "the helper was killed"
        unhang(rig.driver)
        await set_desired(rig, "Active")
        await wait_ws(rig, "rolled back, Active", state_is("Active", suspended=False))
        await rig.serving(True)
        await rig.answered("after the helper past its bound")
        assert rig.container().pid1 == pid1 and await identity(rig) == before and await rig.restarts() == restarts
    finally:
        rig.driver.clear_faults()
        await rig.agent_with()  # the module's agent again
        await api.delete(R.WORKER_SNAPSHOTS, pod.name, namespace=pod.namespace)


# CRIU's fault injection FI_PLUGIN_CUDA_FORCE_ENABLE (criu/include/fault-injection.h): its CUDA plugin runs
# as on a GPU node, where it finds /proc/driver/nvidia/gpus, and looks for cuda-checkpoint on its PATH.
CUDA_PLUGIN_FORCE_ENABLE = "138"


async def test_criu_never_runs_a_cuda_checkpoint_of_the_workers_container(rig: NodeRig) -> None:
    """CRIU runs as the node's root, and its CUDA plugin (loaded from the agent's plugin directory, as the
    chart's agent loads it) runs ``cuda-checkpoint`` from its PATH. CRIU never runs in the worker's mount
    namespace (issue 38: a mount namespace of its own, a copy of the agent's), and with the plugin off (the
    default: the agent saves the GPU processes itself) its PATH is empty: a ``cuda-checkpoint`` the worker's
    image holds in every directory of the agent's PATH is never run while the worker is captured and woken
    in place (the plugin forced on, as on a GPU node)."""
    api, pod = rig.api, rig.pod
    pid1 = rig.container().pid1
    ran = plant_cuda_checkpoint(pid1, os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep))
    plugins = Path(os.environ["DYNSNAP_CRIU"]).parents[1] / "lib" / "criu"
    await rig.agent_with(["--criu-libdir", str(plugins)], {"CRIU_FAULT": CUDA_PLUGIN_FORCE_ENABLE})
    await api.create(R.WORKER_SNAPSHOTS, ws_body(pod, tier="snapshot"))
    try:
        await wait_ws(rig, "Accepted, Active", state_is("Active"))
        asleep = await _capture(rig)
        dump_log = (Path(asleep["status"]["image"]["path"]) / "dump.log").read_text(errors="replace")
        assert 'Plugin "cuda_plugin"' in dump_log, "CRIU loaded its CUDA plugin from the agent's directory"
        await _wake_and_serve(rig, "after the planted cuda-checkpoint")
        assert rig.container().pid1 == pid1
        assert not ran.exists(), f"CRIU ran the worker's cuda-checkpoint: {ran.read_text()}"
    finally:
        await rig.agent_with()  # the module's agent again
        await api.delete(R.WORKER_SNAPSHOTS, pod.name, namespace=pod.namespace)


def _manifest(ws: Obj) -> Obj:
    m: Obj = json.loads((Path(ws["status"]["image"]["path"]) / P.MANIFEST_FILE).read_text())
    return m


async def _capture(rig: NodeRig) -> Obj:
    await rig.serving(False)
    await set_desired(rig, "Suspended")
    return await wait_ws(rig, "Suspended", state_is("Suspended", suspended=True))


async def _wake_and_serve(rig: NodeRig, prompt: str) -> Obj:
    await set_desired(rig, "Active")
    ws = await wait_ws(rig, "Active", state_is("Active", suspended=False), timeout=120)
    await rig.serving(True)
    await rig.answered(prompt)
    return ws


async def test_the_next_agent_wakes_a_worker_its_predecessor_snapshotted(rig: NodeRig) -> None:
    api, pod = rig.api, rig.pod
    before, restarts = await identity(rig), await rig.restarts()
    pid1 = rig.container().pid1
    started = ep_info(pid1)["started"]
    await api.create(R.WORKER_SNAPSHOTS, ws_body(pod, tier="snapshot"))
    try:
        await wait_ws(rig, "Accepted, Active", state_is("Active"))
        asleep = await _capture(rig)
        assert _manifest(asleep)["format"] == P.IMAGE_FORMAT

        # The old agent goes, the next release's comes, the worker asleep meanwhile.
        # The tree under test right after fake_next_agent: its sitecustomize imports dynsnap before
        # ``-m`` puts the working directory on sys.path, and would otherwise find the installed one.
        path = [str(NEXT_AGENT), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
        # The DaemonSet rolls: the node's agent goes (SIGTERM), the next one comes.
        await rig.agent_with(env={"PYTHONPATH": os.pathsep.join(path),
                                  "DYNSNAP_FAKE_NEXT_IMAGE_FORMAT": str(NEXT_FORMAT)})
        ws = await wait_ws(rig, "still asleep under the next agent", state_is("Suspended", suspended=True))
        assert ws["status"]["image"]["path"] == asleep["status"]["image"]["path"]

        woken = await _wake_and_serve(rig, "after the upgrade")
        wake = woken["status"].get("lastWake") or {}
        # Woken from the capture (restored), not started again cold: a wake record, ok, its restore step.
        assert wake.get("ok") is True and woken["status"].get("lastError") is None, woken["status"]
        assert [s["name"] for s in wake["steps"]][:2] == ["wake", "restore"], wake
        assert (rig.container().pid1, ep_info(pid1)["started"]) == (pid1, started), \
            "the container restarted: the worker was not woken in place"
        assert await identity(rig) == before and await rig.restarts() == restarts

        # The next agent's own capture carries its format, and it wakes from that too.
        again = await _capture(rig)
        assert _manifest(again)["format"] == NEXT_FORMAT
        await _wake_and_serve(rig, "after the next agent's own capture")
        assert ep_info(pid1)["started"] == started and await rig.restarts() == restarts
    finally:
        await rig.agent_with()  # this release's agent again, for whatever runs after
        await api.delete(R.WORKER_SNAPSHOTS, pod.name, namespace=pod.namespace)


# -- the module's last test: it deletes the worker's pod ------------------------------------------------------

async def test_pod_deleted_mid_capture_leaves_no_images_and_the_agent_carries_on(rig: NodeRig) -> None:
    """The worker's pod is deleted (its grace period) while its capture is in flight: the dump is complete on
    disk but CRIU has not returned to the agent (the slow CRIU holds its exit; the pod's end kills it, in
    the pod's pid namespace). The agent does not crash or loop, the WorkerSnapshot (owned by the pod) is
    collected by kube-controller-manager's garbage collector or refused PodNotFound, and the agent's image
    GC deletes the gone pod's images (they hold its secrets). The agent carries on: the operator's
    stand-in recreates the pod, and its WorkerSnapshot is taken up."""
    api, pod, criu = rig.api, rig.pod, rig.criu
    pod_dir = rig.images_root / f"{pod.namespace}_{pod.name}_{pod.uid}"
    pid_ns = rig.container().pidns
    await api.create(R.WORKER_SNAPSHOTS, ws_body(pod, tier="snapshot"))
    await wait_ws(rig, "Accepted, Active", state_is("Active"))
    criu.hold("dump", "after")
    await rig.serving(False)
    await set_desired(rig, "Suspended")

    async def dumped() -> bool:
        runs = criu.runs("dump")
        return bool(runs) and "exited 0" in runs[-1]["events"]
    await wait_for("the dump complete on disk, CRIU's exit held back", dumped, timeout=120, interval=0.2)
    staging = [d for d in pod_dir.iterdir() if d.name.startswith(P.STAGING_PREFIX)]
    assert len(staging) == 1 and "Dumping finished successfully" in (staging[0] / "dump.log").read_text()
    ws = await api.get(R.WORKER_SNAPSHOTS, pod.name, namespace=pod.namespace)
    assert ws["status"]["state"] == "Capturing"
    await api.delete(R.PODS, pod.name, namespace=pod.namespace)

    async def collected_or_refused() -> str | None:
        try:
            cur = await api.get(R.WORKER_SNAPSHOTS, pod.name, namespace=pod.namespace)
        except NotFound:
            return "collected"
        if cur["spec"]["podUID"] != pod.uid:
            return None
        acc = next((c for c in (cur.get("status") or {}).get("conditions") or [] if c["type"] == "Accepted"), None)
        return "refused" if acc and acc["status"] == "False" and acc["reason"] == "PodNotFound" else None
    outcome = await wait_for("the WorkerSnapshot collected, or refused PodNotFound", collected_or_refused,
                             timeout=120, interval=0.5)
    print("WorkerSnapshot of the deleted pod:", outcome)

    async def gone() -> bool:
        return not pod_dir.exists()
    await wait_for("the gone pod's images deleted", gone, timeout=90, interval=0.5)
    log = rig.agent.log_path.read_text()
    assert str(pod_dir) in log, "deleted by the agent's image GC"
    assert rig.agent.proc is not None and rig.agent.proc.alive(), "the agent did not crash"
    assert "Traceback" not in log

    new = await real_graph.recreate(api, rig.graph, pod, driver=rig.driver, pid_ns=pid_ns)
    assert new.uid != pod.uid
    with contextlib.suppress(NotFound):
        await api.delete(R.WORKER_SNAPSHOTS, new.name, namespace=new.namespace)  # the old pod's, refused
    await _ws_gone(api, new, "the old pod's WorkerSnapshot gone")
    rig.pod = new
    await api.create(R.WORKER_SNAPSHOTS, ws_body(new, tier="snapshot"))
    try:
        ws = await wait_ws(rig, "the new pod's WorkerSnapshot Accepted, Active", state_is("Active"))
        assert ws["spec"]["podUID"] == new.uid
    finally:
        await api.delete(R.WORKER_SNAPSHOTS, new.name, namespace=new.namespace)
