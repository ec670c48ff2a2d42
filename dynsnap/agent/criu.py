"""CRIU dump and in-place restore of a worker tree inside a pod's namespaces.

Layer: ``dynsnap.agent``. The flags are the ones proven here on CRIU 4.2.1, kernel 6.18.

CRIU runs through ``nsenter -t <pod process> -p -m -n -i -u -C``: in the pod's pid, mount,
network, IPC, UTS and cgroup namespaces, so it sees the pod's ``/proc`` and pids, nothing
namespace-level is dumped or recreated, and a restore puts the tree back into the *same*
namespaces at the same in-namespace pids. (An agent pod has IPC and UTS namespaces of its own, and
on a cgroup v2 node a cgroup namespace too. A namespace of the worker's that CRIU is not in is one
CRIU dumps and on restore makes anew: without -i -u a woken worker landed in a new IPC namespace,
apart from its pod; and in the agent's cgroup namespace CRIU refuses the dump, "invalid cgroup
configuration, ... is not a suffix of /".) With
``--restore-detached`` CRIU exits after the restore and the restored root is reparented to the
namespace's PID 1 (dynsnap-entrypoint, a subreaper).

- ``pid`` is the in-namespace pid of the tree root (CRIU names images by in-namespace pid);
  never the namespace's PID 1. The entrypoint ``setsid``s the worker, so no ``--shell-job``.
- Live TCP connections: ``--tcp-established`` on both sides, with a network lock that needs no
  iptables binary: ``--network-lock nftables`` (libnftables).
- io_uring cannot be dumped: the worker must run with io_uring refused (the entrypoint's
  seccomp filter). :func:`classify` names that and other known causes from CRIU's log.
- ``LD_LIBRARY_PATH`` is never passed to CRIU (it would leak into the helpers CRIU spawns,
  e.g. ``cuda-checkpoint`` for the CUDA plugin, found via ``PATH``).
- The images directory is mode 0700 (images hold the worker's environment: secrets).
- CRIU is killed after ``timeout`` seconds: a wedged CRIU never blocks the next attempt. It is
  *not* killed when the agent dies: CRIU killed mid-dump can leave its parasite in a worker and
  its network lock in the pod, while a CRIU left to finish either completes the dump or resumes
  the tree itself. A restarted agent finds it by the ``DYNSNAP_OP`` marker in its environment
  (:func:`dynsnap.agent.worker.running_helpers`) and waits for it, within the same bound.

Where CRIU's binary and the images directory live on a real node (both must be reachable by
path inside the worker's mount namespace) is the installation's concern (deploy/); locally
the pod sandboxes share the node's filesystem.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dynsnap.models.ids import HostPid, NsPid
from dynsnap.runtime.command import CommandError, find_tool, run_command

__all__ = ["CriuError", "CriuResult", "NamespaceTarget", "classify", "criu_dump", "criu_restore"]

DUMP_LOG = "dump.log"
RESTORE_LOG = "restore.log"
DUMP_DONE = "Dumping finished successfully"


class CriuError(RuntimeError):
    """CRIU failed or timed out; ``log_tail`` holds the end of its log, ``cause`` a short name
    of the known cause found in it (``io_uring``, ``no_space``, ``pid_taken``, ``timeout``...)."""

    def __init__(self, message: str, *, log_path: Path, timed_out: bool = False) -> None:
        self.log_path = log_path
        self.log_tail = tail(log_path)
        self.timed_out = timed_out
        self.cause = "timeout" if timed_out else classify(self.log_tail)
        super().__init__(f"{message} [{self.cause}]\n--- {log_path} (tail) ---\n{self.log_tail}")


@dataclass(frozen=True)
class NamespaceTarget:
    """The namespaces CRIU works in, named by the host pid of any process in them (the pod's
    PID 1, dynsnap-entrypoint, which stays while the worker sleeps)."""

    host_pid: HostPid
    net: bool = True

    def nsenter_argv(self) -> list[str]:
        return [find_tool("nsenter"), "-t", str(self.host_pid), "-p", "-m", *(["-n"] if self.net else []),
                "-i", "-u", "-C", "--"]


@dataclass(frozen=True)
class CriuResult:
    images_dir: Path
    log_path: Path
    seconds: float
    pid: NsPid  # in-namespace pid of the tree root (dumped, or restored)


@dataclass(frozen=True)
class CriuOptions:
    binary: str
    tcp_established: bool = True
    network_lock: str | None = "nftables"
    extra_args: Sequence[str] = ()
    # PATH for CRIU: its CUDA plugin execs `cuda-checkpoint` from it (dynsnap-cuda's drop-in).
    path: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)


_CAUSES = (
    ("io_uring", re.compile(r"io_uring|Can't retrieve FDs|send_fds failed", re.I)),
    ("no_space", re.compile(r"No space left on device|ENOSPC|errno 28\b|\(28\)", re.I)),
    ("pid_taken", re.compile(r"(clone|fork).*(File exists|EEXIST)|Pid \d+ already|set_next_pid|ns_last_pid", re.I)),
    ("tcp", re.compile(r"tcp|socket", re.I)),
)


def classify(log_text: str) -> str:
    """A short name for the first known cause in a CRIU log (``unknown`` when none matches)."""
    errors = "\n".join(line for line in log_text.splitlines() if "Error" in line or "err" in line.lower())
    for name, pattern in _CAUSES:
        if pattern.search(errors or log_text):
            return name
    return "unknown"


def tail(path: Path, limit: int = 3000) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return "(no log)"
    return data[-limit:].decode(errors="replace")


def _private_dir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.chmod(0o700)  # also when it existed: images hold the worker's env (secrets)


def _env(opts: CriuOptions) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    env.update(opts.env)
    if opts.path is not None:
        env["PATH"] = opts.path
    env.pop("LD_LIBRARY_PATH", None)  # never, whoever set it
    return env


def _common(opts: CriuOptions) -> list[str]:
    args = ["-v4"]
    if opts.tcp_established:
        args.append("--tcp-established")
    if opts.network_lock:
        args += ["--network-lock", opts.network_lock]
    return args


async def _run(target: NamespaceTarget, argv: list[str], *, log_path: Path, timeout: float, opts: CriuOptions,
               what: str) -> float:
    t0 = time.monotonic()
    try:
        res = await run_command([*target.nsenter_argv(), *argv], timeout=timeout, check=False, env=_env(opts))
    except CommandError as e:  # timed out: CRIU and nsenter were killed
        raise CriuError(f"criu {what}: no exit within {timeout} s", log_path=log_path, timed_out=True) from e
    if res.returncode != 0:
        raise CriuError(f"criu {what} exited {res.returncode}: {res.stderr.strip()[-500:]}", log_path=log_path)
    return time.monotonic() - t0


async def criu_dump(target: NamespaceTarget, pid: NsPid, images_dir: Path, *, opts: CriuOptions,
                    timeout: float, leave_running: bool = False) -> CriuResult:
    """Dump the tree rooted at in-namespace ``pid`` into ``images_dir``; the tree is killed after a
    successful dump unless ``leave_running``. On failure CRIU leaves the tree running."""
    if pid == 1:
        raise ValueError("refusing to dump the namespace's PID 1: dump the worker subtree under it")
    _private_dir(images_dir)
    log_path = images_dir / DUMP_LOG
    argv = [opts.binary, "dump", "-t", str(pid), "-D", str(images_dir), "-o", DUMP_LOG, *_common(opts)]
    if leave_running:
        argv.append("--leave-running")
    argv += list(opts.extra_args)
    secs = await _run(target, argv, log_path=log_path, timeout=timeout, opts=opts, what="dump")
    return CriuResult(images_dir=images_dir, log_path=log_path, seconds=secs, pid=pid)


async def criu_restore(target: NamespaceTarget, images_dir: Path, *, opts: CriuOptions,
                       timeout: float) -> CriuResult:
    """Restore the tree in ``images_dir`` in place (same pids, same namespaces), detached."""
    log_path = images_dir / RESTORE_LOG
    pidfile = images_dir / "restore.pid"
    pidfile.unlink(missing_ok=True)
    argv = [opts.binary, "restore", "-D", str(images_dir), "-o", RESTORE_LOG, "--restore-detached",
            "--pidfile", str(pidfile), *_common(opts), *opts.extra_args]
    secs = await _run(target, argv, log_path=log_path, timeout=timeout, opts=opts, what="restore")
    try:
        pid = NsPid(int(pidfile.read_text().strip()))
    except (OSError, ValueError) as e:
        raise CriuError("criu restore wrote no pidfile", log_path=log_path) from e
    return CriuResult(images_dir=images_dir, log_path=log_path, seconds=secs, pid=pid)


def dump_completed(images_dir: Path) -> bool:
    """CRIU finished this dump (its log says so): the tree it names is on disk and gone."""
    return DUMP_DONE in tail(images_dir / DUMP_LOG, 400)


def image_pids(images_dir: Path) -> set[NsPid]:
    """In-namespace pids that have a core image in ``images_dir``."""
    out: set[NsPid] = set()
    for f in images_dir.glob("core-*.img"):
        with_pid = f.name.removeprefix("core-").removesuffix(".img")
        if with_pid.isdigit():
            out.add(NsPid(int(with_pid)))
    return out
