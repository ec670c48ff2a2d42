"""The node agent under failing parts, on the real node (kubelet, containerd, runc; dynsnap installed by
``helm install``: realnodeenv.py), moved from the sandbox suite test_agent_faults.py: the CUDA helper
hanging past its bound, a GPU lock that never comes back, a debugger attached to the worker (CRIU
cannot seize a traced task), and a restore whose pid a squatter took in the container's pid
namespace. Each fault is caused for real (the stub driver holding its call as a wedged
driver would; a real ptrace attach from the node), asserted by the Reason and the error text the
chart's agent reports for it, and ends with the worker rolled back and running in its own container
(every GPU process running in the driver, no helper left), then captured once the fault is gone and
woken in place, verified by pinned requests: the same container, never restarted.

The module's install is the package's with the agent's bounds short (a ``helm upgrade``, undone after):
``agent.helperTimeout`` 3 s, ``agent.lockTimeoutMs`` 1000, ``agent.failureBackoff`` 1 s. Each test
deploys examples/dgd/agg.yaml (two workers; idle-after 10m, so only the override on the pod acts) and
asks one worker to sleep as ``dynsnap suspend`` does.
"""

from __future__ import annotations

import copy
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from controllerenv import asleep, cond, get_ws, verified_after
from faultsenv import (
    LAUNCHER,
    debugger_attached,
    error_is,
    fd_holder,
    io_uring_fds,
    io_uring_maps,
    maps_cuda,
    occupy_ns_pid,
    stub_calls,
)
from realnodecycle import back_after_refusal, override, pinned, proven, same_pod, wait_ws
from realnodeenv import TWO_GPU_PROCESSES, WORKER_COMPONENT, Env, deployed, host_dir_mounted, launched_by, upgrade
from realnodefacts import container_pid, container_procs, control_file, kubelet_facts, stub_state

from dynsnap.k8s.client import Obj
from dynsnap.models import protocol as P
from dynsnap.runtime import procfs
from dynsnap.testenv import chart_node
from dynsnap.testenv.cluster import wait_for
from dynsnap.testenv.real_graph import NodePod

pytestmark = pytest.mark.cluster

BOUNDS = {"helperTimeout": 3, "lockTimeoutMs": 1000, "failureBackoff": 1}
RUNNING = 0  # the stub driver's state of a process that runs
BUDGET = 4 << 20  # bytes: far below any worker's capture estimate
# A launcher that leaves a GPU process behind (``sleep``, mapping the stub driver through LD_PRELOAD as
# every process of the container does), started in a subshell that exits, so reparented to the entrypoint:
# outside the worker's tree, as a daemon an engine's wrapper script starts before exec'ing the engine.
GPU_DAEMON = '(sleep infinity &); exec "$@"'
HOLDER = "dynsnap-faults-holder"  # the abstract socket of the io_uring test's fd holder
FAULTS_VOLUME = "faults-launcher"
FULL_INODES = 16  # a tmpfs with room for bytes but this many inodes: CRIU's images run out of them mid-dump


@pytest.fixture(scope="module")
async def bounded(env: Env) -> AsyncIterator[Env]:
    """The package's install with the agent's bounds short (BOUNDS), by ``helm upgrade``; undone after."""
    before = copy.deepcopy(env.values)
    values = copy.deepcopy(before)
    values["agent"] = {**values.get("agent", {}), **BOUNDS}
    await upgrade(env, values)
    try:
        yield env
    finally:
        env.driver.clear_faults()
        await upgrade(env, before)




@pytest.fixture
async def budgeted(bounded: Env) -> AsyncIterator[Env]:
    """The module's install with the agent's image budget at 4 MiB (``agent.imagesBudgetBytes``, a
    ``helm upgrade``), undone after."""
    before = copy.deepcopy(bounded.values)
    values = copy.deepcopy(before)
    values["agent"] = {**values.get("agent", {}), "imagesBudgetBytes": BUDGET}
    await upgrade(bounded, values)
    try:
        yield bounded
    finally:
        await upgrade(bounded, before)


def graph(env: Env, name: str, tier: str, launcher: str | None = None) -> Obj:
    body = chart_node.example_body(env, name=name, worker_replicas=2, policy={"dynsnap.io/tier": tier})
    return body if launcher is None else launched_by(body, launcher)


@pytest.fixture(scope="module")
def faults_launcher(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """faults_launcher.py in a directory of the node the worker's user can read (a hostPath volume)."""
    d = tmp_path_factory.mktemp("faults-launcher")
    d.chmod(0o755)
    (d / LAUNCHER.name).write_bytes(LAUNCHER.read_bytes())
    (d / LAUNCHER.name).chmod(0o644)
    return d / LAUNCHER.name


def holder_graph(env: Env, name: str, launcher: Path) -> Obj:
    """The example's graph (tier snapshot) whose worker is started by faults_launcher.py with an fd
    holder (mounted read-only from the node at the same path), then the mocker as the container's args.
    The worker container also has SYS_PTRACE, as a pod that lets a profiler (py-spy) attach does: the
    runtime's default seccomp profile (containerd's) refuses pidfd_getfd(2) to a container without it
    (EPERM), so only such a container's processes can take a descriptor from another process."""
    body = graph(env, name, "snapshot", f'exec python3 {launcher} --fd-holder {HOLDER} -- "$@"')
    main = host_dir_mounted(body, FAULTS_VOLUME, launcher.parent)
    main.setdefault("securityContext", {}).setdefault("capabilities", {}).setdefault("add", []).append("SYS_PTRACE")
    return body


def gpu_processes(w: NodePod, container_id: str) -> list[int]:
    """Host pids of the container's processes that map the (stub) CUDA driver, but its PID 1."""
    return sorted(p for p in container_procs(w.uid, container_id).tree if maps_cuda(p))


def degraded(ws: Obj, reason: str) -> None:
    c = cond(ws, "Degraded")
    assert c is not None and c["status"] == "True" and c["reason"] == reason, c


def helpers_on_node() -> list[str]:
    """dynsnap-cuda processes anywhere on the node (the shared install runs no other capture meanwhile)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if os.path.basename(os.readlink(d / "exe")) == "dynsnap-cuda":
                    argv = (d / "cmdline").read_bytes().split(b"\0")
                    out.append(f"{d.name} {b' '.join(argv).decode(errors='replace')}")
            except OSError:
                continue
    return out


def no_image_of(env: Env, w: NodePod) -> bool:
    """No directory of the worker's pod under the node's images root holds anything."""
    images = env.paths.images
    return not [p for p in images.iterdir() if w.uid in p.name and any(p.iterdir())] if images.is_dir() else True


def images_dir_of(env: Env, w: NodePod) -> Path:
    """The worker pod's directory under the node's images root (the agent's images.pod_dir)."""
    return env.paths.images / f"{w.namespace}_{w.name}_{w.uid}"


async def active_again(env: Env, w: NodePod) -> None:
    """After ``dynsnap wake`` of a worker whose capture failed: Active wanted and reported, no helper
    running (so no retry runs while the test looks at the node)."""
    await wait_ws(env, w, "Active wanted and reported", lambda o: bool(
        o and o["spec"]["desiredState"] == "Active" and o["status"].get("state") == "Active"
        and not helpers_on_node()), timeout=120)


async def worker_gpu_pid(env: Env, w: NodePod) -> int:
    """The host pid of the worker's GPU process: the worker tree's root in its container."""
    return container_procs(w.uid, (await kubelet_facts(env.api, w)).container_id).root


async def rolled_back(env: Env, w: NodePod, gpu: int, reason: str) -> Obj:
    """Active again while the failure is on record: the worker's GPU process running in the driver (the
    same process), no helper left running."""
    async def back() -> Obj | None:
        ws = await get_ws(env.api, w)
        st = (ws or {}).get("status") or {}
        if st.get("state") != "Active" or (st.get("lastError") or {}).get("reason") != reason:
            return None
        if stub_state(env.driver, gpu) != RUNNING or helpers_on_node():
            return None
        return ws
    found: Obj = await wait_for(f"{w.name} rolled back to Active", back, timeout=120, interval=0.2)
    return found


async def captured_then_woken(env: Env, w: NodePod, tier: str, driver_calls: int) -> None:
    """Once the fault is gone the agent's next attempt captures the worker; woken in place, verified."""
    slept = await wait_ws(env, w, f"asleep ({tier}) once the fault is gone", asleep)
    assert slept["status"]["lastCapture"]["ok"] is True and "lastError" not in slept["status"], slept["status"]
    steps = [s["name"] for s in slept["status"]["lastCapture"]["steps"]]
    if tier == "suspend":
        assert steps == ["quiesce", "save", "settle-suspended"], steps
    else:
        assert steps[:3] == ["quiesce", "save", "dump"] and steps[-1] == "settle-snapshotted", steps
    assert slept["status"].get("consecutiveFailures", 0) == 0
    assert len(env.driver.calls()) > driver_calls
    before = (slept["status"].get("lastWake") or {}).get("id")
    await override(env, w, "active")
    woken = await wait_ws(env, w, "woken and verified", verified_after(before))
    await proven(env, w, woken, tier)


async def test_helper_hanging_past_its_bound_is_killed_rolled_back_and_retried(bounded: Env) -> None:
    """The driver's checkpoint hangs longer than the agent's helperTimeout (3 s): the agent kills
    dynsnap-cuda, reports HelperTimeout, brings the GPU process back to running and the worker back Active
    while the backoff lasts; once the driver answers again, a later attempt captures the worker."""
    env = bounded
    async with deployed(env, graph(env, "flt-helper", "suspend")) as g:
        w = g.workers(WORKER_COMPONENT)[1]
        first = await kubelet_facts(env.api, w)
        gpu = await worker_gpu_pid(env, w)
        mark = len(env.driver.calls())
        env.driver.control("hang cuCheckpointProcessCheckpoint * 30000")
        try:
            await override(env, w, "suspended")
            ws = await wait_ws(env, w, "HelperTimeout", error_is("HelperTimeout", step="save"), timeout=120)
            err = ws["status"]["lastError"]
            assert "dynsnap-cuda --action save" in err["message"], err
            assert "no exit within 3.0 s; killed" in err["message"], err
            degraded(ws, "HelperTimeout")
            ws = await rolled_back(env, w, gpu, "HelperTimeout")
            degraded(ws, "HelperTimeout")
            # Locked by the killed save, unlocked by the rollback.
            calls = env.driver.calls()[mark:]
            assert [c for c in calls if c.startswith("cuCheckpointProcessLock ") and c.endswith("rc=0")], calls
            assert [c for c in calls if c.startswith("cuCheckpointProcessUnlock ") and c.endswith("rc=0")], calls
        finally:
            mark = len(env.driver.calls())
            env.driver.clear_faults()
        await captured_then_woken(env, w, "suspend", mark)
        await same_pod(env, w, first)
        assert await worker_gpu_pid(env, w) == gpu, "the same worker process (tier suspend keeps it)"


async def test_lock_that_never_comes_back_fails_the_capture_and_the_worker_serves(bounded: Env) -> None:
    """The GPU process's lock does not come back within the agent's lockTimeoutMs (1000; the driver
    answers CUDA_ERROR_NOT_READY): CheckpointFailed with the driver's error, nothing checkpointed, the
    worker back in service; captured once the lock comes back."""
    env = bounded
    async with deployed(env, graph(env, "flt-lock", "suspend")) as g:
        w = g.workers(WORKER_COMPONENT)[1]
        first = await kubelet_facts(env.api, w)
        gpu = await worker_gpu_pid(env, w)
        mark = len(env.driver.calls())
        env.driver.control("hang cuCheckpointProcessLock * 30000")
        try:
            await override(env, w, "suspended")
            ws = await wait_ws(env, w, "CheckpointFailed", error_is("CheckpointFailed", step="save"), timeout=120)
            assert "CUDA_ERROR_NOT_READY" in ws["status"]["lastError"]["message"], ws["status"]["lastError"]
            degraded(ws, "CheckpointFailed")
            calls = env.driver.calls()[mark:]
            locks = [c for c in calls if c.startswith("cuCheckpointProcessLock ")]
            assert locks and all(c.endswith("timeout=1000 rc=600") for c in locks), locks
            assert not [c for c in calls if c.startswith("cuCheckpointProcessCheckpoint ")], \
                "nothing is checkpointed without the lock"
            await rolled_back(env, w, gpu, "CheckpointFailed")
        finally:
            mark = len(env.driver.calls())
            env.driver.clear_faults()
        await captured_then_woken(env, w, "suspend", mark)
        await same_pod(env, w, first)


async def test_a_lock_that_never_comes_back_for_one_of_two_gpu_processes_unlocks_the_other(bounded: Env) -> None:
    """Two GPU processes in the worker tree, the second's lock never coming back (CUDA_ERROR_NOT_READY
    after lockTimeoutMs): CheckpointFailed, the first process's lock taken before it rolled back
    (unlocked), nothing checkpointed, both running in the driver again; captured once the lock comes
    back and woken in place, the same two processes."""
    env = bounded
    async with deployed(env, graph(env, "flt-lock2", "suspend", TWO_GPU_PROCESSES)) as g:
        w = g.workers(WORKER_COMPONENT)[1]
        first = await kubelet_facts(env.api, w)
        gpu = gpu_processes(w, first.container_id)
        assert len(gpu) == 2 and container_procs(w.uid, first.container_id).root == gpu[0], gpu
        one, two = gpu  # the helper locks them in this order
        checkpoints = len(stub_calls(env.driver, "cuCheckpointProcessCheckpoint", one))
        env.driver.control(f"hang cuCheckpointProcessLock {two} 30000")
        try:
            await override(env, w, "suspended")
            ws = await wait_ws(env, w, "CheckpointFailed", error_is("CheckpointFailed", step="save"), timeout=120)
            assert "CUDA_ERROR_NOT_READY" in ws["status"]["lastError"]["message"], ws["status"]["lastError"]
            degraded(ws, "CheckpointFailed")
            assert stub_calls(env.driver, "cuCheckpointProcessLock", one)[-1].endswith("timeout=1000 rc=0")
            assert stub_calls(env.driver, "cuCheckpointProcessLock", two)[-1].endswith("timeout=1000 rc=600")
            assert stub_calls(env.driver, "cuCheckpointProcessUnlock", one)[-1].endswith("rc=0"), \
                "the lock taken before the one that timed out was rolled back"
            assert len(stub_calls(env.driver, "cuCheckpointProcessCheckpoint", one)) == checkpoints, \
                "nothing was checkpointed"
            await rolled_back(env, w, one, "CheckpointFailed")
            assert stub_state(env.driver, two) == RUNNING
        finally:
            mark = len(env.driver.calls())
            env.driver.clear_faults()
        await captured_then_woken(env, w, "suspend", mark)
        await same_pod(env, w, first)
        assert gpu_processes(w, first.container_id) == gpu, "the same two processes (tier suspend keeps them)"


async def test_criu_cannot_dump_a_traced_worker_and_the_worker_is_rolled_back(bounded: Env) -> None:
    """A debugger attached to the worker from the node (PTRACE_SEIZE, as gdb or py-spy attach): CRIU,
    in the container's namespaces, cannot seize a traced task. The dump fails (DumpFailed, CRIU's own
    message naming the worker's pid in its namespace), CRIU leaves the tree running, the agent brings
    the GPU process back and the worker back Active, the same process; once the debugger detaches the
    capture goes through and the worker wakes in place."""
    env = bounded
    async with deployed(env, graph(env, "flt-traced", "snapshot")) as g:
        w = g.workers(WORKER_COMPONENT)[1]
        first = await kubelet_facts(env.api, w)
        root = await worker_gpu_pid(env, w)
        ns_pid = int(next(line.split()[-1] for line in Path(f"/proc/{root}/status").read_text().splitlines()
                          if line.startswith("NSpid:")))
        async with debugger_attached(root) as tracer:
            assert f"TracerPid:\t{tracer}" in Path(f"/proc/{root}/status").read_text()
            await override(env, w, "suspended")
            ws = await wait_ws(env, w, "DumpFailed", error_is("DumpFailed", step="dump"), timeout=120)
            err = ws["status"]["lastError"]
            assert "CRIU dump failed" in err["message"], err
            assert re.search(rf"Unable to interrupt task: {ns_pid} \(Operation not permitted\)", err["message"]), err
            degraded(ws, "DumpFailed")
            await rolled_back(env, w, root, "DumpFailed")
            assert Path(f"/proc/{root}").exists(), "CRIU left the tree running: the same worker process"
            mark = len(env.driver.calls())
        await captured_then_woken(env, w, "snapshot", mark)
        await same_pod(env, w, first)


@pytest.mark.parametrize("which", ["root", "other"])
async def test_restore_whose_pid_is_taken_is_refused_then_succeeds_once_it_is_free(bounded: Env, which: str) -> None:
    """A pid of a snapshot's tree taken in the container's pid namespace while it sleeps, as any process
    entering the namespace may land on it: the worker's own (``root``: a squatter there is not the
    worker, though it is the entrypoint's child at the worker's pid), or another process of the dumped
    tree (``other``: the worker's second GPU process, TWO_GPU_PROCESSES). The agent refuses the restore
    (PidsInUse, naming the pid and what holds it), calls no CRIU, keeps the images and never settles a
    squatter as woken; once the pid is free the next attempt restores the worker, verified, in the same
    container."""
    env = bounded
    launcher = TWO_GPU_PROCESSES if which == "other" else None
    async with deployed(env, graph(env, f"flt-pids-{which}", "snapshot", launcher)) as g:
        w = g.workers(WORKER_COMPONENT)[1]
        first = await kubelet_facts(env.api, w)
        await override(env, w, "suspended")
        slept = await wait_ws(env, w, "asleep (snapshot)", asleep)
        image = Path(slept["status"]["image"]["path"])
        manifest = json.loads((image / P.MANIFEST_FILE).read_text())
        root = manifest["rootNsPid"]
        target = root if which == "root" else max(p["ns"] for p in manifest["pids"] if p["ns"] != root)
        ep = container_procs(w.uid, first.container_id).entrypoint
        sleeper = occupy_ns_pid(ep, target)  # the node's /proc: a container's /proc/sys is read-only
        try:
            before = (slept["status"].get("lastWake") or {}).get("id")
            await override(env, w, "active")
            ws = await wait_ws(env, w, "PidsInUse", error_is("PidsInUse", step="restore"), timeout=60)
            err = ws["status"]["lastError"]
            assert f"the capture's pids are taken in the pod's namespace: ['{target}:sleep']" in err["message"], err
            degraded(ws, "PidsInUse")
            assert ws["status"]["state"] == "Waking", ws["status"]
            # Still restoring. On the root's pid the entrypoint sees a child of its own at the worker's
            # pid and says it is alive; the agent knows better (the dumped worker's command line) and
            # never settles it. On another pid the entrypoint sees no worker at all.
            info = control_file(ep)
            assert info["state"] == "restoring" and info["worker_alive"] is (which == "root"), info
            assert (image / P.MANIFEST_FILE).is_file(), "the images are kept"
            assert not (image / "restore.log").exists(), "CRIU was not called"
        finally:
            os.kill(sleeper, signal.SIGKILL)
        woken = await wait_ws(env, w, "woken once the pid is free, verified", verified_after(before))
        wake = await proven(env, w, woken, "snapshot")
        assert "restore" in [s["name"] for s in wake["steps"]], wake
        assert "lastError" not in woken["status"], woken["status"]
        await same_pod(env, w, first)


async def test_a_capture_over_the_disk_budget_is_refused_before_it_starts(budgeted: Env) -> None:
    """The agent's image budget (``agent.imagesBudgetBytes``, 4 MiB here) below the capture's estimate:
    refused before any change (``DiskBudgetExceeded`` at the quiesce step, the estimate, the node's use
    and the budget named), no lock asked of the driver, no image of the worker written; a refusal for
    good, so the controller puts the worker back into serving at once, verified, the same container."""
    env = budgeted
    async with deployed(env, graph(env, "flt-budget", "snapshot")) as g:
        w = g.workers(WORKER_COMPONENT)[1]
        first = await kubelet_facts(env.api, w)
        gpu = await worker_gpu_pid(env, w)
        locks = len(stub_calls(env.driver, "cuCheckpointProcessLock", gpu))
        await override(env, w, "suspended")
        ws = await wait_ws(env, w, "DiskBudgetExceeded", error_is("DiskBudgetExceeded", step="quiesce"), timeout=120)
        err = ws["status"]["lastError"]
        assert re.search(r"capture estimated at \d+ MiB; images on this node use \d+ MiB of a 4 MiB budget",
                         err["message"]), err
        degraded(ws, "DiskBudgetExceeded")
        cap = ws["status"]["lastCapture"]
        assert cap["ok"] is False and [s["name"] for s in cap["steps"]] == ["quiesce"], cap
        assert len(stub_calls(env.driver, "cuCheckpointProcessLock", gpu)) == locks, "the driver was asked to lock"
        assert stub_state(env.driver, gpu) == RUNNING
        assert no_image_of(env, w)
        await wait_ws(env, w, "back in serving, verified", back_after_refusal("DiskBudgetExceeded"), timeout=120)
        await pinned(env, w, prompt="under budget")
        await same_pod(env, w, first)
        assert await worker_gpu_pid(env, w) == gpu, "the same worker process"
        await override(env, w, None)


# Run in a child process of its own (one thread: setns(2) of a mount namespace needs it): enters the mount
# namespace of the process argv[1], then mounts a tmpfs at argv[2] with the options argv[3], or (argv[3]
# "-") detaches what is mounted there. ctypes: no program of the container's is run.
_MOUNT_IN = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
fd = os.open(f"/proc/{sys.argv[1]}/ns/mnt", os.O_RDONLY)
if libc.setns(fd, 0x00020000) != 0:  # CLONE_NEWNS
    sys.exit(f"setns: {os.strerror(ctypes.get_errno())}")
path, opts = sys.argv[2].encode(), sys.argv[3]
if opts == "-":
    rc = libc.umount2(path, 2)  # MNT_DETACH
else:
    rc = libc.mount(b"dynsnap-disk-full", path, b"tmpfs", 0, opts.encode())
if rc != 0:
    sys.exit(f"{'umount' if opts == '-' else 'mount'} {sys.argv[2]}: {os.strerror(ctypes.get_errno())}")
"""


def mount_in(pid: int, path: Path, options: str) -> None:
    """A tmpfs at ``path`` in the mount namespace of ``pid`` (``options`` "-": detached from there)."""
    res = subprocess.run([sys.executable, "-c", _MOUNT_IN, str(pid), str(path), options], capture_output=True,
                         text=True, timeout=30, check=False)
    assert res.returncode == 0, res.stderr


async def test_a_disk_full_mid_dump_fails_with_enospc_and_the_worker_is_rolled_back(bounded: Env) -> None:
    """The worker's images directory, as the chart's agent sees it, runs out of space in the middle of
    CRIU's dump (a tmpfs with room for the bytes but 16 inodes, mounted there in the agent container's
    mount namespace: ENOSPC as a full disk gives it; the capture's estimate fits the node's budget).
    DiskFull with CRIU's own ENOSPC, CRIU leaves the tree running and the agent brings the GPU process
    back, the worker Active (the same process); the staging directory removed, never reused. Once the
    disk has room the capture goes through and the worker wakes in place, verified."""
    env = bounded
    async with deployed(env, graph(env, "flt-disk", "snapshot")) as g:
        w = g.workers(WORKER_COMPONENT)[1]
        first = await kubelet_facts(env.api, w)
        gpu = await worker_gpu_pid(env, w)
        (agent,) = await env.chart_pods("agent")
        agent_pid = container_pid(agent, "agent")
        pod_dir = images_dir_of(env, w)
        pod_dir.mkdir(mode=0o700, exist_ok=True)
        seen = Path(f"/proc/{agent_pid}/root") / str(pod_dir).lstrip("/")  # the agent's view of it
        mount_in(agent_pid, pod_dir, f"size=1g,nr_inodes={FULL_INODES},mode=0700")
        mounted = True
        try:
            assert os.statvfs(seen).f_files == FULL_INODES, "the agent sees the small tmpfs there"
            await override(env, w, "suspended")
            ws = await wait_ws(env, w, "DiskFull", error_is("DiskFull", step="dump"), timeout=120)
            err = ws["status"]["lastError"]
            assert "CRIU dump failed (no_space)" in err["message"], err
            assert "No space left on device" in err["message"], err
            degraded(ws, "DiskFull")
            await rolled_back(env, w, gpu, "DiskFull")
            # Active wanted again (`dynsnap wake`: the planner counts a capturing worker asleep, so only the
            # override calls the capture off): no retry while the staging directory is looked at.
            await override(env, w, "active")
            await active_again(env, w)
            assert not [n for n in os.listdir(seen) if n.startswith(P.STAGING_PREFIX)], os.listdir(seen)
            assert os.statvfs(seen).f_ffree > 0, "the failed dump's files are gone"
            assert Path(f"/proc/{gpu}").exists() and stub_state(env.driver, gpu) == RUNNING, "the same process"
            mount_in(agent_pid, pod_dir, "-")
            mounted = False
            assert os.statvfs(seen).f_files != FULL_INODES
            mark = len(env.driver.calls())
            await override(env, w, "suspended")
        finally:
            if mounted:
                mount_in(agent_pid, pod_dir, "-")
        await captured_then_woken(env, w, "snapshot", mark)
        await same_pod(env, w, first)


async def test_a_gpu_process_outside_the_worker_tree_is_refused_before_any_change(bounded: Env) -> None:
    """A GPU process of the container outside the worker's tree (GPU_DAEMON): CRIU would dump the tree
    without it, so the snapshot is refused at the quiesce step (GpuProcessOutsideTree naming its pid in the
    container) before anything changes: no lock asked of the driver, every GPU process running, no image.
    A refusal for good (the daemon lasts as long as the container): the controller puts the worker back
    into serving at once, verified, the same container and processes. (Before, the dump went through, the
    seal found the daemon missing (IncompleteCapture) and the rollback's CRIU restore failed on the real
    node, "Can't fork for 10000: File exists", until the wake deadline deleted the pod.)"""
    env = bounded
    async with deployed(env, graph(env, "flt-daemon", "snapshot", GPU_DAEMON)) as g:
        w = g.workers(WORKER_COMPONENT)[1]
        first = await kubelet_facts(env.api, w)
        procs = container_procs(w.uid, first.container_id)
        kids = {p: procfs.status(p) for p in procs.tree}
        daemon = next(p for p, st in kids.items() if st and st.name == "sleep")
        worker = next(p for p, st in kids.items() if st and st.ppid == procs.entrypoint and p != daemon)
        daemon_st = kids[daemon]
        assert daemon_st is not None and daemon_st.ppid == procs.entrypoint, "reparented to the entrypoint"
        assert maps_cuda(daemon) and maps_cuda(worker)
        mark = len(env.driver.calls())
        await override(env, w, "suspended")
        ws = await wait_ws(env, w, "GpuProcessOutsideTree", error_is("GpuProcessOutsideTree", step="quiesce"),
                           timeout=120)
        err = ws["status"]["lastError"]
        named = f"GPU processes outside the worker's tree (in-namespace pids): [{daemon_st.ns_pid}]"
        assert named in err["message"], err
        degraded(ws, "GpuProcessOutsideTree")
        cap = ws["status"]["lastCapture"]
        assert cap["ok"] is False and [s["name"] for s in cap["steps"]] == ["quiesce"], cap
        locks = [c for c in env.driver.calls()[mark:] if c.startswith("cuCheckpointProcessLock ")]
        assert locks == [], "the driver was asked to lock"
        assert [stub_state(env.driver, p) for p in (worker, daemon)] == [RUNNING, RUNNING]
        assert no_image_of(env, w)
        await wait_ws(env, w, "back in serving, verified", back_after_refusal("GpuProcessOutsideTree"), timeout=120)
        await pinned(env, w, prompt="the daemon stays")
        await same_pod(env, w, first)
        now = container_procs(w.uid, first.container_id)
        assert {worker, daemon} <= set(now.tree), "the same processes"
        await override(env, w, None)


async def test_io_uring_ring_in_the_worker_tree_is_refused_and_criu_names_a_mapped_one(
        bounded: Env, faults_launcher: Path) -> None:
    """With the entrypoint's filter on, a ring can still reach the worker: made by a process of the
    container's pid namespace outside the filter (nsenter from the node, as the container's user) and
    copied in with pidfd_getfd(2) (the kernel refuses to pass one over a unix socket) by a process of
    the worker's tree (faults_launcher.py's fd holder). Held as a descriptor, the preflight refuses it
    (IoUringInUse at the quiesce step, the holder's pid named, no lock asked). Held only as a mapping
    (its descriptor closed, as liburing's io_uring_close_ring_fd allows), the preflight, which looks at
    descriptors, does not see it, and CRIU's own dump fails on it: CRIU leaves the tree running, the
    agent names the cause from CRIU's log (IoUringInUse at the dump step) and rolls the worker back, the
    failed dump's staging directory removed. Once the ring is gone the capture goes through and the
    worker wakes in place, verified, the same container."""
    env = bounded
    async with deployed(env, holder_graph(env, "flt-uring", faults_launcher)) as g:
        w = g.workers(WORKER_COMPONENT)[1]
        first = await kubelet_facts(env.api, w)
        procs = container_procs(w.uid, first.container_id)
        assert control_file(procs.entrypoint)["seccomp"] == "on"
        gpu = procs.root
        answer = fd_holder(procs.entrypoint, faults_launcher, HOLDER, "hold")
        ns = procfs.pid_ns(procs.entrypoint)
        assert ns is not None
        holder = next(st.pid for st in procfs.in_pid_ns(ns) if st.nspid[-1] == answer["pid"])
        assert io_uring_fds(holder) and holder in container_procs(w.uid, first.container_id).tree
        mark = len(env.driver.calls())
        try:
            await override(env, w, "suspended")
            ws = await wait_ws(env, w, "IoUringInUse (preflight)", error_is("IoUringInUse", step="quiesce"),
                               timeout=120)
            err = ws["status"]["lastError"]
            assert "processes holding io_uring" in err["message"] and str(holder) in err["message"], err
            degraded(ws, "IoUringInUse")
            assert [s["name"] for s in ws["status"]["lastCapture"]["steps"]] == ["quiesce"]
            assert not [c for c in env.driver.calls()[mark:] if c.startswith("cuCheckpointProcessLock ")], \
                "the driver was asked to lock"
            answer = fd_holder(procs.entrypoint, faults_launcher, HOLDER, "map")
            assert answer["mapped"] == 1 and answer["held"] == []
            assert not io_uring_fds(holder) and io_uring_maps(holder)
            # The next attempt (after the 1 s backoff) passes the preflight; CRIU's dump fails on the ring.
            ws = await wait_ws(env, w, "IoUringInUse (CRIU)", error_is("IoUringInUse", step="dump"), timeout=120)
            err = ws["status"]["lastError"]
            assert "CRIU dump failed (io_uring)" in err["message"], err
            assert "anon_inode:[io_uring]" in err["message"], err
            degraded(ws, "IoUringInUse")
            cap = ws["status"]["lastCapture"]
            assert cap["ok"] is False and [s["name"] for s in cap["steps"]] == ["quiesce", "save", "dump"], cap
            # Active wanted again (`dynsnap wake`), so no retry runs while the node is looked at.
            await override(env, w, "active")
            await active_again(env, w)
            assert stub_state(env.driver, gpu) == RUNNING, "the GPU process brought back"
            assert Path(f"/proc/{holder}").exists(), "CRIU left the tree it could not dump running"
            pod_dir = images_dir_of(env, w)
            assert not [n for n in os.listdir(pod_dir) if n.startswith(P.STAGING_PREFIX)], os.listdir(pod_dir)
        finally:
            fd_holder(procs.entrypoint, faults_launcher, HOLDER, "release")
        assert not io_uring_maps(holder) and not io_uring_fds(holder)
        mark = len(env.driver.calls())
        await override(env, w, "suspended")
        await captured_then_woken(env, w, "snapshot", mark)
        await same_pod(env, w, first)
