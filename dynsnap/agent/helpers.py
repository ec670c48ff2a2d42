"""The agent's running helpers (CRIU under nsenter, dynsnap-cuda), recorded where only the agent
writes: a registry on the node, so an agent that restarted finds the helpers an earlier agent
process started, waits for them, kills one only past its bound, and never takes any other process
for one of them.

Layer: ``dynsnap.agent``. CRIU is not killed when the agent dies (killed mid-dump it can leave its
parasite in the worker, dynsnap/agent/criu.py), so a restarted agent must find it. Finding helpers by
a marker in their environment (``DYNSNAP_OP=<pod uid>/...``, before) let any process on the node
pass for one: it stalled that pod's captures and wakes, and was then killed by the agent. Here a
helper is what the agent recorded when it started it, and nothing a process can set about itself:

- the registry is a directory under the agent's state dir (a node path only the agent mounts),
  mode 0700, one small JSON file per running helper;
- a record is written right after the spawn (the exec done): its pid, its start time
  (``/proc/<pid>/stat`` field 22, clock ticks since boot), the executable it runs
  (``/proc/<pid>/exe``), the pod UID and operation, and the boot id, read while the process at that
  pid is checked to be the agent's own child (asyncio reaps a child from a thread the moment it
  exits, so a quick helper can be gone already: then it runs no more and needs no record, and a pid
  reused meanwhile is another process's child). A record that cannot be written kills the helper
  (``SpawnHook``): none runs unrecorded;
- a record stands for a running helper only while the boot id, the pid, the start time and the
  executable all agree with ``/proc``; any other record is stale (its helper ended while no agent
  watched, or the node rebooted) and is removed. The record is removed once the helper is reaped;
- a helper is signalled only through a pidfd opened *before* that check is made again (the pidfd
  pins the process: a pid reused meanwhile fails the check), and with it the processes of its
  session, each through its own pidfd: every helper is started in a session of its own
  (run_command), which no process can join from outside, and whose id cannot be reused while any
  member lives. No other process is ever signalled;
- a record whose process is gone still stands for a running helper while a process of its session
  lives: CRIU outlives its launcher (dynsnap-nsexec), which the agent recorded, when the agent's
  container is stopped (dynsnap/agent/criu.py), and the next agent waits for it as for any helper.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dynsnap.models.ids import HostPid, PodUID
from dynsnap.runtime import procfs
from dynsnap.runtime.command import SpawnHook
from dynsnap.runtime.procfs import PROC

__all__ = ["HelperRegistry", "RunningHelper"]

REGISTRY_DIR = "helpers"  # under the agent's state dir


@dataclass(frozen=True)
class RunningHelper:
    pid: HostPid  # the process that runs: the recorded one, or (it gone) one of its session
    name: str  # its command name (comm)
    label: str  # "<pod uid>/<operation>" (criu, save, resume, unlock, rollback)
    age: float  # seconds since it started
    leader: HostPid | None = None  # the recorded process (the session's id), when it is not ``pid``


@dataclass(frozen=True)
class _Stat:
    state: str
    ppid: int
    session: int
    start: int  # clock ticks after boot


def _stat(pid: int, proc: Path) -> _Stat | None:
    try:
        text = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    # comm (field 2) may hold spaces and parentheses: the fields after it start at the last ")"
    fields = text.rsplit(")", 1)[-1].split()
    try:
        return _Stat(state=fields[0], ppid=int(fields[1]), session=int(fields[3]), start=int(fields[19]))
    except (IndexError, ValueError):
        return None


def _exe(pid: int, proc: Path) -> str | None:
    try:
        return os.readlink(proc / str(pid) / "exe").removesuffix(" (deleted)")
    except OSError:
        return None


class HelperRegistry:
    """The registry under ``root`` (``<state dir>/helpers``); ``proc`` is the node's /proc."""

    def __init__(self, root: Path, *, proc: Path = PROC) -> None:
        self.root = root
        self.proc = proc

    def _this_boot(self, rec: dict[str, Any]) -> bool:
        """The record was written since the node last booted (a pid of an earlier boot names nothing now)."""
        return rec.get("bootId") == self._boot_id()

    def _boot_id(self) -> str:
        try:
            return (self.proc / "sys" / "kernel" / "random" / "boot_id").read_text().strip()
        except OSError:
            return ""

    # -- recording ------------------------------------------------------------------------------

    def spawned(self, label: str) -> SpawnHook:
        """The hook that records a helper run for ``label`` (``<pod uid>/<operation>``) once it runs,
        and drops the record once it is reaped (runtime.command.run_command's ``on_spawn``)."""
        def hook(pid: int) -> Callable[[], None]:
            path = self.record(pid, label)
            return (lambda: None) if path is None else (lambda: path.unlink(missing_ok=True))
        return hook

    def record(self, pid: int, label: str, *, parent: int | None = None) -> Path | None:
        """Write the record of the helper ``pid``, a child of ``parent`` (this process); None when that
        child has exited already (nothing runs: nothing to record). OSError when it cannot be written."""
        st, exe = _stat(pid, self.proc), _exe(pid, self.proc)
        if st is None or exe is None or st.state in ("Z", "X") or st.ppid != (os.getpid() if parent is None
                                                                            else parent):
            return None
        uid, _, op = label.partition("/")
        body = {"pid": pid, "start": st.start, "exe": exe, "podUID": uid, "op": op, "bootId": self._boot_id()}
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.root.chmod(0o700)
        path = self.root / f"{pid}-{st.start}.json"
        tmp = self.root / f".{path.name}.{secrets.token_hex(8)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(body, f)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return path

    # -- finding ---------------------------------------------------------------------------------

    def _records(self) -> list[tuple[Path, dict[str, Any]]]:
        out = []
        try:
            entries = sorted(self.root.glob("*.json"))
        except OSError:
            return []
        for path in entries:
            try:
                rec = json.loads(path.read_text())
            except (OSError, ValueError):
                continue  # being written (temp names do not end in .json), or gone meanwhile
            if isinstance(rec, dict):
                out.append((path, rec))
        return out

    def _matches(self, rec: dict[str, Any]) -> _Stat | None:
        """The helper's /proc stat when ``rec`` is the process now at its pid, else None."""
        pid = rec.get("pid")
        if not isinstance(pid, int) or not self._this_boot(rec):
            return None
        st = _stat(pid, self.proc)
        if st is None or st.start != rec.get("start") or st.state in ("Z", "X"):
            return None
        return st if _exe(pid, self.proc) == rec.get("exe") else None

    def _session(self, rec: dict[str, Any]) -> list[HostPid]:
        """The processes of the recorded helper's session once the helper itself is gone (CRIU, which outlives
        its launcher: dynsnap/agent/criu.py). A session's id is its leader's pid, which the kernel keeps from
        reuse while any member lives: a process of that session is the helper's, started after it."""
        pid = rec.get("pid")
        if not isinstance(pid, int) or not self._this_boot(rec):
            return []
        now = _stat(pid, self.proc)
        if now is not None and now.state not in ("Z", "X"):
            return []  # another process holds the number now: the helper's session, which kept it, is gone
        out = []
        for p in procfs.pids(self.proc):
            st = _stat(p, self.proc)
            if st is not None and st.session == pid and st.state not in ("Z", "X") and st.start >= rec.get("start", 0):
                out.append(p)
        return out

    def running(self, uid: PodUID) -> list[RunningHelper]:
        """The helpers recorded for pod ``uid`` that still run (the recorded process, or once it is gone a
        process of its session); stale records (of any pod) are removed."""
        out = []
        ticks = os.sysconf("SC_CLK_TCK")
        now = self._uptime()
        for path, rec in self._records():
            st = self._matches(rec)
            members = [] if st is not None else self._session(rec)
            if st is None and not members:
                path.unlink(missing_ok=True)
                continue
            if rec.get("podUID") != uid:
                continue
            leader = HostPid(int(rec["pid"]))
            pid = leader if st is not None else members[0]
            status = procfs.status(pid, self.proc)
            name = status.name if status is not None else "?"
            out.append(RunningHelper(pid=pid, name=name, label=f"{rec['podUID']}/{rec.get('op')}",
                                     age=max(now - int(rec["start"]) / ticks, 0.0),
                                     leader=None if pid == leader else leader))
        return out

    def _uptime(self) -> float:
        try:
            return float((self.proc / "uptime").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return 0.0

    # -- killing ---------------------------------------------------------------------------------

    def kill(self, helper: RunningHelper) -> bool:
        """SIGKILL ``helper`` and the processes of its session, each through a pidfd opened before
        its identity was checked. False (nothing signalled) when it is no longer the recorded helper."""
        leader = helper.leader if helper.leader is not None else helper.pid
        rec = next((r for _, r in self._records() if r.get("pid") == leader), None)
        if rec is None:
            return False
        fds: list[int] = []
        try:
            if helper.leader is None:  # the recorded process itself
                try:
                    fds.append(os.pidfd_open(leader))
                except ProcessLookupError:
                    return False
                if self._matches(rec) is None:  # checked with the process pinned: a reused pid fails here
                    return False
            for pid in procfs.pids(self.proc):
                if pid == leader:
                    continue
                st = _stat(pid, self.proc)
                if st is None or st.session != leader:
                    continue
                with contextlib.suppress(ProcessLookupError):
                    fd = os.pidfd_open(pid)
                    st = _stat(pid, self.proc)  # again, with the pidfd pinning the process it names
                    if st is not None and st.session == leader:
                        fds.append(fd)
                    else:
                        os.close(fd)
            if not fds:
                return False
            for fd in fds:
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
            return True
        finally:
            for fd in fds:
                os.close(fd)
