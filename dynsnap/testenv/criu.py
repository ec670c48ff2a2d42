"""CRIU dump and in-place restore of a process tree inside a pod sandbox.

Layer: ``dynsnap.testenv`` (test harness). These are the flags proven here on
CRIU 4.2.1, kernel 6.18; the node agent's runtime code should use the same.

How it works: CRIU runs through ``nsenter -t <PID 1> -p -m -n`` (see
:meth:`PodSandbox.nsenter_argv`), i.e. in the pod's pid, mount and network
namespaces. So it sees the pod's ``/proc`` and pids, its namespaces equal the
dumped tree's (nothing namespace-level is dumped or recreated), and a restore
puts the tree back into the *same* pid and network namespace with the same
in-namespace pids. With ``--restore-detached`` CRIU exits after the restore and
the restored root is reparented to the namespace's PID 1 (the subreaper).

- ``pid`` is the in-namespace pid of the subtree root (CRIU names images by
  in-namespace pid). Dump it while it is not PID 1 and is its own session
  leader (the entrypoint ``setsid``s the worker), so ``--shell-job`` is not needed.
- Its fds must have been opened inside the pod's mount namespace
  ("Can't lookup mount=... for fd" otherwise).
- Live TCP connections: ``tcp_established=True`` on both sides, with a network
  lock that needs no iptables binary: ``--network-lock nftables`` (libnftables).
- io_uring cannot be dumped: the worker must run with io_uring refused
  (seccomp in dynsnap-entrypoint).
- Cgroups: CRIU records the tree's cgroups and restores it into the same paths.
- ``LD_LIBRARY_PATH`` is never passed to CRIU (it would leak into the helpers
  CRIU spawns, e.g. ``cuda-checkpoint`` for the CUDA plugin, found via ``PATH``).
- The images dir is made mode 0700 (images hold the worker's env, i.e. secrets);
  staging and renaming a capture directory is the caller's job.

Errors: :class:`CriuError` (non-zero exit, or no exit within ``timeout``, after
which CRIU and nsenter are killed), with the tail of CRIU's log.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from dynsnap.testenv.netns import CommandError, run_command
from dynsnap.testenv.sandbox import PodSandbox

__all__ = ["CriuError", "CriuResult", "criu_binary", "criu_dump", "criu_restore"]

DUMP_LOG = "dump.log"
RESTORE_LOG = "restore.log"


class CriuError(RuntimeError):
    """CRIU failed or timed out; ``log_tail`` holds the end of its log."""

    def __init__(self, message: str, *, log_path: Path) -> None:
        self.log_path = log_path
        self.log_tail = _tail(log_path)
        super().__init__(f"{message}\n--- {log_path} (tail) ---\n{self.log_tail}")


@dataclass(frozen=True)
class CriuResult:
    images_dir: Path
    log_path: Path
    seconds: float
    pid: int  # in-namespace pid of the tree root (dumped, or restored)


def criu_binary() -> str:
    """``$DYNSNAP_CRIU`` (set by hack/lib-criu.sh), else ``criu`` on PATH."""
    path = os.environ.get("DYNSNAP_CRIU") or shutil.which("criu")
    if not path or not os.access(path, os.X_OK):
        raise FileNotFoundError("CRIU not found: set DYNSNAP_CRIU (./run setup builds it) or put it on PATH")
    return path


def _tail(path: Path, limit: int = 3000) -> str:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return "(no log)"
    return data[-limit:].decode(errors="replace")


def _private_dir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.chmod(0o700)  # also when it existed: images hold the worker's env (secrets)


def _unlink(path: Path) -> None:
    path.unlink(missing_ok=True)


def _read(path: Path) -> str:
    return path.read_text()


def _criu_env(extra: Mapping[str, str] | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    env.update(extra or {})
    env.pop("LD_LIBRARY_PATH", None)
    return env


def _common(tcp_established: bool, network_lock: str | None) -> list[str]:
    args = ["-v4"]
    if tcp_established:
        args.append("--tcp-established")
    if network_lock:
        args += ["--network-lock", network_lock]
    return args


async def _run_criu(
    sandbox: PodSandbox,
    argv: list[str],
    *,
    log_path: Path,
    limit: float,
    env: Mapping[str, str] | None,
    what: str,
) -> float:
    t0 = time.monotonic()
    try:
        res = await run_command(sandbox.nsenter_argv() + argv, timeout=limit, check=False, env=_criu_env(env))
    except CommandError as e:  # timed out: CRIU and nsenter were killed
        raise CriuError(f"criu {what} in {sandbox.netns}: no exit within {limit} s", log_path=log_path) from e
    if res.returncode != 0:
        raise CriuError(
            f"criu {what} in {sandbox.netns} exited {res.returncode}: {res.stderr.strip()[-500:]}",
            log_path=log_path,
        )
    return time.monotonic() - t0


async def criu_dump(
    sandbox: PodSandbox,
    pid: int,
    images_dir: Path,
    *,
    tcp_established: bool = False,
    network_lock: str | None = "nftables",
    leave_running: bool = False,
    shell_job: bool = False,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout: float = 60.0,
) -> CriuResult:
    """Dump the tree rooted at in-namespace ``pid`` of ``sandbox`` into ``images_dir``.

    The tree is killed after a successful dump unless ``leave_running``.
    """
    if pid == 1:
        raise ValueError("refusing to dump the sandbox's PID 1: dump the worker subtree under it")
    _private_dir(images_dir)
    log_path = images_dir / DUMP_LOG
    argv = [criu_binary(), "dump", "-t", str(pid), "-D", str(images_dir), "-o", DUMP_LOG,
            *_common(tcp_established, network_lock)]
    if leave_running:
        argv.append("--leave-running")
    if shell_job:
        argv.append("--shell-job")
    argv += list(extra_args)
    secs = await _run_criu(sandbox, argv, log_path=log_path, limit=timeout, env=env, what="dump")
    return CriuResult(images_dir=images_dir, log_path=log_path, seconds=secs, pid=pid)


async def criu_restore(
    sandbox: PodSandbox,
    images_dir: Path,
    *,
    tcp_established: bool = False,
    network_lock: str | None = "nftables",
    shell_job: bool = False,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout: float = 60.0,
) -> CriuResult:
    """Restore the tree in ``images_dir`` into ``sandbox`` in place (same pids, same netns).

    Detached: returns once the tree runs again, reparented to the sandbox's PID 1.
    """
    log_path = images_dir / RESTORE_LOG
    pidfile = images_dir / "restore.pid"
    _unlink(pidfile)
    argv = [criu_binary(), "restore", "-D", str(images_dir), "-o", RESTORE_LOG, "--restore-detached",
            "--pidfile", str(pidfile), *_common(tcp_established, network_lock)]
    if shell_job:
        argv.append("--shell-job")
    argv += list(extra_args)
    secs = await _run_criu(sandbox, argv, log_path=log_path, limit=timeout, env=env, what="restore")
    try:
        pid = int(_read(pidfile).strip())
    except (FileNotFoundError, ValueError) as e:
        raise CriuError(f"criu restore in {sandbox.netns} wrote no pidfile", log_path=log_path) from e
    return CriuResult(images_dir=images_dir, log_path=log_path, seconds=secs, pid=pid)
