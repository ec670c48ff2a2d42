"""A CRIU failure is reported by its cause: the agent's CriuError carries CRIU's own
``Error (file:line): ...`` lines, the one that ended the run first, and the cause classified from it, not
the last lines of a ``-v4`` log (which, for a restore, are its vdso and cgroup chatter; issue 18: a
corrupted image failed eight restores with the reason "unknown" and a message of vdso lines) nor the
first error CRIU went on from (issue 38: a damaged image led with ``tun: Unable to create tun``); and a
CRIU that never started is reported with its launcher's words, not ``(no log)``.

The real CRIU of the environment dumps a real process; its core image is then corrupted and the
restore goes through the agent's own ``criu_restore``.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from dynsnap.agent.criu import ERROR_LINES_KEPT, CriuError, CriuOptions, classify, criu_restore
from dynsnap.agent.nsexec import Target
from dynsnap.models.ids import HostPid
from dynsnap.runtime import procfs

NATIVE = Path(os.environ.get("DYNSNAP_NATIVE_BIN", Path(__file__).resolve().parents[2] / "native" / "build"))


def _criu() -> str:
    criu = os.environ.get("DYNSNAP_CRIU", "")
    if not criu or not os.access(criu, os.X_OK):
        pytest.fail("CRIU not built: DYNSNAP_CRIU is unset or not executable; run ./run setup")
    return criu


def _dumped_sleeper(images: Path) -> int:
    """A real ``sleep`` dumped by the real CRIU into ``images`` (the process is gone afterwards)."""
    p = subprocess.Popen(["sleep", "600"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        subprocess.run([_criu(), "dump", "-t", str(p.pid), "-D", str(images), "-o", "dump.log"], check=True,
                       timeout=60, stdin=subprocess.DEVNULL, capture_output=True)
        p.wait(timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
    return p.pid


async def test_a_corrupted_image_fails_the_restore_with_criu_s_error_lines_and_its_cause(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("CRIU dumps and restores as root")
    images = tmp_path / "images"
    images.mkdir(mode=0o700)
    pid = _dumped_sleeper(images)
    core = images / f"core-{pid}.img"
    data = bytearray(core.read_bytes())
    for i in range(16, len(data), 7):  # past the magic: the protobuf body no longer unpacks
        data[i] ^= 0xFF
    core.write_bytes(bytes(data))
    opts = CriuOptions(binary=_criu(), tcp_established=False, network_lock=None, net=False,
                       nsexec=str(NATIVE / "dynsnap-nsexec"))
    me = HostPid(os.getpid())
    with pytest.raises(CriuError) as info:
        # In the namespaces of this test's own process: the restore must fail before any task is made.
        await criu_restore(Target(me, procfs.start_time(me)), images, opts=opts, timeout=60)
    e = info.value
    log = (images / "restore.log").read_text(errors="replace")
    assert e.cause == "image_unreadable", (e.cause, e.errors, log[-2000:])
    assert e.errors, log[-2000:]
    assert all(line.startswith(("Error (", "Warn ")) for line in e.errors)
    assert any("Failed unpacking object" in line and core.name in line for line in e.errors), e.errors
    # Every error and warning line CRIU wrote is in the summary, and nothing else it logged, the one that
    # ended the run first.
    logged = [line.split(") ", 1)[1] for line in log.splitlines() if re.search(r"\) (Error|Warn) +\(", line)]
    assert sorted(e.summary.splitlines()) == sorted(logged[-ERROR_LINES_KEPT:])
    assert e.summary.splitlines()[0] == e.decisive and "Failed unpacking object" in e.summary.splitlines()[0]
    assert "Restoring FAILED" in e.summary
    assert "No pidns-1.img image" not in e.summary and "No pidns-1.img image" in log


def _log(*lines: str) -> str:
    return "".join(f"({i / 1000:09.6f}) {line}\n" for i, line in enumerate(lines))


def test_the_summary_is_the_error_lines_not_the_vdso_chatter_after_them(tmp_path: Path) -> None:
    log = tmp_path / "restore.log"
    chatter = [f"vdso: Parsing at {i:x} ... found symbol __vdso_clock_gettime" for i in range(400)]
    log.write_text(_log("Restoring task 10000", "     10000: Error (criu/files-reg.c:2183): Can't open file "
                        "tmp/x on restore: No such file or directory",
                        "pie: 10000: Error (criu/pie/restorer.c:1888): Restorer fail 10000",
                        "Error (criu/cr-restore.c:2331): Restoring FAILED.", *chatter))
    e = CriuError("criu restore exited 1", log_path=log)
    assert e.errors == ["Error (criu/files-reg.c:2183): Can't open file tmp/x on restore: No such file or directory",
                        "Error (criu/pie/restorer.c:1888): Restorer fail 10000",
                        "Error (criu/cr-restore.c:2331): Restoring FAILED."]
    assert "vdso" in e.log_tail and "vdso" not in e.summary and "vdso" not in str(e)
    assert e.cause == "unknown"


def test_the_warning_that_names_the_cause_is_kept_with_the_errors(tmp_path: Path) -> None:
    """CRIU's log of a dump of a traced task (as written here): the cause is a warning, the errors after
    it its consequences; the benign rlimit error before it stays too."""
    log = tmp_path / "dump.log"
    log.write_text(_log("Error (criu/util.c:1534): rlimit: Can't setup RLIMIT_NOFILE for self: Operation not "
                        "permitted", "Seizing task 10000", "Warn  (compel/src/lib/infect.c:132): Unable to interrupt "
                        "task: 10000 (Operation not permitted)", "Unlock network",
                        "Error (compel/src/lib/infect.c:417): Unable to detach from 10000: No such process",
                        "Error (criu/cr-dump.c:1975): Dumping FAILED."))
    e = CriuError("criu dump exited 1", log_path=log)
    assert [line.split(":")[0] for line in e.errors] == ["Error (criu/util.c", "Warn  (compel/src/lib/infect.c",
                                                         "Error (compel/src/lib/infect.c", "Error (criu/cr-dump.c"]
    assert "Unable to interrupt task: 10000 (Operation not permitted)" in e.summary
    assert e.cause == "traced"


def test_the_error_that_ended_the_run_leads_and_names_the_cause(tmp_path: Path) -> None:
    """A restore of a damaged image as CRIU logged it on the real node: an error it went on from first
    (its tun probe), then the damaged vDSO, then the consequences. The damaged image leads, and is the
    cause, not the first line."""
    log = tmp_path / "restore.log"
    log.write_text(_log("Error (criu/util.c:1534): rlimit: Can't setup RLIMIT_NOFILE for self: Operation not permitted",
                        "Error (criu/tun.c:88): tun: Unable to create tun: No such file or directory",
                        "Restoring task 10000",
                        "pie: 10000: Error (criu/pie/util-vdso.c:226): vdso: Invalid ELF magic in the vDSO at 0x7ffd",
                        "pie: 10000: Error (criu/pie/restorer.c:1888): Restorer fail 10000",
                        "Error (criu/cr-restore.c:2331): Restoring FAILED."))
    e = CriuError("criu restore exited 1", log_path=log)
    assert e.decisive is not None and "Invalid ELF magic" in e.decisive
    assert e.summary.splitlines()[0] == e.decisive
    assert e.cause == "image_unreadable"


def test_a_criu_that_never_started_is_reported_with_its_launchers_words(tmp_path: Path) -> None:
    e = CriuError("criu dump exited 125: dynsnap-nsexec: setns(net): Operation not permitted",
                  log_path=tmp_path / "dump.log")
    assert e.summary == "criu dump exited 125: dynsnap-nsexec: setns(net): Operation not permitted"
    assert "(no log)" not in str(e) and e.cause == "launcher"


def test_only_the_last_error_lines_are_kept_each_bounded(tmp_path: Path) -> None:
    log = tmp_path / "dump.log"
    log.write_text(_log(*(f"Error (criu/x.c:{i}): {'y' * 1000}" for i in range(40))))
    e = CriuError("criu dump exited 1", log_path=log)
    assert len(e.errors) == ERROR_LINES_KEPT
    assert e.errors[0].startswith(f"Error (criu/x.c:{40 - ERROR_LINES_KEPT}):")
    assert all(len(line) <= 400 for line in e.errors)


@pytest.mark.parametrize(("errors", "tail", "cause"), [
    ("Error (criu/files.c:1): Can't retrieve FDs", "", "io_uring"),
    ("Error (criu/protobuf.c:101): Failed unpacking object 0x1 from /i/core-1.img", "", "image_unreadable"),
    ("Error (criu/image.c:1): Unable to open /i/pages-1.img", "", "image_unreadable"),
    ("Error (criu/util.c:1): No space left on device", "", "no_space"),
    ("Warn  (compel/src/lib/infect.c:132): Unable to interrupt task: 10000 (Operation not permitted)\n"
     "Error (compel/src/lib/infect.c:417): Unable to detach from 10000: No such process", "", "traced"),
    # An error line that names no known cause does not hide one the tail's error talk names.
    ("Error (criu/util.c:1534): rlimit: Can't setup RLIMIT_NOFILE", "send_fds failed: err 9", "io_uring"),
    # Without error lines: only the tail's lines about an error count (the vdso text has "ring" in it).
    ("", "vdso: found __vdso_getcpu\nsomething: err 28 (28)", "no_space"),
    ("", "vdso: Parsing\nvdso: done", "unknown"),
])
def test_classify_reads_the_error_lines_first(errors: str, tail: str, cause: str) -> None:
    assert classify(errors, tail) == cause


def test_a_criu_killed_from_outside_is_named_so(tmp_path: Path) -> None:
    """The pod, which sees CRIU in its pid namespace, or the OOM killer: the cause is ``killed``, whatever CRIU
    logged before it died."""
    log = tmp_path / "restore.log"
    log.write_text(_log("Restoring task 10000", "vdso: Parsing at 0 ... found symbol __vdso_clock_gettime"))
    e = CriuError("criu restore was killed (signal 9): ", log_path=log, signal=9)
    assert e.cause == "killed" and "was killed (signal 9)" in str(e)
