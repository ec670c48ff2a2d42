"""Faults only a real node has (issue 19), on the node of realnodeenv.py (kubelet, containerd, runc;
dynsnap installed by ``helm install``; examples/dgd/agg.yaml's workers), each ending with the worker
serving or restorable and what happened said by a condition and an Event:

- the agent's pod deleted (``kubectl delete pod``: the chart's grace period) in the middle of a
  capture and in the middle of a wake; the DaemonSet's next pod finishes them. The agent runs its
  dynsnap-cuda as its child in its own container: whether the helper outlived the pod is read from
  /proc once the pod is gone, and the next agent's record must say what it found (here it never
  does outlive it: the stopping agent kills the helpers it runs, and containerd what is left in the
  cgroup of a container in the host's pid namespace);
- the agent's pod deleted while CRIU's dump, or its restore, is in flight (held by SIGSTOP from the node):
  CRIU runs in the worker container's cgroups and outlives the agent's container; the next agent pod
  waits for it, it is let go and finishes, the next agent carries on, the worker connected to the API
  server again and no CRIU network lock left after the wake (issue 38);
- ``kubectl delete pod`` of a sleeping worker: kubelet stops it, the operator's stand-in recreates
  the pod of the same name (a new UID), the old captures are deleted and nothing is restored into the
  new pod, which starts cold and serves.

The sleep of six minutes under Dynamo's own liveness settings and through a ``helm upgrade`` of the
agent is node/test_long_sleep.py: it sleeps while the other suites of tests/integration/node run.

The stub driver (the GPU driver's stand-in, as everywhere off the GPU machine) holds the save or the
resume call so that the agent is deleted while it is in flight: the one fault made on demand here.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from datetime import datetime
from pathlib import Path

import pytest
from agentenv import tcp_established
from controllerenv import asleep, cond, events_for, get_ws, own_instance, verified_after
from helperprocs import Helper, helpers_for
from realnodecycle import override, same_pod, set_tier, trickle, wait_ws
from realnodeenv import (
    DAEMON_SETS,
    DEPLOYMENTS,
    NS,
    RELEASE,
    WORKER_COMPONENT,
    Env,
    agent_off_node,
    chart_pod,
    kubernetes_service,
    running,
    upgrade,
)
from realnodefacts import container_procs, kubelet_facts, stub_state
from restart_faults import unhang

from dynsnap.k8s.client import Obj
from dynsnap.k8s.errors import NotFound
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.models.resources import Resource
from dynsnap.runtime import procfs
from dynsnap.testenv import chart_node, real_graph
from dynsnap.testenv.cluster import LocalCluster, wait_for
from dynsnap.testenv.real_graph import NodePod

pytestmark = pytest.mark.cluster

# The driver holds the call at most this long (it is let go once the old agent pod is gone): the pod is
# deleted and its container stopped inside it (the chart's grace is 30 s; the agent stops at once on SIGTERM).
HANG_MS = 30000
RUNNING, LOCKED, CHECKPOINTED = 0, 1, 2  # the stub driver's states


@pytest.fixture(scope="module")
async def env(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Env]:
    async with running(cluster, Path(tmp_path_factory.mktemp("real-node-faults")), tier="suspend") as e:
        yield e


def _worker(env: Env) -> NodePod:
    assert env.graph is not None
    return env.graph.workers(WORKER_COMPONENT)[0]


async def _delete_agent_pod(env: Env, *, gone: Callable[[], None] = lambda: None) -> tuple[Obj, Obj]:
    """``kubectl delete pod`` of the node's agent (the chart's grace period); ``gone`` is called once the
    old pod is gone (kubelet stopped its container); returns (the old pod, the DaemonSet's next one)
    once the next one is Ready."""
    old = await chart_pod(env, "agent")
    await env.api.delete(R.PODS, old["metadata"]["name"], namespace=NS)

    async def old_gone() -> bool:
        return all(p["metadata"]["uid"] != old["metadata"]["uid"] for p in await env.chart_pods("agent"))
    await wait_for("the agent's old pod gone", old_gone, timeout=120, interval=0.2)
    gone()

    async def next_ready() -> Obj | None:
        pods = await env.chart_pods("agent")
        ready = len(pods) == 1 and any(c["type"] == "Ready" and c["status"] == "True"
                                       for c in pods[0]["status"].get("conditions") or [])
        return pods[0] if ready else None
    new: Obj = await wait_for("the DaemonSet's next agent pod Ready", next_ready, timeout=180, interval=0.5)
    return old, new


def _pidns(pid: int) -> int:
    ino = procfs.pid_ns(pid)
    assert ino is not None
    return ino


def _helpers(ep: int, op: str) -> list[Helper]:
    return [h for h in helpers_for(_pidns(ep), ep) if h.op == op]


async def _helper_running(ep: int, op: str) -> bool:
    return bool(_helpers(ep, op))


def _steps(rec: Obj) -> list[str]:
    return [s["name"] for s in rec["steps"]]


async def _agent_events(env: Env, w: NodePod, reason: str, since: float) -> list[Obj]:
    """The agent's Events about the worker's WorkerSnapshot with ``reason``, first seen after ``since``."""
    out = []
    for e in await events_for(env.api, w.namespace, w.name):
        t = e.get("eventTime") or e.get("deprecatedLastTimestamp") or ""
        if e.get("reason") == reason and e.get("reportingController") == f"{P.DYNSNAP_GROUP}/agent" and t \
                and datetime.fromisoformat(t.replace("Z", "+00:00")).timestamp() >= since - 1:
            out.append(e)
    return out


async def _deleted_mid(env: Env, ep: int, op: str) -> list[Helper]:
    """The agent's pod deleted while its ``op`` helper is held in the driver, which lets the call go
    once the old pod is gone; returns those of the old agent's ``op`` helpers that outlived its pod."""
    await wait_for(f"the agent's {op} helper running", lambda: _helper_running(ep, op), timeout=120, interval=0.2)
    held = _helpers(ep, op)
    outlived: list[Helper] = []

    def gone() -> None:
        outlived.extend(h for h in held if (st := procfs.status(h.pid)) is not None and st.state not in ("Z", "X"))
        unhang(env.driver)  # what is still to come goes through at once
    old, new = await _delete_agent_pod(env, gone=gone)
    print(f"\nagent pod {old['metadata']['name']} deleted mid-{op}: {len(outlived)} of its {len(held)} {op} "
          f"helper(s) outlived it; next agent pod {new['metadata']['name']}")
    return outlived


async def test_agent_pod_deleted_mid_capture_the_next_agent_pod_finishes_it(env: Env) -> None:
    """Tier suspend: the driver holds the save's checkpoint call once every GPU process is locked; the
    agent's pod is deleted. If its helper went with its container, the GPU process is left locked with
    no one at work: the next agent pod names that (Degraded: recovered from Interrupted, GPU processes found
    locked; a Warning Event Interrupted), rolls the GPU back and saves again, and the worker sleeps, the
    same container never restarted (a helper that outlived its pod would be waited for instead); then it
    wakes in place, verified."""
    w = _worker(env)
    await set_tier(env, w, "suspend")
    first = await kubelet_facts(env.api, w)
    procs = container_procs(w.uid, first.container_id)
    ep, root = procs.entrypoint, procs.root
    before = (((await get_ws(env.api, w)) or {}).get("status") or {}).get("lastCapture", {}).get("id")
    since = time.time()
    env.driver.control(f"hang cuCheckpointProcessCheckpoint * {HANG_MS}")
    try:
        async with trickle(env):
            await override(env, w, "suspended")
            left = await _deleted_mid(env, ep, "save")
            ws = await wait_ws(env, w, "asleep, the capture settled by the next agent", lambda ws: asleep(ws) and bool(
                ws and ws["status"]["lastCapture"]["id"] != before and ws["status"]["lastCapture"].get("finished")))
            rec = ws["status"]["lastCapture"]
            assert rec["ok"] is True and rec["tier"] == "suspend", rec
            if left:  # the helper outlived its agent: the next one waited for it
                assert _steps(rec) == ["quiesce", "wait-helper", "settle-suspended"], rec
            else:
                assert _steps(rec) == ["quiesce", "gpu-rollback", "save", "settle-suspended"], rec
                degraded = cond(ws, "Degraded")
                assert degraded is not None and degraded["message"].startswith(
                    f"recovered from {P.Reason.INTERRUPTED.value}: GPU processes found"), degraded
                assert "locked" in degraded["message"], degraded
                assert await _agent_events(env, w, P.Reason.INTERRUPTED.value, since)
            assert stub_state(env.driver, root) == CHECKPOINTED
            await same_pod(env, w, first)
            await override(env, w, "active")
            last_wake = ws["status"].get("lastWake", {}).get("id")
            woken = await wait_ws(env, w, "woken and verified", verified_after(last_wake))
            assert woken["status"]["lastWake"]["ok"] is True
        assert stub_state(env.driver, root) == RUNNING and container_procs(w.uid, first.container_id).root == root
        await same_pod(env, w, first)
    finally:
        env.driver.clear_faults()


async def test_agent_pod_deleted_mid_wake_the_next_agent_pod_finishes_it(env: Env) -> None:
    """Tier snapshot: asleep, then woken; CRIU has put the tree back and the driver holds the resume's
    restore call when the agent's pod is deleted. The next agent pod finds the restored tree's GPU
    process still checkpointed and resumes it (or waits for a helper that outlived its agent), and the
    wake finishes in place: the same container, verified by pinned requests."""
    w = _worker(env)
    await set_tier(env, w, "snapshot")
    first = await kubelet_facts(env.api, w)
    ep = container_procs(w.uid, first.container_id).entrypoint
    await override(env, w, "suspended")
    slept = await wait_ws(env, w, "asleep (snapshot)", asleep)
    before = slept["status"].get("lastWake", {}).get("id")
    env.driver.control(f"hang cuCheckpointProcessRestore * {HANG_MS}")
    try:
        async with trickle(env):
            await override(env, w, "active")
            left = await _deleted_mid(env, ep, "resume")
            woken = await wait_ws(env, w, "woken by the next agent and verified", verified_after(before))
            wake = woken["status"]["lastWake"]
            assert wake["ok"] is True and wake["tier"] == "snapshot", wake
            if left:
                assert _steps(wake) == ["wake", "restore", "wait-helper", "settle-active"], wake
            else:
                assert _steps(wake) == ["wake", "restore", "resume", "settle-active"], wake
        await same_pod(env, w, first)
        now = container_procs(w.uid, first.container_id)
        assert now.entrypoint == ep and stub_state(env.driver, now.root) == RUNNING
        assert not Path(slept["status"]["image"]["path"]).exists()  # the capture restored, then deleted
    finally:
        env.driver.clear_faults()


def _criu_in(pidns: int, op: str) -> int | None:
    """The host pid of a CRIU ``op`` (dump, restore) running in the pod's pid namespace, or None."""
    for st in procfs.in_pid_ns(pidns):
        if st.name == "criu" and st.state not in ("Z", "X") and op in procfs.cmdline(st.pid):
            return int(st.pid)
    return None


async def _held_criu(pidns: int, op: str, pod_images: Path) -> int:
    """CRIU's ``op`` caught and held (SIGSTOP): the one fault made on demand for these two tests, so that the
    agent's pod is deleted while it is certainly in flight. Its host pid. A restore is held as it starts; a
    dump once it dumps the tree's memory (its log says ``Dumping mm``), past the freezing that CRIU bounds
    by an alarm of its own (``--timeout``, 10 s), which a longer hold would run out."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        pid = _criu_in(pidns, op)
        if pid is not None and op == "dump":
            while procfs.status(pid) is not None and time.monotonic() < deadline:
                if any("Dumping mm (pid:" in f.read_text(errors="replace")
                       for f in pod_images.glob(".staging-*/dump.log")):
                    break
                await asyncio.sleep(0.001)
            else:
                raise AssertionError(f"CRIU's dump (host pid {pid}) ended before it dumped memory")
        if pid is not None:
            os.kill(pid, signal.SIGSTOP)
            return pid
        await asyncio.sleep(0.005)
    raise TimeoutError(f"no CRIU {op} started in the pod's pid namespace within 120 s")


def _criu_tables(ep: int) -> list[str]:
    """CRIU's network-lock tables in the worker's network namespace, by the node's nft."""
    out = subprocess.run(["nsenter", "-t", str(ep), "-n", "--", "nft", "list", "tables"], capture_output=True,
                         text=True, timeout=30, check=True).stdout
    return [line for line in out.splitlines() if "CRIU" in line]


@pytest.mark.parametrize("op", ["dump", "restore"])
async def test_agent_pod_deleted_mid_criu_criu_outlives_it_and_the_worker_wakes_in_place(env: Env, op: str) -> None:
    """Tier snapshot: CRIU's dump (or restore) held (a restore as it starts, a dump past its freezing) and the
    agent's pod deleted. CRIU runs in the worker container's cgroups, so the agent's runtime, which kills the
    agent container's processes by cgroup, leaves it (killed mid-dump, CRIU would leave its parasite in the
    worker, which would then die). The next agent pod waits for it (through the registry); let go, it
    finishes, and the next agent carries the capture or the wake on. The worker is connected to the API
    server after the wake (its restored connections, or new ones where the agent reset those after a long
    sleep), and no CRIU network lock is left in its network namespace (issue 38)."""
    w = _worker(env)
    await set_tier(env, w, "snapshot")
    first = await kubelet_facts(env.api, w)
    ep = container_procs(w.uid, first.container_id).entrypoint
    api_server = await kubernetes_service(env)
    conns = tcp_established(ep, remote=api_server)
    assert conns, "the worker holds TCP connections to the API server (its discovery watches)"
    held: list[int] = []
    outlived: list[bool] = []
    agents: list[str] = []
    logs: dict[str, str] = {}  # the held CRIU's log once it ended (a later CRIU of the next agent rewrites it)

    async def deleted_mid(what: str) -> None:
        held.append(await _held_criu(_pidns(ep), what, env.paths.images / f"{w.namespace}_{w.name}_{w.uid}"))

        def gone() -> None:
            st = procfs.status(held[0])
            outlived.append(st is not None and st.state not in ("Z", "X"))
        old, new = await _delete_agent_pod(env, gone=gone)
        agents.append(new["metadata"]["name"])
        # Let go once the next agent waits for it (its one wait-helper entry in the open record): the
        # next agent must find CRIU running, not only its result.
        key = "lastCapture" if what == "dump" else "lastWake"

        async def waiting() -> bool:
            rec = (((await get_ws(env.api, w)) or {}).get("status") or {}).get(key) or {}
            return not rec.get("finished") and bool(rec.get("steps")) and _steps(rec)[-1] == "wait-helper"
        await wait_for("the next agent waiting for the held CRIU", waiting, timeout=120, interval=0.2)
        os.kill(held[0], signal.SIGCONT)

        async def ended() -> bool:
            st = procfs.status(held[0])
            return st is None or st.state in ("Z", "X")
        await wait_for("the held CRIU ended", ended, timeout=120, interval=0.05)
        pod_images = env.paths.images / f"{w.namespace}_{w.name}_{w.uid}"
        for log in sorted(pod_images.glob(f"*/{what}.log")) + sorted(pod_images.glob(f".staging-*/{what}.log")):
            text = log.read_text(errors="replace")
            logs[log.parent.name] = "\n".join([ln for ln in text.splitlines() if "Error" in ln][:20] +
                                               text.splitlines()[-5:])
        print(f"\nagent pod {old['metadata']['name']} deleted mid-{what}: CRIU (host pid {held[0]}) outlived it: "
              f"{outlived[0]}; next agent pod {new['metadata']['name']} waited for it")
    try:
        before = (((await get_ws(env.api, w)) or {}).get("status") or {}).get("lastCapture", {}).get("id")
        await override(env, w, "suspended")
        if op == "dump":
            await deleted_mid("dump")
        ws = await wait_ws(env, w, "asleep (snapshot)", lambda ws: asleep(ws) and bool(
            ws and ws["status"]["lastCapture"]["id"] != before and ws["status"]["lastCapture"].get("finished")))
        cap = ws["status"]["lastCapture"]
        assert cap["ok"] is True and cap["tier"] == "snapshot", cap
        if op == "dump":
            assert _steps(cap)[-3:] == ["wait-helper", "seal", "settle-snapshotted"], (
                cap["steps"], logs, await env.pod_log(NS, agents[0], "agent", tail=120))
        last_wake = ws["status"].get("lastWake", {}).get("id")
        await override(env, w, "active")
        if op == "restore":
            await deleted_mid("restore")
        woken = await wait_ws(env, w, "woken and verified", verified_after(last_wake))
        wake = woken["status"]["lastWake"]
        assert wake["ok"] is True, wake
        if op == "restore":
            assert _steps(wake) == ["wake", "wait-helper", "resume", "settle-active"], (
                wake["steps"], logs, await env.pod_log(NS, agents[0], "agent", tail=120))
        assert outlived == [True], "CRIU died with the agent's pod"
        # Connected to the API server again: the same connections where CRIU restored them, or new ones where
        # the agent reset the restored ones because the sleep (the hold and the agent pod's restart) passed its
        # --reset-apiserver-connections-after (30 s), as it does by design (node/test_agent.py's reset test).
        async def connected() -> bool:
            return bool(tcp_established(ep, remote=api_server))
        await wait_for("the worker connected to the API server again", connected, timeout=60, interval=0.5)
        assert _criu_tables(ep) == [], "CRIU's network lock left in the worker's network namespace"
        await same_pod(env, w, first)
    finally:
        for pid in held:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        await override(env, w, None)


async def _replaced_event(env: Env, new: NodePod) -> Obj | None:
    for e in await events_for(env.api, new.namespace, new.name):
        if e.get("reason") == P.Reason.POD_REPLACED.value and new.uid in (e.get("note") or ""):
            return e
    return None


async def _ws_gone(env: Env, ws: Obj) -> bool:
    try:
        live = await env.api.get(R.WORKER_SNAPSHOTS, ws["metadata"]["name"], namespace=ws["metadata"]["namespace"])
    except NotFound:
        return True
    return bool(live["metadata"]["uid"] != ws["metadata"]["uid"])


async def test_kubectl_delete_pod_of_a_sleeping_worker_restores_nothing_into_the_new_pod(env: Env) -> None:
    """Tier snapshot, asleep; ``kubectl delete pod`` (its grace period): kubelet stops the container, the
    operator's stand-in recreates the pod of the same name with a new UID. kubelet says it stopped the
    container (Event Killing); the old WorkerSnapshot goes with its pod (the garbage collector, or the
    controller's PodReplaced when it sees the new pod first), the agent deletes the old UID's images, and
    the new pod starts cold: its own container, no capture, no wake, no GPU restore, its
    gate set and Ready, requests pinned to it answered by it; no unpinned request failed."""
    assert env.graph is not None and env.fe is not None
    old = _worker(env)
    await set_tier(env, old, "snapshot")
    first = await kubelet_facts(env.api, old)
    await override(env, old, "suspended")
    slept = await wait_ws(env, old, "asleep (snapshot)", asleep)
    old_dir = env.paths.images / f"{old.namespace}_{old.name}_{old.uid}"
    assert Path(slept["status"]["image"]["path"]).parent == old_dir and old_dir.is_dir()
    pid_ns = procfs.pid_ns(container_procs(old.uid, first.container_id).entrypoint)
    assert pid_ns is not None
    calls = len(env.driver.calls())
    async with trickle(env):
        await env.api.delete(R.PODS, old.name, namespace=old.namespace)
        new = await real_graph.recreate(env.api, env.graph, old, driver=env.driver, pid_ns=pid_ns)
        assert new.name == old.name and new.uid != old.uid
        # The old WorkerSnapshot goes: the garbage collector deletes it with its pod (its owner), or, when the
        # new pod is seen first, the controller does (Event PodReplaced: the old capture never restored).
        await wait_for("the old pod's WorkerSnapshot deleted", lambda: _ws_gone(env, slept), timeout=90, interval=0.5)
        if (ev := await _replaced_event(env, new)) is not None:
            assert old.uid in ev["note"] and "never restored" in ev["note"], ev
        ws = await wait_ws(env, new, "a WorkerSnapshot for the new pod, Active", lambda ws: bool(
            ws and ws["spec"]["podUID"] == new.uid and (ws.get("status") or {}).get("state") == "Active"))
        assert ws["metadata"]["uid"] != slept["metadata"]["uid"]
        async def collected() -> bool:
            return not old_dir.exists()
        await wait_for("the old pod's images deleted by the agent", collected, timeout=90, interval=0.5)
        iid: int = await wait_for("the new pod's DWM, owned by it", lambda: own_instance(env.api, new), timeout=90,
                                  interval=0.5)
        await env.fe.wait_routable(iid, timeout=120)
        for i in range(3):
            res = await env.fe.chat(f"cold {i}", worker_id=iid, max_tokens=2)
            assert res.status == 200 and res.worker_id == iid, res.body
    # kubelet's account of the deletion: it stopped the old pod's container (Event Killing, about that pod).
    killing = [e for e in await events_for(env.api, old.namespace, old.name) if e.get("reason") == "Killing"
               and (e.get("regarding") or {}).get("uid") == old.uid]
    assert killing and "main" in killing[0].get("note", ""), killing
    now = await kubelet_facts(env.api, new)
    assert now.uid == new.uid and now.container_id != first.container_id and now.restart_count == 0 and now.ready
    cold = await get_ws(env.api, new)
    assert cold is not None and cold["spec"]["desiredState"] == "Active", cold
    st = cold["status"]
    assert not st.get("lastWake") and not st.get("lastCapture") and not st.get("image"), st
    assert not (env.paths.images / f"{new.namespace}_{new.name}_{new.uid}").exists()
    root = container_procs(new.uid, now.container_id).root
    assert stub_state(env.driver, root) == RUNNING
    restored = [c for c in env.driver.calls()[calls:] if c.startswith(("cuCheckpointProcessRestore",
                                                                       "cuCheckpointProcessUnlock"))]
    assert not restored, restored
    agent = (await chart_pod(env, "agent"))["metadata"]["name"]
    logs = [f.read_text(errors="replace") for f in env.log_files(NS, agent, "agent")]
    assert any("deleted images of pods gone from this node" in t and str(old_dir) in t for t in logs), \
        "the agent's image GC said which images it deleted (its log, as kubelet keeps it)"


# -- helm uninstall with a worker asleep (the module's last two tests: they take the release down) ----------

HOOK_TIMEOUT = 20  # uninstall.timeout for these two: what the hook's `dynsnap wake --all` may take
HOOK_JOB = f"{RELEASE}-wake-all"
JOBS = Resource("batch", "v1", "jobs", "Job")


def _sleeper(env: Env) -> NodePod:
    """The worker these tests put to sleep: the graph's second (the first was recreated above)."""
    assert env.graph is not None
    return env.graph.workers(WORKER_COMPONENT)[1]


async def _asleep_by_override(env: Env, w: NodePod) -> str | None:
    """``dynsnap suspend`` of ``w``, returned once it sleeps: the id of its last wake before (None: none)."""
    await override(env, w, "suspended")
    ws = await wait_ws(env, w, "asleep", asleep)
    wake: Obj = ws["status"].get("lastWake") or {}
    return wake.get("id")


async def _release_objects(env: Env) -> dict[str, bool]:
    """Whether each of the release's workloads, service accounts and cluster roles exists."""
    out = {}
    agent, ctl = f"{RELEASE}-agent", f"{RELEASE}-controller"
    for res, name, ns in ((DAEMON_SETS, agent, NS), (DEPLOYMENTS, ctl, NS), (R.SERVICE_ACCOUNTS, agent, NS),
                          (R.SERVICE_ACCOUNTS, ctl, NS), (R.CLUSTER_ROLES, agent, None), (R.CLUSTER_ROLES, ctl, None),
                          (R.ROLES, f"{ctl}-leader-election", NS)):
        try:
            await env.api.get(res, name, namespace=ns)
            out[f"{res.kind} {name}"] = True
        except NotFound:
            out[f"{res.kind} {name}"] = False
    return out


async def test_an_uninstall_whose_hook_cannot_wake_a_sleeper_stops_with_everything_installed(env: Env) -> None:
    """(Moved from the sandbox's test_helm.py, where processes played the hook's Job and kubelet.) A worker
    asleep and the agent's pod off the node (its DaemonSet kept off it): ``helm uninstall`` runs the chart's
    pre-delete hook, a Job the real Job controller and kubelet run from the controller image under the
    hook's own service account; its ``dynsnap wake --all`` cannot get the worker woken, exits 3 when its
    time is up, the Job fails and helm stops there: the DaemonSet, the Deployment and their identities
    still installed, the release ``uninstalling`` (an upgrade refused until a rollback). The agent, back,
    wakes the worker (the override the hook set stands) and the controller verifies it."""
    values = copy.deepcopy(env.values)
    values.setdefault("uninstall", {})["timeout"] = HOOK_TIMEOUT
    await upgrade(env, values)
    w = _sleeper(env)
    woken_before = await _asleep_by_override(env, w)
    async with agent_off_node(env):
        code, out = await env.helm.run("uninstall", RELEASE, "-n", NS, "--timeout", f"{HOOK_TIMEOUT + 120}s")
        assert code != 0 and f"job {HOOK_JOB} failed" in out, out
        failed = await env.api.get(JOBS, HOOK_JOB, namespace=NS)  # kept, for its log
        assert any(c["type"] == "Failed" and c["status"] == "True" for c in failed["status"]["conditions"]), failed
        (hook,) = (await env.api.list(R.PODS, namespace=NS, label_selector=f"job-name={HOOK_JOB}"))["items"]
        assert hook["spec"]["nodeName"] == env.node.name
        assert hook["spec"]["serviceAccountName"] == f"{RELEASE}-uninstall"
        (cs,) = hook["status"]["containerStatuses"]
        assert cs["state"]["terminated"]["exitCode"] == 3, cs  # not done within its timeout
        log = await env.pod_log(NS, hook["metadata"]["name"], "wake-all")
        assert f"not done in {HOOK_TIMEOUT}s: {w.namespace}/{w.name}" in log, log
        assert all((await _release_objects(env)).values()), await _release_objects(env)
        ws = await get_ws(env.api, w)
        assert ws is not None and ws["status"]["state"] == "Suspended", ws  # asleep, its agent still installed
        # The release is left "uninstalling": an upgrade is refused until a rollback makes it deployed again
        # (docs/install.md says so).
        code, out = await env.helm.run("status", RELEASE, "-n", NS, "-o", "json")
        assert code == 0 and json.loads(out)["info"]["status"] == "uninstalling", out
        code, out = await env.helm.run("upgrade", RELEASE, str(chart_node.CHART), "-n", NS, "--reuse-values")
        assert code != 0 and "has no deployed releases" in out, out
        code, out = await env.helm.run("rollback", RELEASE, "-n", NS)
        assert code == 0, out
        code, out = await env.helm.run("status", RELEASE, "-n", NS, "-o", "json")
        assert code == 0 and json.loads(out)["info"]["status"] == "deployed", out
    # The agent's pod is back on the node: it wakes the worker (the hook's override, active), verified.
    ws = await wait_ws(env, w, "woken by the agent back on the node and verified", verified_after(woken_before))
    assert ws["spec"]["desiredState"] == "Active" and ws["status"]["lastWake"]["ok"] is True


async def test_an_uninstall_wakes_every_sleeper_before_dynsnap_goes(env: Env) -> None:
    """(Moved from the sandbox's test_helm.py.) The worker asleep again: ``helm uninstall``'s hook wakes
    it before the agent and the controller go: the agent's wake (its field manager on ``lastWake``) verified
    by the controller (which only the Deployment's pod can have done), the Job succeeded (helm deleted it),
    then everything of the release gone but the CRD (helm never deletes crds/), and the woken worker,
    in the same pod, answering requests pinned to it with dynsnap gone."""
    assert env.fe is not None
    w = _sleeper(env)
    await override(env, w, None)  # the person who uninstalled lifts the hook's override, then suspends it again
    woken_before = await _asleep_by_override(env, w)
    code, out = await env.helm.run("uninstall", RELEASE, "-n", NS, "--timeout", f"{HOOK_TIMEOUT + 120}s")
    assert code == 0 and f'release "{RELEASE}" uninstalled' in out, out
    ws = await get_ws(env.api, w)
    assert ws is not None and ws["status"]["state"] == "Active" and ws["spec"]["desiredState"] == "Active", ws
    wake = ws["status"]["lastWake"]
    assert wake["id"] != woken_before and wake["ok"] is True
    assert verified_after(woken_before)(ws), ws["status"].get("controller")
    by = {m["manager"] for m in ws["metadata"]["managedFields"] if "f:lastWake" in str(m.get("fieldsV1"))}
    assert by == {P.AGENT_FIELD_MANAGER}, by  # the agent woke it
    live = await env.api.get(R.PODS, w.name, namespace=w.namespace)
    assert live["metadata"]["uid"] == w.uid
    assert ws["metadata"]["annotations"][P.ANN_OVERRIDE] == "Active"  # the hook's `dynsnap wake --all`
    assert any(m["manager"] == P.CLI_FIELD_MANAGER and f"f:{P.ANN_OVERRIDE}" in str(m.get("fieldsV1"))
               for m in ws["metadata"]["managedFields"])
    gone = await _release_objects(env)
    assert not any(gone.values()), gone
    for res, name, ns in ((JOBS, HOOK_JOB, NS), (R.SERVICE_ACCOUNTS, f"{RELEASE}-uninstall", NS)):
        with pytest.raises(NotFound):
            await env.api.get(res, name, namespace=ns)
    await env.api.get(R.CRDS, f"{P.WS_PLURAL}.{P.DYNSNAP_GROUP}")
    iid = await own_instance(env.api, w)
    assert iid is not None
    await env.fe.wait_routable(iid, timeout=60)
    answers = [await env.fe.chat(f"after uninstall {i}", worker_id=iid, max_tokens=2) for i in range(3)]
    assert [(a.status, a.worker_id) for a in answers] == [(200, iid)] * 3, [a.body for a in answers]
