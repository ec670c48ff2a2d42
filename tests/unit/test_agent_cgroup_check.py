"""A tree CRIU restored must run in its container's cgroups: every restored process in the cgroup of the
container's PID 1 (dynsnap-entrypoint), in every hierarchy, or the restore step kills the tree, keeps
the capture and fails with ``RestoredOutsideContainer``. The comparison from /proc/<pid>/cgroup
samples as this node's kubelet writes them (cgroup v1 hybrid, cgroupfs layout) and as a cgroup v2
node's (systemd layout); the reader, the restored tree and the restore step's wiring against a copy
of /proc's layout; the kill on real child processes of the test."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from dynsnap.agent import cgroup_check as CG
from dynsnap.agent import wake_steps as K
from dynsnap.agent import worker as W
from dynsnap.agent.criu import CriuResult
from dynsnap.agent.executor import Executor
from dynsnap.agent.images import Capture
from dynsnap.agent.plan import Facts
from dynsnap.agent.settings import AgentSettings
from dynsnap.agent.steps import Observation, StepCall, StepFailure, Subject
from dynsnap.models.ids import HostPid, NsPid, PodUID
from dynsnap.models.protocol import EntrypointState, Reason, Tier
from dynsnap.runtime import procfs
from dynsnap.runtime.procfs import ProcStatus

UID = "0f6c3f2e-1b2a-4c3d-8e4f-5a6b7c8d9e0f"
CID = "3f1c0e5d" * 8  # the worker's container (64 hex)
OTHER_UID = "7d2e9a41-55b0-4c8e-9f13-2a6b8c4d0e71"  # the agent's pod
OTHER_CID = "9e8d7c6b" * 8
# The hierarchies of this node (cgroup v1 hybrid: kubelet's cgroupfs driver under runc), in the kernel's order.
V1 = ("name=systemd", "pids", "blkio", "freezer", "devices", "memory", "cpuset", "cpuacct", "cpu")


def hybrid(path: str, *, memory: str | None = None) -> str:
    """/proc/<pid>/cgroup on this node for a process in ``path`` (``memory``: its memory cgroup, if another)."""
    lines = [f"{len(V1) - i}:{h}:{memory if h == 'memory' and memory else path}" for i, h in enumerate(V1)]
    return "\n".join([*lines, f"0::{path}"]) + "\n"


CONTAINER = f"/kubepods/burstable/pod{UID}/{CID}"
AGENT = f"/kubepods/besteffort/pod{OTHER_UID}/{OTHER_CID}"
V2_SLICE = "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{u}.slice/cri-containerd-{c}.scope"
V2_CONTAINER = V2_SLICE.format(u=UID.replace("-", "_"), c=CID)
V2_AGENT = V2_SLICE.format(u=OTHER_UID.replace("-", "_"), c=OTHER_CID).replace("burstable", "besteffort")


def parse(text: str, tmp_path: Path, pid: int = 4000) -> dict[str, str]:
    d = tmp_path / "parse" / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    (d / "cgroup").write_text(text)
    got = procfs.cgroups(pid, tmp_path / "parse")
    assert got is not None
    return got


# -- the comparison (pure) ----------------------------------------------------------------------


def test_the_readers_hierarchies_are_the_kernels_lines_on_a_hybrid_and_a_v2_node(tmp_path: Path) -> None:
    got = parse(hybrid(CONTAINER), tmp_path)
    assert got == {**dict.fromkeys(V1, CONTAINER), "": CONTAINER}
    assert parse(f"0::{V2_CONTAINER}\n", tmp_path) == {"": V2_CONTAINER}
    assert parse("12:cpu,cpuacct:/a:b\n0::/..\n", tmp_path) == {"cpu,cpuacct": "/a:b", "": "/.."}  # a path is data


@pytest.mark.parametrize("text", [hybrid(CONTAINER), f"0::{V2_CONTAINER}\n"], ids=["v1-hybrid", "v2"])
def test_a_tree_where_its_container_is_is_not_misplaced(tmp_path: Path, text: str) -> None:
    want = parse(text, tmp_path)
    assert CG.misplaced(want, {5001: parse(text, tmp_path, 5001), 5002: parse(text, tmp_path, 5002)}) == []


def test_a_process_in_the_agents_memory_cgroup_is_named_with_both_paths(tmp_path: Path) -> None:
    want = parse(hybrid(CONTAINER), tmp_path)
    got = {5001: want, 5002: parse(hybrid(CONTAINER, memory=AGENT), tmp_path, 5002)}
    assert CG.misplaced(want, got) == [f"host pid 5002: in {AGENT!r} of hierarchy memory, not the container's "
                                       f"{CONTAINER!r}"]


def test_a_process_in_another_pods_v2_cgroup_is_named(tmp_path: Path) -> None:
    want = parse(f"0::{V2_CONTAINER}\n", tmp_path)
    (line,) = CG.misplaced(want, {5003: parse(f"0::{V2_AGENT}\n", tmp_path, 5003)})
    assert line == f"host pid 5003: in {V2_AGENT!r} of the unified (v2) hierarchy, not the container's {V2_CONTAINER!r}"


def test_a_hierarchy_missing_or_one_the_container_is_not_in_is_named(tmp_path: Path) -> None:
    want = parse(hybrid(CONTAINER), tmp_path)
    no_pids = {h: p for h, p in want.items() if h != "pids"}
    # in a memory cgroup named "<container id>\n77:name=forged:/x" beside the container's: its line ends
    # at the newline and seems the container's; the hierarchy the rest forges is one PID 1 is not in
    extra = parse(hybrid(CONTAINER, memory=f"{CONTAINER}\n77:name=forged:/x"), tmp_path, 5005)
    assert extra["memory"] == CONTAINER
    assert CG.misplaced(want, {5004: no_pids, 5005: extra}) == [
        f"host pid 5004: in no cgroup of hierarchy pids (the container's is {CONTAINER!r})",
        "host pid 5005: in '/x' of hierarchy name=forged, which the container's PID 1 is not in"]
    assert CG.misplaced({"": V2_CONTAINER}, {5006: {}}) == [
        f"host pid 5006: in no cgroup of the unified (v2) hierarchy (the container's is {V2_CONTAINER!r})"]


@pytest.mark.parametrize(("text", "why"), [
    # a cgroup named "<container id>\n5:name=x:/y" beside the container's: the name ends one line, starts another
    (hybrid(CONTAINER, memory=f"{CONTAINER}\n5:name=x:/y"), "hierarchy 5:name=x twice"),
    (hybrid(CONTAINER) + f"12:memory:{CONTAINER}\n", "hierarchy 12:memory twice"),
    (hybrid(CONTAINER) + "garbage\n", "'garbage' is no <id>:<controllers>:<path> line"),
    (hybrid(CONTAINER).rstrip("\n"), "does not end with a newline"),
    ("0::/" + "a" * procfs.CGROUP_READ_BOUND + "\n", "larger than"),
], ids=["forged-line", "twice", "garbage", "unterminated", "oversized"])
def test_a_cgroup_file_no_kernel_wrote_is_unreadable_not_trusted(tmp_path: Path, text: str, why: str) -> None:
    (tmp_path / "4000").mkdir()
    (tmp_path / "4000" / "cgroup").write_text(text)
    with pytest.raises(procfs.CgroupsUnreadable, match=why):
        procfs.cgroups(4000, tmp_path)
    assert procfs.cgroups(4001, tmp_path) is None  # gone


# -- against a copy of /proc ----------------------------------------------------------------------

EP = 500  # the container's PID 1 (host pid)


def _proc(root: Path, pid: int, *, ppid: int, ns: int | None, cgroup: str, children: Sequence[int] = (),
          state: str = "S (sleeping)", pidns: str = "pod") -> ProcStatus:
    d = root / str(pid)
    (d / "task" / str(pid)).mkdir(parents=True)
    (d / "ns").mkdir()
    nspid = f"{pid} {ns}" if ns is not None else str(pid)
    (d / "status").write_text(f"Name:\tpython3\nState:\t{state}\nPPid:\t{ppid}\nNSpid:\t{nspid}\n")
    (d / "cgroup").write_text(cgroup)
    (d / "task" / str(pid) / "children").write_text(" ".join(map(str, children)))
    ns_file = root.parent / f"pidns-{pidns}"
    ns_file.touch()
    (d / "ns" / "pid").symlink_to(ns_file)
    st = procfs.status(pid, root)
    assert st is not None
    return st


def _worker(proc: Path, procs: Sequence[ProcStatus]) -> W.WorkerProcs:
    ns = procfs.pid_ns(EP, proc)
    assert ns is not None
    return W.WorkerProcs(pod_uid=PodUID(UID), entrypoint=HostPid(EP), pidns=ns, control_dir="/run/dynsnap",
                         info={"state": "restoring", "started": STARTED}, procs=tuple(procs), gpu=())


STARTED = "2026-12-01T10:00:00.000Z"


@pytest.fixture
def proc(tmp_path: Path) -> Path:
    root = tmp_path / "proc"
    root.mkdir()
    return root


def _node(proc: Path, *, memory: str | None = None) -> tuple[W.WorkerProcs, list[int]]:
    """The container's PID 1, a process of the container that was there before the restore (an exec'd
    shell), and a restored tree: root 4100 (ns 1000) with a child and a grandchild, a process at an
    image pid orphaned to PID 1, a zombie; a process of another pod's namespace. ``memory``: the
    memory cgroup the restored processes are in, when not the container's."""
    inside, restored = hybrid(CONTAINER), hybrid(CONTAINER, memory=memory)
    _proc(proc, EP, ppid=400, ns=1, cgroup=inside, children=[4100, 4200, 4300])
    shell = _proc(proc, 4000, ppid=EP, ns=900, cgroup=inside)
    _proc(proc, 4100, ppid=EP, ns=1000, cgroup=restored, children=[4101])
    _proc(proc, 4101, ppid=4100, ns=1001, cgroup=restored, children=[4102])
    _proc(proc, 4102, ppid=4101, ns=1002, cgroup=restored)
    _proc(proc, 4200, ppid=EP, ns=1003, cgroup=restored)
    _proc(proc, 4300, ppid=EP, ns=1004, cgroup=restored, state="Z (zombie)")
    _proc(proc, 4400, ppid=1, ns=1, cgroup=hybrid(AGENT), pidns="elsewhere")  # another pod's PID 1
    return _worker(proc, [shell]), [4100, 4101, 4102, 4200]


def test_the_restored_tree_is_the_roots_and_what_the_restore_added(proc: Path) -> None:
    w, tree = _node(proc)
    assert [st.pid for st in CG.restored(w, NsPid(1000), proc)] == tree
    assert CG.check(HostPid(EP), tree, proc) == []


def test_check_names_the_misplaced_and_the_unreadable_and_skips_the_gone(proc: Path) -> None:
    _, tree = _node(proc, memory=AGENT)
    (proc / "4101" / "cgroup").write_text("0::/x\ngarbage\n")
    wrong = CG.check(HostPid(EP), [*tree, 4999], proc)  # 4999: gone since it was listed
    assert wrong[0].startswith("host pid 4101: /proc/4101/cgroup: 'garbage' is no"), wrong
    assert wrong[1:] == [f"host pid {p}: in {AGENT!r} of hierarchy memory, not the container's {CONTAINER!r}"
                         for p in (4100, 4102, 4200)]
    (proc / str(EP) / "cgroup").unlink()
    assert CG.check(HostPid(EP), tree, proc) == [
        f"the container's PID 1 (host pid {EP}) is gone: its cgroups cannot be compared"]


# -- the restore step ----------------------------------------------------------------------------


class Restore:
    """A restore step against the copy of /proc: CRIU faked (it "restored" root ns 1000), the kill
    faked (it makes the processes zombies in the copy, as their exit would; ``forked``: a process the
    tree forked just before it was killed, orphaned to PID 1, which the first kill does not reach)."""

    def __init__(self, tmp_path: Path, proc: Path, w: W.WorkerProcs, monkeypatch: pytest.MonkeyPatch, *,
                 forked: str | None = None) -> None:
        self.images = tmp_path / "capture"
        self.images.mkdir()
        for ns in (1000, 1001, 1002, 1003):
            (self.images / f"core-{ns}.img").write_bytes(b"core")
        self.killed: list[list[HostPid]] = []
        self.ex = Executor(AgentSettings(images_root=tmp_path), proc=proc)

        async def kill_tree(w: W.WorkerProcs, procs: Sequence[ProcStatus], **_: Any) -> list[HostPid]:
            pids = [st.pid for st in procs]
            self.killed.append(pids)
            for p in pids:
                (proc / str(p) / "status").write_text((proc / str(p) / "status").read_text()
                                                      .replace("S (sleeping)", "Z (zombie)"))
            if forked is not None and len(self.killed) == 1:
                _proc(proc, 4500, ppid=EP, ns=1005, cgroup=forked)
            return pids

        async def criu_restore(*_: Any, **__: Any) -> CriuResult:
            return CriuResult(images_dir=self.images, log_path=self.images / "restore.log", seconds=1.5,
                              pid=NsPid(1000))
        monkeypatch.setattr(self.ex, "kill_tree", kill_tree)
        monkeypatch.setattr(K, "criu_restore", criu_restore)
        obs = Observation(worker=w, facts=Facts(ep_state=EntrypointState.RESTORING, worker_alive=False),
                          gpu_states={}, capture=Capture(self.images, {"entrypointStarted": STARTED,
                                                                       "captureId": "c1"}), staging=None)
        self.call = StepCall(subject=Subject(namespace="ns", pod="worker-0", uid=PodUID(UID)), obs=obs,
                             tier=Tier.SNAPSHOT)


async def test_a_tree_restored_in_its_container_is_checked_and_left_running(
        tmp_path: Path, proc: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w, tree = _node(proc)
    r = Restore(tmp_path, proc, w, monkeypatch)
    await K.restore(r.ex, r.call)
    assert r.call.info["cgroupsChecked"] == len(tree) and r.killed == []


async def test_a_tree_restored_outside_its_container_is_killed_and_the_capture_kept(
        tmp_path: Path, proc: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w, tree = _node(proc, memory=AGENT)
    r = Restore(tmp_path, proc, w, monkeypatch, forked=hybrid(CONTAINER, memory=AGENT))
    with pytest.raises(StepFailure) as e:
        await K.restore(r.ex, r.call)
    f = e.value
    assert f.reason == Reason.RESTORED_OUTSIDE_CONTAINER and f.changed
    # the restored tree, and only it (not PID 1, not the shell there before), then what it forked meanwhile
    assert r.killed == [tree, [4500]]
    assert "host pids [4100, 4101, 4102, 4200, 4500]" in f.message
    assert f"host pid 4100: in {AGENT!r} of hierarchy memory, not the container's {CONTAINER!r}" in f.message
    assert "root 1000" in f.message and f"host pid {EP}" in f.message and "still running" not in f.message
    assert r.call.info["cgroupsChecked"] == len(tree)
    assert sorted(p.name for p in r.images.iterdir()) == [f"core-{n}.img" for n in (1000, 1001, 1002, 1003)]


# -- the kill, on real processes ------------------------------------------------------------------


@pytest.fixture
def sleepers() -> Iterator[list[subprocess.Popen[bytes]]]:
    started = [subprocess.Popen(["sleep", "60"], stdin=subprocess.DEVNULL) for _ in range(4)]
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait()


def _alive(p: subprocess.Popen[bytes]) -> bool:
    st = procfs.status(p.pid)
    return st is not None and st.state not in ("Z", "X")


async def test_kill_tree_kills_what_was_listed_waits_for_it_and_spares_pid_1_and_a_reused_pid(
        tmp_path: Path, sleepers: list[subprocess.Popen[bytes]]) -> None:
    ep, a, b, reused = sleepers
    listed = {p.pid: procfs.status(p.pid) for p in sleepers}
    assert all(st is not None for st in listed.values())
    st_reused = listed[reused.pid]
    assert st_reused is not None
    lie = ProcStatus(pid=st_reused.pid, ppid=st_reused.ppid, nspid=(st_reused.pid, 12345), state="S", name="x")
    ns = procfs.pid_ns(ep.pid)
    assert ns is not None
    w = W.WorkerProcs(pod_uid=PodUID(UID), entrypoint=HostPid(ep.pid), pidns=ns, control_dir="/run/dynsnap",
                      info={}, procs=(), gpu=())
    ex = Executor(AgentSettings(images_root=tmp_path))
    t0 = time.monotonic()
    procs = [st for p in (ep, a, b) if (st := listed[p.pid]) is not None]
    killed = await ex.kill_tree(w, [*procs, lie])
    assert killed == sorted([a.pid, b.pid])
    assert not _alive(a) and not _alive(b), "waited for: they have exited when kill_tree returns"
    assert time.monotonic() - t0 < 5
    assert _alive(ep), "the container's PID 1 is never signalled"
    assert _alive(reused), "a process whose pids are not those listed is another: not signalled"
    assert a.wait(timeout=5) == -signal.SIGKILL
