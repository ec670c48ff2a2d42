"""Whether a tree CRIU restored runs in its container's cgroups: every restored process must be, in
every hierarchy the container's PID 1 (dynsnap-entrypoint) is in, in exactly the cgroup that PID 1 is
in, and in no hierarchy it is not in. A process outside them escapes the container's memory and pids
limits; the restore step kills such a tree and fails (``RestoredOutsideContainer``) instead of waking it.

Layer: ``dynsnap.agent``. :func:`misplaced` is pure; :func:`restored` and :func:`check` read ``/proc``
through :mod:`dynsnap.runtime.procfs` (bounded, afresh). Everything read is the container's to write:
a cgroup path is compared as data, never resolved or followed. cgroup v1 (named hierarchies ``memory``,
``pids``, ``cpu,cpuacct``, ``name=systemd``, beside the unified ``0::`` line of a hybrid node) and pure
cgroup v2 (the ``0::`` line alone) are the same comparison: the hierarchies the kernel lists.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

from dynsnap.agent import worker as W
from dynsnap.models.ids import HostPid, NsPid
from dynsnap.runtime import procfs
from dynsnap.runtime.procfs import PROC, ProcStatus

_GONE = ("Z", "X")


def hierarchy(controllers: str) -> str:
    """A hierarchy as a message names it."""
    return "the unified (v2) hierarchy" if controllers == "" else f"hierarchy {controllers}"


def misplaced(want: Mapping[str, str], got: Mapping[int, Mapping[str, str]]) -> list[str]:
    """What differs between the container's cgroups (``want``: controllers to path, from its PID 1)
    and each process's (``got``: host pid to the same), one line per process and hierarchy: a
    hierarchy of the container's the process is not in, one it is in and the container's PID 1 is
    not (the kernel lists every hierarchy for every process, so such a line was written by no
    kernel of this node's), a path that is not the container's. Empty when every process is where
    its container is."""
    out: list[str] = []
    for pid in sorted(got):
        have = got[pid]
        for h in sorted(want.keys() | have.keys()):
            if h not in have:
                out.append(f"host pid {pid}: in no cgroup of {hierarchy(h)} (the container's is {want[h]!r})")
            elif h not in want:
                out.append(f"host pid {pid}: in {have[h]!r} of {hierarchy(h)}, which the container's PID 1 is "
                           "not in")
            elif have[h] != want[h]:
                out.append(f"host pid {pid}: in {have[h]!r} of {hierarchy(h)}, not the container's {want[h]!r}")
    return out


def restored(w: W.WorkerProcs, root: NsPid, proc: Path = PROC) -> list[ProcStatus]:
    """The processes a restore brought back into ``w``'s container: the restored root (``root``, its
    pid in the pod's pid namespace) and its descendants, in that namespace or any below it, and every
    process of the namespace that was not there when ``w`` was observed (before the restore: a
    restored process already orphaned to the entrypoint, a child one forked since). Never the
    container's PID 1; never a zombie. Sorted by host pid."""
    before = {p.pid for p in w.procs}
    found: dict[HostPid, ProcStatus] = {}
    for st in procfs.in_pid_ns(w.pidns, proc):
        if st.ns_pid == root:
            for pid in procfs.tree(st.pid, proc):
                if (d := procfs.status(pid, proc)) is not None:
                    found[d.pid] = d
        elif st.pid not in before:
            found[st.pid] = st
    return sorted((st for st in found.values() if st.pid != w.entrypoint and st.state not in _GONE),
                  key=lambda st: st.pid)


def check(entrypoint: int, pids: Iterable[int], proc: Path = PROC) -> list[str]:
    """:func:`misplaced` for ``pids`` against the container's PID 1 ``entrypoint``, read from ``/proc``
    now. A process gone meanwhile runs nowhere and is left out; one whose cgroups cannot be read as the
    kernel writes them (procfs.CgroupsUnreadable) is named, as is a PID 1 whose cannot: nothing then
    says the tree is in its container."""
    try:
        want = procfs.cgroups(entrypoint, proc)
    except procfs.CgroupsUnreadable as e:
        return [f"the container's PID 1 (host pid {entrypoint}): {e}"]
    if want is None:
        return [f"the container's PID 1 (host pid {entrypoint}) is gone: its cgroups cannot be compared"]
    got: dict[int, Mapping[str, str]] = {}
    unreadable: list[str] = []
    for pid in pids:
        try:
            cg = procfs.cgroups(pid, proc)
        except procfs.CgroupsUnreadable as e:
            unreadable.append(f"host pid {pid}: {e}")
            continue
        if cg is not None:
            got[pid] = cg
    return unreadable + misplaced(want, got)
