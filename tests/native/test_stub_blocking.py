"""The stub driver's semantics for a process's own calls (stub_libcuda.c's header, "The hold" and
"Device memory"), on their own: what the H200's driver showed (DESIGN.md section 2) is that a CUDA
call made while the process is locked or checkpointed blocks, and completes correctly once the
process is resumed. A real process (stub_caller.py) loads the stub and makes a call in a loop,
one answer line per return; the real CLI (dynsnap-cuda) locks, saves and resumes it.

Tests assert outcomes: the caller's answers (how many, their result codes, the data read back),
the stub's holds log (the call waited *because* its own state was locked or checkpointed), the
per-process state, the free memory of the fake devices. No test asserts wall time: a held call is
shown held by an answer count that stays put over a bounded window while the hold is logged.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from cuda_harness import CHECKPOINTED, LOCKED, RUNNING, Stub

CALLER = Path(__file__).with_name("stub_caller.py")
CUDA_ERROR_UNKNOWN = 999
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_INVALID_VALUE = 1
GIB = 1 << 30
WINDOW_S = 1.5  # how long a held call must stay unanswered (the H200's held call: 5 s)
U0 = "GPU-00000000-0000-0000-0000-0000000000a0"
U1 = "GPU-00000000-0000-0000-0000-0000000000a1"

T = TypeVar("T")


def wait_until(what: str, pred: Callable[[], T | None], timeout: float = 15.0) -> T:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class Caller:
    """stub_caller.py in its own process, making ``call`` in a loop against the stub."""

    def __init__(self, stub: Stub, out: Path, call: str, *, alloc: int = 4096, extra: tuple[str, ...] = (),
                 prefix: tuple[str, ...] = ()) -> None:
        self.out = out
        self.proc = subprocess.Popen([*prefix, sys.executable, str(CALLER), "--lib", stub.env["DYNSNAP_LIBCUDA"],
                                      "--out", str(out), "--call", call, "--alloc", str(alloc), *extra],
                                     env=stub.env)
        self.call = call

    def lines(self) -> list[str]:
        return self.out.read_text().splitlines() if self.out.exists() else []

    def ready(self) -> str:
        return wait_until("the caller ready", lambda: next((x for x in self.lines() if x.startswith("ready ")
                                                             or x.startswith("start ")), None))

    def answers(self) -> list[tuple[int, str]]:
        """(rc, check) of every call that returned, in order."""
        return [(int(rc), chk) for n, rc, chk in (x.split() for x in self.lines() if x[0].isdigit())]

    def wait_answers(self, n: int) -> list[tuple[int, str]]:
        return wait_until(f"{n} answers of {self.call}", lambda: (a if len(a := self.answers()) >= n else None))

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture
def callers(stub: Stub, tmp_path: Path) -> Iterator[Callable[..., Caller]]:
    made: list[Caller] = []

    def make(call: str = "cuCtxSynchronize", **kw: object) -> Caller:
        c = Caller(stub, tmp_path / f"caller-{len(made)}.out", call, **kw)  # type: ignore[arg-type]
        made.append(c)
        return c
    try:
        yield make
    finally:
        for c in made:
            c.stop()


def holds(stub: Stub) -> list[str]:
    f = stub.dir / "holds"
    return f.read_text().splitlines() if f.exists() else []


def held_in(stub: Stub, call: str, key: int, *states: int) -> str | None:
    """The hold line of ``call`` made by the process ``key`` in one of ``states`` (a save locks first,
    so a call made during it can be held for the lock)."""
    return next((x for x in holds(stub) if x in {f"hold {call} key={key} state={s}" for s in states}), None)


def stays_put(c: Caller, seconds: float = WINDOW_S) -> bool:
    """The caller's answer count does not move over the window."""
    n0 = len(c.answers())
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if len(c.answers()) != n0:
            return False
        time.sleep(0.05)
    return len(c.answers()) == n0


CALLS = ["cuCtxSynchronize", "cuMemGetInfo_v2", "cuMemcpyDtoH_v2", "cuMemcpyHtoD_v2", "cuInit", "cuDeviceGetCount"]


@pytest.mark.parametrize("call", CALLS)
def test_a_call_while_running_returns_at_once(stub: Stub, callers: Callable[..., Caller], call: str) -> None:
    c = callers(call)
    c.ready()
    answers = c.wait_answers(20)
    assert all(rc == 0 for rc, _ in answers), answers
    assert holds(stub) == []  # nothing waited


@pytest.mark.parametrize("call", CALLS)
def test_a_call_while_checkpointed_waits_until_the_resume_then_returns_its_result(
        stub: Stub, callers: Callable[..., Caller], call: str) -> None:
    c = callers(call)
    c.ready()
    c.wait_answers(3)
    pid = c.proc.pid
    assert stub.run("--action", "save", "--pid", str(pid)).rc == 0
    assert stub.state(pid) == CHECKPOINTED
    wait_until("the call held (a save locks, then checkpoints)",
               lambda: held_in(stub, call, pid, LOCKED, CHECKPOINTED))
    before = len(c.answers())
    assert stays_put(c), "a call returned while the process was checkpointed"
    r = stub.run("--action", "resume", "--pid", str(pid))
    assert r.rc == 0, r.err
    answers = c.wait_answers(before + 3)
    assert answers[before][0] == 0, answers[before:]  # the held call itself: its normal result
    assert all(rc == 0 for rc, _ in answers), answers
    if call == "cuMemcpyDtoH_v2":
        assert all(chk == "ok" for _, chk in answers), answers  # the device memory read back right
    assert any(re.fullmatch(rf"release {call} key={pid} state={RUNNING} ms=\d+ rc=0", x) for x in holds(stub))


def test_a_new_process_never_starts_held_by_a_gone_ones_state(stub: Stub, callers: Callable[..., Caller],
                                                              tmp_path: Path) -> None:
    """A checkpointed state left under the key a new process gets (a gone process's, whose pid namespace
    inode the kernel reused: the real driver's state went with it) does not hold the new process: its
    first cuInit finds its key running, and the holds log says the stale state was dropped. Without
    that a worker started in a reused namespace would hang in cuInit, never Ready."""
    go = tmp_path / "go"
    c = callers("cuCtxSynchronize", extra=("--start-when", str(go)))
    pid = c.proc.pid
    (stub.dir / "state").write_text(f"{pid} {CHECKPOINTED}\n")  # what a gone process under this key left
    go.touch()
    ready = c.ready()
    assert ready.startswith(f"ready {pid} ") and ready.endswith("rc=0"), ready
    assert stub.state(pid) == RUNNING
    assert f"stale key={pid} state={CHECKPOINTED} dropped" in holds(stub), holds(stub)
    assert not [x for x in holds(stub) if x.startswith("hold ")], holds(stub)
    assert all(rc == 0 for rc, _ in c.wait_answers(3))  # and it runs on, answering


def test_a_call_while_locked_waits_until_the_unlock(stub: Stub, callers: Callable[..., Caller]) -> None:
    c = callers("cuCtxSynchronize")
    c.ready()
    c.wait_answers(3)
    pid = c.proc.pid
    assert stub.run("--action", "lock", "--pid", str(pid)).rc == 0
    assert stub.state(pid) == LOCKED
    wait_until("the call held for its locked state", lambda: held_in(stub, "cuCtxSynchronize", pid, LOCKED))
    before = len(c.answers())
    assert stays_put(c)
    assert stub.run("--action", "unlock", "--pid", str(pid)).rc == 0
    answers = c.wait_answers(before + 3)
    assert all(rc == 0 for rc, _ in answers), answers


def test_the_hold_is_bounded(stub: Stub, callers: Callable[..., Caller]) -> None:
    """Past holdmax the held call gives up with CUDA_ERROR_UNKNOWN; after the resume calls work again."""
    stub.control("holdmax 0 300")
    c = callers("cuCtxSynchronize")
    c.ready()
    c.wait_answers(3)
    pid = c.proc.pid
    assert stub.run("--action", "save", "--pid", str(pid)).rc == 0
    def gave_up() -> list[tuple[int, str]] | None:
        a = c.answers()
        return a if any(rc == CUDA_ERROR_UNKNOWN for rc, _ in a) else None
    answers = wait_until("a held call giving up", gave_up)
    assert {rc for rc, _ in answers} <= {0, CUDA_ERROR_UNKNOWN}
    assert any(re.fullmatch(rf"release cuCtxSynchronize key={pid} state={CHECKPOINTED} ms=\d+ rc=999", x)
               for x in holds(stub))
    assert stub.run("--action", "resume", "--pid", str(pid)).rc == 0
    n = len(c.answers())
    later = c.wait_answers(n + 3)[n + 1:]  # the one in flight at the resume may still have given up
    assert later and all(rc == 0 for rc, _ in later), later


def test_only_the_callers_own_state_holds_it(stub: Stub, callers: Callable[..., Caller]) -> None:
    """Another process checkpointed (a real one, and a made-up pid) holds nobody else; the CLI's own
    calls, made while its target is checkpointed, are not held either."""
    stub.set_state(CHECKPOINTED, 42)
    a, b = callers("cuCtxSynchronize"), callers("cuCtxSynchronize")
    a.ready()
    b.ready()
    b.wait_answers(3)
    assert stub.run("--action", "save", "--pid", str(b.proc.pid)).rc == 0
    wait_until("b held", lambda: held_in(stub, "cuCtxSynchronize", b.proc.pid, LOCKED, CHECKPOINTED))
    n_a, n_b = len(a.answers()), len(b.answers())
    a.wait_answers(n_a + 20)
    assert len(b.answers()) == n_b
    r = stub.run("--get-state", "--pid", str(b.proc.pid))
    assert r.rc == 0 and "checkpointed" in r.out
    r = stub.run("--action", "resume", "--pid", str(b.proc.pid), "--json")  # reads free memory in its process
    assert r.rc == 0, r.err
    b.wait_answers(n_b + 3)
    assert all(x.split()[2] == f"key={b.proc.pid}" for x in holds(stub))


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root for unshare --pid")
def test_nskey_holds_a_process_in_its_own_pid_namespace(stub: Stub, callers: Callable[..., Caller]) -> None:
    """With nskey the caller keys itself by its pid namespace and its pid there, as the CLI keys it."""
    stub.control("nskey 0")
    c = callers("cuCtxSynchronize", prefix=("unshare", "--pid", "--fork", "--kill-child", "--mount-proc"))
    assert c.ready().startswith("ready 1 ")  # PID 1 of its namespace
    c.wait_answers(3)
    kids = wait_until("the caller under unshare",
                      lambda: Path(f"/proc/{c.proc.pid}/task/{c.proc.pid}/children").read_text().split())
    host = int(kids[0])
    key = (os.stat(f"/proc/{host}/ns/pid").st_ino << 22) | 1
    assert stub.run("--action", "save", "--pid", str(host)).rc == 0
    assert stub.states().get(key) == CHECKPOINTED
    wait_until("the namespaced caller held", lambda: held_in(stub, "cuCtxSynchronize", key, LOCKED, CHECKPOINTED))
    before = len(c.answers())
    assert stays_put(c)
    assert stub.run("--action", "resume", "--pid", str(host)).rc == 0
    assert all(rc == 0 for rc, _ in c.wait_answers(before + 3))


def alloc_lines(stub: Stub) -> list[list[int]]:
    f = stub.dir / "alloc"
    return [[int(v) for v in x.split()] for x in f.read_text().splitlines()] if f.exists() else []


def test_device_memory_is_taken_from_the_free_and_moved_by_checkpoint_and_restore(
        stub: Stub, callers: Callable[..., Caller]) -> None:
    stub.set_devices((U0, 10 * GIB, 10 * GIB))
    c = callers("cuMemcpyDtoH_v2", alloc=GIB)  # never written past 4 KiB: costs no host memory
    assert "rc=0" in c.ready()
    pid = c.proc.pid
    c.wait_answers(3)
    assert stub.free(0) == 9 * GIB
    assert alloc_lines(stub) == [[pid, 0, GIB, 1]]
    assert stub.run("--action", "save", "--pid", str(pid)).rc == 0
    assert stub.free(0) == 10 * GIB  # the checkpoint freed it on the device
    assert alloc_lines(stub) == [[pid, 0, GIB, 0]]
    assert stub.run("--action", "resume", "--pid", str(pid)).rc == 0
    assert stub.free(0) == 9 * GIB
    n = len(c.answers())
    assert all(chk == "ok" for _, chk in c.wait_answers(n + 3))  # contents intact


def test_device_memory_follows_the_gpu_map_on_restore(stub: Stub, callers: Callable[..., Caller]) -> None:
    stub.set_devices((U0, 10 * GIB, 10 * GIB), (U1, 10 * GIB, 10 * GIB))
    c = callers("cuCtxSynchronize", alloc=2 * GIB)
    assert "rc=0" in c.ready()
    pid = c.proc.pid
    assert (stub.free(0), stub.free(1)) == (8 * GIB, 10 * GIB)
    assert stub.run("--action", "save", "--pid", str(pid)).rc == 0
    assert stub.run("--action", "resume", "--pid", str(pid), "--gpu-map", "0=1,1=0").rc == 0
    assert (stub.free(0), stub.free(1)) == (10 * GIB, 8 * GIB)
    assert alloc_lines(stub) == [[pid, 1, 2 * GIB, 1]]


def test_a_clean_exit_gives_the_device_memory_back(stub: Stub, callers: Callable[..., Caller]) -> None:
    stub.set_devices((U0, 10 * GIB, 10 * GIB))
    c = callers(alloc=3 * GIB, extra=("--count", "0", "--linger", "0"))
    assert "rc=0" in c.ready()
    assert c.proc.wait(timeout=30) == 0
    assert stub.free(0) == 10 * GIB
    assert alloc_lines(stub) == []


def test_an_allocation_past_the_free_memory_is_refused(stub: Stub, callers: Callable[..., Caller]) -> None:
    stub.set_devices((U0, GIB, 10 * GIB))
    c = callers(alloc=2 * GIB)
    assert c.ready() == f"start cuMemAlloc_v2 rc={CUDA_ERROR_OUT_OF_MEMORY}"
    assert stub.free(0) == GIB
    assert alloc_lines(stub) == []


def test_a_copy_outside_the_allocation_is_refused(stub: Stub, callers: Callable[..., Caller]) -> None:
    c = callers("cuMemcpyDtoH_v2", alloc=4095)  # the caller copies 4096 bytes: one past the end
    c.ready()
    assert {rc for rc, _ in c.wait_answers(3)} == {CUDA_ERROR_INVALID_VALUE}
