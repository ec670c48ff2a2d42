"""Pod sandboxes: the part of kubelet + container runtime that runs a pod's process.

Layer: ``dynsnap.testenv`` (test harness only). Takes plain data (names, UID, IP,
argv, env), never Kubernetes objects; writing pod status and probing belong to
the caller.

A :class:`PodSandbox` is one single-container pod, built the way a container
runtime would, so that the agent finds its processes as on a real node:

- network: its own netns from :class:`~dynsnap.testenv.netns.SandboxNetwork`,
  ``eth0`` = the pod IP on the test bridge, ``lo`` up, default route via the
  gateway;
- pid + mount namespaces: ``unshare --pid --fork --mount --mount-proc
  --propagation private``; the container command is PID 1 there and a session
  leader (``setsid``), as under runc;
- stdio: ``/dev/null`` in, stdout+stderr to :attr:`PodSandbox.log_path`, opened
  *inside* the mount namespace (CRIU refuses fds opened in another mount
  namespace: "Can't lookup mount=... for fd");
- cgroup: joined before exec, kubelet-cgroupfs style and carrying the pod UID,
  ``/<cgroup_parent>/kubepods/besteffort/pod<uid>/<container-id>`` in every v1
  hierarchy but ``memory`` (``cpuset`` given its parent's CPUs and memory nodes)
  and in the unified (v2) one when it is mounted and writable. (The v1 ``memory``
  hierarchy is left alone: the harness's own memory limit must keep applying.)
  Every hierarchy, as runc does: CRIU dumps the subtree of each cgroup the tree is
  in and restores its properties, so a pod left in a root cgroup (devices, cpuset)
  made a restore rewrite the whole host's tree, a real node's pods included
  ("Failed writing a to devices//<node root>/kubepods/.../devices.deny");
- env: exactly the pod env, plus a default ``PATH`` when the env has none (an
  image would supply one);
- emptyDir volumes: a tmpfs mounted at each of ``mounts`` inside the pod's mount
  namespace only, as a runtime gives each pod its own emptyDir (so every pod can
  use ``/run/dynsnap`` as its control directory, and the node reaches it only
  through ``/proc/<pid>/root``);

Process chain: ``bash`` (joins the cgroups) → ``setpriv --pdeathsig KILL`` → ``ip netns exec``
→ ``unshare ... --kill-child`` → PID 1 (``setsid`` → ``bash -c 'exec CMD >LOG'``). All
but the fork in ``unshare`` are execs, so :attr:`PodSandbox.pid` is the only child
of the process we spawned; if the test process dies, the whole pod dies with it
(pdeathsig), and :meth:`SandboxNetwork.up` removes the namespaces left behind.

Interface::

    net = SandboxNetwork(bridge="dsnbr0", cidr="10.213.0.0/16"); await net.up()
    sb = await PodSandbox.start(net=net, name=..., namespace=..., uid=..., pod_ip="10.213.0.10",
                                command=[...], env={...}, workdir=Path(...))
    sb.pid / sb.netns / sb.log_path / sb.cgroup_paths / sb.alive()
    rc, out, err = await sb.exec(["cat", "/proc/1/status"], timeout=5)   # pod's ns + cgroup
    sb.nsenter_argv() + ["criu", ...]      # pod's pid+mount+net ns (no cgroup join)
    sb.host_pid(ns_pid)                    # host pid of an in-namespace pid
    await sb.stop(grace=5.0); await net.down()
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shlex
import signal
import time
from pathlib import Path

from dynsnap.testenv.netns import CommandError, SandboxNetwork, find_tool, run_command

__all__ = ["CommandError", "PodSandbox", "SandboxError", "SandboxNetwork", "remove_empty_cgroups"]

_CGROUP_ROOT = Path("/sys/fs/cgroup")
# v1 hierarchies a pod joins (those mounted here); "systemd" is the name=systemd one. Not "memory":
# moving test processes out of the harness's memory cgroup would lift its limit.
_V1_HIERARCHIES = ("pids", "systemd", "devices", "cpuset", "cpu", "cpuacct", "blkio", "freezer")
_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class SandboxError(RuntimeError):
    """A sandbox could not be started, or its PID 1 could not be found."""


def _cgroup_dirs(cgroup_parent: str, uid: str, container_id: str) -> list[Path]:
    rel = Path(cgroup_parent.strip("/")) / "kubepods" / "besteffort" / f"pod{uid}" / container_id
    dirs = [_CGROUP_ROOT / h / rel for h in _V1_HIERARCHIES if (_CGROUP_ROOT / h / "cgroup.procs").exists()]
    unified = _CGROUP_ROOT / "unified"
    if (unified / "cgroup.procs").exists() and os.access(unified, os.W_OK):
        dirs.append(unified / rel)
    elif (_CGROUP_ROOT / "cgroup.controllers").exists():  # pure cgroup v2 host
        dirs.append(_CGROUP_ROOT / rel)
    return dirs


def _status_field(pid: int, field: str) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    for line in text.splitlines():
        if line.startswith(field + ":"):
            return line.split(":", 1)[1].split()
    return None


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (FileNotFoundError, ProcessLookupError):
        return []


class PodSandbox:
    """One running pod sandbox. Create with :meth:`start`; always :meth:`stop`."""

    def __init__(
        self,
        *,
        net: SandboxNetwork,
        name: str,
        namespace: str,
        uid: str,
        pod_ip: str,
        netns: str,
        log_path: Path,
        cgroup_paths: list[Path],
    ) -> None:
        self.net = net
        self.name = name
        self.namespace = namespace
        self.uid = uid
        self.pod_ip = pod_ip
        self.netns = netns
        self.log_path = log_path
        self.cgroup_paths = cgroup_paths
        self.cgroup_parent = "dynsnap-test"
        self.pid = 0
        self._proc: asyncio.subprocess.Process | None = None
        self._pidns: int | None = None
        self._env: dict[str, str] = {}
        self._killed = False

    @classmethod
    async def start(
        cls,
        *,
        net: SandboxNetwork,
        name: str,
        namespace: str,
        uid: str,
        pod_ip: str,
        command: list[str],
        env: dict[str, str],
        workdir: Path,
        cgroup_parent: str = "dynsnap-test",
        container: str = "main",
        startup_timeout: float = 10.0,
        mounts: list[str] | None = None,
    ) -> PodSandbox:
        """Start the pod: network, cgroups, namespaces, then ``command`` as PID 1.

        ``workdir`` holds the container log (``<name>.log``); the command's cwd is
        ``workdir`` too. On any failure everything made so far is removed.
        """
        if not command:
            raise ValueError("empty command")
        _mkdirs([workdir])
        container_id = hashlib.sha256(f"{uid}/{container}".encode()).hexdigest()
        sb = cls(
            net=net, name=name, namespace=namespace, uid=uid, pod_ip=pod_ip,
            netns=net.netns_name(namespace=namespace, name=name, uid=uid),
            log_path=workdir / f"{name}.log",
            cgroup_paths=_cgroup_dirs(cgroup_parent, uid, container_id),
        )
        sb.cgroup_parent = cgroup_parent
        net.on_down(sb.netns, lambda: sb.stop(grace=0))
        try:
            await sb._launch(command, env, workdir, startup_timeout, mounts or [])
        except BaseException:
            await sb.stop(grace=0)
            raise
        return sb

    async def _launch(self, command: list[str], env: dict[str, str], workdir: Path, limit: float,
                      mounts: list[str]) -> None:
        await self.net.attach(self.netns, self.pod_ip, hostname=self.name)
        _mkdirs(self.cgroup_paths)
        q = shlex.quote
        log = q(str(self.log_path))
        # PID 1 joins the pod cgroups itself, from inside its namespaces (`ip netns
        # exec` remounts /sys, so through fds the launcher opened); unshare stays
        # in the caller's cgroup, as a container runtime's shim does.
        run = f"exec {q(find_tool('setsid'))} {shlex.join(command)} >{log} 2>&1 </dev/null"
        volumes = "".join(f"mkdir -p {q(m)} && mount -t tmpfs -o mode=0755,size=64m emptydir {q(m)} && "
                          for m in mounts)
        inner = self._join_cgroups() + volumes + run
        chain = [
            find_tool("setpriv"), "--pdeathsig", "KILL",
            find_tool("ip"), "netns", "exec", self.netns,
            find_tool("unshare"), "--pid", "--fork", "--kill-child", "--mount", "--mount-proc",
            "--propagation", "private", "--", find_tool("bash"), "-c", inner,
        ]
        pod_env = dict(env)
        pod_env.setdefault("PATH", _DEFAULT_PATH)
        self._proc = await asyncio.create_subprocess_exec(
            find_tool("bash"), "-c", self._open_cgroups() + "exec " + shlex.join(chain),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE, env=pod_env, cwd=workdir, start_new_session=True,
        )
        self._env = pod_env
        self.pid = await self._find_pid1(limit)
        self._pidns = os.stat(f"/proc/{self.pid}/ns/pid").st_ino

    async def _find_pid1(self, limit: float) -> int:
        """The unshare process's child whose innermost pid is 1 and that is in the pod cgroups."""
        assert self._proc is not None
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if self._proc.returncode is not None:
                break
            for child in _children(self._proc.pid):
                nspid = _status_field(child, "NSpid")
                if nspid and len(nspid) >= 2 and nspid[-1] == "1" and self._joined(child):
                    return child
            await asyncio.sleep(0.02)
        err = b""
        if self._proc.returncode is not None and self._proc.stderr is not None:
            with contextlib.suppress(TimeoutError):
                err = await asyncio.wait_for(self._proc.stderr.read(), 1.0)
        try:
            log_tail = self.log_path.read_bytes()[-1500:].decode(errors="replace")
        except FileNotFoundError:
            log_tail = "(no log)"
        raise SandboxError(
            f"pod {self.namespace}/{self.name}: no PID 1 within {limit} s "
            f"(launcher rc={self._proc.returncode}, stderr={err.decode(errors='replace').strip()!r});"
            f" container log {self.log_path}:\n{log_tail}"
        )

    # The pod's cgroup.procs files, opened as fds 3, 4, ... by the launching shell
    # (host view of /sys) and written "0" (= the writer itself) by the shell that
    # then execs the pod's process inside its namespaces. Fds closed before exec.
    # Both shells are bash: there are more than seven, and dash reads one digit.
    def _open_cgroups(self) -> str:
        return "".join(
            f"exec {3 + i}>{shlex.quote(str(d / 'cgroup.procs'))}; " for i, d in enumerate(self.cgroup_paths)
        )

    def _join_cgroups(self) -> str:
        fds = [str(3 + i) for i in range(len(self.cgroup_paths))]
        return "".join(f"echo 0 >&{fd} && exec {fd}>&- && " for fd in fds)

    def _joined(self, pid: int) -> bool:
        """PID 1 has joined every pod cgroup (it does so before exec'ing the command)."""
        try:
            text = Path(f"/proc/{pid}/cgroup").read_text()
        except (FileNotFoundError, ProcessLookupError):
            return False
        return text.count(f"/pod{self.uid}/") >= len(self.cgroup_paths)

    def alive(self) -> bool:
        """True while PID 1 runs (not a zombie) in this sandbox's pid namespace."""
        if self.pid <= 0 or self._proc is None or self._proc.returncode is not None:
            return False
        state = _status_field(self.pid, "State")
        if not state or state[0] in ("Z", "X"):
            return False
        try:
            return os.stat(f"/proc/{self.pid}/ns/pid").st_ino == self._pidns
        except FileNotFoundError:
            return False

    @property
    def pid_namespace(self) -> int | None:
        """The inode of the pod's pid namespace, as it was at start (also once the pod has stopped)."""
        return self._pidns

    def nsenter_argv(self) -> list[str]:
        """Prefix that runs a command in the pod's pid, mount and net namespaces.

        Used for CRIU (which must see the pod's pids and ``/proc`` and dump its
        sockets in place); the command keeps the caller's cgroup, as a node
        agent's would.
        """
        return [find_tool("nsenter"), "-t", str(self.pid), "-p", "-m", "-n", "--"]

    async def exec(self, argv: list[str], *, timeout: float) -> tuple[int, str, str]:
        """Run ``argv`` in the pod (namespaces and cgroup, like ``kubectl exec``).

        Returns ``(returncode, stdout, stderr)``; raises :class:`CommandError`
        with ``returncode`` None when it runs past ``timeout``.
        """
        inner = [find_tool("bash"), "-c", self._join_cgroups() + 'exec "$@"', "bash", *argv]
        outer = self._open_cgroups() + "exec " + shlex.join(self.nsenter_argv() + inner)
        wrapped = [find_tool("bash"), "-c", outer]
        res = await run_command(wrapped, timeout=timeout, check=False, env=self._env)
        return res.returncode, res.stdout, res.stderr

    def host_pid(self, ns_pid: int) -> int | None:
        """The host pid of the process that is ``ns_pid`` in this pod's pid namespace."""
        if self._pidns is None:
            return None
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            nspid = _status_field(int(entry.name), "NSpid")
            if not nspid or len(nspid) < 2 or nspid[-1] != str(ns_pid):
                continue
            with contextlib.suppress(FileNotFoundError):
                if os.stat(f"/proc/{entry.name}/ns/pid").st_ino == self._pidns:
                    return int(entry.name)
        return None

    async def stop(self, *, grace: float = 5.0) -> int | None:
        """SIGTERM PID 1, SIGKILL after ``grace`` s, reap; remove netns, veth, cgroups.

        Returns the container's exit status: its own exit code, 137 if it had to
        be SIGKILLed, None if it could not be reaped. Idempotent.
        A PID 1 without a SIGTERM handler ignores SIGTERM (pid-namespace init
        rule), so such a command is killed after ``grace``, as under kubelet.
        """
        rc: int | None = None
        try:
            if self._proc is not None:
                rc = await self._terminate(grace)
        finally:
            try:
                await self._remove_cgroups()
            finally:
                await self.net.detach(self.netns)
                self.net.on_down(self.netns, None)
        return rc

    async def _terminate(self, grace: float) -> int | None:
        proc = self._proc
        assert proc is not None
        if proc.returncode is None and self.pid > 0:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), grace)
        if proc.returncode is None and self.pid > 0:
            # Killing PID 1 kills its whole pid namespace; unshare reaps it and exits.
            # (Killing unshare too would orphan PID 1 to the host's init, unreaped.)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
                self._killed = True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), 5.0)
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), 5.0)
        if proc.returncode is None:
            return None
        # unshare (util-linux 2.38) exits 1 when its child dies by a signal, so a
        # kill is reported as kubelet would: 128 + SIGKILL.
        return 128 + signal.SIGKILL if self._killed else proc.returncode

    async def _remove_cgroups(self, limit: float = 5.0) -> None:
        """Kill anything left in the pod's cgroups (exec'd tools), then rmdir them."""
        deadline = time.monotonic() + limit
        for leaf in self.cgroup_paths:
            for d in (leaf, leaf.parent):  # container, then pod<uid>
                while not _rmdir(d):
                    if time.monotonic() > deadline:
                        raise SandboxError(f"cannot remove cgroup {d}: still busy after {limit} s")
                    for p in _cgroup_pids(d):
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(p, signal.SIGKILL)
                    await asyncio.sleep(0.05)
            # Shared parents (<cgroup_parent>/kubepods/besteffort) go when empty.
            depth = 2 + len(Path(self.cgroup_parent.strip("/")).parts)
            for d in list(leaf.parents)[1 : 1 + depth]:
                _rmdir(d)


def remove_empty_cgroups(cgroup_parent: str = "dynsnap-test") -> list[Path]:
    """Remove empty pod cgroups under ``cgroup_parent`` (left by a crashed run).

    Only empty directories go (rmdir fails on a cgroup with processes), so pods
    of a concurrent session are untouched. Returns what is left.
    """
    left: list[Path] = []
    for root in {d.parents[len(Path(cgroup_parent.strip("/")).parts) + 3]
                 for d in _cgroup_dirs(cgroup_parent, "x", "x")}:
        top = root / cgroup_parent.strip("/")
        if not top.exists():
            continue
        for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
            try:
                d.rmdir()
            except OSError:
                left.append(d)
        with contextlib.suppress(OSError):
            top.rmdir()
    return left


def _mkdirs(dirs: list[Path]) -> None:
    for d in dirs:
        if d.is_relative_to(_CGROUP_ROOT / "cpuset"):
            _mkdirs_cpuset(d)
        d.mkdir(parents=True, exist_ok=True)


def _mkdirs_cpuset(d: Path) -> None:
    """A v1 cpuset directory takes no process until its CPUs and memory nodes are set: each level
    made here gets its parent's."""
    parts = d.relative_to(_CGROUP_ROOT / "cpuset").parts
    for i in range(1, len(parts) + 1):
        level = _CGROUP_ROOT / "cpuset" / Path(*parts[:i])
        level.mkdir(exist_ok=True)
        for f in ("cpuset.cpus", "cpuset.mems"):
            if not (level / f).read_text().strip():
                (level / f).write_text((level.parent / f).read_text())


def _rmdir(d: Path) -> bool:
    """True when ``d`` is gone (removed now or absent); False while it is busy."""
    try:
        d.rmdir()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


def _cgroup_pids(d: Path) -> list[int]:
    pids: list[int] = []
    for sub in [d, *[p for p in d.rglob("*") if p.is_dir()]]:
        with contextlib.suppress(FileNotFoundError):
            pids += [int(x) for x in (sub / "cgroup.procs").read_text().split()]
    return pids

