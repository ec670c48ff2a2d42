"""CRIU dump and in-place restore of a worker tree into the pod's own namespaces, with CRIU never in the
pod's mount namespace.

Layer: ``dynsnap.agent``. The flags are the ones proven here on CRIU 4.2.1, kernel 6.18.

CRIU is started by ``dynsnap-nsexec`` (dynsnap/agent/nsexec.py, native/nsexec): in the pod's pid, network,
IPC, UTS and cgroup namespaces, taken from the pod's PID 1 (dynsnap-entrypoint, pinned by a pidfd and its
start time, its namespaces checked to be the runtime's), so it sees the pod's pids, nothing
namespace-level is dumped or recreated, and a restore puts the tree back into the *same* namespaces at
the same in-namespace pids. (An agent pod has IPC and UTS namespaces of its own, and on a cgroup v2 node a
cgroup namespace too: a namespace of the worker's CRIU is not in is one it dumps and on restore makes
anew, and from the agent's cgroup namespace CRIU refuses the dump, "invalid cgroup configuration".)

It never runs in the pod's mount namespace, where every path is the pod author's: its dynamic loader
would read the pod's ``/etc/ld.so.preload`` (a library the pod names, run as the node's root), and CRIU
its configuration, its kerndat cache and the pod's ``/proc``. It runs in a mount namespace of its own
instead, a copy of the agent's with every mount private and a fresh ``/proc`` for the pod's pid namespace:
the binary, its loader and libraries, its plugins, its PATH, the images and work directories are the
agent's own files by their own paths, and whatever CRIU mounts there (its cgroup yard on a restore, its
cgroup mounts on a dump) is seen by no pod and goes with CRIU, also when CRIU is killed. The pod's file
system is reached only where it must be: a dump takes the tree's mount namespace as CRIU's own and reads
the tree's files through the tree root's ``/proc/<pid>/root`` (``--tree-mntns``, hack/patches/criu/0003,
docs/CRIU_PATCHES.md); a restore has the restored tasks join the pod's mount namespace
(``--join-ns mnt``, through a descriptor of it the launcher checked), where each opens its own files.

With ``--restore-detached`` CRIU exits after the restore and the restored root is reparented to the pid
namespace's PID 1 (dynsnap-entrypoint, a subreaper; the launcher, outside that namespace, is no candidate).

- ``pid`` is the in-namespace pid of the tree root (CRIU names images by in-namespace pid);
  never the namespace's PID 1. The entrypoint ``setsid``s the worker, so no ``--shell-job``.
- Live TCP connections: ``--tcp-established`` on both sides, with a network lock that needs no
  iptables binary: ``--network-lock nftables`` (libnftables).
- io_uring cannot be dumped: the worker must run with io_uring refused (the entrypoint's
  seccomp filter). :func:`classify` names that and other known causes from CRIU's log.
- ``LD_LIBRARY_PATH`` is never passed to CRIU (it would leak into the helpers CRIU spawns,
  e.g. ``cuda-checkpoint`` for the CUDA plugin, found via ``PATH``).
- CRIU reads no configuration file (``--no-default-config``, no ``CRIU_CONFIG_FILE``): what it does is
  what the agent passes.
- The images directory is mode 0700 (images hold the worker's environment: secrets).
- CRIU's PATH and plugin directory are empty directories of the agent's unless the options name the
  agent's own (CRIU's CUDA plugin on: ``criu_cuda_plugin``). A ``--criu`` wrapper script is fine: it is
  the agent's file, run in the agent's file system.
- CRIU runs in the worker container's cgroups (``--join-cgroups``: accounted and limited as the worker,
  and, on a restore with ``--manage-cgroups=ignore``, the tree inherits them, so no cgroup yard is ever
  mounted) and outlives the agent (``--outlive``): the agent's runtime kills the agent container's
  processes by cgroup when it stops it, and CRIU killed mid-dump leaves its parasite in the worker, which
  then dies (seen here: a dump killed 0.3 s in left the tree stuck, then gone). The agent's helper registry
  records the launcher (``on_spawn``, dynsnap/agent/helpers.py) and, once the launcher is gone, finds CRIU
  by its session, so a restarted agent waits for it within the same bound. Only that bound (``timeout``)
  kills CRIU; what a killed CRIU leaves (its network lock in the pod, a partly restored tree) is for the
  next step to find.

CRIU's restore closes, in every restored process, each descriptor it did not restore itself, so none of
the launcher's reach the woken worker (tests/integration/node/test_agent.py checks, on the real node).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dynsnap.agent.criu_log import (
    DUMP_DONE,
    DUMP_LOG,
    ERROR_LINES_KEPT,
    RESTORE_LOG,
    CriuError,
    PagesRead,
    classify,
    dump_completed,
    error_lines,
    pages_read,
    restore_completed,
    tail,
)
from dynsnap.agent.nsexec import MNTNS, NSEXEC, TREE_NAMESPACES, Target, run_in
from dynsnap.models.ids import NsPid
from dynsnap.runtime.command import CommandError, SpawnHook

# CriuError and the log readers live in criu_log.py; they are named here too, where the agent reaches CRIU.
__all__ = ["DUMP_DONE", "DUMP_LOG", "ERROR_LINES_KEPT", "RESTORE_LOG", "CriuError", "CriuOptions", "CriuResult",
           "PagesRead", "classify", "criu_dump", "criu_restore", "dump_completed", "error_lines", "pages_read",
           "restore_completed", "tail"]

PIDFILE = "restore.pid"


@dataclass(frozen=True)
class CriuResult:
    images_dir: Path
    log_path: Path
    seconds: float
    pid: NsPid  # in-namespace pid of the tree root (dumped, or restored)
    pages_read: PagesRead | None = None  # a restore's: how the restorers read the pages (None: stock's loop)


@dataclass(frozen=True)
class CriuOptions:
    binary: str
    tcp_established: bool = True
    network_lock: str | None = "nftables"
    extra_args: Sequence[str] = ()
    # PATH for CRIU, directories of the agent's (what CRIU's CUDA plugin runs cuda-checkpoint from). None:
    # an empty one, so the plugin finds none and stands aside.
    path: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    # CRIU's plugin directory (--libdir), the agent's; None: an empty one (no plugin at all).
    libdir: str | None = None
    # The launcher, dynsnap-nsexec (a bare name: on the agent's PATH).
    nsexec: str = NSEXEC
    # The worker's network namespace entered (False only where the tree shares the caller's: tests).
    net: bool = True
    # Records the run (the launcher CRIU runs under) while it lasts: the agent's helper registry.
    on_spawn: SpawnHook | None = None


def _private_dir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.chmod(0o700)  # also when it existed: images hold the worker's env (secrets)


# Never passed to CRIU, whoever set them: LD_LIBRARY_PATH would leak into what CRIU runs; CRIU_CONFIG_FILE
# and CRIU_LIBS_DIR would give it a configuration and plugins the agent did not choose.
_NOT_FOR_CRIU = ("LD_LIBRARY_PATH", "CRIU_CONFIG_FILE", "CRIU_LIBS_DIR")


def _env(opts: CriuOptions, path: str) -> dict[str, str]:
    env = {**os.environ, **opts.env, "PATH": path}
    for name in _NOT_FOR_CRIU:
        env.pop(name, None)
    return env


def _common(opts: CriuOptions) -> list[str]:
    # --no-default-config: CRIU would read /etc/criu/default.conf and $HOME/.criu/default.conf: options the
    # agent did not pass (an action-script there would be run by CRIU, the node's root).
    args = ["--no-default-config", "-v4"]
    if opts.tcp_established:
        args.append("--tcp-established")
    if opts.network_lock:
        args += ["--network-lock", opts.network_lock]
    return args


def _cancelling() -> bool:
    """Whether the running task is being cancelled (the agent stopping)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _agent_path(binary: str) -> str:
    """``binary`` as the agent finds it (a bare name on the agent's PATH); CriuError when it has none."""
    found = shutil.which(binary)
    if found is None or not os.access(found, os.X_OK):
        raise FileNotFoundError(binary)
    return os.path.abspath(found)


async def _run(target: Target, args: Sequence[str], *, log_path: Path, timeout: float, opts: CriuOptions,
               what: str, join_mntns: bool) -> float:
    try:
        binary = _agent_path(opts.binary)
    except FileNotFoundError as e:
        raise CriuError(f"CRIU {opts.binary!r}: not found, or not executable, in the agent", log_path=log_path) from e
    # CRIU's work directory and the empty directory for its PATH and plugins: the agent's, for this run only,
    # removed once CRIU ended. Not when the agent is stopped while CRIU runs on (outlive): CRIU still uses
    # them, and they go with the agent pod's /tmp, a memory volume whose tmpfs lives on in CRIU's mount
    # namespace, a copy of the agent's, until CRIU ends (the chart's agent DaemonSet; CRIU's kerndat makes
    # its scratch directories under /tmp too, which the agent container's own file system, removed with it,
    # would no longer have).
    work = tempfile.mkdtemp(prefix="dynsnap-criu-")
    try:
        empty = os.path.join(work, "none")
        os.mkdir(empty, 0o700)
        argv = [binary, *args, "--libdir", opts.libdir or empty, "-W", work, *_common(opts), *opts.extra_args]
        namespaces = TREE_NAMESPACES if opts.net else tuple(n for n in TREE_NAMESPACES if n != "net")
        t0 = time.monotonic()
        try:
            # In the worker's cgroups, outliving the agent: CRIU killed mid-dump loses the worker (its parasite
            # is left in it), and the agent's runtime kills the agent container's processes by cgroup.
            res = await run_in(target, argv, timeout=timeout, namespaces=namespaces, private_mounts=True,
                               pass_mntns=join_mntns, join_cgroups=True, outlive=True,
                               env=_env(opts, opts.path if opts.path is not None else empty),
                               nsexec=opts.nsexec, on_spawn=opts.on_spawn)
        except CommandError as e:  # timed out: the launcher and CRIU were killed
            raise CriuError(f"criu {what}: no exit within {timeout} s", log_path=log_path, timed_out=True) from e
        except FileNotFoundError as e:  # no launcher
            raise CriuError(f"criu {what}: {e}", log_path=log_path) from e
    finally:
        if not _cancelling():  # else the agent stops while CRIU runs on: its directories stay with it
            shutil.rmtree(work, ignore_errors=True)
    if res.returncode != 0:
        # 128+N: the launcher's own status for a CRIU killed by signal N (dynsnap-nsexec passes it on)
        killed = res.returncode - 128 if 128 < res.returncode < 160 else None
        how = f"was killed (signal {killed})" if killed else f"exited {res.returncode}"
        raise CriuError(f"criu {what} {how}: {res.stderr.strip()[-500:]}", log_path=log_path, signal=killed)
    return time.monotonic() - t0


async def criu_dump(target: Target, pid: NsPid, images_dir: Path, *, opts: CriuOptions,
                    timeout: float, leave_running: bool = False) -> CriuResult:
    """Dump the tree rooted at in-namespace ``pid`` into ``images_dir``; the tree is killed after a
    successful dump unless ``leave_running``. On failure CRIU leaves the tree running."""
    if pid == 1:
        raise ValueError("refusing to dump the namespace's PID 1: dump the worker subtree under it")
    _private_dir(images_dir)
    log_path = images_dir / DUMP_LOG
    args = ["dump", "--tree-mntns", "-t", str(pid), "-D", str(images_dir), "-o", str(log_path),
            *(["--leave-running"] if leave_running else [])]
    secs = await _run(target, args, log_path=log_path, timeout=timeout, opts=opts, what="dump", join_mntns=False)
    return CriuResult(images_dir=images_dir, log_path=log_path, seconds=secs, pid=pid)


async def criu_restore(target: Target, images_dir: Path, *, opts: CriuOptions, timeout: float) -> CriuResult:
    """Restore the tree in ``images_dir`` in place (same pids, same namespaces), detached."""
    log_path = images_dir / RESTORE_LOG
    pidfile = images_dir / PIDFILE
    pidfile.unlink(missing_ok=True)
    # --manage-cgroups=ignore: CRIU runs in the worker container's cgroups and the tree inherits them, so no
    # cgroup yard is mounted at all (none to leave behind, nothing of the node's cgroups laid out anywhere).
    args = ["restore", "-D", str(images_dir), "-o", str(log_path), "--restore-detached", "--pidfile", str(pidfile),
            "--manage-cgroups=ignore", "--join-ns", f"mnt:{MNTNS}"]
    secs = await _run(target, args, log_path=log_path, timeout=timeout, opts=opts, what="restore", join_mntns=True)
    try:
        pid = NsPid(int(pidfile.read_text().strip()))
    except (OSError, ValueError) as e:
        raise CriuError("criu restore wrote no pidfile", log_path=log_path) from e
    return CriuResult(images_dir=images_dir, log_path=log_path, seconds=secs, pid=pid, pages_read=pages_read(log_path))


def image_pids(images_dir: Path) -> set[NsPid]:
    """In-namespace pids that have a core image in ``images_dir``."""
    out: set[NsPid] = set()
    for f in images_dir.glob("core-*.img"):
        with_pid = f.name.removeprefix("core-").removesuffix(".img")
        if with_pid.isdigit():
            out.add(NsPid(int(with_pid)))
    return out
