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
- CRIU reads no configuration file: ``--no-default-config`` (its default files would be read in the
  worker's mount namespace, written by the pod's author: an ``action-script`` there would run as the
  node's root) and no ``CRIU_CONFIG_FILE`` in its environment.
- The images directory is mode 0700 (images hold the worker's environment: secrets).
- CRIU is killed after ``timeout`` seconds: a wedged CRIU never blocks the next attempt. It is
  *not* killed when the agent dies: CRIU killed mid-dump can leave its parasite in a worker and
  its network lock in the pod, while a CRIU left to finish either completes the dump or resumes
  the tree itself. A restarted agent finds it in the agent's helper registry (``on_spawn`` records
  the nsenter that runs it, dynsnap/agent/helpers.py) and waits for it, within the same bound.

Nothing of the agent's needs to exist in the worker's container. CRIU runs in the worker's mount
namespace, where paths resolve in the worker's file system, so the agent hands it its own files as
open descriptors, named by ``/proc/self/fd/N`` paths (a magic link reaches the file whatever the
mount namespace; the descriptors are opened close-on-exec and passed to nsenter and CRIU alone):

- CRIU is started by the agent's dynamic loader (the binary's ``PT_INTERP``; glibc's, for its options):
  ``/proc/self/fd/L --inhibit-cache --library-path /proc/self/fd/D1:... --argv0 <criu> /proc/self/fd/C``.
  The library directories are those the agent's loader resolves CRIU's libraries from
  (``--list``, in the agent's environment, ``LD_LIBRARY_PATH`` included); ``--inhibit-cache``
  keeps the worker's ``ld.so.cache`` out. The loader's ``--library-path`` applies to CRIU alone,
  not to what CRIU runs. A static CRIU is run as ``/proc/self/fd/C``.
- The images directory (``-D``; the log ``-o`` and the ``--pidfile`` are in it) and the plugin
  directory (``--libdir``) are named the same way.
- CRIU's work dir (``-W``) is a directory of the worker's own: the entrypoint's control directory
  (an emptyDir in every dynsnap worker). A restore makes its cgroup yard there, a tmpfs it mounts,
  and a mount point must be in CRIU's own mount namespace: in the images directory, reached through
  ``/proc/self/fd``, the mount failed ("Unable to mount tmpfs in .criu.cgyard...: Invalid argument").
- CRIU's CUDA plugin (off unless ``criu_cuda_plugin``) execs ``cuda-checkpoint`` from ``PATH`` in a
  child that first closes every descriptor above stderr, so no ``/proc/self/fd/N`` on ``PATH``
  reaches it there; and the child's only other tie to the agent's files, CRIU's working directory,
  must be the worker's for the cgroup yard. So with the plugin on, the directory of
  ``cuda-checkpoint`` (dynsnap-cuda's drop-in) must exist at the agent's path in the worker's
  container as well (and what the container holds there is what CRIU runs). With it off (the
  default), CRIU's ``PATH`` is an empty directory of the agent's, named by a descriptor: CRIU runs
  as the node's root in the worker's mount namespace, and the plugin, loaded from the agent's plugin
  directory, would otherwise run a ``cuda-checkpoint`` of the container's
  (tests/integration/node/test_agent_restart.py plants one).
- A ``--criu`` that is not an ELF binary (a wrapper script) is refused (CriuError): it could only
  run by its path, a file of the worker's container. No plugin directory set: CRIU gets an empty
  one of the agent's, never its compiled-in one (looked up in the container, where a plugin planted
  there would be loaded into CRIU).

CRIU's restore closes, in every restored process, each descriptor it did not restore itself, so
none of these reach the woken worker (tests/integration/node/test_agent.py checks both, on the real node).
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
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
    tail,
)
from dynsnap.models.ids import HostPid, NsPid
from dynsnap.runtime.command import CommandError, SpawnHook, find_tool, run_command

# CriuError and the log readers live in criu_log.py; they are named here too, where the agent reaches CRIU.
__all__ = ["DUMP_DONE", "DUMP_LOG", "ERROR_LINES_KEPT", "RESTORE_LOG", "CriuError", "CriuResult", "NamespaceTarget",
           "PagesRead", "classify", "criu_dump", "criu_restore", "dump_completed", "elf_interpreter", "error_lines",
           "library_dirs", "pages_read", "tail"]

PIDFILE = "restore.pid"


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
    pages_read: PagesRead | None = None  # a restore's: how the restorers read the pages (None: stock's loop)


@dataclass(frozen=True)
class CriuOptions:
    binary: str
    tcp_established: bool = True
    network_lock: str | None = "nftables"
    extra_args: Sequence[str] = ()
    # PATH for CRIU, as directories of the worker's file system (what CRIU's CUDA plugin runs
    # cuda-checkpoint from: the worker's files, run as the node's root). None: nothing of the
    # worker's, an empty directory of the agent's named by a descriptor (_run).
    path: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    # CRIU's plugin directory (--libdir), an agent path; None: no plugin (an empty directory of the
    # agent's: CRIU's compiled-in one would be looked up in the worker's file system).
    libdir: str | None = None
    # CRIU's work dir (-W), a directory of the worker's file system where CRIU may make and mount its
    # cgroup yard on a restore (the entrypoint's control directory). None: the images directory by its
    # agent path, never by descriptor (the yard's mount fails there, "Invalid argument"), so it only
    # serves where the worker shares the node's file system (the test sandboxes); the agent sets it.
    # CRIU resolves it in the worker's mount namespace, against the container's root: no way out of the
    # container (dynsnap/agent/container.py says what a worker can do with it).
    workdir: str | None = None
    # Records the run (the nsenter CRIU runs under) while it lasts: the agent's helper registry.
    on_spawn: SpawnHook | None = None


def _private_dir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.chmod(0o700)  # also when it existed: images hold the worker's env (secrets)


# Never passed to CRIU, whoever set them: LD_LIBRARY_PATH would leak into what CRIU runs; a
# CRIU_CONFIG_FILE or CRIU_LIBS_DIR path would resolve in the worker's container, the pod author's
# files (a configuration; plugins CRIU would load).
_NOT_FOR_CRIU = ("LD_LIBRARY_PATH", "CRIU_CONFIG_FILE", "CRIU_LIBS_DIR")


def _env(opts: CriuOptions, path: str) -> dict[str, str]:
    env = {**os.environ, **opts.env, "PATH": path}
    for name in _NOT_FOR_CRIU:
        env.pop(name, None)
    return env


def _common(opts: CriuOptions) -> list[str]:
    # --no-default-config: CRIU would read /etc/criu/default.conf and $HOME/.criu/default.conf in the
    # worker's mount namespace, files the pod's author writes, as options of a CRIU running as the
    # node's root (an action-script there, run by CRIU, would escape the container).
    args = ["--no-default-config", "-v4"]
    if opts.tcp_established:
        args.append("--tcp-established")
    if opts.network_lock:
        args += ["--network-lock", opts.network_lock]
    return args


_PT_INTERP = 3
# (e_phoff, e_phentsize, e_phnum) and, in a program header, (p_type, p_offset, p_filesz): struct
# formats and offsets for ELFCLASS32 and ELFCLASS64.
_ELF_LAYOUT = {1: ("I", 0x1C, 0x2A, "I", 4, 0x10), 2: ("Q", 0x20, 0x36, "Q", 8, 0x20)}


class NotElf(ValueError):
    """The file is not an ELF binary (a script, say)."""


def elf_interpreter(fd: int) -> str | None:
    """The program interpreter (``PT_INTERP``, the dynamic loader) of the ELF binary open at ``fd``;
    None for a static binary. :class:`NotElf` when it is no ELF binary."""
    head = os.pread(fd, 64, 0)
    if len(head) < 52 or head[:4] != b"\x7fELF" or head[4] not in _ELF_LAYOUT or head[5] not in (1, 2):
        raise NotElf("not an ELF binary")
    end = "<" if head[5] == 1 else ">"
    off_fmt, off_at, size_at, ph_fmt, ph_off_at, ph_size_at = _ELF_LAYOUT[head[4]]
    (phoff,) = struct.unpack_from(end + off_fmt, head, off_at)
    phentsize, phnum = struct.unpack_from(end + "HH", head, size_at)
    table = os.pread(fd, phentsize * phnum, phoff)
    for i in range(phnum):
        entry = table[i * phentsize:(i + 1) * phentsize]
        if len(entry) < ph_size_at + 4 or struct.unpack_from(end + "I", entry, 0)[0] != _PT_INTERP:
            continue
        (offset,) = struct.unpack_from(end + ph_fmt, entry, ph_off_at)
        (size,) = struct.unpack_from(end + ph_fmt, entry, ph_size_at)
        return os.pread(fd, size, offset).split(b"\0", 1)[0].decode()
    return None


def library_dirs(listing: str) -> list[str]:
    """The directories a loader's ``--list`` output resolved the libraries from, in order; an
    unresolved library is a ValueError that names it."""
    dirs: list[str] = []
    for line in listing.splitlines():
        name, arrow, found = line.strip().partition(" => ")
        if not arrow:
            continue  # the vDSO and the loader itself: nothing to look up
        path = found.rsplit(" (0x", 1)[0].strip()
        if not path.startswith("/"):
            raise ValueError(f"CRIU's library {name} is not found in the agent: {line.strip()}")
        d = os.path.dirname(path)
        if d not in dirs:
            dirs.append(d)
    return dirs


class _Files:
    """The agent's files CRIU needs, open for one run and named by ``/proc/self/fd/N`` paths."""

    def __init__(self) -> None:
        self.fds: list[int] = []

    def open(self, path: str | Path, *, directory: bool = False) -> str:
        # Close-on-exec here; pass_fds makes them inheritable in CRIU's nsenter only (never in a
        # helper another reconcile starts meanwhile).
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECTORY if directory else 0))
        self.fds.append(fd)
        return f"/proc/self/fd/{fd}"

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()


def _agent_path(binary: str) -> str:
    """``binary`` as the agent finds it (a bare name on the agent's PATH)."""
    found = shutil.which(binary)
    return os.path.abspath(found) if found else binary


@dataclass(frozen=True)
class _Launch:
    """How one CRIU run names what it needs: agent files as ``/proc/self/fd/N`` paths."""

    argv: list[str]  # the command that is CRIU
    images: str
    libdir: str | None


async def _launch(opts: CriuOptions, images_dir: Path, files: _Files, *, timeout: float, log_path: Path) -> _Launch:
    binary = _agent_path(opts.binary)
    try:
        exe = files.open(binary)
    except OSError as e:
        raise CriuError(f"CRIU {binary!r}: {e.strerror}", log_path=log_path) from e
    try:
        interp = elf_interpreter(files.fds[-1])
    except NotElf as e:  # a script would run by its path, a file of the worker's container
        raise CriuError(f"CRIU {binary!r} is {e}: the agent starts CRIU in a worker's namespaces from "
                        "descriptors of its own files, which only an ELF binary allows", log_path=log_path) from e
    if interp is None:
        argv = [exe]
    else:
        loader = files.open(interp)
        try:  # resolved as the agent's loader resolves them, LD_LIBRARY_PATH included
            res = await run_command([loader, "--list", exe], timeout=min(timeout, 30.0), pass_fds=files.fds)
            libs = library_dirs(res.stdout)
        except (CommandError, ValueError) as e:
            raise CriuError(f"CRIU's libraries in the agent: {e}", log_path=log_path) from e
        argv = [loader, "--inhibit-cache", "--library-path", ":".join(files.open(d, directory=True) for d in libs),
                "--argv0", binary, exe]
    libdir = files.open(opts.libdir, directory=True) if opts.libdir else None
    return _Launch(argv, files.open(images_dir, directory=True), libdir)


async def _run(target: NamespaceTarget, images_dir: Path, build: Callable[[_Launch], list[str]], *,
               log_path: Path, timeout: float, opts: CriuOptions, what: str) -> float:
    files = _Files()
    # CRIU's PATH and plugin directory, unless the options name them: an empty directory of the agent's
    # for the run, named by a descriptor (/proc/self/fd/N, which no file of the container can stand for,
    # and which is gone in CRIU's children that close their descriptors before an exec): nothing of the
    # worker's is run or loaded.
    with tempfile.TemporaryDirectory(prefix="dynsnap-criu-path-") as empty:
        try:
            launch = await _launch(opts, images_dir, files, timeout=timeout, log_path=log_path)
            nothing = files.open(empty, directory=True)
            path = opts.path if opts.path is not None else nothing
            argv = [*launch.argv, *build(launch), "--libdir", launch.libdir or nothing]
            argv += ["-W", opts.workdir or str(images_dir)]
            argv += [*_common(opts), *opts.extra_args]
            t0 = time.monotonic()
            try:
                res = await run_command([*target.nsenter_argv(), *argv], timeout=timeout, check=False,
                                        env=_env(opts, path), pass_fds=files.fds, on_spawn=opts.on_spawn)
            except CommandError as e:  # timed out: CRIU and nsenter were killed
                raise CriuError(f"criu {what}: no exit within {timeout} s", log_path=log_path, timed_out=True) from e
        finally:
            files.close()
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

    def build(at: _Launch) -> list[str]:
        return ["dump", "-t", str(pid), "-D", at.images, "-o", f"{at.images}/{DUMP_LOG}",
                *(["--leave-running"] if leave_running else [])]
    secs = await _run(target, images_dir, build, log_path=log_path, timeout=timeout, opts=opts, what="dump")
    return CriuResult(images_dir=images_dir, log_path=log_path, seconds=secs, pid=pid)


async def criu_restore(target: NamespaceTarget, images_dir: Path, *, opts: CriuOptions,
                       timeout: float) -> CriuResult:
    """Restore the tree in ``images_dir`` in place (same pids, same namespaces), detached."""
    log_path = images_dir / RESTORE_LOG
    pidfile = images_dir / PIDFILE
    pidfile.unlink(missing_ok=True)

    def build(at: _Launch) -> list[str]:
        return ["restore", "-D", at.images, "-o", f"{at.images}/{RESTORE_LOG}", "--restore-detached",
                "--pidfile", f"{at.images}/{PIDFILE}"]
    secs = await _run(target, images_dir, build, log_path=log_path, timeout=timeout, opts=opts, what="restore")
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
