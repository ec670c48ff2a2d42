"""The snapshot tier on a worker whose container has nothing of the agent's: not CRIU, not its dynamic
loader or libraries, not its plugin directory, not the images directory. On a real node the worker
image holds none of them, while the agent runs CRIU inside the worker's mount namespace; here the pod
sandboxes share the node's file system, so the worker's sandbox over-mounts an empty tmpfs on each
of those node directories (the testenv's stand-in for an image without them), and the test checks
from inside the worker's mount namespace that they are gone, so it cannot pass by finding them.

CRIU here is a private install like the agent image's: the binary, its loader (the binary's
PT_INTERP points at it), every library it needs and its CUDA plugin under one directory of the node,
found by the agent's loader through the agent's LD_LIBRARY_PATH. The agent captures and wakes the
worker in place with it, the worker answers requests pinned to it afterwards, and none of the files
the agent handed to CRIU (as descriptors) is open or mapped in any process of the woken pod."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from agentenv import (
    AGENT_NS,
    AGENT_SA,
    AgentProc,
    build_stub_driver,
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
from dynsnap.runtime import procfs
from dynsnap.runtime.command import find_tool
from dynsnap.testenv import dynamo as D
from dynsnap.testenv.cluster import HIDDEN_PATHS_ANNOTATION, LocalCluster, RunningPod

pytestmark = pytest.mark.cluster

SYSTEM_LOADER = "/lib64/ld-linux-x86-64.so.2"


@dataclass
class PrivateCriu:
    """CRIU installed under one node directory, as the agent image holds it apart from any worker."""

    prefix: Path

    @property
    def binary(self) -> Path:
        return self.prefix / "bin" / "criu"

    @property
    def loader(self) -> Path:
        return self.prefix / "ld.so"

    @property
    def libs(self) -> Path:
        return self.prefix / "lib"

    @property
    def plugins(self) -> Path:
        return self.prefix / "lib" / "criu"


def _set_interpreter(binary: Path, interp: str) -> None:
    """Point an x86-64 ELF binary's PT_INTERP at ``interp`` (no longer than the one it names)."""
    data = bytearray(binary.read_bytes())
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, "an ELF64 little-endian binary"
    (phoff,) = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    for i in range(phnum):
        at = phoff + i * phentsize
        if struct.unpack_from("<I", data, at)[0] == 3:  # PT_INTERP
            (offset,) = struct.unpack_from("<Q", data, at + 8)
            (size,) = struct.unpack_from("<Q", data, at + 0x20)
            new = interp.encode()
            assert len(new) < size, f"{interp} does not fit the {size} bytes of PT_INTERP"
            data[offset:offset + size] = new + b"\0" * (size - len(new))
            binary.write_bytes(bytes(data))
            return
    raise AssertionError(f"{binary} has no PT_INTERP")


def install_private_criu() -> PrivateCriu:
    criu = Path(os.environ["DYNSNAP_CRIU"])
    # Short: the new PT_INTERP must fit where "/lib64/ld-linux-x86-64.so.2" was.
    c = PrivateCriu(Path(tempfile.mkdtemp(prefix="dsnc", dir="/tmp")))
    c.binary.parent.mkdir()
    c.plugins.mkdir(parents=True)
    listing = subprocess.run([SYSTEM_LOADER, "--list", str(criu)], capture_output=True, text=True, check=True).stdout
    for line in listing.splitlines():
        name, arrow, found = line.strip().partition(" => ")
        if arrow:
            shutil.copy(found.rsplit(" (0x", 1)[0], c.libs / name)
    shutil.copy(SYSTEM_LOADER, c.loader)
    shutil.copy(criu, c.binary)
    _set_interpreter(c.binary, str(c.loader))
    shutil.copy(criu.parents[1] / "lib" / "criu" / "cuda_plugin.so", c.plugins)
    return c


@dataclass
class Env:
    graph: D.Graph
    fe: D.FrontendClient
    agent: AgentProc
    criu: PrivateCriu
    hidden: list[str]

    @property
    def pod(self) -> RunningPod:
        return self.graph.workers("worker")[0]


@pytest.fixture(scope="module")
async def env(cluster: LocalCluster) -> AsyncIterator[Env]:
    work = Path(tempfile.mkdtemp(prefix="dynsnap-criufds-"))
    driver = build_stub_driver(work / "stubcuda")
    criu = install_private_criu()
    await install_dynsnap(cluster)
    kubeconfig = await token_kubeconfig(cluster, namespace=AGENT_NS, sa=AGENT_SA, path=work / "agent.kubeconfig")
    comp = worker_component("worker", replicas=1, driver=driver)
    agent_dir = work / "agent"
    agent_dir.mkdir(mode=0o700)
    # Out of the worker's sight: the private CRIU, the cache's CRIU (and its compiled-in plugin
    # directory), and the agent's own directory (its images root, its dynsnap-cuda state).
    hidden = [str(criu.prefix), str(Path(os.environ["DYNSNAP_CRIU"]).parents[1]), str(agent_dir)]
    comp["annotations"] = {HIDDEN_PATHS_ANNOTATION: json.dumps(hidden)}
    g = await deploy_serving(cluster, D.dgd("crfd", [D.frontend_component(), comp]))
    pod = g.workers("worker")[0]
    agent = AgentProc(pod.node, kubeconfig, agent_dir, driver,
                      extra=["--failure-backoff", "1", "--criu", str(criu.binary), "--criu-libdir", str(criu.plugins)],
                      env={"LD_LIBRARY_PATH": str(criu.libs)})
    fe = D.FrontendClient(g.frontend)
    try:
        await agent.start()
        await fe.wait_model()
        yield Env(g, fe, agent, criu, hidden)
    finally:
        await fe.close()
        await gather_stop([agent])
        await D.teardown(cluster, g)
        shutil.rmtree(criu.prefix, ignore_errors=True)


def _in_worker_mount_ns(pod: RunningPod, path: Path) -> bool:
    res = subprocess.run([find_tool("nsenter"), "-t", str(pod.sandbox.pid), "-m", "--", "test", "-e", str(path)],
                         check=False, timeout=30)
    assert res.returncode in (0, 1), res
    return res.returncode == 0


def _pod_processes(pod: RunningPod) -> list[int]:
    pidns = procfs.pid_ns(pod.sandbox.pid)
    assert pidns is not None, "the pod's sandbox is running"
    return [p for p in procfs.pids() if procfs.pid_ns(p) == pidns]  # one gone meanwhile: None, left out


def _agent_files_held(pod: RunningPod, roots: list[str]) -> list[str]:
    """Open descriptors, working directories and mappings of the pod's processes under ``roots``."""
    found = []
    for pid in _pod_processes(pod):
        links = []
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


async def test_snapshot_wakes_a_worker_whose_container_has_no_criu(cluster: LocalCluster, env: Env) -> None:
    api = cluster.api
    pod = env.pod
    c = env.criu
    must_be_absent = [c.binary, c.loader, c.libs / "libc.so.6", c.libs / "libnftables.so.1",
                      c.plugins / "cuda_plugin.so", Path(os.environ["DYNSNAP_CRIU"]), env.agent.images_root]
    env.agent.images_root.mkdir(mode=0o700, exist_ok=True)
    for path in must_be_absent:
        assert path.exists(), f"{path} exists on the node (the agent's side)"
        assert not _in_worker_mount_ns(pod, path), f"{path} is visible in the worker's mount namespace"
    wid = await D.instance_id(cluster, pod)
    await env.fe.wait_routable(wid)
    await api.create(R.WORKER_SNAPSHOTS, ws_body(pod, tier="snapshot"))
    try:
        await wait_ws(api, pod, "Active", state_is("Active"), agents=[env.agent])
        res = await env.fe.chat("before the sleep", worker_id=wid)
        assert res.status == 200 and res.worker_id == wid, res.body
        ctl_path = Path(f"/proc/{pod.sandbox.pid}/root") / P.ENTRYPOINT_CONTROL_DIR.lstrip("/") / \
            P.ENTRYPOINT_CONTROL_FILE
        before = json.loads(ctl_path.read_text())
        await quiesce(cluster, pod, serving=False)
        await set_desired(api, pod, "Suspended")
        asleep = await wait_ws(api, pod, "Suspended", state_is("Suspended", suspended=True), agents=[env.agent])
        cap = asleep["status"]["lastCapture"]
        assert cap["ok"] is True and [s["name"] for s in cap["steps"]] == [
            "quiesce", "save", "dump", "seal", "settle-snapshotted"]
        image = Path(asleep["status"]["image"]["path"])
        assert image.is_relative_to(env.agent.images_root)
        dump_log = (image / "dump.log").read_text(errors="replace")
        # CRIU loaded its plugin from the directory handed to it (the only plugin directory there is:
        # the compiled-in one is hidden from the worker too) and wrote its images through the descriptor.
        assert 'Plugin "cuda_plugin"' in dump_log, dump_log[-2000:]
        assert "Dumping finished successfully" in dump_log
        assert {f"core-{p['ns']}.img" for p in cap["pids"] if p["gpu"]} <= set(os.listdir(image))
        assert json.loads(ctl_path.read_text())["worker_alive"] is False
        await set_desired(api, pod, "Active")
        awake = await wait_ws(api, pod, "Active", state_is("Active", suspended=False), agents=[env.agent])
        wake = awake["status"]["lastWake"]
        assert wake["ok"] is True and [s["name"] for s in wake["steps"]] == [
            "wake", "restore", "resume", "settle-active"]
        after = json.loads(ctl_path.read_text())
        assert after["worker_alive"] is True and after["worker_pid"] == before["worker_pid"], (before, after)
        await quiesce(cluster, pod, serving=True)
        await env.fe.wait_routable(wid)
        for i in range(2):
            res = await env.fe.chat(f"after the wake {i}", worker_id=wid)
            assert res.status == 200 and res.worker_id == wid, res.body
        assert pod.kubelet.restarts == 0
        # Still nothing of the agent's in the worker's mount namespace, and nothing it handed CRIU
        # held by any process of the woken pod: no descriptor, working directory or mapping.
        for path in must_be_absent:
            assert not _in_worker_mount_ns(pod, path), path
        held = _agent_files_held(pod, [str(c.prefix), str(env.agent.workdir)])
        assert held == [], held
        assert len(_pod_processes(pod)) >= 2, "the entrypoint and the restored worker tree"
    finally:
        await api.delete(R.WORKER_SNAPSHOTS, pod.name, namespace=pod.namespace)
