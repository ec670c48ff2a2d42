"""The facts a test on the real node reads about a worker, each from whoever owns it: the pod's
status as kubelet reports it (container id, restartCount, UID, IP, readiness), the runtime's own
state (``runc state`` against the node's runc root, ``ctr tasks ls`` against its containerd), the
kernel's view of the container's processes (/proc: pid namespace, cgroups, security state), the
cgroup files of the container (its memory limit, its pod's pids limit), and the stub driver's
per-process checkpoint state (the stand-in for the GPU driver's).

Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dynsnap.agent.worker import find_entrypoint
from dynsnap.k8s.client import Obj
from dynsnap.models.ids import PodUID
from dynsnap.runtime import procfs
from dynsnap.runtime.command import run_command
from dynsnap.testenv.dynsnap_parts import NSKEY_SHIFT, StubDriver
from dynsnap.testenv.hostprocs import container_pid
from dynsnap.testenv.node import RealNode
from dynsnap.testenv.node_cleanup import CGROUP_FS
from dynsnap.testenv.real_graph import KubeletFacts, kubelet_facts

# real_graph's, where the demo reads them too; hostprocs', where the benches read it too
__all__ = ["KubeletFacts", "container_pid", "kubelet_facts"]

SECURITY_FIELDS = ("Seccomp", "Seccomp_filters", "NoNewPrivs", "CapEff", "CapPrm", "CapBnd", "CapInh")


async def runc_state(node: RealNode, container_id: str) -> Obj:
    """``runc state`` of the container, from the runc root containerd's shim uses (its namespace's)."""
    assert node.bins is not None
    res = await run_command([str(node.bins.runc), "--root", str(node.layout.runc_root / "k8s.io"), "state",
                             container_id], timeout=30)
    out: Obj = json.loads(res.stdout)
    return out


async def containerd_task(node: RealNode, container_id: str) -> tuple[int, str] | None:
    """(pid, status) of the container's task in ``ctr tasks ls``, or None when containerd lists none."""
    for line in (await run_command(node.ctr_argv("tasks", "ls"), timeout=30)).stdout.splitlines()[1:]:
        parts = line.split()
        if len(parts) == 3 and parts[0] == container_id:
            return int(parts[1]), parts[2]
    return None


@dataclass(frozen=True)
class Procs:
    """The worker container's processes as the kernel shows them."""

    entrypoint: int  # host pid of its PID 1
    tree: tuple[int, ...]  # host pids of every other process of its pid namespace

    @property
    def root(self) -> int:
        """The worker tree's root: the entrypoint's child."""
        kids = [p for p in self.tree if (st := procfs.status(p)) is not None and st.ppid == self.entrypoint]
        assert len(kids) == 1, f"the entrypoint {self.entrypoint} has children {kids}"
        return kids[0]


def container_procs(uid: str, container_id: str) -> Procs:
    ep = find_entrypoint(PodUID(uid), container_id=container_id)
    ns = procfs.pid_ns(ep)
    assert ns is not None
    tree = tuple(st.pid for st in procfs.in_pid_ns(ns) if st.pid != ep and st.state not in ("Z", "X"))
    return Procs(ep, tree)


def cgroups(pid: int) -> dict[str, str]:
    """controller -> path, from /proc/<pid>/cgroup ("" is the unified hierarchy)."""
    out = {}
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, ctrl, path = line.split(":", 2)
        out[ctrl] = path
    return out


def security(pid: int) -> dict[str, str]:
    """The process's seccomp, no_new_privs and capability state (/proc/<pid>/status)."""
    fields = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                  if ":\t" in line)
    return {k: fields[k].strip() for k in SECURITY_FIELDS}


def namespaces(pid: int) -> dict[str, str]:
    return {ns: os.readlink(f"/proc/{pid}/ns/{ns}") for ns in ("pid", "mnt", "net", "ipc", "uts", "cgroup")}


def cgroup_file(controller: str, path: str, name: str) -> str:
    return (CGROUP_FS / controller / path.lstrip("/") / name).read_text().strip()


def stub_state(driver: StubDriver, pid: int) -> int:
    """The stub driver's checkpoint state of ``pid`` (0 running, 1 locked, 2 checkpointed), keyed as the
    stub keys it (its pid namespace's inode and its pid there), 0 when it has none."""
    st, ns = procfs.status(pid), procfs.pid_ns(pid)
    assert st is not None and ns is not None
    return driver.states().get((ns << NSKEY_SHIFT) | st.nspid[-1], 0)


def control_file(entrypoint: int) -> Obj:
    """The worker's entrypoint.json, read through its entrypoint's /proc/<pid>/root."""
    return control_file_at(entrypoint, "/run/dynsnap")


def control_file_at(entrypoint: int, control_dir: str) -> Obj:
    """The entrypoint.json in ``control_dir`` of the entrypoint's container (no symlink on the way)."""
    info: Obj = json.loads((Path(f"/proc/{entrypoint}/root") / control_dir.lstrip("/") / "entrypoint.json")
                           .read_text())
    return info


def _state(pid: int) -> str:
    st = procfs.status(pid)
    return st.state if st is not None else "gone"


@contextlib.contextmanager
def stopped(pids: list[int]) -> Iterator[list[int]]:
    """``pids`` stopped (SIGSTOP) for the block, each seen stopped (or gone, or a zombie) before it starts:
    a stop is delivered, not done, by kill() (bounded: 10 s); continued (SIGCONT) after, those still there.
    They answer nothing meanwhile and their connections stay open (requests to them time out)."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 10
        while not all(_state(p) in ("T", "Z", "X", "gone") for p in pids):
            assert time.monotonic() < deadline, [(p, _state(p)) for p in pids]
            time.sleep(0.05)
        yield pids
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
