"""The node agent's own account of a worker taken through each tier and back on the real node (the
agent a pod of the chart's DaemonSet, the worker a container kubelet, containerd and runc run), and the
worker's account after: the same worker. Each cycle is asked as a user asks it (the override on the
pod); besides the facts test_real_node_wake.py checks (the container, its namespaces and cgroups):

- the capture's record: its steps, the GPU processes it found (under the pid floor), the entrypoint's
  control file, the stub driver's state; for a snapshot, the image on the node's disk (mode 0700, its
  manifest naming the pod, a CUDA core file per GPU process) and the pid reservation the entrypoint
  made by cycling pids (containerd mounts /proc/sys read-only in the container: the way a pod gets
  there without privilege), the worker back at its own pid; the wake's steps;
- the worker's identity after the wake (pod UID and IP, DWM UID and instance id), its EndpointSlice
  endpoint not ready while asleep and ready again with the same ``targetRef.uid``;
- its TCP connections to the API server (Dynamo's discovery watches, through the ``kubernetes``
  Service's address) the same ones after the wake, and its log lines from before the sleep and after
  the wake both in the container's log as kubelet keeps it (``kubectl logs``);
- nothing of the agent's in the worker's container (its node tools, its images directory, its image's
  CRIU and plugin, which CRIU gets as descriptors) before or after, and none of it held open or mapped
  by the woken pod's processes; CRIU's log naming the CUDA plugin; nothing of the container's steering
  CRIU (a CRIU configuration at CRIU's default paths naming an action script: never run);
- the agent's Events about the WorkerSnapshot; a snapshot's image deleted once woken from;
- twenty snapshot cycles of one worker in a row, each a new capture of the same worker;
- a snapshot sleep longer than the agent's --reset-apiserver-connections-after (30 s, the chart's
  default): the agent resets the woken worker's connections to the API server, and the worker watches
  again at once on new ones (the session API server's audit log).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from datetime import UTC, datetime
from pathlib import Path

import pytest
from agentenv import tcp_established
from auditlog import AuditLog
from controllerenv import get_ws
from longsleep import watched_since, watching
from realnodecycle import cycle, same_pod, trickle
from realnodeenv import NS, Env, chart_pod, deployed, kubernetes_service
from realnodefacts import container_pid, container_procs, control_file, kubelet_facts, stub_state
from trustenv import plant_criu_config

from dynsnap.k8s.client import Obj
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.models.dynamo import instance_id_from_dwm
from dynsnap.testenv import chart_node
from dynsnap.testenv import dynamo as D
from dynsnap.testenv.cluster import wait_for
from dynsnap.testenv.real_graph import NodePod

pytestmark = pytest.mark.cluster

WORKER = "VllmWorker"
CHECKPOINTED, RUNNING = 2, 0  # the stub driver's states
CYCLES = 20
# The agent image's CRIU and its CUDA plugin (hack/lib-images.sh), in the agent's container.
AGENT_IMAGE_FILES = ("/usr/local/sbin/criu", "/usr/local/lib/criu/cuda_plugin.so")
RESET_AFTER_S = 30.0  # the agent's --reset-apiserver-connections-after, which the chart leaves at its default
RESET_LOG = re.compile(r"reset (\d+) connection\(s\) of the woken worker to the API server")


def graph(env: Env, name: str, tier: str) -> Obj:
    """examples/dgd/agg.yaml (idle-after 10m: only the override acts), two workers, tier ``tier``."""
    return chart_node.example_body(env, name=name, worker_replicas=2, policy={"dynsnap.io/tier": tier})


async def _identity(env: Env, w: NodePod) -> dict[str, object]:
    p = await env.api.get(R.PODS, w.name, namespace=w.namespace)
    dwm = await env.api.get(R.DWMS, w.name, namespace=w.namespace)
    return {"uid": p["metadata"]["uid"], "ip": p["status"]["podIP"], "dwm": dwm["metadata"]["uid"],
            "instance": instance_id_from_dwm(dwm)}


async def _endpoint_ready(env: Env, w: NodePod) -> bool | None:
    """The worker's endpoint in its discovery EndpointSlices: ready, or None when it has none."""
    ep = await env.cluster.endpoint_of(w, label_selector=f"{P.LABEL_DISCOVERY_ENABLED}=true")
    return None if ep is None else bool((ep.get("conditions") or {}).get("ready"))


async def _endpoint_becomes(env: Env, w: NodePod, ready: bool) -> None:
    async def reached() -> bool:
        return await _endpoint_ready(env, w) is ready
    await wait_for(f"{w.name}'s endpoint ready={ready}", reached, timeout=60, interval=0.25)


async def _agent_root(env: Env) -> Path:
    """The agent container's root file system, seen from the host (/proc/<its PID 1>/root)."""
    (agent,) = await env.chart_pods("agent")
    return Path(f"/proc/{container_pid(agent, 'agent')}/root")


def _in_container(ep: int, path: str) -> bool:
    """Whether ``path`` exists in the mount namespace of the container whose PID 1 is ``ep``."""
    return os.path.lexists(f"/proc/{ep}/root{path}")


def _held(pids: list[int], roots: list[str]) -> list[str]:
    """Open descriptors, working directories and mappings of ``pids`` under ``roots``."""
    found = []
    for pid in pids:
        try:
            links = [(f"fd {fd}", os.readlink(f"/proc/{pid}/fd/{fd}")) for fd in os.listdir(f"/proc/{pid}/fd")]
            links.append(("cwd", os.readlink(f"/proc/{pid}/cwd")))
            maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
        except OSError:
            continue
        links += [("map", line.split(None, 5)[5]) for line in maps if len(line.split(None, 5)) == 6]
        found += [f"pid {pid} {what}: {target}" for what, target in links
                  if any(target == r or target.startswith(r + "/") for r in roots)]
    return found


async def _pinned(env: Env, iid: int, n: int) -> list[str]:
    """n requests pinned to the worker, each answered by it; their request ids (the worker logs them)."""
    assert env.fe is not None
    await env.fe.wait_routable(iid, timeout=60)
    ids = []
    for i in range(n):
        res = await env.fe.chat(f"pinned {i}", worker_id=iid, max_tokens=2)
        assert res.status == 200 and res.worker_id == iid, res.body
        ids.append(str(res.body["id"]).removeprefix("chatcmpl-"))
    return ids


@pytest.mark.parametrize("tier", ["suspend", "snapshot"])
async def test_a_worker_through_each_tier_and_back_is_the_same_worker(env: Env, tier: str) -> None:
    async with deployed(env, graph(env, f"agt-{tier}", tier)) as g:
        w = g.workers(WORKER)[0]
        first = await kubelet_facts(env.api, w)
        procs = container_procs(w.uid, first.container_id)
        ep, root = procs.entrypoint, procs.root
        before = await _identity(env, w)
        iid = before["instance"]
        assert isinstance(iid, int)
        before_ids = await _pinned(env, iid, n=1)
        api_server = await kubernetes_service(env)
        conns = tcp_established(ep, remote=api_server)
        assert conns, "the worker holds TCP connections to the API server (its discovery watches)"
        assert await _endpoint_ready(env, w) is True
        # Nothing of the agent's in the worker's container: its node tools and images (host paths,
        # mounted into the agent's container only) and its image's CRIU; CRIU gets them as descriptors.
        agent_root = await _agent_root(env)
        node_paths = [str(env.paths.tools / "bin" / "criu"), str(env.paths.images)]
        for path in node_paths:
            assert Path(path).exists() and not _in_container(ep, path), path
        for path in AGENT_IMAGE_FILES:
            assert (agent_root / path.lstrip("/")).exists() and not _in_container(ep, path), path
        facts: dict[str, Obj] = {}
        # A CRIU configuration in the worker's image, naming an action script: CRIU never reads it.
        planted_ran = plant_criu_config(ep) if tier == "snapshot" else None

        async def while_asleep(ws: Obj) -> None:
            await _endpoint_becomes(env, w, ready=False)
            facts["ctl"] = control_file(ep)
            if tier == "suspend":
                facts["driver"] = {"state": stub_state(env.driver, root)}
            else:
                image = Path(ws["status"]["image"]["path"])
                facts["image"] = {"mode": image.stat().st_mode & 0o777,
                                  "files": sorted(p.name for p in image.iterdir()),
                                  "manifest": json.loads((image / P.MANIFEST_FILE).read_text()),
                                  "dump_log": (image / "dump.log").read_text(errors="replace")}
        woken = await cycle(env, w, tier, while_asleep)
        st = woken["status"]
        cap, wake = st["lastCapture"], st["lastWake"]
        names = [s["name"] for s in cap["steps"]]
        gpu = [p for p in cap["pids"] if p["gpu"]]
        assert gpu, "the worker maps the (stub) CUDA driver: the agent found it as a GPU process"
        assert all(p["ns"] >= P.PID_FLOOR for p in cap["pids"]), cap["pids"]
        ctl = facts["ctl"]
        if tier == "suspend":
            assert names == ["quiesce", "save", "settle-suspended"], names
            assert ctl["state"] == "suspended" and ctl["worker_alive"] is True, ctl
            assert facts["driver"]["state"] == CHECKPOINTED
            assert [s["name"] for s in wake["steps"]] == ["wake", "resume", "settle-active"]
        else:
            assert names == ["quiesce", "save", "dump", "seal", "settle-snapshotted"], names
            assert ctl["state"] == "snapshotted" and ctl["worker_alive"] is False, ctl
            # containerd mounts /proc/sys read-only in the worker's container: the entrypoint reserved
            # the pids below the floor by starting and reaping children, and CRIU gave the worker its pid.
            assert ctl["pid_reserved"] is True and int(ctl["worker_pid"]) >= P.PID_FLOOR, ctl
            log = await env.pod_log(w.namespace, w.name, "main", tail=100000)
            assert "moved the pid counter to the floor by starting and reaping" in log, log[:2000]
            assert "RESERVATION FAILED" not in log
            assert st["image"]["format"] == P.IMAGE_FORMAT
            image = facts["image"]
            assert image["mode"] == 0o700 and image["manifest"]["podUID"] == w.uid, image
            assert {f"core-{p['ns']}.img" for p in gpu} <= set(image["files"]), image["files"]
            assert 'Plugin "cuda_plugin"' in image["dump_log"] and "Dumping finished successfully" in image["dump_log"]
            assert [s["name"] for s in wake["steps"]] == ["wake", "restore", "resume", "settle-active"]
            assert not Path(st["image"]["path"]).exists()  # woken from and superseded: the secrets gone
            assert planted_ran is not None and not planted_ran.exists(), \
                f"CRIU ran the action script the worker's image configured: {planted_ran.read_text()}"
        # The same worker: its identity, its endpoint, its connections, its log.
        await _endpoint_becomes(env, w, ready=True)
        assert await _identity(env, w) == before
        await same_pod(env, w, first)
        now = container_procs(w.uid, first.container_id)
        assert now.entrypoint == ep and stub_state(env.driver, now.root) == RUNNING
        after = control_file(ep)
        assert after["state"] == "active" and after["worker_pid"] == ctl["worker_pid"], after  # in place
        # Still nothing of the agent's in the container, and nothing it handed CRIU held by the woken
        # pod's processes: no descriptor, working directory or mapping.
        for path in [*node_paths, *AGENT_IMAGE_FILES]:
            assert not _in_container(ep, path), path
        assert _held([ep, *now.tree], [str(env.paths.tools), str(env.paths.images), *AGENT_IMAGE_FILES]) == []
        assert conns <= tcp_established(ep, remote=api_server), "the worker's API-server connections are the same ones"
        after_ids = await _pinned(env, iid, n=2)

        async def logged() -> bool:
            text = D.uncoloured(await env.pod_log(w.namespace, w.name, "main", tail=5000))
            return all(f"request_id={rid}" in text for rid in before_ids + after_ids)
        await wait_for("request ids from before and after the wake in the container's log", logged,
                       timeout=30, interval=1)
        # Every step explained: the agent's Events about this WorkerSnapshot.
        mine = [(e["reason"], e.get("note", "")) for e in (await env.api.list(R.EVENTS, namespace=w.namespace))["items"]
                if e["regarding"].get("uid") == woken["metadata"]["uid"]
                and e.get("reportingController") == "dynsnap.io/agent"]
        assert {"Capturing", "Suspended", "Waking", "Active"} <= {r for r, _ in mine}, mine
        assert any(r == "Suspended" and n.startswith("captured in ") for r, n in mine), mine


async def test_twenty_snapshot_cycles_of_one_worker_in_a_row(env: Env) -> None:
    async with deployed(env, graph(env, "agt-twenty", "snapshot")) as g:
        w = g.workers(WORKER)[1]
        first = await kubelet_facts(env.api, w)
        before = await _identity(env, w)

        async def nothing(_: Obj) -> None:
            pass
        captures = set()
        for _ in range(CYCLES):
            woken = await cycle(env, w, "snapshot", nothing)
            captures.add(woken["status"]["lastCapture"]["id"])
            assert await _identity(env, w) == before
        assert len(captures) == CYCLES
        await same_pod(env, w, first)
        ws = await get_ws(env.api, w)
        assert ws is not None and ws["status"]["state"] == "Active"


async def test_a_sleep_past_reset_after_resets_the_workers_api_server_connections(env: Env,
                                                                                       audit: AuditLog) -> None:
    """Asleep (snapshot) longer than --reset-apiserver-connections-after, the worker's connections to
    the API server come back from the image as they were frozen, while the server went on (a watch it
    ended meanwhile leaves such a connection half-open: nothing arrives on it until kube-client's read
    timeout, 295 s). The agent resets them at the restore: its log counts them (at most the frozen
    ones), none of the frozen ones is left, the worker watches both resources again on new
    connections within a minute (the audit log), the wake is verified by pinned requests, and
    unpinned requests served by its peer meanwhile never fail. (The frontend's own connection to
    the worker is not one to look at: it drops it when the worker leaves serving.)"""
    async with deployed(env, graph(env, "agt-reset", "snapshot")) as g:
        w = g.workers(WORKER)[0]
        first = await kubelet_facts(env.api, w)
        ep = container_procs(w.uid, first.container_id).entrypoint
        api_server = await kubernetes_service(env)
        await watching(env, audit, w)
        frozen = tcp_established(ep, remote=api_server)
        assert frozen, "the worker holds TCP connections to the API server (its discovery watches)"
        agent = (await chart_pod(env, "agent"))["metadata"]["name"]
        logged_before = len(RESET_LOG.findall(await env.pod_log(NS, agent, "agent", tail=100000)))
        woken_at: list[datetime] = []

        async def past_reset_after(ws: Obj) -> None:
            asleep_s = (datetime.now(UTC) - datetime.fromisoformat(ws["status"]["lastCapture"]["finished"])
                        ).total_seconds()
            await asyncio.sleep(max(RESET_AFTER_S + 5 - asleep_s, 0))
            woken_at.append(datetime.now(UTC))
        async with trickle(env):
            woken = await cycle(env, w, "snapshot", past_reset_after)
        assert [s["name"] for s in woken["status"]["lastWake"]["steps"]] == ["wake", "restore", "resume",
                                                                            "settle-active"]
        resets = RESET_LOG.findall(await env.pod_log(NS, agent, "agent", tail=100000))[logged_before:]
        # One reset, of the connections restored from the image: ss -K names the API server's address
        # and port, so no other connection of the worker's is touched.
        assert len(resets) == 1 and 1 <= int(resets[0]) <= len(frozen), (resets, frozen)
        assert not tcp_established(ep, remote=api_server) & frozen, "a frozen API-server connection is left"

        async def watching_again() -> bool:
            return watched_since(audit, w, woken_at[0])
        await wait_for("the woken worker watching the API server again", watching_again, timeout=60, interval=1)
        await same_pod(env, w, first)
        print(f"\nasleep past {RESET_AFTER_S:.0f} s: the agent reset {resets[0]} connection(s) to the API server "
              f"of {len(frozen)} frozen")
