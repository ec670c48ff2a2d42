"""The agent's side of ``dynsnap-nsexec`` (native/nsexec, docs/NATIVE.md): every program the agent starts
inside a worker's namespaces (CRIU, ``ss``) goes through here, so a reviewer audits one module.

Layer: ``dynsnap.agent``. The agent is root on the node, and everything of a worker's is the pod
author's: its file system, its ``/proc``, its PID 1. So:

- **No program the agent starts ever enters a worker's mount namespace.** ``nsenter -m`` ran the
  program's dynamic loader there, which reads ``/etc/ld.so.preload`` by path, the pod's: a library the
  pod named ran as the node's root. ``dynsnap-nsexec`` enters only pid, net, ipc, uts and cgroup
  namespaces; the program is a file of the agent's, loaded by the agent's loader with the agent's
  libraries. Given ``private_mounts`` it runs in a mount namespace of its own, a copy of the agent's with
  every mount private and a fresh ``/proc`` for the worker's pid namespace: whatever it mounts (CRIU's
  cgroup yard on a restore, its cgroup mounts on a dump) is seen by nobody else and goes with it.
  CRIU reaches the worker's files through the tree root's ``/proc/<pid>/root`` on a dump
  (``--tree-mntns``, hack/patches/criu/0003) and joins the worker's mount namespace on a restore
  (``--join-ns mnt``) only in the restored tasks, through a descriptor the launcher checked.
- **The target is pinned from the look to the act**: its pidfd is opened here and its start time checked
  against the one the agent saw when it located the worker (``/proc/<pid>/stat`` field 22); the launcher
  takes the pidfd, opens the namespaces while the pidfd shows the process alive, and checks the start
  time again.
- **Only the namespaces the runtime made are entered**: the target's user namespace must be the node's
  (the agent's) and every namespace entered, and its mount namespace, owned by it. A PID 1 that moved
  itself into a user namespace of its own (where seccomp is Unconfined and unprivileged user
  namespaces are allowed) owns whatever namespaces it then makes, and would otherwise decide what
  CRIU, root on the node, is pointed at. :func:`foreign_namespaces` makes the same check when the agent
  locates a worker, so the refusal (``ForeignNamespace``) comes before any helper runs; the launcher
  makes it again at the act (exit 122).

    ForeignNamespace    (a ContainerRefused) the target's namespaces are not the ones the runtime made
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from dynsnap.agent.container import ContainerRefused
from dynsnap.models.ids import HostPid
from dynsnap.models.protocol import Reason
from dynsnap.runtime import procfs
from dynsnap.runtime.command import CommandResult, SpawnHook, find_tool, run_command
from dynsnap.runtime.procfs import PROC

__all__ = ["EXIT_REFUSED", "MNTNS", "ForeignNamespace", "Target", "TargetChanged", "foreign_namespaces", "run_in"]

EXIT_REFUSED: Final = 122  # dynsnap-nsexec: the namespaces are not the runtime's (its "refused:" line says how)
NSEXEC: Final = "dynsnap-nsexec"
MNTNS: Final = "{target-mntns}"  # in run_in's argv: where the program finds the target's mount namespace
# What the worker's tree lives in, and CRIU must be in: the pid namespace (a restore into an existing one
# needs CRIU started in it), net (its sockets, the network lock), ipc and uts (a namespace CRIU is not in
# is one it dumps and makes anew), cgroup (CRIU refuses a dump from another one).
TREE_NAMESPACES: Final = ("pid", "net", "ipc", "uts", "cgroup")
_NS_GET_USERNS: Final = 0xB701  # _IO(0xb7, 0x1), linux/nsfs.h


class ForeignNamespace(ContainerRefused):
    reason = Reason.FOREIGN_NAMESPACE


class TargetChanged(ProcessLookupError):
    """The process at the target's pid is gone, or another one than the agent saw."""


@dataclass(frozen=True)
class Target:
    """The process whose namespaces a program is started in: the worker container's PID 1
    (dynsnap-entrypoint, which stays while the worker sleeps), by its host pid and the start time the
    agent saw (clock ticks after boot; None: whatever process is at that pid when it is opened)."""

    host_pid: HostPid
    start: int | None = None

    @classmethod
    def of(cls, pid: HostPid, proc: Path = PROC) -> Target:
        return cls(pid, procfs.start_time(pid, proc))

    @contextlib.contextmanager
    def pidfd(self, proc: Path = PROC) -> Iterator[int]:
        """A pidfd of the target, checked (with the process pinned by it) to be the process the agent saw."""
        try:
            fd = os.pidfd_open(self.host_pid)
        except ProcessLookupError as e:
            raise TargetChanged(f"process {self.host_pid} has exited") from e
        try:
            if self.start is not None and procfs.start_time(self.host_pid, proc) != self.start:
                raise TargetChanged(f"process {self.host_pid} is not the one the agent located (another start "
                                    "time): the worker's container was restarted")
            yield fd
        finally:
            os.close(fd)


async def run_in(target: Target, argv: Sequence[str], *, timeout: float, namespaces: Sequence[str] = TREE_NAMESPACES,
                 private_mounts: bool = False, pass_mntns: bool = False, join_cgroups: bool = False,
                 outlive: bool = False, env: Mapping[str, str] | None = None, nsexec: str = NSEXEC,
                 on_spawn: SpawnHook | None = None) -> CommandResult:
    """Run ``argv`` (``argv[0]`` an absolute path of the agent's) in ``target``'s ``namespaces`` through
    dynsnap-nsexec, within ``timeout`` seconds (run_command: killed with its session past it). With
    ``pass_mntns`` the target's mount namespace is open at a descriptor of the program's: :data:`MNTNS`
    in an argument stands for its ``/proc/self/fd/N`` path (CRIU's ``--join-ns mnt:``). ``join_cgroups``: the
    program runs in the target's own cgroups (accounted and limited as its container; what it restores
    inherits them). ``outlive``: the program goes on when the launcher, or this process, ends (the agent's
    container stopped: its runtime kills its processes by cgroup, which with ``join_cgroups`` the program
    left): recorded by ``on_spawn``, a later agent finds it; the time bound still kills it.
    :class:`ForeignNamespace` when the launcher refused the namespaces, :class:`TargetChanged` when the
    target is gone or another process; else the command's result (the caller reads the exit code)."""
    with target.pidfd() as pidfd:
        launcher = [_abs(nsexec), "--target-pidfd", str(pidfd)]
        if target.start is not None:
            launcher += ["--target-start", str(target.start)]
        launcher += ["--ns", ",".join(namespaces)]
        if private_mounts:
            launcher.append("--private-mounts")
        if join_cgroups:
            launcher.append("--join-cgroups")
        if outlive:
            launcher.append("--outlive")
        if pass_mntns:
            # free in the launcher when it dups there: only 0-2, the pidfd and that namespace's own are open
            launcher += ["--mntns-fd", str(pidfd + 1)]
        program = [a.replace(MNTNS, f"/proc/self/fd/{pidfd + 1}") for a in argv]
        res = await run_command([*launcher, "--", *program], timeout=timeout, check=False, env=env,
                                pass_fds=[pidfd], on_spawn=on_spawn, kill_on_cancel=not outlive)
    if res.returncode == EXIT_REFUSED:
        line = next((x for x in res.stderr.splitlines() if "refused:" in x), res.stderr.strip())
        raise ForeignNamespace(line.split("refused:", 1)[-1].strip()[:1000])
    return res


def _abs(binary: str) -> str:
    return binary if os.path.isabs(binary) else find_tool(binary)


def _owner_inode(path: Path) -> int:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        owner = fcntl.ioctl(fd, _NS_GET_USERNS)
        try:
            return os.fstat(owner).st_ino
        finally:
            os.close(owner)
    finally:
        os.close(fd)


def foreign_namespaces(pid: HostPid, proc: Path = PROC) -> str | None:
    """Why the namespaces of process ``pid`` are not ones the runtime made for a container, or None: its
    user namespace is not the node's (this agent's), or its mount namespace or one the agent enters
    is owned by another user namespace. The launcher checks the same at the act; this is the look, so
    that the refusal comes before anything runs. An OSError when the process is gone."""
    node = os.stat(proc / "self" / "ns" / "user").st_ino
    ns = proc / str(pid) / "ns"
    user = os.stat(ns / "user").st_ino
    if user != node:
        return (f"process {pid} (the container's PID 1) is in user namespace {user}, not the node's ({node}): "
                "it made one of its own, or the pod runs with hostUsers: false (not supported)")
    for kind in ("mnt", *TREE_NAMESPACES):
        owner = _owner_inode(ns / kind)
        if owner != node:
            return (f"the {kind} namespace of process {pid} (the container's PID 1) is owned by user namespace "
                    f"{owner}, not the node's ({node}): not one the runtime made")
    return None
