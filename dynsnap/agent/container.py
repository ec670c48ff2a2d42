"""The agent's trust boundary with a worker container: every file the privileged agent opens inside a
container, and every piece of a container process's memory it reads (environment, command line),
goes through this module, so a reviewer audits one file.

Layer: ``dynsnap.agent``. The agent runs as root with hostPID. Everything inside a worker container
(paths, symlinks, files, environment, processes) is written by whoever controls the worker and is
treated as an attacker's.

Paths. A container's files are reached from the node through a process's root, ``/proc/<pid>/root``.
Opened the ordinary way (``open("/proc/<pid>/root/run/dynsnap/x")``), the kernel resolves an
absolute symlink met inside the container against the *agent's* root: a control directory that is a
symlink to ``/etc`` would have the agent write into the node's ``/etc``. So here:

- a path is checked before it is used (:func:`components`): absolute, no ``..`` component, no NUL,
  at most ``PATH_BOUND`` bytes; else :class:`UnsafeContainerPath` says which rule it broke;
- the container's root is opened once as an ``O_PATH`` directory descriptor (:class:`ContainerRoot`)
  and the path is resolved from it by ``openat2(2)`` with ``RESOLVE_IN_ROOT | RESOLVE_NO_SYMLINKS |
  RESOLVE_NO_MAGICLINKS``: nothing resolves outside the container's root, and a symlink at any
  component is refused (ELOOP), named by :func:`_first_symlink`. ``symlinks=True`` (only the read of a
  kubeconfig the worker names: kubelet builds Secret and ConfigMap volumes out of symlinks) drops
  ``RESOLVE_NO_SYMLINKS`` alone: its symlinks resolve against the container's root, ``..`` stops there;
- where ``openat2`` is missing (ENOSYS: a kernel before 5.6, or a seccomp filter around the agent that
  refuses it) the path is walked one component at a time instead, each opened ``O_PATH | O_NOFOLLOW``
  from the descriptor of the one before and checked not to be a symlink. With ``..`` refused
  beforehand, every step is one directory entry below the last, so the walk cannot leave the root.
  It cannot follow a symlink safely, so there ``symlinks=True`` is not honoured: the symlink is
  refused (the kubeconfig read is best effort; only its connection reset after a long sleep is lost);
- a file is resolved as an ``O_PATH`` descriptor and read only if it is a regular file (a FIFO would
  block the agent, a device file's open has side effects), reopened through ``/proc/self/fd`` (the
  agent's own descriptor: the same inode), and read up to its bound: a larger file is
  :class:`ContainerFileTooLarge`, never read whole;
- a write (:meth:`ContainerDir.replace`) creates a temp file in the directory's descriptor with
  ``O_CREAT | O_EXCL | O_NOFOLLOW`` under a random name (``secrets.token_hex``: nothing to plant a
  symlink, a FIFO or a hard link at in advance), then renames it within that same descriptor (both
  names relative to it: neither can be redirected); the temp file is removed on any failure. A
  symlink at the target name is replaced by the rename, never followed.

Process memory. A container process's ``/proc/<pid>/environ`` and ``cmdline`` are its own memory,
which it can rewrite and (with ``prctl(PR_SET_MM)``) make larger than anything an exec gave it. They
are read up to ``ENVIRON_BOUND`` (ARG_MAX under the default stack limit); more is
:class:`ContainerFileTooLarge`. Of the environment only the keys the agent uses are kept, validated
(:class:`~dynsnap.models.workerenv.WorkerEnv`).

    ContainerRefused          something of the container the agent will not use (``reason``)
      UnsafeContainerPath     a path that is not absolute, has ``..``, a symlink, a NUL, or is too long
    ContainerFileTooLarge     a file or process memory larger than its bound (the caller names the reason)

Programs the agent starts in a worker's namespaces (CRIU, ``ss``) never enter its mount namespace
(dynsnap/agent/nsexec.py): no path of the container's reaches them as a path to resolve.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import ClassVar, Final

from dynsnap.models.ids import HostPid
from dynsnap.models.protocol import Reason
from dynsnap.models.workerenv import ENVIRON_BOUND, WorkerEnv
from dynsnap.runtime.procfs import PROC

__all__ = ["PATH_BOUND", "ContainerDir", "ContainerFileTooLarge", "ContainerRefused", "ContainerRoot",
           "UnsafeContainerPath", "cmdline", "components", "worker_env"]

PATH_BOUND: Final = 4096  # PATH_MAX: no longer path resolves anyway
NAME_BOUND: Final = 255  # NAME_MAX

# openat2(2), Linux 5.6: 437 in the unified syscall table (x86-64, arm64 and every architecture since).
# An architecture that numbers it otherwise answers ENOSYS, and the component walk takes over.
_SYS_OPENAT2: Final = 437
RESOLVE_NO_MAGICLINKS: Final = 0x02
RESOLVE_NO_SYMLINKS: Final = 0x04
RESOLVE_IN_ROOT: Final = 0x10
# A replacement's temp file: created, never opened (O_EXCL: whatever sits at the name, even a dangling
# symlink, a hard link or a FIFO, is refused), never through a symlink (O_NOFOLLOW), and an open that
# could only block (a FIFO) fails instead (O_NONBLOCK).
_CREATE_FLAGS: Final = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# Concurrent renames or mounts make openat2 answer EAGAIN where it cannot prove a ".." stayed inside
# (only a followed symlink can hold one here): tried again a few times, then the error stands.
_EAGAIN_TRIES: Final = 4


class ContainerRefused(Exception):
    """Something of a worker container the agent will not use; nothing was done with it. ``reason``
    is what the WorkerSnapshot's condition says."""

    reason: ClassVar[Reason]


class UnsafeContainerPath(ContainerRefused):
    reason = Reason.UNSAFE_CONTAINER_PATH


class ContainerFileTooLarge(ValueError):
    """A container's file, or a container process's memory, larger than the bound it is read with."""

    def __init__(self, what: str, bound: int) -> None:
        super().__init__(f"{what} is larger than {bound} bytes: not read")
        self.bound = bound


def _shown(path: str) -> str:
    return repr(path[:200] + ("..." if len(path) > 200 else ""))


def components(path: str) -> tuple[str, ...]:
    """The components of ``path``, a path inside a container; :class:`UnsafeContainerPath` says why
    it is none the agent will resolve. Empty and ``.`` components mean nothing to the kernel and are
    dropped."""
    if "\0" in path:
        raise UnsafeContainerPath(f"container path {_shown(path)}: it holds a NUL byte")
    if len(path.encode(errors="surrogateescape")) > PATH_BOUND:
        raise UnsafeContainerPath(f"container path {_shown(path)}: longer than {PATH_BOUND} bytes")
    if not path.startswith("/"):
        raise UnsafeContainerPath(f"container path {_shown(path)}: not absolute")
    parts = tuple(p for p in path.split("/") if p not in ("", "."))
    if ".." in parts:
        raise UnsafeContainerPath(f"container path {_shown(path)}: it has a '..' component")
    if any(len(p.encode(errors="surrogateescape")) > NAME_BOUND for p in parts):
        raise UnsafeContainerPath(f"container path {_shown(path)}: a component longer than {NAME_BOUND} bytes")
    return parts


class _OpenHow(ctypes.Structure):
    _fields_ = (("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64))


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _openat2(dirfd: int, path: str, flags: int, resolve: int) -> int:
    how = _OpenHow(flags, 0, resolve)
    raw = path.encode(errors="surrogateescape")
    for _ in range(_EAGAIN_TRIES):
        # every argument at the width syscall(2) reads it with (a variadic long each)
        fd = int(_libc.syscall(ctypes.c_long(_SYS_OPENAT2), ctypes.c_long(dirfd), ctypes.c_char_p(raw),
                               ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how))))
        if fd >= 0:
            return fd
        err = ctypes.get_errno()
        if err != errno.EAGAIN:
            break
    raise OSError(err, os.strerror(err), path)


def _walk(root: int, parts: tuple[str, ...], shown: str) -> int:
    """An O_PATH descriptor of ``parts`` below ``root``, one component at a time, refusing symlinks
    (the resolution where openat2 is missing)."""
    fd = os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=root)
    try:
        for i, name in enumerate(parts):
            nfd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            mode = os.fstat(nfd).st_mode
            os.close(fd)
            fd = nfd
            if stat.S_ISLNK(mode):
                raise UnsafeContainerPath(f"container path {shown}: /{'/'.join(parts[:i + 1])} is a symlink "
                                          "(no symlink is followed inside a container)")
            if i < len(parts) - 1 and not stat.S_ISDIR(mode):
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), "/" + "/".join(parts[:i + 1]))
    except BaseException:
        os.close(fd)
        raise
    return fd


def _first_symlink(root: int, parts: tuple[str, ...]) -> str | None:
    """The first component of ``parts`` below ``root`` that is a symlink (to name it in a refusal)."""
    fd = os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=root)
    try:
        for i, name in enumerate(parts):
            nfd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nfd
            if stat.S_ISLNK(os.fstat(fd).st_mode):
                return "/" + "/".join(parts[:i + 1])
    except OSError:
        return None
    finally:
        os.close(fd)
    return None


class ContainerRoot:
    """A container's file system as the node reaches it: ``root`` (``/proc/<pid>/root`` of one of its
    processes, see :meth:`of`) opened once as an O_PATH directory descriptor, every path below it
    resolved from that descriptor. Use it as a context manager (the descriptor is closed on exit)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._fd: int | None = None

    @classmethod
    def of(cls, pid: HostPid | int, *, proc: Path = PROC) -> ContainerRoot:
        return cls(proc / str(pid) / "root")

    def __enter__(self) -> ContainerRoot:
        self._fd = os.open(self.root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    @property
    def fd(self) -> int:
        assert self._fd is not None, "ContainerRoot used outside its with-block"
        return self._fd

    def resolve(self, path: str, *, symlinks: bool = False) -> int:
        """An O_PATH descriptor of ``path`` (a path inside the container), resolved inside the root;
        the caller closes it. :class:`UnsafeContainerPath` for a path this module refuses; OSError
        (ENOENT...) as the resolution met it."""
        parts = components(path)
        rel = "/".join(parts) or "."
        resolve = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | (0 if symlinks else RESOLVE_NO_SYMLINKS)
        try:
            return _openat2(self.fd, rel, os.O_PATH | os.O_CLOEXEC, resolve)
        except OSError as e:
            if e.errno == errno.ENOSYS:
                return _walk(self.fd, parts, _shown(path))
            if e.errno == errno.ELOOP:
                link = _first_symlink(self.fd, parts)
                at = f"{link} is a symlink" if link else "a symlink on the way (or too many)"
                raise UnsafeContainerPath(f"container path {_shown(path)}: {at} (no symlink is followed "
                                          "inside a container)") from e
            raise

    @contextlib.contextmanager
    def directory(self, path: str) -> Iterator[ContainerDir]:
        """The directory ``path`` of the container, held open for reads and replacements in it."""
        fd = self.resolve(path)
        try:
            if not stat.S_ISDIR(os.fstat(fd).st_mode):
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
            yield ContainerDir(fd, path)
        finally:
            os.close(fd)

    def read(self, path: str, *, limit: int, symlinks: bool = False) -> bytes:
        """The bytes of the regular file ``path``, at most ``limit`` (else :class:`ContainerFileTooLarge`)."""
        fd = self.resolve(path, symlinks=symlinks)
        try:
            return _read_regular(fd, limit, _shown(path))
        finally:
            os.close(fd)


class ContainerDir:
    """A directory inside a container, held as an O_PATH descriptor (see :meth:`ContainerRoot.directory`).
    Names are single components: they are resolved relative to the descriptor, nothing else."""

    def __init__(self, fd: int, path: str) -> None:
        self.fd = fd
        self.path = path

    def _name(self, name: str) -> str:
        if not name or "/" in name or "\0" in name or name in (".", "..") or len(name.encode()) > NAME_BOUND:
            raise UnsafeContainerPath(f"{_shown(name)} in {_shown(self.path)}: not a single file name")
        return name

    def read(self, name: str, *, limit: int) -> bytes:
        """The bytes of the regular file ``name`` here, at most ``limit``; a symlink is refused."""
        shown = _shown(f"{self.path.rstrip('/')}/{name}")
        try:
            fd = os.open(self._name(name), os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd)
        except OSError as e:
            raise type(e)(e.errno, e.strerror, shown) from None
        try:
            if stat.S_ISLNK(os.fstat(fd).st_mode):
                raise UnsafeContainerPath(f"container path {shown} is a symlink (no symlink is followed inside "
                                          "a container)")
            return _read_regular(fd, limit, shown)
        finally:
            os.close(fd)

    def replace(self, name: str, data: bytes) -> None:
        """Make ``name`` here hold ``data``: a new temp file under a random name, created exclusively
        and never through a symlink, written, then renamed over ``name`` within this directory."""
        final = self._name(name)
        tmp = f".{final}.{secrets.token_hex(16)}"
        fd = os.open(tmp, _CREATE_FLAGS, 0o644, dir_fd=self.fd)
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            os.rename(tmp, final, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self.fd)
            raise


def _read_regular(opath: int, limit: int, shown: str) -> bytes:
    """Read the regular file ``opath`` (an O_PATH descriptor) names, at most ``limit`` bytes."""
    st = os.fstat(opath)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeContainerPath(f"container path {shown}: not a regular file")
    if st.st_size > limit:
        raise ContainerFileTooLarge(f"container file {shown}", limit)
    # Reopened through the agent's own descriptor: the inode already resolved, nothing looked up again.
    fd = os.open(f"/proc/self/fd/{opath}", os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY)
    try:
        return _read_bounded(fd, limit, f"container file {shown}")
    finally:
        os.close(fd)


def _read_bounded(fd: int, limit: int, what: str) -> bytes:
    chunks: list[bytes] = []
    got = 0
    while got <= limit:
        chunk = os.read(fd, min(limit + 1 - got, 1 << 20))
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        got += len(chunk)
    raise ContainerFileTooLarge(what, limit)


def _process_memory(pid: int, name: str, proc: Path) -> bytes:
    """``/proc/<pid>/<name>`` (environ, cmdline) of a container process, at most ENVIRON_BOUND bytes."""
    fd = os.open(proc / str(pid) / name, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return _read_bounded(fd, ENVIRON_BOUND, f"the {name} of process {pid}")
    finally:
        os.close(fd)


def worker_env(pid: HostPid | int, *, proc: Path = PROC) -> WorkerEnv:
    """The keys of a container process's environment the agent uses, validated; empty when the process
    is gone. :class:`ContainerFileTooLarge` past ``ENVIRON_BOUND``."""
    try:
        raw = _process_memory(pid, "environ", proc)
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return WorkerEnv()
    env: dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            # the first of a repeated key, as getenv(3) in the worker finds it
            env.setdefault(key.decode(errors="replace"), value.decode(errors="replace"))
    return WorkerEnv.parse(env)


def cmdline(pid: HostPid | int, *, proc: Path = PROC) -> list[str]:
    """A container process's argv; empty when the process is gone. :class:`ContainerFileTooLarge`
    past ``ENVIRON_BOUND``."""
    try:
        raw = _process_memory(pid, "cmdline", proc)
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0")[:-1]]
