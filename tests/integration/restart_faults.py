"""What the agent-killed matrix (restartmatrix.py) needs to kill the node agent in the middle of one
step and start another: the agent killed and reaped, a helper an agent started found by what it
is (helperprocs.py), the worker's entrypoint held (SIGSTOP) so it cannot acknowledge a request, the
entrypoint's control files read through /proc/<pid>/root (a sandbox's PID 1 or a real container's,
by its host pid), and the slow CRIU (``fake_slow_criu``) that holds a dump or a restore in flight.

Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentenv import AgentProc, StubDriver, eventually
from helperprocs import Helper, helpers_for

from dynsnap.models import protocol as P

HERE = Path(__file__).resolve().parent


async def kill_agent(agent: AgentProc) -> None:
    """SIGKILL the agent (AgentProc.kill: no cleanup of any kind), then reap it. Its helpers run in
    sessions of their own and are not touched."""
    assert agent.proc is not None and agent.proc.proc is not None
    agent.kill()
    await agent.proc.proc.wait()
    agent.proc = None


def helpers(pidns: int, pid1: int) -> list[Helper]:
    """The CRIU (with its dynsnap-nsexec) and dynsnap-cuda processes an agent started for the worker whose pid
    namespace is ``pidns`` and whose entrypoint is host pid ``pid1`` that still run, found by what they
    are (helperprocs.py), not by the agent's own registry."""
    return helpers_for(pidns, pid1)


def unhang(driver: StubDriver) -> None:
    """Drop the stub driver's ``hang`` lines, keep the rest of its control file (``nskey``, ``mem``)."""
    driver.set_control([line for line in driver.control_lines() if not line.startswith("hang ")])


# -- the worker's entrypoint --------------------------------------------------------------------

def control_dir(pid1: int) -> Path:
    """The control directory of the entrypoint at host pid ``pid1``, reached as the agent reaches it (no volume)."""
    return Path(f"/proc/{pid1}/root") / P.ENTRYPOINT_CONTROL_DIR.lstrip("/")


def ep_info(pid1: int) -> dict[str, Any]:
    info: dict[str, Any] = json.loads((control_dir(pid1) / P.ENTRYPOINT_CONTROL_FILE).read_text())
    return info


def pending_request(pid1: int) -> tuple[int, str] | None:
    """The agent's last request (``SEQ STATE``), None when there is none or it is half-written."""
    try:
        text = (control_dir(pid1) / P.ENTRYPOINT_REQUEST_FILE).read_text()
    except OSError:
        return None
    parts = text.split()
    if not text.endswith("\n") or len(parts) != 2 or not parts[0].isdigit():
        return None
    return int(parts[0]), parts[1]


@contextlib.contextmanager
def entrypoint_stopped(pid1: int) -> Iterator[int]:
    """The dynsnap-entrypoint at host pid ``pid1`` stopped (SIGSTOP): it cannot acknowledge a request
    until the block ends (SIGCONT), whatever happens in it. Yields the request_seq it had acknowledged."""
    seq = int(ep_info(pid1).get("request_seq") or 0)
    os.kill(pid1, signal.SIGSTOP)
    try:
        yield seq
    finally:
        os.kill(pid1, signal.SIGCONT)


async def wait_request(pid1: int, after: int, state: str, *, timeout: float = 60) -> int:
    """Wait until the agent has written a request for ``state`` numbered past ``after``; its number."""
    async def written() -> int | None:
        req = pending_request(pid1)
        return req[0] if req is not None and req[0] > after and req[1] == state else None
    seq: int = await eventually(f"the agent's request for {state!r} (past seq {after})", written, timeout=timeout)
    return seq


async def wait_ack(pid1: int, seq: int, state: str, *, timeout: float = 30) -> dict[str, Any]:
    async def acked() -> dict[str, Any] | None:
        info = ep_info(pid1)
        return info if int(info.get("request_seq") or 0) >= seq and info.get("state") == state else None
    info: dict[str, Any] = await eventually(f"the entrypoint's ack of {seq} {state}", acked, timeout=timeout)
    return info


# -- the slow CRIU --------------------------------------------------------------------------

FAKE_SLOW_CRIU_SRC = HERE.parent / "native" / "fake_slow_criu" / "fake_slow_criu.c"
FAKE_SLOW_CRIU_ENV = "DYNSNAP_FAKE_SLOW_CRIU"  # its control directory, a path in CRIU's own mount namespace
# CRIU's mount namespace is a copy of the agent's (dynsnap/agent/criu.py): for an agent that runs as a process of
# the node's (the tests' AgentProc), a node path. This session's own.
FAKE_SLOW_CRIU_DIR = str(Path(tempfile.gettempdir()) / f"dynsnap-fake-slow-criu-{os.getpid()}")


def build_slow_criu(workdir: Path) -> Path:
    """A copy of the real CRIU (``$DYNSNAP_CRIU``) that loads libfake_slow_criu.so (see its source's
    header), both in ``workdir``; its path, for the agent's ``--criu`` with
    ``FAKE_SLOW_CRIU_ENV=FAKE_SLOW_CRIU_DIR`` in the agent's environment."""
    workdir.mkdir(parents=True, exist_ok=True)
    lib = workdir / "libfake_slow_criu.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-Wall", "-Wextra", "-Werror", "-o", str(lib),
                    str(FAKE_SLOW_CRIU_SRC)], check=True)
    criu = workdir / "criu"
    shutil.copyfile(os.environ["DYNSNAP_CRIU"], criu)
    criu.chmod(0o755)
    # One change a run: patchelf 0.14 given both at once took the library's name for the RUNPATH.
    subprocess.run(["patchelf", "--add-rpath", str(workdir), str(criu)], check=True)
    subprocess.run(["patchelf", "--add-needed", lib.name, str(criu)], check=True)
    return criu


@dataclass(frozen=True)
class SlowCriu:
    """fake_slow_criu's control directory in one worker's container, as the node reaches it
    (``/proc/<its entrypoint>/root``, the container's PID 1, there as long as the container is)."""

    dir: Path

    @classmethod
    def at(cls, directory: str = FAKE_SLOW_CRIU_DIR) -> SlowCriu:
        c = cls(Path(directory))
        c.dir.mkdir(mode=0o700, exist_ok=True)
        c.reset()
        return c

    def hold(self, op: str, mode: str) -> None:
        """The next ``op`` (dump, restore) waits for :meth:`release` before (``before``) or after
        (``after``) running the real CRIU."""
        (self.dir / "release").unlink(missing_ok=True)
        (self.dir / f"{op}.mode").write_text(mode)

    def release(self) -> None:
        (self.dir / "release").touch()

    def reset(self) -> None:
        for name in ("dump.mode", "restore.mode"):
            (self.dir / name).unlink(missing_ok=True)
        self.release()

    def log(self) -> list[list[str]]:
        try:
            return [line.split() for line in (self.dir / "log").read_text().splitlines() if line.strip()]
        except OSError:
            return []

    def runs(self, op: str) -> list[dict[str, Any]]:
        """Every run of ``op`` so far: its pid, mode, argv, and what it logged after its start."""
        out: list[dict[str, Any]] = []
        by_pid: dict[str, dict[str, Any]] = {}
        for words in self.log():
            if words[0] == "start" and len(words) >= 4:
                run = {"pid": int(words[1]), "mode": words[2], "argv": words[3:], "events": []}
                by_pid[words[1]] = run
                if words[3] == op:
                    out.append(run)
            elif len(words) >= 2 and words[1] in by_pid:
                by_pid[words[1]]["events"].append(words[0] if words[0] != "exited" else f"exited {words[2]}")
        return out

    @staticmethod
    def images_dir(run: dict[str, Any]) -> str:
        argv: list[str] = run["argv"]
        return argv[argv.index("-D") + 1]
