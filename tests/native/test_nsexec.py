"""dynsnap-nsexec (native/nsexec, docs/NATIVE.md): what the agent starts in a worker's namespaces never loads
or runs anything of the worker's, never leaves a mount where the worker (or the node) sees it, and never
enters namespaces a worker made for itself.

A "container" here is what a runtime makes: a process that is PID 1 of its own pid namespace, in mount,
network, UTS and IPC namespaces of its own, whose file system is the pod author's: its ``/etc`` is a copy
whose ``ld.so.preload`` names a library that records every load it gets (a line with the pid and euid of
the process it was loaded into). The control: ``nsenter -m`` into it, as the agent started CRIU before
issue 38, loads that library as root. Through dynsnap-nsexec the same program never does.

Real processes and namespaces, as root; nothing is faked.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dynsnap.runtime import procfs
from dynsnap.runtime.command import find_tool

ROOT = Path(__file__).resolve().parents[2]
NATIVE = Path(os.environ.get("DYNSNAP_NATIVE_BIN", ROOT / "native" / "build"))
NSEXEC = NATIVE / "dynsnap-nsexec"
EXIT_REFUSED = 122
EXIT_FAILED = 125

RECORDER = r"""
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
__attribute__((constructor)) static void recorded(void) {
    char line[128];
    int n = snprintf(line, sizeof line, "%d %d\n", (int)getpid(), (int)geteuid());
    int fd = open(MARK, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd >= 0) { if (write(fd, line, (size_t)n) < 0) {} close(fd); }
}
"""


def _need() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (namespaces)")
    if not NSEXEC.exists():
        pytest.fail(f"{NSEXEC} is not built: run make -C native")


def _children(pid: int) -> list[int]:
    return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


class Container:
    """``unshare`` of a pid, mount, network, UTS and IPC namespace whose PID 1 is a ``sleep`` (found as
    the child of unshare), its /etc the test's copy."""

    def __init__(self, argv: list[str], *, etc: Path | None = None) -> None:
        setup = f"mount --bind {etc} /etc && " if etc else ""
        self.proc = subprocess.Popen(
            [*argv, "sh", "-c", f"{setup}exec sleep 1000"], stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self.pid1 = 0
        for _ in range(100):
            kids = _children(self.proc.pid) if self.proc.poll() is None else []
            if kids and procfs.exe_name(kids[0]) == "sleep":
                self.pid1 = kids[0]
                break
            time.sleep(0.05)
        if not self.pid1:
            self.stop()
            pytest.fail(f"no container from {argv}")

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid1, signal.SIGKILL)
        self.proc.wait(10)


RUNTIME = [find_tool("unshare") if os.geteuid() == 0 else "unshare", "--pid", "--fork", "--kill-child",
           "--mount-proc", "--mount", "--propagation", "private", "--net", "--uts", "--ipc", "--"]


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The pod author's /etc (a copy of the node's whose ld.so.preload names the recorder) and the file
    the recorder writes."""
    _need()
    work = tmp_path_factory.mktemp("nsexec")
    mark = work / "loaded"
    src = work / "recorder.c"
    src.write_text(RECORDER)
    lib = work / "librecorder.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", f'-DMARK="{mark}"', "-o", str(lib), str(src)], check=True)
    etc = work / "etc"
    subprocess.run(["cp", "-a", "/etc", str(etc)], check=True)
    (etc / "ld.so.preload").write_text(f"{lib}\n")
    return etc, mark


@pytest.fixture
def container(planted: tuple[Path, Path]) -> Iterator[Container]:
    c = Container(RUNTIME, etc=planted[0])
    try:
        yield c
    finally:
        c.stop()


def nsexec(target: int, program: list[str], *, ns: str = "pid,net,ipc,uts,cgroup", private: bool = True,
           start: int | None = None, extra: tuple[str, ...] = (),
           timeout: float = 30) -> subprocess.CompletedProcess[str]:
    fd = os.pidfd_open(target)
    try:
        argv = [str(NSEXEC), "--target-pidfd", str(fd), "--ns", ns, *(["--private-mounts"] if private else []),
                *(["--target-start", str(start)] if start is not None else []), *extra, "--", *program]
        return subprocess.run(argv, pass_fds=[fd], capture_output=True, text=True, timeout=timeout)
    finally:
        os.close(fd)


def _loads(mark: Path) -> list[str]:
    return mark.read_text().splitlines() if mark.exists() else []


def test_nsenter_into_the_mount_namespace_runs_the_pods_preload_as_root(container: Container,
                                                                        planted: tuple[Path, Path]) -> None:
    """The attack is real: a dynamic program started the way the agent started CRIU before (``nsenter -m``
    into the worker's mount namespace) loads the library the pod's /etc/ld.so.preload names, as root."""
    _, mark = planted
    before = _loads(mark)
    r = subprocess.run([find_tool("nsenter"), "-t", str(container.pid1), "-m", "-p", "--", "/bin/true"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    new = _loads(mark)[len(before):]
    assert new and all(line.split()[1] == "0" for line in new), new


def test_a_program_started_by_nsexec_loads_nothing_of_the_pods(container: Container,
                                                               planted: tuple[Path, Path]) -> None:
    """Through dynsnap-nsexec the same program runs in the pod's pid, network, IPC, UTS and cgroup namespaces
    (its own pid there, the pod's PID 1 and network interfaces seen) and the library is never loaded."""
    _, mark = planted
    before = _loads(mark)
    r = nsexec(container.pid1, ["/bin/sh", "-c", "cat /proc/1/comm; readlink /proc/self/ns/pid /proc/self/ns/net "
                                "/proc/self/ns/uts /proc/self/ns/ipc; /bin/true"])
    assert r.returncode == 0, r.stderr
    assert _loads(mark) == before, "the pod's preload was loaded into a program the launcher started"
    lines = r.stdout.splitlines()
    assert lines[0] == "sleep"  # its /proc is the pod's pid namespace's: PID 1 is the pod's
    for kind, seen in zip(("pid", "net", "uts", "ipc"), lines[1:5], strict=True):
        assert seen == os.readlink(f"/proc/{container.pid1}/ns/{kind}")


def test_what_the_program_mounts_is_seen_nowhere_else_and_goes_with_it(container: Container,
                                                                       tmp_path: Path) -> None:
    """With --private-mounts the program's mount namespace is its own (a copy of the caller's): a tmpfs it
    mounts (as CRIU mounts its cgroup yard) is in neither the node's mount table nor the pod's while it
    runs, and gone with it."""
    ready = tmp_path / "mounted"
    script = (f"mount -t tmpfs dynsnap-nsexec-yard /mnt && grep -c dynsnap-nsexec-yard /proc/self/mountinfo "
              f"&& touch {ready} && sleep 2")
    fd = os.pidfd_open(container.pid1)
    try:
        p = subprocess.Popen([str(NSEXEC), "--target-pidfd", str(fd), "--ns", "pid,net,ipc,uts,cgroup",
                              "--private-mounts", "--", "/bin/sh", "-c", script], pass_fds=[fd],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    finally:
        os.close(fd)
    for _ in range(100):
        if ready.exists() or p.poll() is not None:
            break
        time.sleep(0.05)
    assert ready.exists(), p.communicate()[1]
    assert "dynsnap-nsexec-yard" not in Path("/proc/self/mountinfo").read_text()
    assert "dynsnap-nsexec-yard" not in Path(f"/proc/{container.pid1}/mountinfo").read_text()
    out, err = p.communicate(timeout=30)
    assert p.returncode == 0 and out.strip() == "1", err
    assert "dynsnap-nsexec-yard" not in Path(f"/proc/{container.pid1}/mountinfo").read_text()


def test_the_checked_mount_namespace_is_handed_over_as_a_descriptor(container: Container) -> None:
    r = nsexec(container.pid1, ["/bin/sh", "-c", "readlink /proc/self/fd/9; readlink /proc/self/ns/mnt"],
               extra=("--mntns-fd", "9"))
    assert r.returncode == 0, r.stderr
    handed, own = r.stdout.split()
    assert handed == os.readlink(f"/proc/{container.pid1}/ns/mnt")
    assert own != handed, "the program itself is not in the pod's mount namespace"


def test_a_pid1_in_a_user_namespace_of_its_own_is_refused_before_anything_runs(tmp_path: Path) -> None:
    """A PID 1 that made a user namespace of its own owns the namespaces it then makes: never entered."""
    _need()
    c = Container([find_tool("unshare"), "--user", "--map-root-user", "--pid", "--fork", "--kill-child",
                   "--mount-proc", "--mount", "--net", "--"])
    ran = tmp_path / "ran"
    try:
        r = nsexec(c.pid1, ["/bin/sh", "-c", f"touch {ran}"])
    finally:
        c.stop()
    assert r.returncode == EXIT_REFUSED, r.stderr
    assert "refused: ForeignNamespace: the target (pid" in r.stderr and "is in user namespace" in r.stderr
    assert not ran.exists()


@pytest.mark.parametrize("kind", ["mnt", "net"])
def test_a_namespace_owned_by_another_user_namespace_is_refused(tmp_path: Path, kind: str) -> None:
    """The PID 1 is in the node's user namespace, but its mount (or network) namespace belongs to a user
    namespace someone made: refused by name."""
    _need()
    # a user namespace and mount and network namespaces it owns, held by a sleep
    owner = subprocess.Popen([find_tool("unshare"), "--user", "--map-root-user", "--mount", "--net", "--", "sleep",
                              "1000"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ran = tmp_path / "ran"
    try:
        for _ in range(100):
            if os.readlink(f"/proc/{owner.pid}/ns/user") != os.readlink("/proc/self/ns/user"):
                break
            time.sleep(0.05)
        # the node's root enters that one namespace alone and makes a pid namespace there
        c = Container([find_tool("nsenter"), "-t", str(owner.pid), "-m" if kind == "mnt" else "-n", "--",
                       find_tool("unshare"), "--pid", "--fork", "--kill-child", "--"])
        try:
            assert os.readlink(f"/proc/{c.pid1}/ns/user") == os.readlink("/proc/self/ns/user")
            r = nsexec(c.pid1, ["/bin/sh", "-c", f"touch {ran}"])
        finally:
            c.stop()
    finally:
        owner.kill()
        owner.wait(10)
    assert r.returncode == EXIT_REFUSED, r.stderr
    assert f"{kind} namespace is owned by user namespace" in r.stderr
    assert not ran.exists()


def test_a_target_that_is_not_the_process_checked_is_never_entered(container: Container, tmp_path: Path) -> None:
    ran = tmp_path / "ran"
    start = procfs.start_time(container.pid1)
    assert start is not None
    r = nsexec(container.pid1, ["/bin/sh", "-c", f"touch {ran}"], start=start + 1)
    assert r.returncode == EXIT_FAILED and "is not the target the agent checked" in r.stderr, r.stderr
    r = nsexec(container.pid1, ["/bin/sh", "-c", f"touch {ran}"], start=start)
    assert r.returncode == 0 and ran.exists(), r.stderr


def test_the_program_dies_with_the_launcher(container: Container, tmp_path: Path) -> None:
    """Killed past its bound (or with the agent), the launcher takes its program with it."""
    fd = os.pidfd_open(container.pid1)
    try:
        p = subprocess.Popen([str(NSEXEC), "--target-pidfd", str(fd), "--ns", "pid", "--private-mounts", "--",
                              "/bin/sh", "-c", "echo $$ > /dev/null; exec sleep 300"], pass_fds=[fd],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    finally:
        os.close(fd)
    child = 0
    for _ in range(100):
        kids = _children(p.pid)
        if kids and procfs.exe_name(kids[0]) == "sleep":
            child = kids[0]
            break
        time.sleep(0.05)
    assert child
    os.kill(p.pid, signal.SIGKILL)
    p.wait(10)
    for _ in range(100):
        st = procfs.status(child)
        if st is None or st.state in ("Z", "X"):
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the program (pid {child}) outlived its launcher")


def _cgroup_dir() -> Path:
    """A cgroup directory the test may make: the v1 pids hierarchy where there is one, else the v2 root."""
    for base in (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup")):
        if (base / "cgroup.procs").exists():
            return base
    pytest.skip("no cgroup hierarchy to make a cgroup in")


def _line_of(pid: int, base: Path) -> str:
    """The line of /proc/<pid>/cgroup of the hierarchy mounted at ``base``."""
    lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    if base.name == "pids":
        return next(ln for ln in lines if ln.split(":")[1] == "pids")
    return next(ln for ln in lines if ln.startswith("0::"))


def test_joined_the_program_runs_in_the_targets_cgroups_and_outlives_the_launcher(container: Container) -> None:
    """--join-cgroups: the program is accounted as the target's container (the target was moved into a
    cgroup of its own here, as a runtime puts a container); --outlive: it goes on when the launcher is
    killed (the agent's container stopped by its runtime)."""
    base = _cgroup_dir()
    cg = base / f"dynsnap-nsexec-test-{os.getpid()}"
    cg.mkdir()
    p: subprocess.Popen[bytes] | None = None
    try:
        (cg / "cgroup.procs").write_text(str(container.pid1))
        fd = os.pidfd_open(container.pid1)
        try:
            p = subprocess.Popen([str(NSEXEC), "--target-pidfd", str(fd), "--ns", "pid,net,ipc,uts,cgroup",
                                  "--private-mounts", "--join-cgroups", "--outlive", "--", "/bin/sh", "-c",
                                  "exec sleep 300"], pass_fds=[fd], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        finally:
            os.close(fd)
        child = 0
        for _ in range(100):
            kids = _children(p.pid) if p.poll() is None else []
            if kids and procfs.exe_name(kids[0]) == "sleep":
                child = kids[0]
                break
            time.sleep(0.05)
        assert child, p.stderr.read().decode() if p.poll() is not None and p.stderr else "no program"
        assert _line_of(child, base) == _line_of(container.pid1, base), "not in the target's cgroup"
        assert _line_of(child, base) != _line_of(os.getpid(), base)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
        time.sleep(0.3)
        st = procfs.status(child)
        assert st is not None and st.state not in ("Z", "X"), "the program died with its launcher"
        os.kill(child, signal.SIGKILL)
    finally:
        if p is not None and p.poll() is None:
            p.kill()
            p.wait(10)
        with contextlib.suppress(OSError):
            for pid in (cg / "cgroup.procs").read_text().split():
                os.kill(int(pid), signal.SIGKILL)
        for _ in range(100):
            with contextlib.suppress(OSError):
                cg.rmdir()
                break
            time.sleep(0.05)


@pytest.mark.parametrize("ns", ["mnt", "user", "pid,mnt"])
def test_the_mount_and_user_namespaces_are_never_entered(container: Container, ns: str) -> None:
    r = nsexec(container.pid1, ["/bin/true"], ns=ns)
    assert r.returncode == 2 and "mnt and user are never entered" in r.stderr, r.stderr


def test_it_is_static(container: Container) -> None:
    """Nothing it loads comes from anywhere but its own file (no interpreter: no loader to read a preload)."""
    with open(NSEXEC, "rb") as f:
        head = f.read(4096)
    assert head[:4] == b"\x7fELF"
    assert b"ld-linux" not in head and b"/lib64/ld" not in head, "it names a dynamic loader"
    assert sys.platform == "linux"
