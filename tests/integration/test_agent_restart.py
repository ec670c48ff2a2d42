"""The node agent killed in the middle of every step of a capture and of a wake (issue 8's fault
matrix, first row): SIGKILL (no cleanup of any kind) while that step is in flight, a new agent
started for the node, and the worker consistent afterwards.

Each row holds one step in flight by a fault that changes no product behaviour:

- a request to the entrypoint (quiesce, wake, settle-*): the pod's dynsnap-entrypoint is stopped
  (SIGSTOP) so it cannot acknowledge; the agent is killed once it has written the request; the
  entrypoint is let go (SIGCONT) and applies it; then the new agent starts;
- a dynsnap-cuda call (save, resume): the stub driver hangs the checkpoint (or restore) call; the
  agent is killed while its helper holds the locks; the helper runs in its own session and lives
  on, so the new agent must wait for it. In the ``-helper-killed`` rows the helper dies too (a
  crash could do that; a reboot of the agent pod would not): the new agent finds the GPU
  processes locked (or still checkpointed) with nothing running for them;
- a CRIU dump or restore: the agent's ``--criu`` is ``fake_slow_criu``, which holds the real CRIU
  back before it starts (``dump``, ``restore``) or after it exited (``seal``, ``restore-exited``:
  the dump or restore is complete, the agent never learnt it).

Every row ends with the same checks: the WorkerSnapshot says what happened (state, conditions,
the capture or wake record with the steps each agent did, no error left), no GPU process locked or
checkpointed unless the worker is asleep, no staging directory left and the sealed capture the
one restored, no helper left running, the pod's identity intact (UID, IP, DWM UID, instance id,
its container never restarted) and, once awake and back in serving, a request pinned to the worker
answered by it.

Sandbox, why: it SIGKILLs the agent process at each of 20 steps; on the real node that is deleting
its pod, shown for a save and a resume in test_real_node_faults.py, the other steps not yet moved.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
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
    eventually,
    install_dynsnap,
    quiesce,
    set_desired,
    state_is,
    token_kubeconfig,
    wait_ws,
    worker_component,
    ws_body,
)
from restart_faults import (
    SlowCriu,
    control_dir,
    entrypoint_stopped,
    ep_info,
    helpers,
    kill_agent,
    pending_request,
    unhang,
    wait_ack,
    wait_request,
)

from dynsnap.k8s.client import Obj
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.models.dynamo import instance_id_from_dwm
from dynsnap.testenv import dynamo as D
from dynsnap.testenv.cluster import LocalCluster, RunningPod

pytestmark = pytest.mark.cluster

RUNNING, LOCKED, CHECKPOINTED, FAILED = 0, 1, 2, 3  # stub_libcuda's state file
# A save or resume held this long gives the new agent time to start and find the helper still at
# work (it does in about 2 s here, on a loaded machine more); calls still to come (another GPU
# process) are let go once it has.
HELPER_HANG_MS = 15000
# A checkpoint or restore held this long lets the test stop the entrypoint while it runs, before the
# agent can ask for the settle that follows.
SETTLE_HANG_MS = 3000
# What the stub driver frees per GPU process checkpointed in a snapshot capture, a different amount
# in each row: the capture's manifest must record this capture's (the wake checks the GPU has it
# again before restoring), whichever agent ran the save, never one left from an earlier capture.
FREED_UNIT = 1 << 28


@dataclass(frozen=True)
class Row:
    op: str  # capture | wake
    step: str  # the step in flight when the agent is killed
    tier: str

    def __str__(self) -> str:
        return f"{self.op}-{self.step}-{self.tier}"

    @property
    def snapshot(self) -> bool:
        return self.tier == "snapshot"

    @property
    def stops_entrypoint(self) -> bool:
        return self.step in ("quiesce", "wake") or self.step.startswith("settle-")


BOTH = ("suspend", "snapshot")
ROWS = [
    *(Row("capture", s, t) for s in ("quiesce", "save", "save-helper-killed") for t in BOTH),
    Row("capture", "settle-suspended", "suspend"),
    Row("capture", "dump", "snapshot"),
    Row("capture", "seal", "snapshot"),
    Row("capture", "settle-snapshotted", "snapshot"),
    *(Row("wake", "wake", t) for t in BOTH),
    Row("wake", "restore", "snapshot"),
    Row("wake", "restore-exited", "snapshot"),
    *(Row("wake", s, t) for s in ("resume", "resume-helper-killed", "settle-active") for t in BOTH),
]


def expected_steps(row: Row) -> list[str]:
    """The steps the capture or wake record lists once settled: those the killed agent recorded
    before the step in flight, then those the new agent did (``wait-helper`` once, however long
    it waited). A step whose request the entrypoint applied after the agent died is the
    entrypoint's doing; it is not listed."""
    snap = row.snapshot
    if row.op == "capture":
        rest = ["dump", "seal", "settle-snapshotted"] if snap else ["settle-suspended"]
        return {
            "quiesce": ["save", *rest],
            "save": ["quiesce", "wait-helper", *rest],
            "save-helper-killed": ["quiesce", "gpu-rollback", "save", *rest],
            "settle-suspended": ["quiesce", "save"],
            "dump": ["quiesce", "save", "wait-helper", "seal", "settle-snapshotted"],
            "seal": ["quiesce", "save", "wait-helper", "seal", "settle-snapshotted"],
            "settle-snapshotted": ["quiesce", "save", "dump", "seal"],
        }[row.step]
    restored = ["wake", "restore"] if snap else ["wake"]
    return {
        "wake": [*restored[1:], "resume", "settle-active"],
        "restore": ["wake", "wait-helper", "resume", "settle-active"],
        "restore-exited": ["wake", "wait-helper", "resume", "settle-active"],
        "resume": [*restored, "wait-helper", "settle-active"],
        "resume-helper-killed": [*restored, "resume", "settle-active"],
        # the entrypoint applied `active`; a snapshot's images are then deleted under the same record
        "settle-active": [*restored, "resume", *(["cleanup"] if snap else [])],
    }[row.step]


@dataclass
class Env:
    graph: D.Graph
    fe: D.FrontendClient
    pod: RunningPod
    agent: AgentProc
    driver: StubDriver
    criu: SlowCriu
    wid: int


@pytest.fixture(scope="module")
async def env(cluster: LocalCluster) -> AsyncIterator[Env]:
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
        yield Env(g, fe, pod, agent, driver, criu, wid)
    finally:
        await fe.close()
        await agent.stop()
        criu.reset()
        await D.teardown(cluster, g)
        shutil.rmtree(work, ignore_errors=True)


# -- what the node shows ------------------------------------------------------------------------

async def identity(cluster: LocalCluster, pod: RunningPod) -> dict[str, object]:
    p = await cluster.api.get(R.PODS, pod.name, namespace=pod.namespace)
    dwm = await cluster.api.get(R.DWMS, pod.name, namespace=pod.namespace)
    return {"uid": p["metadata"]["uid"], "ip": p["status"]["podIP"], "dwm": dwm["metadata"]["uid"],
            "instance": instance_id_from_dwm(dwm)}


def pidns(pod: RunningPod) -> int:
    return os.stat(f"/proc/{pod.sandbox.pid}/ns/pid").st_ino


def driver_states(env: Env) -> dict[int, int]:
    """The stub driver's state of every process of the worker's pid namespace, by in-namespace pid
    (the stub keys them by pid namespace and pid in it: ``nskey 0``)."""
    ns = pidns(env.pod)
    return {key & ((1 << 22) - 1): st for key, st in env.driver.states().items() if key >> 22 == ns}


def gpu_ns_pids(pod: RunningPod) -> list[int]:
    """In-namespace pids of the worker's live processes that map the (stub) CUDA driver."""
    return sorted(gpu_pids(pod).values())


def gpu_pids(pod: RunningPod) -> dict[int, int]:
    """Host pid -> in-namespace pid of the worker's live processes that map the (stub) CUDA driver."""
    ns = f"pid:[{pidns(pod)}]"
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/ns/pid") != ns or int(pid) == pod.sandbox.pid:
                continue
            if "libcuda.so" not in Path(f"/proc/{pid}/maps").read_text():
                continue
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        out[int(pid)] = int(next(line.split()[-1] for line in status.splitlines() if line.startswith("NSpid:")))
    return out


def pod_images(env: Env) -> list[Path]:
    return sorted(env.agent.images_root.glob(f"*_{env.pod.uid}/*"))


def stagings(env: Env) -> list[Path]:
    return [p for p in pod_images(env) if p.name.startswith(P.STAGING_PREFIX)]


def record(ws: Obj, op: str) -> Obj:
    rec: Obj = ws["status"]["lastCapture" if op == "capture" else "lastWake"]
    return rec


def step_names(rec: Obj) -> list[str]:
    return [s["name"] for s in rec["steps"]]


async def events(cluster: LocalCluster, ws: Obj, reason: str) -> list[Obj]:
    """Events with ``reason`` about this WorkerSnapshot (by UID: earlier rows' objects had the same name)."""
    evs = (await cluster.api.list(R.EVENTS, namespace=ws["metadata"]["namespace"])).get("items") or []
    return [e for e in evs if (e.get("regarding") or {}).get("uid") == ws["metadata"]["uid"]
            and e.get("reason") == reason]


def no_error_left(ws: Obj) -> None:
    st = ws["status"]
    assert st.get("lastError") is None, st.get("lastError")
    assert not st.get("consecutiveFailures")
    degraded = condition(ws, "Degraded")
    assert degraded is not None and degraded["status"] == "False", degraded


def check_asleep(env: Env, ws: Obj, tier: str) -> None:
    """Asleep and settled: the capture record closed and ok, every GPU process checkpointed (none
    locked), and for a snapshot one sealed capture on disk, no staging directory."""
    pod = env.pod
    cap = record(ws, "capture")
    assert cap["ok"] is True and cap.get("finished") and cap["tier"] == tier, cap
    no_error_left(ws)
    gpu = sorted(p["ns"] for p in cap["pids"] if p["gpu"])
    assert gpu, f"the capture record names the worker's GPU processes: {cap}"
    states = driver_states(env)
    assert {states.get(p) for p in gpu} == {CHECKPOINTED}, f"GPU pids {gpu}, driver states {states}"
    assert LOCKED not in states.values() and FAILED not in states.values(), states
    info = ep_info(pod)
    if tier == "suspend":
        assert info["state"] == "suspended" and info["worker_alive"] is True
        assert gpu_ns_pids(pod) == gpu, "the checkpointed processes are the worker's GPU processes, alive"
    else:
        assert info["state"] == "snapshotted" and info["worker_alive"] is False
        image = Path(ws["status"]["image"]["path"])
        assert image.name == cap["id"] and (image / P.MANIFEST_FILE).is_file()
        assert pod_images(env) == [image], f"one sealed capture and nothing else: {pod_images(env)}"
        assert {f"core-{p}.img" for p in gpu} <= set(os.listdir(image))
    assert helpers(pod) == []


async def check_awake(env: Env, ws: Obj) -> None:
    """Active and settled: no GPU process locked or checkpointed, no image or helper left."""
    pod = env.pod
    no_error_left(ws)
    info = ep_info(pod)
    assert info["state"] == "active" and info["worker_alive"] is True
    states = driver_states(env)
    assert states and set(states.values()) == {RUNNING}, states
    assert gpu_ns_pids(pod), "the worker's GPU processes run"

    async def cleaned() -> bool:
        return pod_images(env) == []
    await eventually("the woken worker's images deleted (they hold its secrets)", cleaned, timeout=30)
    assert helpers(pod) == []


# -- the faults: each triggers the operation, kills the agent with the step in flight, starts a new one

Fault = Callable[[LocalCluster, Env, Row], Awaitable[None]]


def settled(state: str, op: str) -> Callable[[Obj], bool]:
    """At ``state``, with nothing in progress and the record of the last ``op`` closed."""
    at_state = state_is(state, suspended=state == "Suspended")

    def check(ws: Obj) -> bool:
        progressing = condition(ws, "Progressing")
        rec = (ws.get("status") or {}).get("lastCapture" if op == "capture" else "lastWake") or {}
        return at_state(ws) and progressing is not None and progressing["status"] == "False" \
            and bool(rec.get("finished"))
    return check


def _want(row: Row) -> str:
    return "Suspended" if row.op == "capture" else "Active"


async def _restart(env: Env) -> None:
    await env.agent.start()


async def _ws_steps(cluster: LocalCluster, env: Env, op: str, name: str) -> None:
    """Wait until the new agent's record shows ``name`` (e.g. it found the helper and waits)."""
    await wait_ws(cluster.api, env.pod, f"{name} in the {op} record",
                  lambda ws: name in step_names((ws.get("status") or {}).get(
                      "lastCapture" if op == "capture" else "lastWake") or {"steps": []}),
                  agents=[env.agent])


async def killed_at_request(cluster: LocalCluster, env: Env, row: Row) -> None:
    """quiesce / wake: the entrypoint cannot acknowledge; the agent dies with its request unanswered."""
    pod = env.pod
    state = "suspending" if row.op == "capture" else "restoring"
    with entrypoint_stopped(pod) as acked:
        await set_desired(cluster.api, pod, _want(row))
        seq = await wait_request(pod, acked, state)
        await kill_agent(env.agent)
        assert int(ep_info(pod)["request_seq"] or 0) == acked, "the request was still unanswered"
    await wait_ack(pod, seq, state)  # let go, the entrypoint applies the request the dead agent left
    await _restart(env)


async def killed_at_settle(cluster: LocalCluster, env: Env, row: Row) -> None:
    """settle-*: the entrypoint is stopped while the step before the settle runs (held by the stub
    driver or by the slow CRIU), so the settle request the agent writes next stays unanswered."""
    pod = env.pod
    state = {"settle-suspended": "suspended", "settle-snapshotted": "snapshotted",
             "settle-active": "active"}[row.step]
    dump_started = _started(env, "dump")
    if row.step == "settle-snapshotted":
        env.criu.hold("dump", "before")
    else:
        fn = "cuCheckpointProcessCheckpoint" if row.op == "capture" else "cuCheckpointProcessRestore"
        env.driver.control(f"hang {fn} * {SETTLE_HANG_MS}")
    await set_desired(cluster.api, pod, _want(row))
    if row.step == "settle-snapshotted":
        await eventually("the dump started", dump_started, timeout=60)
    else:
        op = "save" if row.op == "capture" else "resume"
        await eventually(f"the {op} helper running", lambda: _helper(pod, op), timeout=60)
    with entrypoint_stopped(pod) as acked:
        assert ep_info(pod)["state"] == ("restoring" if row.op == "wake" else "suspending"), \
            "stopped before the step ahead of the settle was over"
        unhang(env.driver)
        env.criu.release()
        seq = await wait_request(pod, acked, state)
        await kill_agent(env.agent)
        assert int(ep_info(pod)["request_seq"] or 0) == acked, "the settle request was still unanswered"
    await wait_ack(pod, seq, state)
    await _restart(env)


def _started(env: Env, op: str, *, event: str | None = None) -> Callable[[], Awaitable[bool]]:
    n = len(env.criu.runs(op))

    async def check() -> bool:
        runs = env.criu.runs(op)[n:]
        return bool(runs) and (event is None or event in runs[-1]["events"])
    return check


async def _helper(pod: RunningPod, op: str) -> bool:
    return any(h.op == op for h in helpers(pod))


async def killed_in_helper(cluster: LocalCluster, env: Env, row: Row) -> None:
    """save / resume: the driver holds the call; the agent dies while its dynsnap-cuda is at work.
    In the -helper-killed rows the helper is killed too, leaving the GPU processes mid-way."""
    pod = env.pod
    capture = row.op == "capture"
    fn = "cuCheckpointProcessCheckpoint" if capture else "cuCheckpointProcessRestore"
    op = "save" if capture else "resume"
    calls = len(env.driver.calls())
    env.driver.control(f"hang {fn} * {HELPER_HANG_MS}")
    await set_desired(cluster.api, pod, _want(row))
    await eventually(f"the {op} helper running", lambda: _helper(pod, op), timeout=60)
    if capture:  # the save has locked every GPU process and is checkpointing the first
        want = {f"cuCheckpointProcessLock pid={host}" for host in gpu_pids(pod)}

        async def locked() -> bool:
            done = {c.split(" timeout=")[0] for c in env.driver.calls()[calls:] if c.endswith(" rc=0")}
            return want <= done
        await eventually("every GPU process's lock in the driver's call log", locked)
    await kill_agent(env.agent)
    alive = [h for h in helpers(pod) if h.op == op]
    assert alive, "the helper outlives the agent (it runs in its own session)"
    if row.step.endswith("-helper-killed"):
        for h in alive:
            os.kill(h.pid, signal.SIGKILL)

        async def gone() -> bool:
            return not helpers(pod)
        await eventually("the helper gone", gone)
        unhang(env.driver)
        left = set(driver_states(env).values())
        assert left == ({LOCKED} if capture else {CHECKPOINTED}), \
            f"the helper died mid-way: GPU processes left {left}"
        await _restart(env)
        return
    await _restart(env)
    await _ws_steps(cluster, env, row.op, "wait-helper")  # the new agent found the helper and waits
    unhang(env.driver)  # the calls still to come (other GPU processes) go through at once


async def killed_in_criu(cluster: LocalCluster, env: Env, row: Row) -> None:
    """dump / restore: CRIU held before it starts; seal / restore-exited: CRIU finished, its exit held."""
    pod = env.pod
    op = "dump" if row.op == "capture" else "restore"
    before = row.step in ("dump", "restore")
    env.criu.hold(op, "before" if before else "after")
    started = _started(env, op, event=None if before else "exited 0")
    await set_desired(cluster.api, pod, _want(row))
    await eventually(f"CRIU {op} {'started' if before else 'exited'}", started, timeout=60)
    await kill_agent(env.agent)
    run = env.criu.runs(op)[-1]
    assert any(h.op == "criu" and h.ns_pid == run["pid"] for h in helpers(pod)), \
        "the CRIU the dead agent started still runs"
    if before:
        assert "exec" not in run["events"], "the real CRIU had not started when the agent died"
    else:
        assert run["events"] == ["exited 0"], f"the real CRIU had finished when the agent died: {run}"
    await _restart(env)
    await _ws_steps(cluster, env, row.op, "wait-helper")
    env.criu.release()


FAULTS: dict[str, Fault] = {
    "quiesce": killed_at_request, "wake": killed_at_request,
    "save": killed_in_helper, "save-helper-killed": killed_in_helper,
    "resume": killed_in_helper, "resume-helper-killed": killed_in_helper,
    "dump": killed_in_criu, "seal": killed_in_criu, "restore": killed_in_criu, "restore-exited": killed_in_criu,
    "settle-suspended": killed_at_settle, "settle-snapshotted": killed_at_settle, "settle-active": killed_at_settle,
}


@pytest.mark.parametrize("row", ROWS, ids=str)
async def test_agent_killed_during(cluster: LocalCluster, env: Env, row: Row) -> None:
    api, pod = cluster.api, env.pod
    agents = [env.agent]
    await api.create(R.WORKER_SNAPSHOTS, ws_body(pod, tier=row.tier))
    try:
        await wait_ws(api, pod, "Accepted, Active", state_is("Active"), agents=agents)
        before = await identity(cluster, pod)
        started, restarts = ep_info(pod)["started"], pod.kubelet.restarts
        dumps, restores = len(env.criu.runs("dump")), len(env.criu.runs("restore"))
        await quiesce(cluster, pod, serving=False)
        freed = 0
        if row.op == "capture" and row.snapshot:
            per = FREED_UNIT * (ROWS.index(row) + 1)
            for host in gpu_pids(pod):
                env.driver.control(f"mem {host} 0 {per}")
            freed = per * len(gpu_pids(pod))
        if row.op == "wake":
            await set_desired(api, pod, "Suspended")
            ws = await wait_ws(api, pod, "Suspended", settled("Suspended", "capture"), agents=agents)
            check_asleep(env, ws, row.tier)

        await FAULTS[row.step](cluster, env, row)

        if row.op == "capture":
            ws = await wait_ws(api, pod, "Suspended, settled", settled("Suspended", "capture"), agents=agents)
            assert step_names(record(ws, "capture")) == expected_steps(row), record(ws, "capture")
            check_asleep(env, ws, row.tier)
            if freed:
                manifest = json.loads((Path(ws["status"]["image"]["path"]) / P.MANIFEST_FILE).read_text())
                assert list(manifest["gpuFreed"].values()) == [freed], manifest["gpuFreed"]
            if row.step == "save-helper-killed":
                # The rollback is named: Degraded said why while it happened, and the settled capture
                # says what it recovered from; a Warning Event records it.
                degraded = condition(ws, "Degraded")
                assert degraded is not None and degraded["message"].startswith(
                    f"recovered from {P.Reason.INTERRUPTED.value}: GPU processes found"), degraded
                assert "locked" in degraded["message"], degraded
                assert await events(cluster, ws, P.Reason.INTERRUPTED.value)
            asleep = ws
            await set_desired(api, pod, "Active")
            ws = await wait_ws(api, pod, "Active, settled", settled("Active", "wake"), agents=agents)
            assert record(ws, "wake")["ok"] is True
        else:
            asleep = ws
            ws = await wait_ws(api, pod, "Active, settled", settled("Active", "wake"), agents=agents)
            wake = record(ws, "wake")
            assert wake["ok"] is True and wake.get("finished") and wake["tier"] == row.tier, wake
            assert step_names(wake) == expected_steps(row), wake
        await check_awake(env, ws)

        if row.snapshot:  # one dump, sealed, and that sealed capture (never a staging dir) restored
            image = Path(asleep["status"]["image"]["path"])
            dumped = env.criu.runs("dump")[dumps:]
            restored = env.criu.runs("restore")[restores:]
            assert [SlowCriu.images_dir(r) for r in dumped] == [str(image.parent / (P.STAGING_PREFIX + image.name))]
            assert [SlowCriu.images_dir(r) for r in restored] == [str(image)], restored
        assert stagings(env) == []
        assert pending_request(pod) is not None and control_dir(pod).is_dir()

        await quiesce(cluster, pod, serving=True)
        assert await identity(cluster, pod) == before
        assert ep_info(pod)["started"] == started and pod.sandbox.alive(), "the container never restarted"
        if not row.stops_entrypoint:
            # (A stopped entrypoint fails kubelet's /live probe if one lands in the stop, which is
            # the test's doing; the rows that stop it check the container by its start time above.)
            assert pod.kubelet.restarts == restarts
        await env.fe.wait_routable(env.wid)
        res = await env.fe.chat(f"after {row}", worker_id=env.wid)
        assert res.status == 200 and res.worker_id == env.wid, res.body
    finally:
        env.driver.clear_faults()
        env.criu.reset()
        os.kill(pod.sandbox.pid, signal.SIGCONT)
        if env.agent.proc is None:
            await env.agent.start()
        await api.delete(R.WORKER_SNAPSHOTS, pod.name, namespace=pod.namespace)
