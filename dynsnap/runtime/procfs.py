"""What ``/proc`` says about processes on this node: which belong to a pod (its UID in
``/proc/<pid>/cgroup``), their pid in the pod's own namespace (``NSpid``), their children,
their pid namespace, what they map and hold open, their environment.

Layer: ``dynsnap.runtime`` (generic node facts; the agent builds on them, the test harness
may too). Every function reads ``/proc`` afresh (nothing cached: pids are reused) and treats
a process that vanished mid-read as absent. ``proc`` is a parameter so tests can point at a
copy; it defaults to the node's ``/proc`` (the agent runs with hostPID). Nothing here opens a file
inside a process's root (``/proc/<pid>/root/...``): the agent does that only through
``dynsnap.agent.container``, its trust boundary with containers.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dynsnap.models.ids import HostPid, NsPid, PodUID

PROC = Path("/proc")

# kubelet names a pod's cgroup after its UID, and the runtime names the container's under it after
# the container id. The two drivers kubelet has (docs/install.md, "Before you install"):
#   cgroupfs  .../kubepods[/burstable|/besteffort]/pod<uid>/<id>            (containerd, docker)
#             .../kubepods[/burstable|/besteffort]/pod<uid>/crio-<id>       (CRI-O)
#   systemd   .../kubepods[-<qos>].slice/kubepods[-<qos>]-pod<uid, _ for ->.slice/<prefix>-<id>.scope
#             with <prefix> cri-containerd (containerd), crio (CRI-O) or docker.
# CRI-O's conmon runs beside the container in crio-conmon-<id>.scope: that is no container of the pod.
_UID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}"
_POD_DIR = re.compile(rf"^(?:pod|kubepods(?:-(?:burstable|besteffort))?-pod)({_UID})(?:\.slice)?$")
_CONTAINER_DIR = re.compile(r"^(?:(cri-containerd|crio|docker)-)?([0-9a-f]{64})(\.scope)?$")


@dataclass(frozen=True)
class ProcStatus:
    pid: HostPid
    ppid: HostPid
    nspid: tuple[int, ...]  # outermost (host) first, the process's own namespace last
    state: str  # R, S, D, Z, T, ...
    name: str

    @property
    def ns_pid(self) -> NsPid:
        return NsPid(self.nspid[-1])


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError, NotADirectoryError):
        return None
    except OSError:
        return None


def pids(proc: Path = PROC) -> Iterator[HostPid]:
    for entry in os.scandir(proc):
        if entry.name.isdigit():
            yield HostPid(int(entry.name))


def status(pid: int, proc: Path = PROC) -> ProcStatus | None:
    text = _read(proc / str(pid) / "status")
    if text is None:
        return None
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    try:
        nspid = tuple(int(x) for x in fields.get("NSpid", str(pid)).split())
        return ProcStatus(pid=HostPid(pid), ppid=HostPid(int(fields.get("PPid", "0"))), nspid=nspid,
                          state=fields.get("State", "?")[:1], name=fields.get("Name", ""))
    except ValueError:
        return None


def start_time(pid: int, proc: Path = PROC) -> int | None:
    """When the process started, clock ticks after boot (``/proc/<pid>/stat`` field 22): with the pid, what
    tells one process from a later one at the same pid. None when it is gone."""
    text = _read(proc / str(pid) / "stat")
    if text is None:
        return None
    # comm (field 2) may hold spaces and parentheses: the fields after it start at the last ")"
    fields = text.rsplit(")", 1)[-1].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def uptime_ticks(proc: Path = PROC) -> int:
    """The node's clock ticks since boot now: the unit of :func:`start_time`."""
    text = _read(proc / "uptime") or "0"
    return int(float(text.split()[0]) * os.sysconf("SC_CLK_TCK"))


def pod_uid_of(pid: int, proc: Path = PROC) -> PodUID | None:
    """The pod UID in the process's cgroup path, normalised to dashes; None outside any pod."""
    for path in cgroup_paths(pid, proc):
        pc = parse_pod_cgroup(path)
        if pc is not None:
            return pc.pod_uid
    return None


def cgroup_paths(pid: int, proc: Path = PROC) -> list[str]:
    text = _read(proc / str(pid) / "cgroup") or ""
    return [line.split(":", 2)[2] for line in text.splitlines() if line.count(":") >= 2]


# /proc/<pid>/cgroup is read up to this: a line per hierarchy, each path at most PATH_MAX (4096).
CGROUP_READ_BOUND = 64 * 1024
# One line of it, as the kernel writes it: hierarchy id, controllers (a v1 named hierarchy's
# name=<name>; none for the unified v2 one), path (always absolute: "/.." first for a cgroup outside
# the reader's cgroup namespace).
_CGROUP_LINE = re.compile(r"([0-9]+):([^:]*):(/.*)")


class CgroupsUnreadable(ValueError):
    """A /proc/<pid>/cgroup that is no list of hierarchies to trust (too large, a line out of the
    kernel's form, a hierarchy twice): the message says which."""


def cgroups(pid: int, proc: Path = PROC) -> dict[str, str] | None:
    """The process's cgroup in each hierarchy, as ``/proc/<pid>/cgroup`` lists them: controllers
    (``memory``, ``cpu,cpuacct``, ``name=systemd``; ``""`` for the unified v2 one) to path, both as
    data (never resolved, undecodable bytes kept apart by ``surrogateescape``). None when the process
    is gone. A cgroup's name may hold any byte but ``/``, a newline too, so a name can end one line
    and start another: a file past CGROUP_READ_BOUND, a line out of the kernel's form, or a hierarchy
    (by id or by controllers) listed twice raises :class:`CgroupsUnreadable` rather than yield
    hierarchies a container wrote."""
    try:
        with open(proc / str(pid) / "cgroup", "rb") as f:
            raw = f.read(CGROUP_READ_BOUND + 1)
    except OSError:
        return None
    if len(raw) > CGROUP_READ_BOUND:
        raise CgroupsUnreadable(f"/proc/{pid}/cgroup is larger than {CGROUP_READ_BOUND} bytes")
    text = raw.decode(errors="surrogateescape")
    if text and not text.endswith("\n"):
        raise CgroupsUnreadable(f"/proc/{pid}/cgroup does not end with a newline")
    out: dict[str, str] = {}
    ids: set[str] = set()
    for line in text.split("\n")[:-1]:
        m = _CGROUP_LINE.fullmatch(line)
        if m is None:
            raise CgroupsUnreadable(f"/proc/{pid}/cgroup: {line[:300]!r} is no <id>:<controllers>:<path> line")
        hid, controllers, path = m.groups()
        if hid in ids or controllers in out:
            raise CgroupsUnreadable(f"/proc/{pid}/cgroup lists hierarchy {hid}:{controllers} twice")
        ids.add(hid)
        out[controllers] = path
    return out


@dataclass(frozen=True)
class PodCgroup:
    """A cgroup path of kubelet's, read by its components: the pod it is under and, when the path
    goes on to a container's own cgroup, that container's id (as the runtime reports it in the pod's
    ``containerStatuses``, without the ``containerd://`` / ``cri-o://`` scheme)."""

    pod_uid: PodUID
    container_id: str | None


def parse_pod_cgroup(path: str) -> PodCgroup | None:
    """The pod (and container) a cgroup path names, under either cgroup driver (pure); None for a
    path outside any pod. Component by component: the pod's directory is the one named
    ``pod<uid>`` (cgroupfs) or ``kubepods[-<qos>]-pod<uid>.slice`` (systemd), and the container's is
    the one right below it, a 64-hex id bare or with its runtime's prefix (``<id>``, ``crio-<id>``,
    ``cri-containerd-<id>.scope``, ``crio-<id>.scope``, ``docker-<id>.scope``). Anything else below
    the pod's directory (``crio-conmon-<id>.scope``, a sub-cgroup) names no container."""
    parts = [p for p in path.split("/") if p]
    for i, part in enumerate(parts):
        m = _POD_DIR.match(part)
        if m is None:
            continue
        uid = PodUID(m.group(1).replace("_", "-"))
        below = parts[i + 1:]
        c = _CONTAINER_DIR.match(below[0]) if len(below) == 1 else None
        if c is not None and part.endswith(".slice") != bool(c.group(3)):
            c = None  # a systemd pod slice holds scopes; a cgroupfs pod directory holds bare directories
        return PodCgroup(pod_uid=uid, container_id=c.group(2) if c else None)
    return None


def container_ids(pid: int, proc: Path = PROC) -> set[str]:
    """The container ids the process's cgroup paths name (one under a sane runtime; empty outside
    a container's cgroup)."""
    return {pc.container_id for path in cgroup_paths(pid, proc)
            if (pc := parse_pod_cgroup(path)) is not None and pc.container_id is not None}


def pod_pids(uid: PodUID, proc: Path = PROC) -> list[HostPid]:
    """Every process whose cgroup carries the pod's UID (all its containers)."""
    return sorted(p for p in pids(proc) if pod_uid_of(p, proc) == uid)


def pid_ns(pid: int, proc: Path = PROC) -> int | None:
    """Inode of the process's pid namespace (equal inodes: same namespace)."""
    try:
        return os.stat(proc / str(pid) / "ns" / "pid").st_ino
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None


def exe_name(pid: int, proc: Path = PROC) -> str | None:
    try:
        return os.path.basename(os.readlink(proc / str(pid) / "exe")).removesuffix(" (deleted)")
    except OSError:
        return None


# A process's argv and environment are its own memory: it can rewrite them and (prctl PR_SET_MM) make
# them larger than any exec gave it. They are read up to ARG_MAX under the default stack limit (a
# quarter of 8 MiB); what lies beyond is not read.
MEMORY_READ_BOUND = 2 * 1024 * 1024


def _read_memory(path: Path) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read(MEMORY_READ_BOUND)
    except OSError:
        return None


def cmdline(pid: int, proc: Path = PROC) -> list[str]:
    """The process's argv (at most MEMORY_READ_BOUND bytes of it)."""
    raw = _read_memory(proc / str(pid) / "cmdline")
    if raw is None:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0")[:-1]]


def children(pid: int, proc: Path = PROC) -> list[HostPid]:
    """Direct children of every thread of ``pid``."""
    out: list[HostPid] = []
    try:
        tids = os.listdir(proc / str(pid) / "task")
    except OSError:
        return out
    for tid in tids:
        text = _read(proc / str(pid) / "task" / tid / "children")
        if text:
            out += [HostPid(int(c)) for c in text.split()]
    return sorted(set(out))


def tree(root: int, proc: Path = PROC, *, limit: int = 100_000) -> list[HostPid]:
    """``root`` and all its descendants (bounded: a fork bomb does not hang the agent)."""
    out: list[HostPid] = []
    todo = [HostPid(root)]
    seen: set[int] = set()
    while todo and len(out) < limit:
        pid = todo.pop()
        if pid in seen or status(pid, proc) is None:
            continue
        seen.add(pid)
        out.append(pid)
        todo += children(pid, proc)
    return sorted(out)


def in_pid_ns(ns_inode: int, proc: Path = PROC) -> list[ProcStatus]:
    """Every process of one pid namespace (by its inode), with its in-namespace pid."""
    out = []
    for p in pids(proc):
        if pid_ns(p, proc) == ns_inode:
            st = status(p, proc)
            if st is not None:
                out.append(st)
    return out


def host_pid_of(ns_pid: int, *, ns_inode: int, proc: Path = PROC) -> HostPid | None:
    """The host pid of the process that is ``ns_pid`` in the pid namespace ``ns_inode``."""
    for st in in_pid_ns(ns_inode, proc):
        if st.ns_pid == ns_pid:
            return st.pid
    return None


# What the agent reads of one process's mappings and descriptors. A worker maps a few thousand files and holds
# a few thousand descriptors; a pod can make a process with hundreds of thousands of either (long paths,
# dup'ed descriptors), and reading them all would cost the agent seconds and memory on every look.
MAPS_READ_BOUND = 16 << 20  # bytes of /proc/<pid>/maps: about 100,000 mappings of 160-byte lines
FD_COUNT_BOUND = 1 << 16  # entries of /proc/<pid>/fd


class ProcBoundExceeded(Exception):
    """A process's ``/proc`` entry is larger than the agent reads (MAPS_READ_BOUND, FD_COUNT_BOUND)."""


def maps_paths(pid: int, proc: Path = PROC) -> set[str]:
    """Paths of the files the process maps (libraries, device files); ProcBoundExceeded past MAPS_READ_BOUND."""
    try:
        with open(proc / str(pid) / "maps", "rb") as f:
            raw = f.read(MAPS_READ_BOUND + 1)
    except OSError:
        raw = b""
    if len(raw) > MAPS_READ_BOUND:
        raise ProcBoundExceeded(f"process {pid} maps more than the {MAPS_READ_BOUND} bytes of /proc/{pid}/maps "
                                "the agent reads")
    text = raw.decode(errors="replace")
    out = set()
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith("/"):
            out.add(parts[5].removesuffix(" (deleted)"))
    return out


def fd_targets(pid: int, proc: Path = PROC) -> list[str]:
    """What each descriptor of the process names; ProcBoundExceeded past FD_COUNT_BOUND descriptors (counted
    before any is read)."""
    out = []
    with contextlib.suppress(OSError), os.scandir(proc / str(pid) / "fd") as it:
        names: list[str] = []
        for entry in it:
            if len(names) == FD_COUNT_BOUND:
                raise ProcBoundExceeded(f"process {pid} holds more than the {FD_COUNT_BOUND} descriptors the "
                                        "agent reads")
            names.append(entry.name)
        for fd in names:
            with contextlib.suppress(OSError):
                out.append(os.readlink(proc / str(pid) / "fd" / fd))
    return out


def environ(pid: int, proc: Path = PROC) -> dict[str, str]:
    """The process's environment (at most MEMORY_READ_BOUND bytes of it). The agent reads a container
    process's through dynsnap.agent.container instead, which refuses one past its bound."""
    raw = _read_memory(proc / str(pid) / "environ")
    if raw is None:
        return {}
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def rss_bytes(pid: int, proc: Path = PROC) -> int:
    """Resident memory of the process (what a CRIU dump writes, roughly: anonymous + dirty)."""
    text = _read(proc / str(pid) / "smaps_rollup") or _read(proc / str(pid) / "status") or ""
    m = re.search(r"^(?:Rss|VmRSS):\s+(\d+) kB", text, re.M)
    return int(m.group(1)) * 1024 if m else 0
