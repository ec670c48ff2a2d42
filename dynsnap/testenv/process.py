"""Supervised child processes for the test environment (etcd, kube-apiserver, kwok, ...).

Each runs in its own session with stdout+stderr to a log file that is kept; ``stop``
sends SIGTERM to the process group, then SIGKILL after a grace period, and always reaps.
A binary that does not exist is reported with the setup command that builds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path


class MissingBinary(RuntimeError):
    """A real part the environment needs is not built."""


class ProcessFailed(RuntimeError):
    """A supervised process exited or never became ready."""


def require_binary(path: str | os.PathLike[str] | None, what: str, env_var: str) -> Path:
    if not path:
        raise MissingBinary(f"{what}: ${env_var} is not set; run `./run setup` (it builds and exports it)")
    p = Path(path)
    if not (p.is_file() and os.access(p, os.X_OK)):
        raise MissingBinary(f"{what}: {p} (from ${env_var}) is missing or not executable; run `./run setup`")
    return p


class Supervised:
    """One child process with a kept log."""

    def __init__(self, name: str, argv: Sequence[str], *, log_path: Path, env: dict[str, str] | None = None,
                 cwd: Path | None = None) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.env = env
        self.cwd = cwd
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # A local file open is instant; the child inherits the descriptor, ours is closed below.
        log = open(self.log_path, "ab")  # noqa: SIM115, ASYNC230
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *self.argv, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log,
                env=self.env, cwd=self.cwd, start_new_session=True,
            )
        finally:
            log.close()

    @property
    def pid(self) -> int:
        assert self.proc is not None, f"{self.name} not started"
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    async def wait_ready(self, probe: Callable[[], Awaitable[bool]], *, timeout: float, what: str = "ready") -> None:
        """Poll ``probe`` until it returns True; fail early if the process dies."""
        deadline = time.monotonic() + timeout
        delay = 0.05
        while time.monotonic() < deadline:
            if not self.alive():
                raise ProcessFailed(f"{self.name} exited ({self.proc and self.proc.returncode}) before {what}; "
                                    f"log {self.log_path}:\n{self.tail()}")
            with contextlib.suppress(Exception):
                if await probe():
                    return
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)
        raise ProcessFailed(f"{self.name} not {what} after {timeout:.0f}s; log {self.log_path}:\n{self.tail()}")

    async def stop(self, *, grace: float = 10.0) -> int | None:
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return None if proc is None else proc.returncode
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                return await asyncio.wait_for(proc.wait(), wait)
            except TimeoutError:
                continue
        return proc.returncode
