"""dynsnap on the real node, as a user runs it (issue 19): ``helm install`` of deploy/helm/dynsnap puts
the controller Deployment and the agent DaemonSet on the node as pods of the project's images, and
examples/dgd/agg.yaml under the local overlay (real_graph.py: the local images, the mocker, a memory
limit, the GPU stand-in's driver) runs as pods that the node's kubelet, containerd and runc run. One
worker is captured and woken in place by dynsnap itself, through the manual override on its pod (as
``dynsnap suspend|wake`` sets it), three times in each tier, while a trickle of unpinned requests
runs through the frontend. Each wake must be verified by the controller's pinned requests, and the
facts of the ones who own them must hold: kubelet's (the same container id, restartCount, pod UID
and IP), runc's and containerd's (the same container running), the kernel's (the woken tree in the
container's own namespaces and cgroups, under its memory and pids limits, with the seccomp and
capability state the runtime gave it), and the GPU driver stand-in's (checkpointed while asleep,
running after).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import statistics
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from controllerenv import Load, asleep, events_for, get_ws
from realnodecycle import all_ready, cycle, runtime_runs, same_pod, set_tier, trickle
from realnodeenv import NODE, NS, RELEASE, WORKER_COMPONENT, Env, running
from realnodefacts import (
    cgroup_file,
    cgroups,
    container_pid,
    container_procs,
    kubelet_facts,
    namespaces,
    security,
    stub_state,
)

from dynsnap.k8s.client import Obj
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.models.dynamo import instance_id_from_dwm
from dynsnap.models.ids import PodUID
from dynsnap.runtime import caps, procfs
from dynsnap.testenv import dynamo as D
from dynsnap.testenv.cluster import LocalCluster, wait_for
from dynsnap.testenv.node_config import POD_PIDS_LIMIT
from dynsnap.testenv.node_restart import restart_containerd, restart_kubelet
from dynsnap.testenv.oci import OciImage, image_layout

pytestmark = pytest.mark.cluster

CYCLES = 3
CAP_CHECKPOINT_RESTORE = 40
CONTROLLER_UID = 65532  # the controller and entrypoint images' user (hack/lib-images.sh)
MEMORY_LIMIT_BYTES = 2 * 2**30  # realnodeenv.WORKER_MEMORY_LIMIT
SETTLE_S = 25.0  # after a daemon's restart: examples/dgd's startupProbe and readinessProbe periods (10 s each) + 5
TIMINGS: dict[str, list[float]] = {"suspend": [], "snapshot": []}


@pytest.fixture(scope="module")
async def env(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Env]:
    try:
        async with running(cluster, Path(tmp_path_factory.mktemp("real-node-wake")), tier="suspend") as e:
            yield e
    finally:
        for tier, secs in TIMINGS.items():  # for docs/BENCHMARKS.md; never asserted
            if secs:
                print(f"\nreal node, tier {tier}: wake (lastWake) {', '.join(f'{s:.3f}' for s in secs)} s; "
                      f"median {statistics.median(secs):.3f} s")


def _root_mount_options(pid: int) -> set[str]:
    """The per-mount options of the process's root mount (/proc/<pid>/mountinfo's line for ``/``)."""
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == "/":
            return set(fields[5].split(","))
    raise AssertionError(f"no root mount in /proc/{pid}/mountinfo")


async def test_chart_runs_as_pods_of_the_real_node(env: Env) -> None:
    """The chart's Deployment and DaemonSet, each one pod on the node, Ready, from the project's images,
    under the chart's service accounts; the agent privileged in the host's pid namespace with the
    patched CRIU its init container installed from its image; both reach the API server at the address
    kubelet gave them (the kubernetes Service)."""
    (ctl,) = await env.chart_pods("controller")
    (agent,) = await env.chart_pods("agent")
    for pod, sa, image in ((ctl, f"{RELEASE}-controller", "dynsnap-controller"),
                           (agent, f"{RELEASE}-agent", "dynsnap-agent")):
        assert pod["spec"]["nodeName"] == NODE and pod["spec"]["serviceAccountName"] == sa
        (cs,) = pod["status"]["containerStatuses"]
        assert cs["ready"] and cs["restartCount"] == 0 and cs["image"] == f"docker.io/library/{env.images[image]}"
        pid = container_pid(pod, cs["name"])
        assert (Path(f"/proc/{pid}/root") / "opt/dynsnap/bin/dynsnap").is_file()  # the image's, not this checkout
        assert procfs.environ(pid)["KUBERNETES_SERVICE_HOST"] == env.node.kube_proxy["services"][0]["clusterIP"]  # type: ignore[index]
    lease = await env.api.get(R.LEASES, f"{RELEASE}-controller", namespace=NS)
    assert lease["spec"]["holderIdentity"] == ctl["metadata"]["name"]
    ctl_pid = container_pid(ctl, "controller")
    ctl_sec = security(ctl_pid)
    assert ctl_sec["CapEff"] == "0000000000000000" and ctl_sec["NoNewPrivs"] == "1" and ctl_sec["Seccomp"] == "2"
    # As uid and gid 65532 (the chart's restricted pod securityContext, the image's own user too) on a
    # read-only root filesystem.
    status = dict(line.split(":\t", 1) for line in Path(f"/proc/{ctl_pid}/status").read_text().splitlines()
                  if ":\t" in line)
    assert status["Uid"].split() == status["Gid"].split() == [str(CONTROLLER_UID)] * 4, status
    assert _root_mount_options(ctl_pid) & {"ro", "rw"} == {"ro"}
    assert agent["spec"]["hostPID"] is True
    # Not privileged: the chart's capabilities and nothing else, in every set the kernel keeps; no seccomp
    # filter (a restored tree would inherit it), privilege escalation allowed (CRIU restores set-id tasks).
    agent_sc = agent["spec"]["containers"][0]["securityContext"]
    assert agent_sc["privileged"] is False and agent_sc["capabilities"]["drop"] == ["ALL"]
    agent_sec = security(container_pid(agent, "agent"))
    assert agent_sec["Seccomp"] == "0" and agent_sec["NoNewPrivs"] == "0"
    want_caps = set(agent_sc["capabilities"]["add"])
    assert {k: set(caps.names(int(agent_sec[k], 16))) for k in ("CapPrm", "CapEff", "CapBnd")} == {
        k: want_caps for k in ("CapPrm", "CapEff", "CapBnd")}, agent_sec
    # The node tools the init container put on the node are the image's CRIU, with dynsnap's patches,
    # its CUDA plugin and dynsnap-cuda (also under the name the plugin execs), byte for byte, mode 0755.
    agent_img = OciImage.load(image_layout("dynsnap-agent"))
    tools = env.paths.tools
    for node_path, image_path in (("bin/criu", "usr/local/sbin/criu"),
                                  ("lib/criu/cuda_plugin.so", "usr/local/lib/criu/cuda_plugin.so"),
                                  ("bin/dynsnap-cuda", "usr/local/bin/dynsnap-cuda")):
        assert (tools / node_path).read_bytes() == agent_img.read(image_path), node_path
        assert (tools / node_path).stat().st_mode & 0o777 == 0o755, node_path
    assert os.readlink(tools / "bin" / "cuda-checkpoint") == "dynsnap-cuda"
    criu = (tools / "bin" / "criu").read_bytes()
    assert b"DYNSNAP_CRIU_READ_THREADS" in criu and b"early madvise(" in criu  # patches 0002 and 0001
    assert oct(env.paths.images.stat().st_mode & 0o777) == "0o700"
    assert oct(env.paths.cuda_state.stat().st_mode & 0o777) == "0o700"


async def test_example_workers_run_as_the_example_ships_them(env: Env) -> None:
    """Each worker: both init containers of the example completed from the entrypoint image, the copied
    entrypoint as the container's PID 1 with its control directory on the emptyDir kubelet keeps, the
    probes and the readiness gate exactly as examples/dgd/agg.yaml has them, no capability added (the pid
    range reserved without one), containerd's default seccomp profile, the huge-page library and the GPU
    stand-in's driver mapped into the worker; each serves requests pinned to it."""
    assert env.graph is not None and env.fe is not None
    example = next(c for c in env.graph.dgd["spec"]["components"] if c["name"] == WORKER_COMPONENT)
    want = next(c for c in example["podTemplate"]["spec"]["containers"] if c["name"] == "main")
    ep_img = OciImage.load(image_layout("dynsnap-entrypoint"))
    for w in env.graph.workers(WORKER_COMPONENT):
        pod = await env.api.get(R.PODS, w.name, namespace=w.namespace)
        inits = {c["name"]: c["state"].get("terminated", {}) for c in pod["status"]["initContainerStatuses"]}
        assert {n: t.get("exitCode") for n, t in inits.items()} == {"dynsnap-entrypoint": 0, "dynsnap-thp": 0}
        assert {"conditionType": P.CONDITION_SERVING} in pod["spec"]["readinessGates"]
        main = next(c for c in pod["spec"]["containers"] if c["name"] == "main")
        assert "securityContext" not in main and "securityContext" not in want  # no capability added
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert main[probe]["httpGet"]["port"] == "probe" and main[probe] == pod["spec"]["containers"][0][probe]
        facts = await kubelet_facts(env.api, w)
        procs = container_procs(w.uid, facts.container_id)
        assert procfs.cmdline(procs.entrypoint)[:1] == ["/dynsnap/bin/dynsnap-entrypoint"]
        # ... the very file of the entrypoint image, copied by its init container onto the emptyDir
        # (the init container's non-root user owns the copy), and the huge-page library beside it.
        volumes = env.node.layout.kubelet_root / "pods" / w.uid / "volumes"
        bindir = volumes / "kubernetes.io~empty-dir" / "dynsnap-bin"
        copied = bindir / "dynsnap-entrypoint"
        assert Path(f"/proc/{procs.entrypoint}/exe").read_bytes() == copied.read_bytes() == ep_img.read(
            "usr/local/bin/dynsnap-entrypoint")
        assert copied.stat().st_uid == CONTROLLER_UID and copied.stat().st_mode & 0o111 == 0o111
        assert (bindir / "libdynsnap-thp.so").read_bytes() == ep_img.read("usr/local/bin/libdynsnap-thp.so")
        # kubelet's cgroupfs layout, as this node makes it: the memory and pids hierarchies' paths (and any
        # other that names a pod) name this pod and the container kubelet reports: the real sample of
        # procfs.parse_pod_cgroup's cgroupfs rows.
        ours = procfs.PodCgroup(pod_uid=PodUID(w.uid), container_id=facts.container_id)
        named = {c: procfs.parse_pod_cgroup(path) for c, path in cgroups(procs.entrypoint).items()}
        assert named["memory"] == named["pids"] == ours and set(named.values()) <= {ours, None}, named
        control = volumes / "kubernetes.io~empty-dir" / "dynsnap-control"
        # the pid range reserved without a capability (containerd's /proc/sys is read-only: by cycling pids)
        assert json.loads((control / "entrypoint.json").read_text())["pid_reserved"] is True
        maps = procfs.maps_paths(procs.root)
        assert "/dynsnap/bin/libdynsnap-thp.so" in maps and str(env.driver.libcuda) in maps
        sec = security(procs.root)
        assert sec["Seccomp"] == "2" and not int(sec["CapEff"], 16) & (1 << CAP_CHECKPOINT_RESTORE)
        assert security(procs.entrypoint)["Seccomp"] == "2"  # RuntimeDefault: the kubelet's seccompDefault
        iid = instance_id_from_dwm(await env.api.get(R.DWMS, w.name, namespace=w.namespace))
        await env.fe.wait_routable(iid, timeout=60)


async def test_suspend_wakes_in_place_on_real_containers(env: Env) -> None:
    """Tier suspend, three times: the worker's processes stay (the same host pid), checkpointed by the
    driver while asleep and running after; the container the same one, never restarted."""
    assert env.graph is not None
    w = env.graph.workers(WORKER_COMPONENT)[0]
    first = await kubelet_facts(env.api, w)
    procs = container_procs(w.uid, first.container_id)
    worker = procs.root

    async def asleep_facts(_: Obj) -> None:
        assert stub_state(env.driver, worker) == 2  # checkpointed
        assert container_procs(w.uid, first.container_id).root == worker
        await runtime_runs(env, first.container_id, procs.entrypoint)
        await same_pod(env, w, first)

    async with trickle(env):
        for _ in range(CYCLES):
            await cycle(env, w, "suspend", asleep_facts, timings=TIMINGS["suspend"])
            await same_pod(env, w, first)
            assert stub_state(env.driver, worker) == 0 and container_procs(w.uid, first.container_id).root == worker
    reasons = {e["reason"] for e in await events_for(env.api, w.namespace, w.name)}
    assert {"Quiescing", "CaptureRequested", "WakeRequested", "Verified"} <= reasons, reasons


_MIGRATED = re.compile(r"migration retry scheduled .*migration\.reason=\"disconnected\" "
                       r"migration\.from_worker_id=(\d+) .*?request_id=([0-9a-f-]+)")
UNDER_LOAD_CYCLES = 8  # at most: until the frontend has moved a request off the leaving worker


async def test_quiesced_under_load_no_request_fails(env: Env) -> None:
    """A worker put to sleep (tier suspend) and woken while ten clients send unpinned requests through the
    frontend without pause: every request is answered 200. When the quiesce takes the worker out of its
    EndpointSlice, Dynamo's frontend cancels the requests still queued on it (sent, no response stream
    yet) with a migratable error; the example's frontend (``--migration-limit 3``) moves them to the peer,
    where without migration each is answered 503. The cause, not only the outcome: the cycles go on until
    the frontend's own log shows at least one request moved off this worker for that disconnect (at most
    ``UNDER_LOAD_CYCLES``), so the load did meet the worker as it left."""
    assert env.graph is not None and env.fe is not None
    w = env.graph.workers(WORKER_COMPONENT)[0]
    await set_tier(env, w, "suspend")
    iid = instance_id_from_dwm(await env.api.get(R.DWMS, w.name, namespace=w.namespace))
    fe = env.graph.frontend
    moved: set[str] = set()
    load = Load(env.fe, concurrency=10, pause=0.0, max_tokens=2)
    load.start()
    try:
        for _ in range(UNDER_LOAD_CYCLES):
            await cycle(env, w, "suspend", lambda _: asyncio.sleep(0))
            log = D.uncoloured(await env.pod_log(fe.namespace, fe.name, "main", tail=20000))
            moved |= {m.group(2) for m in _MIGRATED.finditer(log) if int(m.group(1)) == iid}
            if moved:
                break
    finally:
        await load.stop()
    failed = load.failures()
    assert load.results and not failed, (len(failed), len(load.results), failed[:5])
    assert moved, f"no request was moved off {w.name} in {UNDER_LOAD_CYCLES} cycles: the load never met its quiesce"
    print(f"\nquiesced under load: {len(load.results)} requests, none failed; {len(moved)} moved off {w.name} "
          "by the frontend's migration")


async def test_snapshot_wakes_in_place_on_real_containers(env: Env) -> None:
    """Tier snapshot, three times: while asleep no process of the worker's tree is left, yet runc and
    containerd still run the container (its PID 1, the entrypoint); woken, the restored tree has the
    worker's own pid in the container's pid namespace, every namespace and every cgroup of the
    container, its memory limit and its pod's pids limit over it, and the seccomp, no_new_privs and
    capability state it had before the capture."""
    assert env.graph is not None
    w = env.graph.workers(WORKER_COMPONENT)[0]
    await set_tier(env, w, "snapshot")
    first = await kubelet_facts(env.api, w)
    procs = container_procs(w.uid, first.container_id)
    ep, ns_pid = procs.entrypoint, procfs.status(procs.root).nspid[-1]  # type: ignore[union-attr]
    sec_before, ns_before = security(procs.root), namespaces(ep)
    container_cg = cgroups(ep)

    async def asleep_facts(ws: Obj) -> None:
        assert container_procs(w.uid, first.container_id).tree == ()  # the whole tree is in the images
        await runtime_runs(env, first.container_id, ep)
        await same_pod(env, w, first)
        image = Path(ws["status"]["image"]["path"])
        assert image.is_relative_to(env.paths.images) and "Dumping finished successfully" in (
            image / "dump.log").read_text(errors="replace")

    async with trickle(env):
        for _ in range(CYCLES):
            await cycle(env, w, "snapshot", asleep_facts, timings=TIMINGS["snapshot"])
            await same_pod(env, w, first)
            await runtime_runs(env, first.container_id, ep)
            now = container_procs(w.uid, first.container_id)
            root = now.root
            assert procfs.status(root).nspid[-1] == ns_pid  # type: ignore[union-attr]
            assert namespaces(root) == ns_before
            for pid in now.tree:  # every restored process: the container's cgroups, all of them
                assert cgroups(pid) == container_cg, (pid, cgroups(pid), container_cg)
            assert security(root) == sec_before
            mem = container_cg["memory"]
            assert int(cgroup_file("memory", mem, "memory.limit_in_bytes")) == MEMORY_LIMIT_BYTES
            assert str(root) in cgroup_file("memory", mem, "cgroup.procs").split()
            pod_pids = str(Path(container_cg["pids"]).parent)
            assert cgroup_file("pids", pod_pids, "pids.max") == str(POD_PIDS_LIMIT)
            assert int(cgroup_file("pids", pod_pids, "pids.current")) >= len(now.tree) + 1


@pytest.mark.parametrize("daemon", ["kubelet", "containerd"])
@pytest.mark.parametrize("tier", ["suspend", "snapshot"])
async def test_a_node_daemon_restarted_under_a_sleeping_worker_then_it_wakes_in_place(env: Env, tier: str,
                                                                                     daemon: str) -> None:
    """kubelet, or containerd, stopped and started again while the worker sleeps (as the node's supervisor
    restarts it): the sleeping container is the same one afterwards (its id, restartCount, PID 1, runc and
    containerd running it), still not Ready (only the gate takes it out of serving), its capture kept;
    then the wake is in place and verified.

    Unpinned requests run through the frontend from the restart on (the capture before it is judged by
    the tests above), and the frontend's and the awake peer's readiness is sampled beside them. A
    restarted kubelet keeps no probe result: every container there
    counts as not started and not ready until its startup and readiness probes run again (the example's
    startupProbe every 10 s), so the peer leaves its EndpointSlice for those seconds and the frontend
    has no worker for the model: it answers 404 (model gone) or 503 (``Service temporarily unavailable``:
    listed, no instance to route to), with dynsnap or without. The test says exactly that: every failed
    request is one of those two answered within the frontend's lag (10 s) of a look that saw the frontend
    or the peer not Ready by kubelet's account, and requests are answered again after."""
    assert env.graph is not None and env.fe is not None
    w = env.graph.workers(WORKER_COMPONENT)[0]
    others = [env.graph.frontend, *[p for p in env.graph.workers(WORKER_COMPONENT) if p.name != w.name]]
    await wait_for("the frontend and the peer Ready", lambda: all_ready(env, others), timeout=90, interval=0.5)
    await set_tier(env, w, tier)
    first = await kubelet_facts(env.api, w)
    ep = container_procs(w.uid, first.container_id).entrypoint
    restart = restart_kubelet if daemon == "kubelet" else restart_containerd
    not_ready: list[float] = []  # when the frontend or the peer was seen not Ready
    done = asyncio.Event()

    async def sample() -> None:
        """Every change of the frontend's and the peer's pods while the load runs, by a watch (a poll every
        0.25 s missed a short not-Ready under the two lanes' load: 0 looks beside a 404, 2026-12-07),
        and a look every second beside it."""
        names, ns = {p.name for p in others}, others[0].namespace

        def seen(pod: Obj) -> None:
            conds = (pod.get("status") or {}).get("conditions") or []
            if pod["metadata"]["name"] in names and not any(c["type"] == "Ready" and c["status"] == "True"
                                                              for c in conds):
                not_ready.append(time.time())

        async def watch() -> None:
            listed = await env.api.list(R.PODS, namespace=ns)
            for pod in listed["items"]:
                seen(pod)
            rv = listed["metadata"]["resourceVersion"]
            for _ in range(20):  # bounded: each stream ends after its timeout, then the next from where it was
                async for ev in env.api.watch(R.PODS, namespace=ns, resource_version=rv, timeout_seconds=60):
                    rv = ev["object"]["metadata"].get("resourceVersion") or rv
                    if ev["type"] in ("ADDED", "MODIFIED"):
                        seen(ev["object"])

        watcher = asyncio.create_task(watch())
        try:
            for _ in range(600):  # every second, bounded (10 minutes)
                if done.is_set():
                    return
                with contextlib.suppress(Exception):
                    if not await all_ready(env, others):
                        not_ready.append(time.time())
                await asyncio.sleep(1.0)
        finally:
            watcher.cancel()
            with contextlib.suppress(BaseException):
                await watcher

    restarted: list[float] = []

    async def restarted_while_asleep(slept: Obj) -> None:
        restarted.append(time.time())
        load.start()  # from here on: the capture before it is test_snapshot_…'s and test_suspend_…'s to judge
        sampler.append(asyncio.create_task(sample()))
        await restart(env.node)
        await runtime_runs(env, first.container_id, ep)
        await same_pod(env, w, first)
        assert (await kubelet_facts(env.api, w)).ready is False  # still out of serving: its gate
        ws = await get_ws(env.api, w)
        assert asleep(ws) and ws is not None and ws["status"]["lastCapture"]["id"] == \
            slept["status"]["lastCapture"]["id"], ws

    # The frontend sees an EndpointSlice change through its watch and then finds the instance again: mostly
    # within a second or two, once 6 s after the peer's one not-Ready look (a kubelet restart, 2026-12-02).
    lag = 10.0
    load = Load(env.fe, concurrency=1, pause=0.5, max_tokens=2)
    sampler: list[asyncio.Task[None]] = []
    try:
        await cycle(env, w, tier, restarted_while_asleep)
        await same_pod(env, w, first)
        await runtime_runs(env, first.container_id, ep)
        await wait_for("the frontend and the peer Ready", lambda: all_ready(env, others), timeout=90, interval=0.25)

        async def answered_after() -> bool:
            # Three answers after the last not-Ready look (plus the lag), once kubelet has had the time to
            # run every probe again (the example's startup and readiness periods, 10 s each): the next test
            # must not start inside this restart's window.
            since = (not_ready[-1] if not_ready else 0.0) + lag
            return time.time() > restarted[0] + SETTLE_S and sum(1 for r in load.results if r[0] > since) >= 3
        await wait_for("requests answered after the peer was Ready again", answered_after, timeout=60, interval=0.5)
    finally:
        done.set()
        await load.stop()
        for task in sampler:
            await task
    failed = load.failures()
    print(f"\n{daemon} restart under a {tier} sleeper: {len(failed)} of {len(load.results)} requests failed; "
          f"the frontend or the peer seen not Ready {len(not_ready)} times (watched, and looked at every second)")
    for r in failed:  # no worker, within the lag of a not-Ready look, either side (every change of their pods seen)
        no_worker = r[1] == 404 or (r[1] == 503 and "Service temporarily unavailable" in r[3])
        assert no_worker and any(abs(t - r[0]) <= lag for t in not_ready), (r, not_ready[:3], not_ready[-3:])
    after = [r for r in load.results if r[0] > (not_ready[-1] if not_ready else 0.0) + lag]
    assert len(after) >= 3 and all(r[1] == 200 for r in after), after[:5]
