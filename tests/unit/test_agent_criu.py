"""How the agent starts CRIU (dynsnap/agent/criu.py, dynsnap/agent/nsexec.py): through dynsnap-nsexec, in
the worker's pid, network, IPC, UTS and cgroup namespaces and a mount namespace of its own, never the
worker's; a dump takes the tree's mount namespace through the tree root (``--tree-mntns``), a restore
joins it in the restored tasks only (``--join-ns mnt:`` the descriptor the launcher checked); CRIU's PATH
and plugins are empty directories of the agent's for the run; no configuration. Nothing is run here
(run_command replaced): the real CRIU, launcher and worker are in tests/native/test_nsexec.py,
tests/native/test_agent_exec.py and the real node's tests/integration/node/test_agent_trust.py."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from dynsnap.agent import criu as criu_mod
from dynsnap.agent import nsexec as nsexec_mod
from dynsnap.agent.criu import CriuError, CriuOptions, PagesRead, _common, _env, pages_read
from dynsnap.agent.nsexec import ForeignNamespace, Target, TargetChanged
from dynsnap.models.ids import HostPid, NsPid
from dynsnap.runtime import procfs
from dynsnap.runtime.command import CommandResult

SELF = Target(HostPid(os.getpid()), procfs.start_time(os.getpid()))
NSEXEC = "/opt/dynsnap/dynsnap-nsexec"  # never run here


def _fake_criu(tmp_path: Path) -> str:
    """A CRIU wrapper script of the agent's: a file of the agent's file system is what CRIU runs from."""
    script = tmp_path / "criu-wrapper"
    script.write_text("#!/bin/sh\nexec criu \"$@\"\n")
    script.chmod(0o755)
    return str(script)


def _seen(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, opts: CriuOptions, *, restore: bool = False,
          answer: CommandResult | None = None) -> dict[str, object]:
    """What one dump (or restore) hands the launcher (argv, environment, descriptors), and what CRIU's PATH
    holds while it runs; nothing is run."""
    seen: dict[str, object] = {}

    async def fake_run(argv: list[str], **kw: object) -> CommandResult:
        env = kw["env"]
        assert isinstance(env, dict)
        seen.update(argv=argv, env=env, fds=list(kw["pass_fds"]))  # type: ignore[call-overload]
        path = env["PATH"]
        seen["path_holds"] = os.listdir(path) if os.path.isdir(path) else None
        if restore:
            (tmp_path / "img" / criu_mod.PIDFILE).write_text("4242\n")
        return answer or CommandResult(0, "", "")
    monkeypatch.setattr(nsexec_mod, "run_command", fake_run)
    images = tmp_path / "img"
    images.mkdir(exist_ok=True)
    if restore:
        asyncio.run(criu_mod.criu_restore(SELF, images, opts=opts, timeout=30))
    else:
        asyncio.run(criu_mod.criu_dump(SELF, NsPid(10000), images, opts=opts, timeout=30))
    return seen


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    at = argv.index("--")
    return argv[:at], argv[at + 1:]


def test_a_dump_runs_criu_through_the_launcher_outside_the_workers_mount_namespace(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    criu = _fake_criu(tmp_path)
    seen = _seen(monkeypatch, tmp_path, CriuOptions(binary=criu, nsexec=NSEXEC))
    launcher, program = _split(seen["argv"])  # type: ignore[arg-type]
    assert launcher[0] == NSEXEC
    pidfd = int(launcher[launcher.index("--target-pidfd") + 1])
    assert seen["fds"] == [pidfd], "the target's pidfd, and nothing else of the agent's, is handed over"
    assert launcher[launcher.index("--target-start") + 1] == str(SELF.start)
    assert launcher[launcher.index("--ns") + 1] == "pid,net,ipc,uts,cgroup", "never mnt, never user"
    assert "--private-mounts" in launcher and "--mntns-fd" not in launcher
    assert program[:3] == [criu, "dump", "--tree-mntns"]
    assert program[program.index("-t") + 1] == "10000"
    assert program[program.index("-D") + 1] == str(tmp_path / "img")
    assert program[program.index("-o") + 1] == str(tmp_path / "img" / "dump.log")
    with pytest.raises(OSError):
        os.fstat(pidfd)  # closed after the run


def test_a_restore_has_only_the_restored_tasks_join_the_checked_mount_namespace(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen = _seen(monkeypatch, tmp_path, CriuOptions(binary=_fake_criu(tmp_path), nsexec=NSEXEC), restore=True)
    launcher, program = _split(seen["argv"])  # type: ignore[arg-type]
    pidfd = int(launcher[launcher.index("--target-pidfd") + 1])
    mntns = int(launcher[launcher.index("--mntns-fd") + 1])
    assert mntns != pidfd and "--private-mounts" in launcher
    assert program[program.index("--join-ns") + 1] == f"mnt:/proc/self/fd/{mntns}"
    assert program[1] == "restore" and "--tree-mntns" not in program
    assert "--restore-detached" in program


def test_criu_gets_an_empty_path_and_plugin_directory_of_the_agents(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    """With no PATH and no plugin directory in the options (the plugin off), CRIU's PATH and --libdir are one
    empty directory of the agent's, made for the run and gone after it, as is its work directory (-W, where a
    restore mounts its cgroup yard, in CRIU's own mount namespace)."""
    before = set(Path(tempfile.gettempdir()).glob("dynsnap-criu-*"))  # (those of agents killed mid-run)
    seen = _seen(monkeypatch, tmp_path, CriuOptions(binary=_fake_criu(tmp_path), nsexec=NSEXEC))
    env = seen["env"]
    assert isinstance(env, dict)
    _, program = _split(seen["argv"])  # type: ignore[arg-type]
    path = env["PATH"]
    assert ":" not in path and seen["path_holds"] == [], "an empty directory"
    assert program[program.index("--libdir") + 1] == path
    work = program[program.index("-W") + 1]
    assert os.path.dirname(path) == work
    assert set(Path(tempfile.gettempdir()).glob("dynsnap-criu-*")) == before, "removed after the run"
    # Named in the options (the plugin on: the helper's directory alone), they are what CRIU gets.
    seen = _seen(monkeypatch, tmp_path, CriuOptions(binary=_fake_criu(tmp_path), path="/opt/dynsnap/bin",
                                                    libdir="/opt/criu/lib/criu", nsexec=NSEXEC))
    _, program = _split(seen["argv"])  # type: ignore[arg-type]
    assert seen["env"]["PATH"] == "/opt/dynsnap/bin"  # type: ignore[index]
    assert program[program.index("--libdir") + 1] == "/opt/criu/lib/criu"


def test_an_agent_stopped_while_criu_runs_on_leaves_criu_its_directories(monkeypatch: pytest.MonkeyPatch,
                                                                            tmp_path: Path) -> None:
    """The agent cancelled mid-run (its pod deleted: CRIU outlives it, kill_on_cancel off) keeps CRIU's work and
    empty directories, which CRIU still uses; they go with the agent pod's memory volume at /tmp once CRIU
    ends. A run that ended, in failure too, removes them."""
    started = asyncio.Event()
    seen: dict[str, str] = {}

    async def hung(argv: list[str], **kw: object) -> CommandResult:
        assert kw["kill_on_cancel"] is False
        _, program = _split(argv)
        seen["work"] = program[program.index("-W") + 1]
        started.set()
        await asyncio.sleep(3600)
        raise AssertionError("not cancelled")
    monkeypatch.setattr(nsexec_mod, "run_command", hung)
    (tmp_path / "img").mkdir()

    async def stopped() -> None:
        run = asyncio.create_task(criu_mod.criu_dump(SELF, NsPid(10000), tmp_path / "img", timeout=30,
                                                     opts=CriuOptions(binary=_fake_criu(tmp_path), nsexec=NSEXEC)))
        await started.wait()
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
    asyncio.run(stopped())
    work = Path(seen["work"])
    try:
        assert work.is_dir() and (work / "none").is_dir(), "CRIU's directories taken from under it"
    finally:
        shutil.rmtree(work, ignore_errors=True)
    before = set(Path(tempfile.gettempdir()).glob("dynsnap-criu-*"))
    with pytest.raises(CriuError):
        _seen(monkeypatch, tmp_path, CriuOptions(binary=_fake_criu(tmp_path), nsexec=NSEXEC),
              answer=CommandResult(1, "", "failed"))
    assert set(Path(tempfile.gettempdir()).glob("dynsnap-criu-*")) == before, "a failed run's removed"


def test_criu_reads_no_configuration_file(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every run says --no-default-config, and neither the agent's environment nor the options pass
    CRIU_CONFIG_FILE, CRIU_LIBS_DIR or LD_LIBRARY_PATH on: what CRIU does is what the agent passes."""
    monkeypatch.setenv("CRIU_CONFIG_FILE", "/etc/criu/planted.conf")
    monkeypatch.setenv("LD_LIBRARY_PATH", "/opt/elsewhere")
    monkeypatch.setenv("CRIU_LIBS_DIR", "/usr/lib/criu")
    opts = CriuOptions(binary="criu", env={"CRIU_CONFIG_FILE": "/x.conf", "LD_LIBRARY_PATH": "/y", "KEEP": "1"})
    assert "--no-default-config" in _common(opts)
    env = _env(opts, "/opt/criu/bin")
    assert "CRIU_CONFIG_FILE" not in env and "LD_LIBRARY_PATH" not in env and "CRIU_LIBS_DIR" not in env
    assert env["KEEP"] == "1" and env["PATH"] == "/opt/criu/bin"


def test_the_launchers_refusal_is_a_foreign_namespace_with_its_words(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    words = "ForeignNamespace: the target (pid 7) is in user namespace 4026532999, not the node's (4026531837)"
    with pytest.raises(ForeignNamespace, match="user namespace 4026532999") as e:
        _seen(monkeypatch, tmp_path, CriuOptions(binary=_fake_criu(tmp_path), nsexec=NSEXEC),
              answer=CommandResult(nsexec_mod.EXIT_REFUSED, "", f"dynsnap-nsexec: refused: {words}\n"))
    assert e.value.reason.value == "ForeignNamespace"


def test_a_target_that_is_another_process_is_never_handed_over(monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    """A start time other than the one the agent saw (the container restarted, its pid reused): nothing runs."""
    ran: list[object] = []

    async def fake_run(argv: list[str], **kw: object) -> CommandResult:
        ran.append(argv)
        return CommandResult(0, "", "")
    monkeypatch.setattr(nsexec_mod, "run_command", fake_run)
    other = Target(SELF.host_pid, (SELF.start or 0) + 1)
    with pytest.raises(TargetChanged, match="another start time"):
        asyncio.run(criu_mod.criu_dump(other, NsPid(10000), tmp_path / "img", opts=CriuOptions(
            binary=_fake_criu(tmp_path), nsexec=NSEXEC), timeout=30))
    assert ran == []


def test_a_missing_criu_is_a_criu_error(tmp_path: Path) -> None:
    with pytest.raises(CriuError, match="not found, or not executable"):
        asyncio.run(criu_mod.criu_dump(SELF, NsPid(10000), tmp_path / "img",
                                       opts=CriuOptions(binary=str(tmp_path / "nope")), timeout=30))


def test_pages_read_sums_the_restorers_lines_and_is_none_for_stocks_loop(tmp_path: Path) -> None:
    log = tmp_path / "restore.log"
    log.write_text("(00.04) pie: 15: dynsnap: reading 545361920 bytes of pages with 4 threads\n"
                   "(00.11) pie: 15: dynsnap: read 545361920 bytes of pages with 4 threads\n"
                   "(00.12) pie: 16: dynsnap: read 1048576 bytes of pages with 2 threads\n")
    assert pages_read(log) == PagesRead(bytes=545361920 + 1048576, threads=4, processes=2)
    log.write_text("(00.04) pie: 15: Preadv 0x7f00:4096... (3 iovs)\n")  # stock CRIU's loop, at -v4
    assert pages_read(log) is None
    assert pages_read(tmp_path / "missing.log") is None


def test_a_criu_killed_from_outside_says_so_first_whatever_it_logged_before(tmp_path: Path) -> None:
    """A restore SIGKILLed mid-way (by a pod that sees CRIU in its pid namespace) after CRIU logged a
    non-fatal kerndat error: the summary, which a person reads first, leads with the kill, then that line;
    the cause is ``killed``, not what the line would suggest."""
    log = tmp_path / "restore.log"
    log.write_text("(00.001000) Error (criu/tun.c:85): tun: Unable to create tun: No such file or directory\n"
                   "(00.020000) Restoring the tree\n")
    e = CriuError("criu restore was killed (signal 9): ", log_path=log, signal=9)
    assert e.cause == "killed"
    assert e.summary.splitlines()[0] == "criu restore was killed (signal 9): "
    assert "tun: Unable to create tun" in e.summary.splitlines()[1]
