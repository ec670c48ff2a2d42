"""Running external commands with bounds: every command has a time limit, runs in its own
session, and is killed with its whole process group when the limit passes or the caller is
cancelled. Optionally it dies with the calling process (``die_with_parent``), so a helper
cannot outlive an agent that was killed.

Layer: ``dynsnap.runtime`` (generic machinery; used by the agent and by the test harness).

    CommandError       a command exited non-zero (``returncode``), or ran past its bound
                       (``returncode`` None, ``timed_out`` True)
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import shutil
import signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["CommandError", "CommandResult", "SpawnHook", "find_tool", "run_command"]

# Called with a command's pid as soon as it runs (exec done; a quick command may have exited, and been
# reaped by asyncio's child watcher, already); returns what to call once the command has been reaped.
# An exception from it kills the command: a caller that must know about every command it runs (the
# agent's helper registry) never has one running it does not know of.
SpawnHook = Callable[[int], Callable[[], None]]

_PR_SET_PDEATHSIG = 1


class CommandError(RuntimeError):
    """A command exited non-zero, or ran past its time bound (``returncode`` None)."""

    def __init__(self, argv: Sequence[str], returncode: int | None, stdout: str, stderr: str) -> None:
        what = "timed out" if returncode is None else f"exited {returncode}"
        super().__init__(f"{' '.join(argv)} {what}: {stderr.strip()[-2000:] or stdout.strip()[-2000:]}")
        self.argv = list(argv)
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


@dataclass(frozen=True)
class CommandResult:
    returncode: int
    stdout: str
    stderr: str


def find_tool(name: str) -> str:
    """``name`` on PATH, else in the usual system directories; FileNotFoundError names it."""
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin:/bin")
    if path is None:
        raise FileNotFoundError(f"{name!r} not found on PATH")
    return path


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


async def run_command(
    argv: Sequence[str],
    *,
    timeout: float,
    check: bool = True,
    env: Mapping[str, str] | None = None,
    die_with_parent: bool = False,
    pass_fds: Sequence[int] = (),
    on_spawn: SpawnHook | None = None,
    kill_on_cancel: bool = True,
) -> CommandResult:
    """Run ``argv`` to completion within ``timeout`` seconds.

    The command runs in its own session; on timeout (or cancellation) its whole
    process group is killed and reaped, then :class:`CommandError` (returncode
    None) is raised (or the cancellation propagates). ``die_with_parent`` sets
    ``PR_SET_PDEATHSIG`` to SIGKILL in the child, so it dies if this process dies.
    ``pass_fds``: open fds of this process the command inherits (every other one is closed in it).
    ``on_spawn``: see :data:`SpawnHook`; what it returns is called once the command is reaped.
    ``kill_on_cancel=False``: a cancelled caller (the process stopping) leaves the command running, to be
    found by whoever comes next (the agent's CRIU: killed mid-dump, a worker can be lost); the time bound
    still kills it.
    """
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=dict(env) if env is not None else None,
        start_new_session=True,
        preexec_fn=_die_with_parent if die_with_parent else None,
        pass_fds=tuple(pass_fds),
    )
    reaped: Callable[[], None] | None = None
    try:
        if on_spawn is not None:
            reaped = on_spawn(proc.pid)
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except BaseException as e:  # timed out, cancelled, or not recorded: never leave the command running
        if isinstance(e, asyncio.CancelledError) and not kill_on_cancel and reaped is not None:
            raise  # left running, and on record (the hook's record stays: the next process finds it)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(proc.wait(), 5.0)  # reap it
        if reaped is not None and proc.returncode is not None:
            reaped()
        if isinstance(e, TimeoutError):
            raise CommandError(argv, None, "", f"no exit within {timeout} s") from None
        raise
    if reaped is not None:
        reaped()
    res = CommandResult(proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace"))
    if check and res.returncode != 0:
        raise CommandError(argv, res.returncode, res.stdout, res.stderr)
    return res
