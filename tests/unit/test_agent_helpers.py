"""The agent's helper registry (dynsnap/agent/helpers.py, issue 18): a helper is what the agent
recorded when it started it (pid, start time, executable, boot id), never what a process says about
itself. Against real processes on this machine: a recorded helper is found and, past its bound,
killed with its session; a process carrying the old environment marker, or sitting at a recorded pid
with another start time or executable (a pid reused), is neither found nor signalled; a record is
written while the command runs and gone once it is reaped, and a command that cannot be recorded
does not run on."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dynsnap.agent.helpers import HelperRegistry
from dynsnap.models.ids import PodUID
from dynsnap.runtime.command import run_command

UID = PodUID("0f6c3f2e-1b2a-4c3d-8e4f-5a6b7c8d9e0f")


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=10)


def _start(procs: list[subprocess.Popen[bytes]], argv: list[str], env: dict[str, str] | None = None
           ) -> subprocess.Popen[bytes]:
    p = subprocess.Popen(argv, env=env, start_new_session=True, stdin=subprocess.DEVNULL)
    procs.append(p)
    return p


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _wait_dead(p: subprocess.Popen[bytes]) -> int:
    return p.wait(timeout=10)


def test_a_recorded_helper_is_found_and_killed_with_its_session(tmp_path: Path,
                                                                 procs: list[subprocess.Popen[bytes]]) -> None:
    reg = HelperRegistry(tmp_path / "helpers")
    # a helper with a child in its session, as nsenter runs CRIU
    helper = _start(procs, ["/bin/sh", "-c", "sleep 1000 & wait"])
    reg.record(helper.pid, f"{UID}/criu")
    assert oct((tmp_path / "helpers").stat().st_mode & 0o777) == "0o700"
    time.sleep(0.1)  # the child is forked
    child = int(Path(f"/proc/{helper.pid}/task/{helper.pid}/children").read_text().split()[0])
    unrelated = _start(procs, ["sleep", "1000"])
    found = reg.running(UID)
    assert [(h.pid, h.label) for h in found] == [(helper.pid, f"{UID}/criu")]
    assert found[0].age >= 0 and found[0].name == "sh"
    assert reg.running(PodUID("another")) == []
    assert reg.kill(found[0]) is True
    assert _wait_dead(helper) == -signal.SIGKILL
    for _ in range(100):
        if not _alive(child):
            break
        time.sleep(0.05)
    assert not _alive(child), "the helper's session was killed with it"
    assert _alive(unrelated.pid), "nothing else was signalled"


def test_a_forged_marker_is_no_helper(tmp_path: Path, procs: list[subprocess.Popen[bytes]]) -> None:
    reg = HelperRegistry(tmp_path / "helpers")
    criu = tmp_path / "criu"  # even running an executable named criu
    shutil.copy("/bin/sleep", criu)
    forged = _start(procs, [str(criu), "1000"], env={**os.environ, "DYNSNAP_OP": f"{UID}/criu"})
    time.sleep(0.05)
    assert reg.running(UID) == []
    assert _alive(forged.pid)


@pytest.mark.parametrize("lie", ["start", "exe", "boot"])
def test_a_record_whose_process_is_another_is_stale_and_nothing_is_signalled(
        tmp_path: Path, procs: list[subprocess.Popen[bytes]], lie: str) -> None:
    """The pid of a record now names another process (the helper ended, the pid was reused): its start
    time or executable differs, or the node rebooted since. The record is dropped, the process left."""
    reg = HelperRegistry(tmp_path / "helpers")
    other = _start(procs, ["sleep", "1000"])
    path = reg.record(other.pid, f"{UID}/save")
    assert path is not None
    found = reg.running(UID)
    assert [h.pid for h in found] == [other.pid]
    rec = json.loads(path.read_text())
    rec.update({"start": rec["start"] + 1} if lie == "start" else {"exe": "/usr/bin/criu"} if lie == "exe"
               else {"bootId": "an-earlier-boot"})
    path.write_text(json.dumps(rec))
    assert reg.kill(found[0]) is False, "a process that is not the recorded helper was signalled"
    assert reg.running(UID) == []
    assert not path.exists(), "the stale record was removed"
    assert _alive(other.pid)


def test_run_command_records_a_helper_while_it_runs_and_drops_it_once_reaped(tmp_path: Path) -> None:
    reg = HelperRegistry(tmp_path / "helpers")

    async def scenario() -> None:
        task = asyncio.create_task(run_command(["sleep", "1"], timeout=30, on_spawn=reg.spawned(f"{UID}/resume")))
        for _ in range(100):
            if reg.running(UID):
                break
            await asyncio.sleep(0.02)
        running = reg.running(UID)
        assert [h.label for h in running] == [f"{UID}/resume"] and running[0].name == "sleep"
        await task
        assert reg.running(UID) == [] and list((tmp_path / "helpers").iterdir()) == []
    asyncio.run(scenario())


def test_a_helper_gone_before_its_record_or_no_child_of_the_agent_is_not_recorded(
        tmp_path: Path, procs: list[subprocess.Popen[bytes]]) -> None:
    """asyncio reaps a child from a thread the moment it exits: a quick helper can be gone before the
    spawn hook runs (nothing to record, no error), and its pid can even name another process by then
    (not the agent's child: not recorded either)."""
    reg = HelperRegistry(tmp_path / "helpers")
    stranger = _start(procs, ["sleep", "1000"])
    assert reg.record(stranger.pid, f"{UID}/unlock", parent=stranger.pid + 1) is None  # another's child
    assert reg.record(os.getppid(), f"{UID}/unlock") is None  # a process that is not this one's child

    async def scenario() -> None:
        for _ in range(20):  # each exits at once: some before their hook runs
            await run_command(["true"], timeout=30, on_spawn=reg.spawned(f"{UID}/unlock"))
    asyncio.run(scenario())
    assert list((tmp_path / "helpers").glob("*.json")) == []


def test_a_helper_that_cannot_be_recorded_does_not_run_on(tmp_path: Path) -> None:
    (tmp_path / "helpers").write_text("a file where the registry's directory goes")
    hook = HelperRegistry(tmp_path / "helpers").spawned(f"{UID}/save")
    spawned: list[int] = []

    def spy(pid: int) -> Callable[[], None]:
        spawned.append(pid)
        return hook(pid)

    async def scenario() -> None:
        with pytest.raises(OSError):
            await run_command(["sleep", "1000"], timeout=30, on_spawn=spy)
    asyncio.run(scenario())
    assert len(spawned) == 1 and not _alive(spawned[0]), "the unrecorded helper was left running"


def test_a_helper_that_outlives_the_recorded_process_is_still_found_and_killed_by_its_session(
        tmp_path: Path, procs: list[subprocess.Popen[bytes]]) -> None:
    """CRIU outlives its launcher (dynsnap-nsexec, the recorded process) when the agent's container is stopped:
    the record still stands for a running helper while a process of the launcher's session lives, a later
    agent finds that process and, past the bound, kills it; once it is gone the record is stale."""
    reg = HelperRegistry(tmp_path / "helpers")
    pidfile = tmp_path / "child"
    # the launcher: its child in its session, then it waits for its stdin to close and exits
    launcher = subprocess.Popen(["sh", "-c", f"sleep 1000 & echo $! > {pidfile}.tmp && mv {pidfile}.tmp {pidfile}; "
                                 "read x"], start_new_session=True, stdin=subprocess.PIPE)
    procs.append(launcher)
    for _ in range(200):
        if pidfile.exists():
            break
        time.sleep(0.01)
    child = int(pidfile.read_text())
    assert reg.record(launcher.pid, f"{UID}/criu") is not None
    assert launcher.stdin is not None
    launcher.stdin.close()
    _wait_dead(launcher)
    try:
        found = reg.running(UID)
        assert [(h.pid, h.leader, h.name) for h in found] == [(child, launcher.pid, "sleep")]
        assert reg.kill(found[0]) is True
        for _ in range(100):
            if not _alive(child):
                break
            time.sleep(0.05)
        assert not _alive(child)
        assert reg.running(UID) == []
        assert not list((tmp_path / "helpers").glob("*.json")), "the stale record was removed"
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)
