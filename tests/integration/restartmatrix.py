"""The node agent killed in the middle of every step of a capture and of a wake (issue 8's fault
matrix, first row), wherever the worker runs: SIGKILL (no cleanup of any kind) while that step is in
flight, a new agent started for the node, and the worker consistent afterwards, in its real
container on the real node (node/test_agent_restart.py runs every row).

Each row holds one step in flight by a fault that changes no product behaviour:

- a request to the entrypoint (quiesce, wake, settle-*): the pod's dynsnap-entrypoint is stopped
  (SIGSTOP) so it cannot acknowledge; the agent is killed once it has written the request; the
  entrypoint is let go (SIGCONT) and applies it; then the new agent starts;
- a dynsnap-cuda call (save, resume): the stub driver hangs the checkpoint (or restore) call; the
  agent is killed while its helper holds the locks; the helper runs in its own session and lives
  on, so the new agent must wait for it. In the ``-helper-killed`` rows the helper dies too (a
  crash could do that; a reboot of the agent pod would not): the new agent finds the GPU
  processes locked (or still checkpointed) with nothing running for them;
- a CRIU dump or restore: the agent's ``--criu`` is the real CRIU with ``fake_slow_criu`` loaded,
  which holds its main() back (``dump``, ``restore``) or its exit (``seal``, ``restore-exited``:
  the dump or restore is complete, the agent never learnt it).

Every row ends with the same checks (:func:`run_row`): the WorkerSnapshot says what happened (state,
conditions, the capture or wake record with the steps each agent did, no error left), no GPU process
locked or checkpointed unless the worker is asleep, no staging directory left and the sealed capture
the one restored, no helper left running, the pod's identity intact (UID, IP, DWM UID, instance id,
its container never restarted) and, once awake and back in serving, a request pinned to the worker
answered by it.

Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import agentenv
from agentenv import AgentProc, StubDriver, condition, eventually, state_is, ws_body
from restart_faults import (
    SlowCriu,
    control_dir,
    entrypoint_stopped,
    ep_info,
    helpers,
    kill_agent,
    pending_request,
    unhang,
    wait_ack,
    wait_request,
)

from dynsnap.k8s.client import Kube, Obj
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.models.dynamo import instance_id_from_dwm
from dynsnap.testenv.dynsnap_parts import PodOnNode

RUNNING, LOCKED, CHECKPOINTED, FAILED = 0, 1, 2, 3  # stub_libcuda's state file
# A save or resume held this long gives the new agent time to start and find the helper still at
# work (it does in about 2 s here, on a loaded machine more); calls still to come (another GPU
# process) are let go once it has.
HELPER_HANG_MS = 15000
# A checkpoint or restore held this long lets the test stop the entrypoint while it runs, before the
# agent can ask for the settle that follows.
SETTLE_HANG_MS = 3000
# What the stub driver frees per GPU process checkpointed in a snapshot capture, a different amount
# in each row: the capture's manifest must record this capture's (the wake checks the GPU has it
# again before restoring), whichever agent ran the save, never one left from an earlier capture.
FREED_UNIT = 1 << 28


@dataclass(frozen=True)
class Row:
    op: str  # capture | wake
    step: str  # the step in flight when the agent is killed
    tier: str

    def __str__(self) -> str:
        return f"{self.op}-{self.step}-{self.tier}"

    @property
    def snapshot(self) -> bool:
        return self.tier == "snapshot"


BOTH = ("suspend", "snapshot")
ROWS = [
    *(Row("capture", s, t) for s in ("quiesce", "save", "save-helper-killed") for t in BOTH),
    Row("capture", "settle-suspended", "suspend"),
    Row("capture", "dump", "snapshot"),
    Row("capture", "seal", "snapshot"),
    Row("capture", "settle-snapshotted", "snapshot"),
    *(Row("wake", "wake", t) for t in BOTH),
    Row("wake", "restore", "snapshot"),
    Row("wake", "restore-exited", "snapshot"),
    *(Row("wake", s, t) for s in ("resume", "resume-helper-killed", "settle-active") for t in BOTH),
]


def expected_steps(row: Row) -> list[str]:
    """The steps the capture or wake record lists once settled: those the killed agent recorded
    before the step in flight, then those the new agent did (``wait-helper`` once, however long
    it waited). A step whose request the entrypoint applied after the agent died is the
    entrypoint's doing; it is not listed."""
    snap = row.snapshot
    if row.op == "capture":
        rest = ["dump", "seal", "settle-snapshotted"] if snap else ["settle-suspended"]
        return {
            "quiesce": ["save", *rest],
            "save": ["quiesce", "wait-helper", *rest],
            "save-helper-killed": ["quiesce", "gpu-rollback", "save", *rest],
            "settle-suspended": ["quiesce", "save"],
            "dump": ["quiesce", "save", "wait-helper", "seal", "settle-snapshotted"],
            "seal": ["quiesce", "save", "wait-helper", "seal", "settle-snapshotted"],
            "settle-snapshotted": ["quiesce", "save", "dump", "seal"],
        }[row.step]
    restored = ["wake", "restore"] if snap else ["wake"]
    return {
        "wake": [*restored[1:], "resume", "settle-active"],
        "restore": ["wake", "wait-helper", "resume", "settle-active"],
        "restore-exited": ["wake", "wait-helper", "resume", "settle-active"],
        "resume": [*restored, "wait-helper", "settle-active"],
        "resume-helper-killed": [*restored, "resume", "settle-active"],
        # the entrypoint applied `active`; a snapshot's images are then deleted under the same record
        "settle-active": [*restored, "resume", *(["cleanup"] if snap else [])],
    }[row.step]


@dataclass(frozen=True)
class Container:
    """The worker's container as the kernel shows it now: its entrypoint's host pid (PID 1 of its pid
    namespace) and that namespace's inode."""

    pid1: int
    pidns: int


class Rig(Protocol):
    """Where the rows run: one worker, the one agent of its node (an AgentProc, killed and started again
    in every row), the stub driver its GPU processes map, and the slow CRIU's control directory."""

    api: Kube
    pod: PodOnNode
    agent: AgentProc
    driver: StubDriver
    criu: SlowCriu
    wid: int  # the worker's Dynamo instance id

    @property
    def images_root(self) -> Path: ...
    def container(self) -> Container: ...
    async def serving(self, on: bool) -> None:
        """Play the controller: the worker out of serving (or back in) by its gate, as kubelet then says."""
    async def restarts(self) -> int:
        """kubelet's restartCount of the worker's container."""
    async def answered(self, prompt: str) -> None:
        """A request pinned to the worker, through the frontend, answered by it."""


async def set_desired(rig: Rig, desired: str) -> None:
    await agentenv.set_desired(rig.api, rig.pod, desired)


async def wait_ws(rig: Rig, what: str, check: Callable[[Obj], bool], *, timeout: float = 90) -> Obj:
    return await agentenv.wait_ws(rig.api, rig.pod, what, check, timeout=timeout, agents=[rig.agent])


# -- what the node shows ------------------------------------------------------------------------

async def identity(rig: Rig) -> dict[str, object]:
    p = await rig.api.get(R.PODS, rig.pod.name, namespace=rig.pod.namespace)
    dwm = await rig.api.get(R.DWMS, rig.pod.name, namespace=rig.pod.namespace)
    return {"uid": p["metadata"]["uid"], "ip": p["status"]["podIP"], "dwm": dwm["metadata"]["uid"],
            "instance": instance_id_from_dwm(dwm)}


def driver_states(rig: Rig) -> dict[int, int]:
    """The stub driver's state of every process of the worker's pid namespace, by in-namespace pid
    (the stub keys them by pid namespace and pid in it: ``nskey 0``)."""
    ns = rig.container().pidns
    return {key & ((1 << 22) - 1): st for key, st in rig.driver.states().items() if key >> 22 == ns}


def gpu_pids(rig: Rig) -> dict[int, int]:
    """Host pid -> in-namespace pid of the worker's live processes that map the (stub) CUDA driver."""
    c = rig.container()
    ns = f"pid:[{c.pidns}]"
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/ns/pid") != ns or int(pid) == c.pid1:
                continue
            if "libcuda.so" not in Path(f"/proc/{pid}/maps").read_text():
                continue
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        out[int(pid)] = int(next(line.split()[-1] for line in status.splitlines() if line.startswith("NSpid:")))
    return out


def gpu_ns_pids(rig: Rig) -> list[int]:
    """In-namespace pids of the worker's live processes that map the (stub) CUDA driver."""
    return sorted(gpu_pids(rig).values())


def running_helpers(rig: Rig) -> list[str]:
    c = rig.container()
    return [f"{h.pid} {h.name} {h.op}" for h in helpers(c.pidns, c.pid1)]


def pod_images(rig: Rig) -> list[Path]:
    return sorted(rig.images_root.glob(f"*_{rig.pod.uid}/*"))


def stagings(rig: Rig) -> list[Path]:
    return [p for p in pod_images(rig) if p.name.startswith(P.STAGING_PREFIX)]


def record(ws: Obj, op: str) -> Obj:
    rec: Obj = ws["status"]["lastCapture" if op == "capture" else "lastWake"]
    return rec


def step_names(rec: Obj) -> list[str]:
    return [s["name"] for s in rec["steps"]]


async def events(rig: Rig, ws: Obj, reason: str) -> list[Obj]:
    """Events with ``reason`` about this WorkerSnapshot (by UID: earlier rows' objects had the same name)."""
    evs = (await rig.api.list(R.EVENTS, namespace=ws["metadata"]["namespace"])).get("items") or []
    return [e for e in evs if (e.get("regarding") or {}).get("uid") == ws["metadata"]["uid"]
            and e.get("reason") == reason]


def no_error_left(ws: Obj) -> None:
    st = ws["status"]
    assert st.get("lastError") is None, st.get("lastError")
    assert not st.get("consecutiveFailures")
    degraded = condition(ws, "Degraded")
    assert degraded is not None and degraded["status"] == "False", degraded


def check_asleep(rig: Rig, ws: Obj, tier: str) -> None:
    """Asleep and settled: the capture record closed and ok, every GPU process checkpointed (none
    locked), and for a snapshot one sealed capture on disk, no staging directory."""
    cap = record(ws, "capture")
    assert cap["ok"] is True and cap.get("finished") and cap["tier"] == tier, cap
    no_error_left(ws)
    gpu = sorted(p["ns"] for p in cap["pids"] if p["gpu"])
    assert gpu, f"the capture record names the worker's GPU processes: {cap}"
    states = driver_states(rig)
    assert {states.get(p) for p in gpu} == {CHECKPOINTED}, f"GPU pids {gpu}, driver states {states}"
    assert LOCKED not in states.values() and FAILED not in states.values(), states
    info = ep_info(rig.container().pid1)
    if tier == "suspend":
        assert info["state"] == "suspended" and info["worker_alive"] is True
        assert gpu_ns_pids(rig) == gpu, "the checkpointed processes are the worker's GPU processes, alive"
    else:
        assert info["state"] == "snapshotted" and info["worker_alive"] is False
        image = Path(ws["status"]["image"]["path"])
        assert image.name == cap["id"] and (image / P.MANIFEST_FILE).is_file()
        assert pod_images(rig) == [image], f"one sealed capture and nothing else: {pod_images(rig)}"
        assert {f"core-{p}.img" for p in gpu} <= set(os.listdir(image))
    assert running_helpers(rig) == []


async def check_awake(rig: Rig, ws: Obj) -> None:
    """Active and settled: no GPU process locked or checkpointed, no image or helper left."""
    no_error_left(ws)
    info = ep_info(rig.container().pid1)
    assert info["state"] == "active" and info["worker_alive"] is True
    states = driver_states(rig)
    assert states and set(states.values()) == {RUNNING}, states
    assert gpu_ns_pids(rig), "the worker's GPU processes run"

    async def cleaned() -> bool:
        return pod_images(rig) == []
    await eventually("the woken worker's images deleted (they hold its secrets)", cleaned, timeout=30)
    assert running_helpers(rig) == []


# -- the faults: each triggers the operation, kills the agent with the step in flight, starts a new one

Fault = Callable[[Rig, Row], Awaitable[None]]


def settled(state: str, op: str) -> Callable[[Obj], bool]:
    """At ``state``, with nothing in progress and the record of the last ``op`` closed."""
    at_state = state_is(state, suspended=state == "Suspended")

    def check(ws: Obj) -> bool:
        progressing = condition(ws, "Progressing")
        rec = (ws.get("status") or {}).get("lastCapture" if op == "capture" else "lastWake") or {}
        return at_state(ws) and progressing is not None and progressing["status"] == "False" \
            and bool(rec.get("finished"))
    return check


def _want(row: Row) -> str:
    return "Suspended" if row.op == "capture" else "Active"


async def _ws_steps(rig: Rig, op: str, name: str) -> None:
    """Wait until the new agent's record shows ``name`` (e.g. it found the helper and waits)."""
    await wait_ws(rig, f"{name} in the {op} record",
                  lambda ws: name in step_names((ws.get("status") or {}).get(
                      "lastCapture" if op == "capture" else "lastWake") or {"steps": []}))


async def killed_at_request(rig: Rig, row: Row) -> None:
    """quiesce / wake: the entrypoint cannot acknowledge; the agent dies with its request unanswered."""
    pid1 = rig.container().pid1
    state = "suspending" if row.op == "capture" else "restoring"
    with entrypoint_stopped(pid1) as acked:
        await set_desired(rig, _want(row))
        seq = await wait_request(pid1, acked, state)
        await kill_agent(rig.agent)
        assert int(ep_info(pid1)["request_seq"] or 0) == acked, "the request was still unanswered"
    await wait_ack(pid1, seq, state)  # let go, the entrypoint applies the request the dead agent left
    await rig.agent.start()


def _started(criu: SlowCriu, op: str, *, event: str | None = None) -> Callable[[], Awaitable[bool]]:
    n = len(criu.runs(op))

    async def check() -> bool:
        runs = criu.runs(op)[n:]
        return bool(runs) and (event is None or event in runs[-1]["events"])
    return check


def _helper(rig: Rig, op: str) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        c = rig.container()
        return any(h.op == op for h in helpers(c.pidns, c.pid1))
    return check


async def killed_at_settle(rig: Rig, row: Row) -> None:
    """settle-*: the entrypoint is stopped while the step before the settle runs (held by the stub
    driver or by the slow CRIU), so the settle request the agent writes next stays unanswered."""
    pid1 = rig.container().pid1
    state = {"settle-suspended": "suspended", "settle-snapshotted": "snapshotted",
             "settle-active": "active"}[row.step]
    if row.step == "settle-snapshotted":
        dump_started = _started(rig.criu, "dump")
        rig.criu.hold("dump", "before")
    else:
        fn = "cuCheckpointProcessCheckpoint" if row.op == "capture" else "cuCheckpointProcessRestore"
        rig.driver.control(f"hang {fn} * {SETTLE_HANG_MS}")
    await set_desired(rig, _want(row))
    if row.step == "settle-snapshotted":
        await eventually("the dump started", dump_started, timeout=60)
    else:
        op = "save" if row.op == "capture" else "resume"
        await eventually(f"the {op} helper running", _helper(rig, op), timeout=60)
    with entrypoint_stopped(pid1) as acked:
        assert ep_info(pid1)["state"] == ("restoring" if row.op == "wake" else "suspending"), \
            "stopped before the step ahead of the settle was over"
        unhang(rig.driver)
        rig.criu.release()
        seq = await wait_request(pid1, acked, state)
        await kill_agent(rig.agent)
        assert int(ep_info(pid1)["request_seq"] or 0) == acked, "the settle request was still unanswered"
    await wait_ack(pid1, seq, state)
    await rig.agent.start()


async def killed_in_helper(rig: Rig, row: Row) -> None:
    """save / resume: the driver holds the call; the agent dies while its dynsnap-cuda is at work.
    In the -helper-killed rows the helper is killed too, leaving the GPU processes mid-way."""
    capture = row.op == "capture"
    fn = "cuCheckpointProcessCheckpoint" if capture else "cuCheckpointProcessRestore"
    op = "save" if capture else "resume"
    calls = len(rig.driver.calls())
    rig.driver.control(f"hang {fn} * {HELPER_HANG_MS}")
    await set_desired(rig, _want(row))
    await eventually(f"the {op} helper running", _helper(rig, op), timeout=60)
    if capture:  # the save has locked every GPU process and is checkpointing the first
        want = {f"cuCheckpointProcessLock pid={host}" for host in gpu_pids(rig)}

        async def locked() -> bool:
            done = {c.split(" timeout=")[0] for c in rig.driver.calls()[calls:] if c.endswith(" rc=0")}
            return want <= done
        await eventually("every GPU process's lock in the driver's call log", locked)
    await kill_agent(rig.agent)
    c = rig.container()
    alive = [h for h in helpers(c.pidns, c.pid1) if h.op == op]
    assert alive, "the helper outlives the agent (it runs in its own session)"
    if row.step.endswith("-helper-killed"):
        for h in alive:
            os.kill(h.pid, signal.SIGKILL)

        async def gone() -> bool:
            return not helpers(c.pidns, c.pid1)
        await eventually("the helper gone", gone)
        unhang(rig.driver)
        left = set(driver_states(rig).values())
        assert left == ({LOCKED} if capture else {CHECKPOINTED}), \
            f"the helper died mid-way: GPU processes left {left}"
        await rig.agent.start()
        return
    await rig.agent.start()
    await _ws_steps(rig, row.op, "wait-helper")  # the new agent found the helper and waits
    unhang(rig.driver)  # the calls still to come (other GPU processes) go through at once


async def killed_in_criu(rig: Rig, row: Row) -> None:
    """dump / restore: CRIU held before it starts; seal / restore-exited: CRIU finished, its exit held."""
    criu = rig.criu
    op = "dump" if row.op == "capture" else "restore"
    before = row.step in ("dump", "restore")
    criu.hold(op, "before" if before else "after")
    started = _started(criu, op, event=None if before else "exited 0")
    await set_desired(rig, _want(row))
    await eventually(f"CRIU {op} {'started' if before else 'exited'}", started, timeout=60)
    await kill_agent(rig.agent)
    run = criu.runs(op)[-1]
    c = rig.container()
    assert any(h.op == "criu" and h.ns_pid == run["pid"] for h in helpers(c.pidns, c.pid1)), \
        "the CRIU the dead agent started still runs"
    if before:
        assert "exec" not in run["events"], "the real CRIU had not started when the agent died"
    else:
        assert run["events"] == ["exited 0"], f"the real CRIU had finished when the agent died: {run}"
    await rig.agent.start()
    await _ws_steps(rig, row.op, "wait-helper")
    criu.release()


FAULTS: dict[str, Fault] = {
    "quiesce": killed_at_request, "wake": killed_at_request,
    "save": killed_in_helper, "save-helper-killed": killed_in_helper,
    "resume": killed_in_helper, "resume-helper-killed": killed_in_helper,
    "dump": killed_in_criu, "seal": killed_in_criu, "restore": killed_in_criu, "restore-exited": killed_in_criu,
    "settle-suspended": killed_at_settle, "settle-snapshotted": killed_at_settle, "settle-active": killed_at_settle,
}


async def _why(rig: Rig) -> None:
    """On a failed row: the stub driver's last calls and the WorkerSnapshot's conditions (pytest
    shows what a failed test printed), where a record alone does not say why a step was chosen."""
    print("stub driver, last calls:", *rig.driver.calls()[-30:], sep="\n  ")
    with contextlib.suppress(Exception):
        ws = await rig.api.get(R.WORKER_SNAPSHOTS, rig.pod.name, namespace=rig.pod.namespace)
        print("conditions:", *((ws.get("status") or {}).get("conditions") or []), sep="\n  ")


async def run_row(rig: Rig, row: Row) -> None:
    """One row, from a fresh WorkerSnapshot (tier ``row.tier``) of the awake, serving worker to the same
    worker awake and serving again."""
    api, pod = rig.api, rig.pod
    await api.create(R.WORKER_SNAPSHOTS, ws_body(pod, tier=row.tier))
    pid1 = rig.container().pid1
    try:
        await wait_ws(rig, "Accepted, Active", state_is("Active"))
        before = await identity(rig)
        started, restarts = ep_info(pid1)["started"], await rig.restarts()
        criu = rig.criu
        dumps, restores = len(criu.runs("dump")), len(criu.runs("restore"))
        await rig.serving(False)
        freed = 0
        if row.op == "capture" and row.snapshot:
            per = FREED_UNIT * (ROWS.index(row) + 1)
            for host in gpu_pids(rig):
                rig.driver.control(f"mem {host} 0 {per}")
            freed = per * len(gpu_pids(rig))
        if row.op == "wake":
            await set_desired(rig, "Suspended")
            ws = await wait_ws(rig, "Suspended", settled("Suspended", "capture"))
            check_asleep(rig, ws, row.tier)

        await FAULTS[row.step](rig, row)

        if row.op == "capture":
            ws = await wait_ws(rig, "Suspended, settled", settled("Suspended", "capture"))
            assert step_names(record(ws, "capture")) == expected_steps(row), record(ws, "capture")
            check_asleep(rig, ws, row.tier)
            if freed:
                manifest = json.loads((Path(ws["status"]["image"]["path"]) / P.MANIFEST_FILE).read_text())
                assert list(manifest["gpuFreed"].values()) == [freed], manifest["gpuFreed"]
            if row.step == "save-helper-killed":
                # The rollback is named: Degraded said why while it happened, and the settled capture
                # says what it recovered from; a Warning Event records it.
                degraded = condition(ws, "Degraded")
                assert degraded is not None and degraded["message"].startswith(
                    f"recovered from {P.Reason.INTERRUPTED.value}: GPU processes found"), degraded
                assert "locked" in degraded["message"], degraded
                assert await events(rig, ws, P.Reason.INTERRUPTED.value)
            asleep = ws
            await set_desired(rig, "Active")
            ws = await wait_ws(rig, "Active, settled", settled("Active", "wake"))
            assert record(ws, "wake")["ok"] is True
        else:
            asleep = ws
            ws = await wait_ws(rig, "Active, settled", settled("Active", "wake"))
            wake = record(ws, "wake")
            assert wake["ok"] is True and wake.get("finished") and wake["tier"] == row.tier, wake
            assert step_names(wake) == expected_steps(row), wake
        await check_awake(rig, ws)

        if row.snapshot:  # one dump, sealed, and that sealed capture (never staging) restored
            image = Path(asleep["status"]["image"]["path"])
            dumped = criu.runs("dump")[dumps:]
            restored = criu.runs("restore")[restores:]
            assert [SlowCriu.images_dir(r) for r in dumped] == [str(image.parent / (P.STAGING_PREFIX + image.name))]
            assert [SlowCriu.images_dir(r) for r in restored] == [str(image)], restored
        assert stagings(rig) == []
        assert pending_request(pid1) is not None and control_dir(pid1).is_dir()

        await rig.serving(True)
        assert await identity(rig) == before
        assert rig.container().pid1 == pid1 and ep_info(pid1)["started"] == started, \
            "the container never restarted (the same entrypoint, started when it was)"
        assert await rig.restarts() == restarts
        await rig.answered(f"after {row}")
    except BaseException:
        await _why(rig)
        raise
    finally:
        rig.driver.clear_faults()
        rig.criu.reset()
        os.kill(pid1, signal.SIGCONT)
        if rig.agent.proc is None:
            await rig.agent.start()
        await api.delete(R.WORKER_SNAPSHOTS, pod.name, namespace=pod.namespace)
