"""CRIU 4.2.1 captures a live Dynamo mocker worker running under dynsnap-entrypoint in a
pod sandbox and restores it into the same pod (same pid and network namespace): the
entrypoint stays PID 1 and keeps the pod alive while the worker is gone, the restored
worker keeps its TCP connections, pod UID, IP, DWM and instance id, and answers requests
pinned to it through the Dynamo frontend again."""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from dynsnap.agent.entrypoint_control import EntrypointControl
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.models.protocol import EntrypointState as S
from dynsnap.testenv import dynamo as D
from dynsnap.testenv.cluster import LocalCluster, wait_for
from dynsnap.testenv.criu import criu_binary, criu_dump, criu_restore

pytestmark = pytest.mark.cluster


def _tree_host_pids(root_host_pid: int) -> list[int]:
    out, todo = [], [root_host_pid]
    while todo:
        pid = todo.pop()
        out.append(pid)
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                todo += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
    return out


def _ns_pid(host_pid: int) -> int:
    status = Path(f"/proc/{host_pid}/status").read_text()
    return int(re.search(r"^NSpid:\s+(.*)$", status, re.M).group(1).split()[-1])  # type: ignore[union-attr]


def _io_uring_fds(pids: list[int]) -> list[str]:
    found = []
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if "io_uring" in target:
                    found.append(f"{pid}:{fd}")
        except OSError:
            continue
    return found


@pytest.fixture(scope="module")
async def graph(cluster: LocalCluster) -> AsyncIterator[tuple[D.Graph, Path]]:
    criu_binary()  # a missing CRIU is a setup error, reported by name
    ctl = Path(tempfile.mkdtemp(prefix="dynsnap-ctl-"))
    g = await D.deploy(cluster, D.dgd("snap", [D.frontend_component(),
                                               D.mocker_component("worker", replicas=1, control_dir=str(ctl))]))
    try:
        yield g, ctl
    finally:
        await D.teardown(cluster, g)


async def _pinned_ok(fe: D.FrontendClient, wid: int, n: int = 3) -> list[str]:
    """Send n requests pinned to ``wid``; return their request ids (the worker logs them)."""
    ids = []
    for i in range(n):
        res = await fe.chat(f"pinned {i}", worker_id=wid)
        assert res.status == 200, res.body
        assert res.worker_id == wid
        ids.append(str(res.body["id"]).removeprefix("chatcmpl-"))
    return ids


async def test_mocker_under_entrypoint_is_dumped_and_restored_in_place(
    cluster: LocalCluster, graph: tuple[D.Graph, Path], tmp_path: Path
) -> None:
    g, ctl_dir = graph
    w = g.workers("worker")[0]
    ctl = EntrypointControl(ctl_dir)
    fe = D.FrontendClient(g.frontend)
    api = cluster.api
    try:
        await fe.wait_model()
        wid = await D.instance_id(cluster, w)
        await fe.wait_routable(wid)
        before_ids = await _pinned_ok(fe, wid)
        before_pod = await api.get(R.PODS, w.name, namespace=w.namespace)
        before_dwm = await api.get(R.DWMS, w.name, namespace=w.namespace)
        info = ctl.read()
        assert info["pid"] == 1 and info["state"] == "active" and info["seccomp"] == "on"
        worker_ns_pid = int(info["worker_pid"])
        worker_host_pid = w.sandbox.host_pid(worker_ns_pid)
        assert worker_host_pid is not None
        tree = _tree_host_pids(worker_host_pid)
        # The reservation held: every process of the worker tree is at or above the floor.
        assert all(_ns_pid(p) >= P.PID_FLOOR for p in tree)
        assert _io_uring_fds(tree) == []
        # Live TCP connections exist between the frontend and this worker (the request plane).
        established = Path(f"/proc/{worker_host_pid}/net/tcp").read_text().count(" 01 ")
        assert established > 0

        # Quiesce: the entrypoint's /health turns 503, so the pod leaves the EndpointSlice.
        await ctl.request(S.SUSPENDING)
        await cluster.wait_ready(w.namespace, w.name, ready=False, timeout=30)

        images = tmp_path / "images"
        dump = await criu_dump(w.sandbox, worker_ns_pid, images, tcp_established=True, timeout=120)
        assert (images / f"core-{worker_ns_pid}.img").exists()
        assert oct(images.stat().st_mode & 0o777) == "0o700"
        await ctl.request(S.SNAPSHOTTED)
        assert not os.path.exists(f"/proc/{worker_host_pid}") or _ns_pid(worker_host_pid) != worker_ns_pid
        # The pod's PID 1 is still there and answers for the sleeping worker.
        assert w.sandbox.alive()
        async with httpx.AsyncClient(timeout=3) as http:
            live = await http.get(f"http://{w.ip}:{P.ENTRYPOINT_PROBE_PORT}/live")
            health = await http.get(f"http://{w.ip}:{P.ENTRYPOINT_PROBE_PORT}/health")
        assert live.status_code == 200 and health.status_code == 503
        assert w.kubelet.restarts == 0

        await ctl.request(S.RESTORING)
        restore = await criu_restore(w.sandbox, images, tcp_established=True, timeout=120)
        assert restore.pid == worker_ns_pid
        after = await ctl.request(S.ACTIVE)
        assert after["worker_alive"] is True and int(after["worker_pid"]) == worker_ns_pid
        # Restored into the same pid namespace, reparented to the entrypoint.
        new_host_pid = w.sandbox.host_pid(worker_ns_pid)
        assert new_host_pid is not None
        assert _ns_pid(new_host_pid) == worker_ns_pid
        ppid = int(re.search(r"^PPid:\s+(\d+)", Path(f"/proc/{new_host_pid}/status").read_text(), re.M)
                   .group(1))  # type: ignore[union-attr]
        assert ppid == w.sandbox.pid

        await cluster.wait_ready(w.namespace, w.name, ready=True, timeout=60)
        # This was the model's only worker: while it slept the frontend dropped the model (404);
        # it comes back from the same EndpointSlice entry and DWM, with no re-registration.
        await fe.wait_model(timeout=60)
        await fe.wait_routable(wid)
        after_ids = await _pinned_ok(fe, wid, n=3)

        after_pod = await api.get(R.PODS, w.name, namespace=w.namespace)
        after_dwm = await api.get(R.DWMS, w.name, namespace=w.namespace)
        assert after_pod["metadata"]["uid"] == before_pod["metadata"]["uid"]
        assert after_pod["status"]["podIP"] == before_pod["status"]["podIP"]
        assert after_dwm["metadata"]["uid"] == before_dwm["metadata"]["uid"]
        assert D.instance_id_from_dwm(after_dwm) == wid
        assert w.kubelet.restarts == 0

        # The worker logs each request id; the entrypoint copies its log to its own stdout
        # (the container log), from before the dump and from the restored worker alike.
        async def logged_before_and_after() -> bool:
            text = re.sub(r"\x1b\[[0-9;]*m", "", w.sandbox.log_path.read_text(errors="replace"))  # colours
            return all(f"request_id={rid}" in text for rid in before_ids + after_ids)
        await wait_for("worker logs from before and after the restore on the entrypoint's stdout",
                       logged_before_and_after, timeout=30)
        print(f"criu dump {dump.seconds:.2f}s restore {restore.seconds:.2f}s")
    except BaseException:
        ep_lines = [ln for ln in w.sandbox.log_path.read_text(errors="replace").splitlines() if "entrypoint" in ln]
        print("ENTRYPOINT LOG:\n" + "\n".join(ep_lines[-30:]))
        print("CONTROL:", (ctl_dir / "entrypoint.json").read_text())
        raise
    finally:
        await fe.close()
