"""What the agent's fault tests (test_agent_faults.py) need beyond agentenv.py: workers with a fault in
their tree (faults_launcher.py), the node facts every fault test checks afterwards (entrypoint state,
each GPU process's state in the stub driver, no stopped process, images on disk), and the faults
the tests cause from outside: a debugger attached to the worker, an io_uring ring passed into it, a
pid of the pod's namespace taken.

Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from agentenv import AgentProc, StubDriver, worker_component

from dynsnap.k8s.client import Obj
from dynsnap.models import protocol as P
from dynsnap.runtime import procfs
from dynsnap.runtime.procfs import ProcStatus
from dynsnap.testenv.cluster import RunningPod

HERE = Path(__file__).resolve().parent
LAUNCHER = HERE / "faults_launcher.py"


def fault_worker(name: str, driver: StubDriver, *, launcher: list[str] | None = None,
                 entrypoint: list[str] | None = None) -> Obj:
    """A mocker worker wired for dynsnap (agentenv.worker_component) whose worker command is
    faults_launcher.py with ``launcher`` options, its entrypoint started with ``entrypoint`` options."""
    comp = worker_component(name, replicas=1, driver=driver)
    main = comp["extraPodSpec"]["mainContainer"]
    cmd: list[str] = main["command"]
    sep = cmd.index("--")
    python, worker = cmd[sep + 1], cmd[sep + 1:]
    wrapped = [python, str(LAUNCHER), *(launcher or []), "--", *worker] if launcher else worker
    main["command"] = [*cmd[:sep], *(entrypoint or []), "--", *wrapped]
    return comp


# -- what the node shows ----------------------------------------------------------------------------

def ep_info(pod: RunningPod) -> dict[str, Any]:
    """The entrypoint's control file, reached as the agent reaches it."""
    path = Path(f"/proc/{pod.sandbox.pid}/root") / P.ENTRYPOINT_CONTROL_DIR.lstrip("/") / P.ENTRYPOINT_CONTROL_FILE
    info: dict[str, Any] = json.loads(path.read_text())
    return info


def pod_procs(pod: RunningPod) -> list[ProcStatus]:
    """Every live process of the pod's pid namespace but its PID 1."""
    ns = procfs.pid_ns(pod.sandbox.pid)
    assert ns is not None, f"pod {pod.name}: its PID 1 is gone"
    return [p for p in procfs.in_pid_ns(ns) if p.pid != pod.sandbox.pid and p.state not in ("Z", "X")]


def maps_cuda(pid: int) -> bool:
    return any(os.path.basename(m).startswith("libcuda.so") for m in procfs.maps_paths(pid))


def stub_key(pid: int) -> int:
    """The stub driver's key for a process under ``nskey 0``: (pid namespace inode, pid in it)."""
    st = procfs.status(pid)
    assert st is not None, f"process {pid} is gone"
    return (os.stat(f"/proc/{pid}/ns/pid").st_ino << 22) | st.ns_pid


STATE_NAMES = {0: "running", 1: "locked", 2: "checkpointed", 3: "failed"}


def gpu_states(driver: StubDriver, pod: RunningPod) -> dict[int, str]:
    """The stub driver's state of every process of the pod that maps it (host pid -> state)."""
    states = driver.states()
    return {p.pid: STATE_NAMES[states.get(stub_key(p.pid), 0)] for p in pod_procs(pod) if maps_cuda(p.pid)}


def stopped(pod: RunningPod) -> list[str]:
    """Processes of the pod stopped or traced-stopped (state T or t): frozen, not serving."""
    return [f"{p.pid} {p.name} {p.state}" for p in pod_procs(pod) if p.state in ("T", "t")]


def assert_running(pod: RunningPod, driver: StubDriver) -> dict[int, str]:
    """The worker runs and serves from the node's point of view: the entrypoint active with its
    worker alive, every GPU process running in the driver, no process stopped. Returns the GPU states."""
    info = ep_info(pod)
    assert info["state"] == "active" and info["worker_alive"] is True, info
    states = gpu_states(driver, pod)
    assert states and set(states.values()) == {"running"}, states
    assert not stopped(pod), stopped(pod)
    return states


def pod_image_dir(agent: AgentProc, pod: RunningPod, root: Path | None = None) -> Path:
    return (root or agent.images_root) / f"{pod.namespace}_{pod.name}_{pod.uid}"


def image_entries(agent: AgentProc, pod: RunningPod, root: Path | None = None) -> list[str]:
    """Names under the pod's images directory (captures, .staging-* dirs); [] when it has none."""
    d = pod_image_dir(agent, pod, root)
    return sorted(os.listdir(d)) if d.is_dir() else []


def io_uring_fds(pid: int) -> list[str]:
    return [t for t in procfs.fd_targets(pid) if "io_uring" in t]


def io_uring_maps(pid: int) -> list[str]:
    """Mappings of an io_uring ring (procfs.maps_paths lists only files with a path)."""
    try:
        text = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return []
    return [line for line in text.splitlines() if line.endswith("anon_inode:[io_uring]")]


def stub_calls(driver: StubDriver, fn: str, pid: int) -> list[str]:
    """The stub driver's log lines of ``fn`` for host pid ``pid``."""
    return [c for c in driver.calls() if c.startswith(fn + " ") and f" pid={pid} " in c + " "]


# -- WorkerSnapshot status checks ---------------------------------------------------------------------

def error_is(reason: str, *, step: str | None = None) -> Callable[[Obj | None], bool]:
    def check(ws: Obj | None) -> bool:
        err = ((ws or {}).get("status") or {}).get("lastError") or {}
        return bool(err.get("reason") == reason and (step is None or err.get("step") == step))
    return check


# -- faults caused from outside -----------------------------------------------------------------------

def _run(argv: list[str], *, timeout: float = 30) -> str:
    res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    assert res.returncode == 0, f"{argv}: rc {res.returncode}\n{res.stdout}\n{res.stderr}"
    return res.stdout


def fd_holder(pod: RunningPod, name: str, cmd: str) -> dict[str, Any]:
    """Send ``cmd`` to the pod's fd holder (faults_launcher.py --fd-holder ``name``); for ``hold``,
    with an io_uring ring made in the pod's pid namespace but outside the entrypoint's filter.
    Returns the holder's answer."""
    out = _run(["nsenter", "-t", str(pod.sandbox.pid), "-p", "-n", "--", sys.executable, str(LAUNCHER), "--send", name,
                cmd])
    answer: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    assert answer["error"] is None, answer
    return answer


@contextlib.asynccontextmanager
async def debugger_attached(pid: int) -> AsyncIterator[int]:
    """A tracer attached to ``pid`` (PTRACE_SEIZE, as gdb or py-spy attach) for the duration: the
    tracee keeps running; the tracer is killed (which detaches it) at the end. Yields its pid."""
    code = ("import ctypes, sys, time\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "rc = libc.ptrace(0x4206, int(sys.argv[1]), None, None)  # PTRACE_SEIZE\n"
            "print('seized' if rc == 0 else f'failed errno {ctypes.get_errno()}', flush=True)\n"
            "time.sleep(600)\n")
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code, str(pid), stdout=asyncio.subprocess.PIPE)
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode().strip()
        assert line == "seized", line
        yield proc.pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()


_OCCUPY = """
import os, sys
target = int(sys.argv[1])
for _ in range(50):
    with open("/proc/sys/kernel/ns_last_pid", "w") as f:  # this process's pid namespace: the pod's
        f.write(str(target - 1))
    pid = os.fork()
    if pid == 0:
        null = os.open("/dev/null", os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)  # the caller waits for its output to end
        os.execv("/bin/sleep", ["sleep", "600"])
    if pid == target:
        print(pid, flush=True)
        os._exit(0)  # the sleeper is reparented to the namespace's PID 1
    os.kill(pid, 9)
    os.waitpid(pid, 0)
sys.exit(f"pid {target} not obtained")
"""


def occupy_ns_pid(pid1: int, ns_pid: int, *, mount_ns: bool = False) -> int:
    """Start a sleeping process at pid ``ns_pid`` of the pid namespace whose PID 1 is host pid ``pid1`` (as
    any process that enters the namespace may land there: the counter set below it, then a fork);
    returns its host pid. ``mount_ns``: enter its mount namespace too (a sandbox's shares the node's
    files; a container's /proc/sys is read-only, so there the node's own /proc is used)."""
    python = sys.executable if mount_ns else "python3"
    out = _run(["nsenter", "-t", str(pid1), "-p", *(["-m"] if mount_ns else []), "--", python, "-c", _OCCUPY,
                str(ns_pid)])
    assert int(out.strip()) == ns_pid, out
    ns = procfs.pid_ns(pid1)
    assert ns is not None, f"{pid1} is gone"
    host = next((st.pid for st in procfs.in_pid_ns(ns) if st.nspid[-1] == ns_pid), None)
    assert host is not None, f"no process at pid {ns_pid} of {pid1}'s namespace"
    return host


def occupy_pid(pod: RunningPod, ns_pid: int) -> int:
    """A sleeping process at in-namespace pid ``ns_pid`` of the pod (:func:`occupy_ns_pid`)."""
    return occupy_ns_pid(pod.sandbox.pid, ns_pid, mount_ns=True)

