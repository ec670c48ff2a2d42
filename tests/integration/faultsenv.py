"""What the fault tests on the real node (node/test_agent_faults.py, node/test_controller_refusals.py)
need beyond realnodeenv.py: the node facts they check (a process mapping the (stub) driver, io_uring
descriptors and mappings, the stub driver's calls for a process, a WorkerSnapshot's error), and the
faults they cause from outside: a debugger attached to the worker, an io_uring ring passed into it
(faults_launcher.py's fd holder), a pid of a container's namespace taken.

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

from agentenv import StubDriver

from dynsnap.k8s.client import Obj
from dynsnap.runtime import procfs

HERE = Path(__file__).resolve().parent
LAUNCHER = HERE / "faults_launcher.py"


# -- what the node shows ----------------------------------------------------------------------------

def maps_cuda(pid: int) -> bool:
    return any(os.path.basename(m).startswith("libcuda.so") for m in procfs.maps_paths(pid))


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


def fd_holder(pid1: int, launcher: Path, name: str, cmd: str) -> dict[str, Any]:
    """Send ``cmd`` to the fd holder (faults_launcher.py --fd-holder ``name``) of the container whose PID 1
    is host pid ``pid1``, where the launcher is at ``launcher``; for ``hold``, with an io_uring ring made
    in the container's pid namespace but outside the entrypoint's filter and the runtime's seccomp
    profile (nsenter from the node), as the container's user with no capability (pidfd_getfd(2) lets
    the holder take a descriptor only from a process no more privileged than itself). The container's
    own python runs it. Returns the holder's answer."""
    ids = {line.split(":")[0]: line.split()[1] for line in Path(f"/proc/{pid1}/status").read_text().splitlines()
           if line.startswith(("Uid:", "Gid:"))}
    out = _run(["nsenter", "-t", str(pid1), "-p", "-n", "-m", "-S", ids["Uid"], "-G", ids["Gid"], "--",
                "python3", str(launcher), "--send", name, cmd])
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
