"""Pod sandboxes (dynsnap.testenv.sandbox) and CRIU in place (dynsnap.testenv.criu).

Real namespaces, veths, cgroups and CRIU; no control plane. The tests use their own
bridge and a /24 of their own so they never touch the session cluster's network.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from dynsnap.agent.criu import CriuOptions, NamespaceTarget, criu_dump, criu_restore
from dynsnap.models.ids import NsPid
from dynsnap.testenv.netns import run_command
from dynsnap.testenv.sandbox import PodSandbox, SandboxNetwork, remove_empty_cgroups

# Not the cluster's dsnbr0 / 10.213.0.0/16 pod CIDRs (10.213.1-2.0/24): the more
# specific /24 route wins on the host, so both can be up in one session.
BRIDGE = "dsntest0"
CIDR = "10.213.250.0/24"
UID = "0f0e0d0c-1111-4222-8333-444455556666"

# PID 1 of the CRIU sandboxes: a subreaper-like init that starts the worker in its
# own session with stdio opened inside the pod (as dynsnap-entrypoint does) and
# reaps whatever is reparented to it.
INIT = r"""
import os, subprocess, sys, time
out = open(sys.argv[1], "ab")
subprocess.Popen([sys.executable, "-c", sys.argv[2]], stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                 start_new_session=True, close_fds=True)
out.close()
while True:
    try:
        os.wait()
    except ChildProcessError:
        time.sleep(0.2)
"""
COUNTER = r"""
import time
i = 0
while True:
    print(i, flush=True)
    i += 1
    time.sleep(0.05)
"""
ECHO_SERVER = r"""
import socket, sys
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", 7000)); srv.listen(1)
print("listening", flush=True)
conn, _ = srv.accept()
while True:
    data = conn.recv(1024)
    if not data:
        break
    conn.sendall(b"echo:" + data)
"""


def _need_root() -> None:
    if os.geteuid() != 0:
        pytest.fail("the sandbox tests need root (network namespaces, cgroups, CRIU)")


@pytest.fixture(scope="module")
async def net() -> AsyncIterator[SandboxNetwork]:
    _need_root()
    n = SandboxNetwork(bridge=BRIDGE, cidr=CIDR)
    await n.up()
    try:
        yield n
    finally:
        await n.down()
        remove_empty_cgroups()


async def _wait(what: str, check: object, *, limit: float) -> None:
    assert callable(check)
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            if await check() if asyncio.iscoroutinefunction(check) else check():
                return
        except FileNotFoundError:  # a file the process has yet to create
            pass
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {limit} s waiting for {what}")


def _read(path: str | Path) -> str:
    return Path(path).read_text()


def _exists(path: str | Path) -> bool:
    return Path(path).exists()


def _status(pid: int, field: str) -> list[str]:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return line.split(":", 1)[1].split()
    raise AssertionError(f"no {field} in /proc/{pid}/status")


async def _netns_names() -> set[str]:
    res = await run_command(["ip", "netns", "list"], timeout=5)
    return {line.split(" ", 1)[0] for line in res.stdout.splitlines()}


async def _links() -> str:
    return (await run_command(["ip", "-o", "link", "show"], timeout=5)).stdout


async def test_http_server_reachable_at_pod_ip_with_pod_identity(net: SandboxNetwork, tmp_path: Path) -> None:
    ip = "10.213.250.10"
    env = {"POD_NAME": "web-0", "POD_NAMESPACE": "team-a", "POD_UID": UID}
    sb = await PodSandbox.start(
        net=net, name="web-0", namespace="team-a", uid=UID, pod_ip=ip,
        command=[sys.executable, "-m", "http.server", "--bind", ip, "8080"], env=env, workdir=tmp_path,
    )
    try:
        assert sb.alive()
        # PID 1 of its own pid namespace, under the pod's kubelet-style cgroup.
        assert _status(sb.pid, "NSpid")[-1] == "1"
        cgroups = _read(f"/proc/{sb.pid}/cgroup")
        assert f"/kubepods/besteffort/pod{UID}/" in cgroups
        assert any(line.startswith("0::") and f"pod{UID}" in line for line in cgroups.splitlines())
        # In a cgroup of its own in every v1 hierarchy but memory (the harness's limit), as under runc:
        # CRIU dumps and restores the subtree of each cgroup the tree is in, and a root one is the host's.
        by_hierarchy = {line.split(":", 2)[1]: line.split(":", 2)[2] for line in cgroups.splitlines()}
        outside = {h: path for h, path in by_hierarchy.items() if h not in ("", "memory") and f"/pod{UID}/" not in path}
        assert not outside, outside
        # As on a node: everything in the pod's cgroups is in the pod's pid namespace
        # (the launcher, like a runtime shim, is not in them).
        pidns = os.stat(f"/proc/{sb.pid}/ns/pid").st_ino
        for d in sb.cgroup_paths:
            members = [int(p) for p in _read(d / "cgroup.procs").split()]
            assert members == [sb.pid]
            assert all(os.stat(f"/proc/{p}/ns/pid").st_ino == pidns for p in members)
        # The pod env arrived at the container command.
        environ = dict(
            kv.split("=", 1) for kv in _read(f"/proc/{sb.pid}/environ").split("\0") if "=" in kv
        )
        assert {k: environ.get(k) for k in env} == env
        # Reachable from the host at the pod IP, through the bridge.
        async with httpx.AsyncClient(timeout=2.0, trust_env=False) as client:
            async def serving() -> bool:
                try:
                    return (await client.get(f"http://{ip}:8080/")).status_code == 200
                except httpx.HTTPError:
                    return False
            await _wait("the sandboxed HTTP server", serving, limit=15)
        # exec runs in the pod: its eth0 is the pod IP, its /proc is the pod's, and it gets the pod env.
        rc, out, _ = await sb.exec(["sh", "-c", 'ip -o -4 addr show eth0; echo "pod=$POD_NAME"; ls /proc'],
                                   timeout=10)
        assert rc == 0
        assert f"inet {ip}/24" in out and "pod=web-0" in out
        pids = {w for w in out.split() if w.isdigit()}
        assert "1" in pids and len(pids) < 10  # only the pod's processes are visible
        rc, out, _ = await sb.exec(["cat", "/proc/self/cgroup"], timeout=10)
        assert rc == 0 and out.count(f"pod{UID}") == len(sb.cgroup_paths)
        # The log is the container's stdout/stderr (http.server logs requests to stderr).
        await _wait("request log line", lambda: '"GET / HTTP/1.1" 200' in sb.log_path.read_text(), limit=5)
    finally:
        await sb.stop(grace=1)
    assert not sb.alive()


async def test_stop_leaves_nothing_behind(net: SandboxNetwork, tmp_path: Path) -> None:
    sb = await PodSandbox.start(
        net=net, name="sleeper", namespace="team-a", uid=UID, pod_ip="10.213.250.11",
        command=["sh", "-c", "sleep 1000 & sleep 1000"], env={}, workdir=tmp_path,
    )
    try:
        children = f"/proc/{sb.pid}/task/{sb.pid}/children"
        await _wait("PID 1 to fork its sleepers", lambda: len(_read(children).split()) >= 2, limit=10)
        host_pids = [sb.pid, *map(int, _read(children).split())]
        assert sb.netns in await _netns_names()
        veth = net.veth_name(sb.netns)
        assert veth in await _links()
    finally:
        rc = await sb.stop(grace=0.5)
    assert rc == 137  # sh as PID 1 ignores SIGTERM: killed after the grace period
    for pid in host_pids:
        assert not _exists(f"/proc/{pid}"), f"pid {pid} survived stop()"
    assert sb.netns not in await _netns_names()
    assert veth not in await _links()
    for d in sb.cgroup_paths:
        assert not _exists(d) and not _exists(d.parent), f"cgroup {d} left behind"
    assert not _exists(f"/etc/netns/{sb.netns}")
    assert await sb.stop() == rc  # idempotent


async def test_network_down_stops_pods_a_test_left_running(tmp_path: Path) -> None:
    _need_root()
    n = SandboxNetwork(bridge="dsntest2", cidr="10.213.252.0/24")
    await n.up()
    try:
        sb = await PodSandbox.start(
            net=n, name="orphan", namespace="team-a", uid=UID, pod_ip="10.213.252.5",
            command=["sleep", "1000"], env={}, workdir=tmp_path,
        )
        pid = sb.pid
    finally:
        await n.down()
    assert not _exists(f"/proc/{pid}")
    assert sb.netns not in await _netns_names()
    assert not any(_exists(d) for d in sb.cgroup_paths)
    assert "dsntest2" not in await _links()


async def test_up_removes_what_a_crashed_run_left(tmp_path: Path) -> None:
    _need_root()
    n = SandboxNetwork(bridge="dsntest1", cidr="10.213.251.0/24")
    await n.up()
    stale = n.netns_name(namespace="x", name="y", uid=UID)
    await n.attach(stale, "10.213.251.20")
    fresh = SandboxNetwork(bridge="dsntest1", cidr="10.213.251.0/24")  # a new session
    await fresh.up()
    try:
        assert stale not in await _netns_names()
    finally:
        await fresh.down()
    assert "dsntest1" not in await _links()


async def _start_init(net: SandboxNetwork, tmp_path: Path, name: str, ip: str, program: str) -> PodSandbox:
    out = tmp_path / "worker.out"
    init = tmp_path / "init.py"
    init.write_text(INIT)
    return await PodSandbox.start(
        net=net, name=name, namespace="team-a", uid=UID, pod_ip=ip,
        command=[sys.executable, str(init), str(out), program], env={"POD_NAME": name}, workdir=tmp_path,
    )


def _criu(*, tcp: bool = True) -> CriuOptions:
    """CRIU as the agent runs it (binary from ./run setup); a clear error when it is not built."""
    binary = os.environ.get("DYNSNAP_CRIU", "")
    if not os.access(binary, os.X_OK):
        pytest.fail("CRIU not built: DYNSNAP_CRIU is unset or not executable; run ./run setup")
    return CriuOptions(binary=binary, tcp_established=tcp, network_lock="nftables" if tcp else None)


def _numbers(path: Path) -> list[int]:
    return [int(x) for x in path.read_text().split()]


async def test_criu_dump_and_restore_in_place(net: SandboxNetwork, tmp_path: Path) -> None:
    sb = await _start_init(net, tmp_path, "counter", "10.213.250.12", COUNTER)
    out = tmp_path / "worker.out"
    try:
        await _wait("the counter's first lines", lambda: len(_numbers(out)) > 5, limit=10)
        worker = sb.host_pid(2)
        assert worker is not None
        assert _status(worker, "NSpid")[-1] == "2"
        pidns = os.stat(f"/proc/{sb.pid}/ns/pid").st_ino
        netns = os.stat(f"/proc/{sb.pid}/ns/net").st_ino

        images = tmp_path / "images"
        dumped = await criu_dump(NamespaceTarget(sb.pid), NsPid(2), images, opts=_criu(tcp=False), timeout=60)
        assert images.stat().st_mode & 0o777 == 0o700
        assert (images / "core-2.img").exists()
        await _wait("the dumped worker to be gone", lambda: sb.host_pid(2) is None, limit=5)
        last = _numbers(out)[-1]
        await asyncio.sleep(0.3)
        assert _numbers(out)[-1] == last, "the counter ran on after its dump"
        assert sb.alive()

        restored = await criu_restore(NamespaceTarget(sb.pid), images, opts=_criu(tcp=False), timeout=60)
        assert restored.pid == dumped.pid == 2
        host = sb.host_pid(2)
        assert host is not None
        # Same pid and network namespace, reparented to the sandbox's PID 1, same pod cgroup.
        assert os.stat(f"/proc/{host}/ns/pid").st_ino == pidns
        assert os.stat(f"/proc/{host}/ns/net").st_ino == netns
        assert _status(host, "PPid") == [str(sb.pid)]
        assert f"pod{UID}" in _read(f"/proc/{host}/cgroup")
        # It continues counting from where it stopped, not from 0.
        await _wait("the restored counter to count on", lambda: _numbers(out)[-1] > last + 5, limit=10)
        nums = _numbers(out)
        i = nums.index(last)
        assert nums[i + 1] == last + 1 and nums[: i + 1] == list(range(last + 1))
    finally:
        await sb.stop(grace=0.5)


async def test_criu_restores_established_tcp_connection(net: SandboxNetwork, tmp_path: Path) -> None:
    ip = "10.213.250.13"
    sb = await _start_init(net, tmp_path, "echo", ip, ECHO_SERVER)
    out = tmp_path / "worker.out"
    try:
        await _wait("the echo server", lambda: "listening" in out.read_text(), limit=10)
        loop = asyncio.get_running_loop()
        conn = socket.create_connection((ip, 7000), timeout=5)
        try:
            await loop.run_in_executor(None, conn.sendall, b"one")
            assert await loop.run_in_executor(None, conn.recv, 64) == b"echo:one"
            images = tmp_path / "images"
            await criu_dump(NamespaceTarget(sb.pid), NsPid(2), images, opts=_criu(), timeout=60)
            await criu_restore(NamespaceTarget(sb.pid), images, opts=_criu(), timeout=60)
            # The very same host-side connection keeps working with the restored server.
            await loop.run_in_executor(None, conn.sendall, b"two")
            assert await loop.run_in_executor(None, conn.recv, 64) == b"echo:two"
        finally:
            conn.close()
    finally:
        await sb.stop(grace=0.5)


def _need_env(*names: str) -> dict[str, str]:
    missing = [n for n in names if not os.environ.get(n)]
    if missing:
        pytest.fail(f"{', '.join(missing)} unset: use ./run test (./run setup builds and exports them)")
    return {n: os.environ[n] for n in names}


def _request_state(control: Path, seq: int, state: str) -> None:
    """What the agent does: ask dynsnap-entrypoint for a state (temp file + rename)."""
    tmp = control / "state-request.tmp"
    tmp.write_text(f"{seq} {state}\n")
    tmp.rename(control / "state-request")


async def test_criu_live_dynamo_mocker_in_place(net: SandboxNetwork, tmp_path: Path) -> None:
    """The CRIU flags the agent needs, on a real Dynamo worker with live TCP to its frontend.

    File discovery here (no control plane): the restore follows the dump at once,
    well inside the file backend's lease. The cluster suite does the same with
    Kubernetes discovery and a real suspend.
    """
    e = _need_env("DYNSNAP_DYNAMO_PYTHON", "DYNSNAP_MODEL_DIR", "DYNSNAP_NATIVE_BIN")
    py, model = e["DYNSNAP_DYNAMO_PYTHON"], e["DYNSNAP_MODEL_DIR"]
    entrypoint = Path(e["DYNSNAP_NATIVE_BIN"]) / "dynsnap-entrypoint"
    kv, control = tmp_path / "kv", tmp_path / "control"
    kv.mkdir()
    control.mkdir()
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/root",
        "DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(kv),
        "DYN_SYSTEM_PORT": "9090", "DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS": '["generate"]',
    }
    fe_ip, wk_ip = "10.213.250.20", "10.213.250.21"
    fe = await PodSandbox.start(
        net=net, name="frontend", namespace="team-a", uid=UID.replace("0f", "f1"), pod_ip=fe_ip,
        command=[py, "-m", "dynamo.frontend", "--http-port", "8000"], env=env, workdir=tmp_path / "fe",
    )
    wk: PodSandbox | None = None
    try:
        wk = await PodSandbox.start(
            net=net, name="worker-0", namespace="team-a", uid=UID.replace("0f", "f2"), pod_ip=wk_ip,
            command=[str(entrypoint), "--control-dir", str(control), "--", py, "-m", "dynamo.mocker",
                     "--model-path", model, "--model-name", "tiny", "--speedup-ratio", "0"],
            env=env, workdir=tmp_path / "wk",
        )
        url = f"http://{fe_ip}:8000"
        async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
            async def model_listed() -> bool:
                try:
                    return "tiny" in (await client.get(f"{url}/v1/models")).text
                except httpx.HTTPError:
                    return False
            await _wait("the frontend to list the mocker's model", model_listed, limit=90)

            async def chat(pin: int | None) -> tuple[int, dict[str, object]]:
                headers = {"x-dynamo-worker-instance-id": str(pin)} if pin is not None else {}
                body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 4,
                        "nvext": {"extra_fields": ["worker_id"]}}
                r = await client.post(f"{url}/v1/chat/completions", headers=headers, json=body)
                return r.status_code, r.json()

            code, body = await chat(None)
            assert code == 200, body
            nvext = body["nvext"]
            assert isinstance(nvext, dict)
            worker_id = int(nvext["worker_id"]["decode_worker_id"])

            info = json.loads(_read(control / "entrypoint.json"))
            assert info["seccomp"] == "on", "io_uring must be refused to the worker for CRIU"
            wpid = int(info["worker_pid"])
            # The entrypoint must have taken the request before the dump, or it exits with its worker.
            _request_state(control, 1, "suspending")
            await _wait("the entrypoint to take the suspending request",
                        lambda: json.loads(_read(control / "entrypoint.json"))["state"] == "suspending",
                        limit=10)
            images = tmp_path / "images"
            await criu_dump(NamespaceTarget(wk.pid), NsPid(wpid), images, opts=_criu(), timeout=60)
            assert wk.host_pid(wpid) is None
            _request_state(control, 2, "restoring")
            restored = await criu_restore(NamespaceTarget(wk.pid), images, opts=_criu(), timeout=60)
            assert restored.pid == wpid
            _request_state(control, 3, "active")
            for _ in range(3):
                code, body = await chat(worker_id)
                assert code == 200, body
                nvext = body["nvext"]
                assert isinstance(nvext, dict)
                assert int(nvext["worker_id"]["decode_worker_id"]) == worker_id
    finally:
        if wk is not None:
            await wk.stop(grace=2)
        await fe.stop(grace=2)
