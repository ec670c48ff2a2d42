"""A real node's pod processes as the host sees them, for tests and benches: a container's PID 1 (by the
container id kubelet reports, in the processes' cgroup paths), a process's memory figures from
``/proc/<pid>/status`` (VmRSS, VmHWM) and its peak set back to its size now.

Layer: ``dynsnap.testenv`` (test harness only; never imported by the product).
"""

from __future__ import annotations

from pathlib import Path

from dynsnap.k8s.client import Obj
from dynsnap.runtime import procfs


def container_pid(pod: Obj, container: str) -> int:
    """The host pid of ``pod``'s ``container``'s PID 1: the lowest pid of the pod's processes whose
    cgroup paths name that container's id (as the pod's status reports it)."""
    cid = next(c for c in pod["status"]["containerStatuses"] if c["name"] == container)["containerID"]
    pids = [p for p in procfs.pod_pids(pod["metadata"]["uid"]) if any(cid.split("//")[1] in c for c in
                                                                      procfs.cgroup_paths(p))]
    assert pids, f"no process of {pod['metadata']['name']}/{container}"
    return min(pids)


def status_kib(pid: int, field: str) -> int:
    """A ``kB`` field of ``/proc/<pid>/status`` (``VmRSS``, ``VmHWM``), in KiB."""
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1])


def peak_reset(pid: int) -> None:
    """The process's peak resident size (VmHWM) set back to its resident size now (proc(5), clear_refs 5)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
