"""The CRIU the project builds carries its patches (hack/patches/criu/), and each does what it
claims on this kernel.

0001: a private anonymous mapping the process had marked MADV_HUGEPAGE (what libdynsnap-thp
does to the CUDA driver's host copy) comes back from ``criu restore`` on huge pages, with its
bytes intact. Stock CRIU 4.2.1 marks it only after reading the pages in, so the restored
mapping is on 4 KiB pages (AnonHugePages 0 right after the restore; measured against the
unpatched build, docs/CRIU_PATCHES.md), which is both the slower restore and the slower CUDA
resume after it (docs/BENCHMARKS.md, "CRIU's restore onto huge pages").

0002: the restorer reads the pages image with DYNSNAP_CRIU_READ_THREADS threads (default one
per CPU, at most 16). Every byte and every thread of the process comes back as with one reader;
one thread reads as stock CRIU does; a bad count is reported and the default used; an image
that ends early fails the restore with the read's error instead of a process with holes.

0003: ``--tree-mntns``: CRIU, started by dynsnap-nsexec in a container's pid and other namespaces but in a
mount namespace of its own (never the container's), dumps a tree that holds a file open on a mount only the
container has, without dumping the container's mount namespace (its files reached through the tree root),
and a restore that joins the container's mount namespace (``--join-ns mnt``) puts the tree back there,
writing on to the same file. Without the option CRIU takes the container's mount namespace for one to dump.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

SIZE_MIB = 64  # 32 huge pages
PARALLEL_MIB = 256  # 8 of the restorer's 32 MiB chunks, past its 64 MiB floor for threads

# The process the CRIU restore bench dumps and restores (a MADV_HUGEPAGE mapping with a pattern, its
# AnonHugePages and a pattern check on request), as tests/gpu runs bench/gpu/worker.py.
HOLDER = Path(__file__).resolve().parents[2] / "bench" / "criu_restore" / "holder.py"


def _criu() -> Path:
    criu = os.environ.get("DYNSNAP_CRIU", "")
    if not criu or not os.access(criu, os.X_OK):
        pytest.fail("CRIU not built: DYNSNAP_CRIU is unset or not executable; run ./run setup")
    return Path(criu)


def _thp_mode() -> str:
    text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    return text[text.index("[") + 1:text.index("]")]


def _wait(path: Path, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return json.loads(path.read_text())
        time.sleep(0.05)
    raise TimeoutError(f"no {path.name} within {timeout:.0f} s")


def _wait_gone(pid: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"pid {pid} was not reaped within {timeout:.0f} s")
        time.sleep(0.05)


@dataclass
class _Run:
    before: dict  # the holder's answer before the dump
    restore: subprocess.CompletedProcess[bytes]
    log: str  # restore.log
    pid: int = 0  # the restored process (0: the restore failed)
    after: dict = field(default_factory=dict)  # its answer after the restore
    child_before: dict = field(default_factory=dict)  # the holder's child's answers, when it has one
    child_after: dict = field(default_factory=dict)


def _dump_and_restore(tmp_path: Path, mib: int, *, threads: int = 0, read_threads: str | None = None,
                      cut_image_mib: int = 0, min_huge: bool = False, child_mib: int = 0) -> _Run:
    """Dump a holder of ``mib`` MiB (and ``threads`` more threads, and a child of ``child_mib`` MiB),
    optionally cut the end off its largest pages image, restore it with
    DYNSNAP_CRIU_READ_THREADS=``read_threads`` (None: unset), and ask the restored processes for
    their pattern checks and thread ids (the child's in ``child_before`` and ``child_after``)."""
    if os.geteuid() != 0:
        pytest.skip("CRIU dumps and restores as root")
    criu = _criu()
    images = tmp_path / "images"
    images.mkdir(mode=0o700)
    holder = subprocess.Popen([sys.executable, str(HOLDER), str(tmp_path), str(mib), str(threads), str(child_mib)],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True, cwd=tmp_path)
    run: _Run | None = None
    try:
        before = _wait(tmp_path / "ready")
        child_before = _wait(tmp_path / "child" / "ready") if child_mib else {}
        if min_huge and before["anon_huge_kib"] < mib * 1024 // 2:
            pytest.skip(f"the kernel gave the live process only {before['anon_huge_kib']} KiB of huge pages "
                        "(fragmented memory): nothing to compare the restore with")
        subprocess.run([str(criu), "dump", "-t", str(holder.pid), "-D", str(images), "-o", "dump.log"],
                       check=True, timeout=120, stdin=subprocess.DEVNULL)
        holder.wait(timeout=30)
        if child_mib:  # killed by the dump and reparented to PID 1: its pid (and the session's) is free once reaped
            _wait_gone(child_before["pid"])
        if cut_image_mib:
            pages = max(images.glob("pages-*.img"), key=lambda f: f.stat().st_size)
            os.truncate(pages, pages.stat().st_size - (cut_image_mib << 20))
        env = {k: v for k, v in os.environ.items() if k != "DYNSNAP_CRIU_READ_THREADS"}
        if read_threads is not None:
            env["DYNSNAP_CRIU_READ_THREADS"] = read_threads
        res = subprocess.run([str(criu), "restore", "-v4", "-D", str(images), "-o", "restore.log",
                              "--restore-detached", "--pidfile", str(tmp_path / "restored.pid")],
                             timeout=120, stdin=subprocess.DEVNULL, capture_output=True, env=env)
        run = _Run(before=before, restore=res, log=(images / "restore.log").read_text(errors="replace"),
                   child_before=child_before)
        if res.returncode == 0:
            run.pid = int((tmp_path / "restored.pid").read_text())
            (tmp_path / "verify").touch()
            run.after = _wait(tmp_path / "verified")
            if child_mib:
                (tmp_path / "child" / "verify").touch()
                run.child_after = _wait(tmp_path / "child" / "verified")
        return run
    finally:
        for pid in (holder.pid, run.pid if run else 0, child_before.get("pid", 0) if child_mib else 0):
            if pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if holder.poll() is None:
            holder.wait(timeout=30)


def _restored_whole(run: _Run) -> None:
    assert run.restore.returncode == 0, run.log[-3000:]
    assert run.after["pid"] == run.before["pid"] == run.pid
    assert run.after["ok"], f"the restored mapping's bytes differ from the dumped ones: blocks {run.after}"
    assert run.after["tids"] == run.before["tids"], "the restored process's threads are not the dumped ones"


READ_LINE = re.compile(r"dynsnap: read (\d+) bytes of pages with (\d+) threads")


def test_a_hugepage_mapping_is_restored_on_huge_pages(tmp_path: Path) -> None:
    if _thp_mode() == "never":
        pytest.skip("transparent huge pages are off on this kernel ('never'): nothing to restore onto")
    run = _dump_and_restore(tmp_path, SIZE_MIB, min_huge=True)
    _restored_whole(run)
    # Right after the restore, before khugepaged could collapse anything: on huge pages as
    # when dumped (stock CRIU: 0 KiB here).
    assert run.after["anon_huge_kib"] >= run.before["anon_huge_kib"] * 9 // 10, (run.before, run.after)


def test_pages_are_read_by_several_threads_and_every_byte_and_thread_comes_back(tmp_path: Path) -> None:
    # More readers than this VM has CPUs, and a process with threads of its own: the readers are
    # threads of the restored process too, gone before its own are created with their old tids.
    run = _dump_and_restore(tmp_path, PARALLEL_MIB, threads=3, read_threads="4")
    _restored_whole(run)
    assert len(run.before["tids"]) == 4
    read = READ_LINE.findall(run.log)
    assert len(read) == 1, run.log[-3000:]
    nbytes, nthreads = map(int, read[0])
    assert nthreads == 4
    assert nbytes >= PARALLEL_MIB << 20  # the whole mapping went through the readers


def test_two_processes_of_a_tree_each_read_theirs_with_threads_and_get_their_own_pages(tmp_path: Path) -> None:
    # Each restorer starts its helpers under the tree's last_pid_mutex: the two reads take turns, and
    # neither process's helpers hold a pid the other's threads are restored with. Each process's
    # blocks carry their own numbers, so a page restored into the wrong process shows.
    run = _dump_and_restore(tmp_path, PARALLEL_MIB, threads=2, read_threads="3", child_mib=PARALLEL_MIB // 2)
    _restored_whole(run)
    child_pid = run.child_before["pid"]
    assert run.child_after["pid"] == child_pid and run.child_after["ok"], run.child_after
    assert run.child_after["tids"] == run.child_before["tids"]
    read = READ_LINE.findall(run.log)
    assert sorted(int(n) for _, n in read) == [3, 3], run.log[-3000:]  # one line per process
    assert sorted(int(b) >> 20 for b, _ in read)[0] >= PARALLEL_MIB // 2


def test_one_read_thread_reads_as_stock_criu(tmp_path: Path) -> None:
    run = _dump_and_restore(tmp_path, PARALLEL_MIB, threads=1, read_threads="1")
    _restored_whole(run)
    assert not READ_LINE.search(run.log), "one thread must take stock CRIU's loop"
    assert "Preadv " in run.log  # stock CRIU's loop, at -v4


def test_a_bad_read_thread_count_is_reported_and_the_default_used(tmp_path: Path) -> None:
    run = _dump_and_restore(tmp_path, PARALLEL_MIB, read_threads="0")
    _restored_whole(run)
    assert "DYNSNAP_CRIU_READ_THREADS=0 is not a number from 1 to 16: using the default" in run.log
    default = min(len(os.sched_getaffinity(0)), 16)
    read = READ_LINE.findall(run.log)
    if default == 1:
        assert not read
    else:
        assert [int(n) for _, n in read] == [default], run.log[-3000:]


def test_an_image_that_ends_early_fails_the_restore_with_the_read_error(tmp_path: Path) -> None:
    # Stock CRIU's loop spins on the short read; the readers stop at it and the restore fails,
    # instead of resuming a process whose last pages are zeros.
    run = _dump_and_restore(tmp_path, PARALLEL_MIB, read_threads="4", cut_image_mib=8)
    assert run.restore.returncode != 0
    assert "Can't read pages data (-5)" in run.log, run.log[-3000:]
    # CRIU killed and reaped what it had begun to restore: no process holds the pid.
    _wait_gone(run.before["pid"], timeout=10)


# -- 0003: --tree-mntns ----------------------------------------------------------------------------------------

NSEXEC = Path(os.environ.get("DYNSNAP_NATIVE_BIN", Path(__file__).resolve().parents[2] / "native" / "build")) \
    / "dynsnap-nsexec"
# The worker: holds a file open on a tmpfs only its container mounts and appends a line to it every 50 ms.
APPENDER = "import os, sys, time\nf = open(sys.argv[1], 'a', buffering=1)\nn = 0\nwhile True:\n" \
           "    n += 1\n    f.write(f'{os.getpid()} {n}\\n')\n    time.sleep(0.05)\n"


@dataclass
class _Box:
    """A container: PID 1 (a shell) of its own pid namespace, in a mount namespace of its own where a tmpfs
    at ``mnt`` exists (the node has no such mount), and the appender under it."""

    proc: subprocess.Popen[bytes]
    mnt: Path
    pid1: int = 0
    worker: int = 0  # host pid
    worker_ns: int = 0  # its pid in the container

    def lines(self) -> list[str]:
        # the file is reached through the container's root: the node does not have the tmpfs
        return Path(f"/proc/{self.pid1}/root{self.mnt}/log").read_text().splitlines()


def _box(tmp_path: Path) -> _Box:
    mnt = tmp_path / "container-only"
    mnt.mkdir()
    script = tmp_path / "appender.py"
    script.write_text(APPENDER)
    inner = (f"mount -t tmpfs dynsnap-0003 {mnt} && (setsid {sys.executable} {script} {mnt}/log "
             "</dev/null >/dev/null 2>&1 &) && while true; do sleep 1; done")
    proc = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "--mount", "--propagation",
                             "private", "--", "sh", "-c", inner], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    box = _Box(proc, mnt)
    for _ in range(200):
        kids = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split() if proc.poll() is None else []
        if kids:
            box.pid1 = int(kids[0])
            for k in Path(f"/proc/{box.pid1}/task/{box.pid1}/children").read_text().split():
                if "appender.py" in Path(f"/proc/{k}/cmdline").read_text():
                    box.worker = int(k)
        if box.worker:
            with contextlib.suppress(OSError):
                if box.lines():
                    break
        time.sleep(0.05)
    assert box.worker, "the container's worker did not start"
    status = Path(f"/proc/{box.worker}/status").read_text()
    box.worker_ns = int(status.split("NSpid:")[1].split("\n")[0].split()[-1])
    return box


def _in_box(box: _Box, args: list[str], *, join: bool) -> subprocess.CompletedProcess[bytes]:
    """CRIU as the agent starts it: dynsnap-nsexec, the container's pid namespace, a mount namespace of its own."""
    fd = os.pidfd_open(box.pid1)
    try:
        launcher = [str(NSEXEC), "--target-pidfd", str(fd), "--ns", "pid,ipc,uts,cgroup", "--private-mounts",
                    *(["--mntns-fd", str(fd + 1)] if join else []), "--"]
        argv = [a.replace("{mntns}", f"/proc/self/fd/{fd + 1}") for a in args]
        return subprocess.run([*launcher, str(_criu()), *argv], pass_fds=[fd], timeout=120,
                              stdin=subprocess.DEVNULL, capture_output=True)
    finally:
        os.close(fd)


@pytest.fixture
def box(tmp_path: Path) -> Iterator[_Box]:
    """A container (:func:`_box`), its images directory made; killed after the test."""
    if os.geteuid() != 0:
        pytest.skip("CRIU dumps and restores as root")
    b = _box(tmp_path)
    (tmp_path / "images").mkdir(mode=0o700)
    try:
        yield b
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(b.proc.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.kill(b.pid1, signal.SIGKILL)
        b.proc.wait(timeout=30)


def test_a_tree_is_dumped_from_outside_its_mount_namespace_and_restored_into_it(box: _Box, tmp_path: Path) -> None:
    images = tmp_path / "images"
    dumped = _in_box(box, ["dump", "--tree-mntns", "-t", str(box.worker_ns), "-D", str(images),
                           "-o", str(images / "dump.log"), "-v4", "--no-default-config"], join=False)
    assert dumped.returncode == 0, (images / "dump.log").read_text(errors="replace")[-3000:]
    assert not list(images.glob("mountpoints-*.img")), "the container's mount namespace was dumped"
    _wait_gone(box.worker)
    written = len(box.lines())
    restored = _in_box(box, ["restore", "-D", str(images), "-o", str(images / "restore.log"), "-v4",
                             "--no-default-config", "--restore-detached", "--pidfile", str(images / "pid"),
                             "--join-ns", "mnt:{mntns}"], join=True)
    assert restored.returncode == 0, (images / "restore.log").read_text(errors="replace")[-3000:]
    for _ in range(100):
        if len(box.lines()) > written + 3:
            break
        time.sleep(0.05)
    last = box.lines()[-1].split()
    assert int(last[0]) == box.worker_ns and int(last[1]) > written, "the same worker writes on to the same file"
    host = next(int(k) for k in Path(f"/proc/{box.pid1}/task/{box.pid1}/children").read_text().split()
                if "appender.py" in Path(f"/proc/{k}/cmdline").read_text())
    assert os.readlink(f"/proc/{host}/ns/mnt") == os.readlink(f"/proc/{box.pid1}/ns/mnt")


def test_without_tree_mntns_the_containers_mount_namespace_is_taken_for_one_to_dump(box: _Box, tmp_path: Path) -> None:
    """Why the patch: stock CRIU, outside the tree's mount namespace, takes it for one to dump (and a restore
    would make it anew): the log says so, and the tree is left running."""
    images = tmp_path / "images"
    _in_box(box, ["dump", "-t", str(box.worker_ns), "-D", str(images), "-o", str(images / "dump.log"), "-v4",
                  "--no-default-config", "--leave-running"], join=False)
    assert "Will take mnt namespace in the image" in (images / "dump.log").read_text(errors="replace")
    assert Path(f"/proc/{box.worker}").exists()
