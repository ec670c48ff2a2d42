"""A snapshot never leaves a GPU process of the container out (dynsnap/agent): the preflight refuses a
container whose GPU process is outside the worker's tree before anything changes, for good
(``GpuProcessOutsideTree``; ``worker.gpu_outside_tree``, ``capture_steps.snapshot_preflight``), and the
seal's completeness guard rejects a dump whose images lack a GPU process the capture recorded (a process
that left the tree between the preflight and the dump), naming it, the staging directory marked
rejected, never sealed.

The processes are ProcStatus records as the agent reads them from /proc; the staging directory holds the
files the dump step writes and core images named as CRIU names them. The preflight's refusal of a real
worker's daemon, under the chart's agent on the real node, is node/test_agent_faults.py's.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from dynsnap.agent import capture_steps as CS
from dynsnap.agent import worker as W
from dynsnap.agent.images import ImageStore
from dynsnap.agent.steps import PIDS_FILE, StepCall, StepFailure
from dynsnap.models.ids import HostPid, NsPid, PodUID
from dynsnap.models.protocol import PERMANENT_REFUSALS, Reason, Tier
from dynsnap.runtime.procfs import ProcStatus

EP = HostPid(100)  # the entrypoint, the container's PID 1


def proc(pid: int, ppid: int, ns: int, name: str = "python3") -> ProcStatus:
    return ProcStatus(pid=HostPid(pid), ppid=HostPid(ppid), nspid=(pid, ns), state="S", name=name)


def container(procs: list[ProcStatus], gpu: list[int], *, worker_pid: int = 10000) -> W.WorkerProcs:
    return W.WorkerProcs(pod_uid=PodUID("u"), entrypoint=EP, pidns=1, control_dir="/run/dynsnap",
                         info={"worker_pid": worker_pid, "pid_reserved": True, "seccomp": "on"},
                         procs=tuple(procs), gpu=tuple(HostPid(p) for p in gpu))


WORKER = proc(501, 100, 10000)  # the worker's root, the entrypoint's child at worker_pid
RANK = proc(502, 501, 10001)  # its child, a second GPU process
GRANDCHILD = proc(503, 502, 10002)  # a GPU process two generations down
DAEMON = proc(504, 100, 10003, "sleep")  # started by a launcher, reparented to the entrypoint


def test_every_gpu_process_in_the_tree_leaves_none_outside() -> None:
    assert W.gpu_outside_tree(container([WORKER, RANK, GRANDCHILD], [501, 502, 503])) == []


def test_a_gpu_process_reparented_to_the_entrypoint_is_outside() -> None:
    assert W.gpu_outside_tree(container([WORKER, RANK, DAEMON], [501, 504])) == [NsPid(10003)]


def test_a_process_outside_the_tree_not_on_the_gpu_does_not_count() -> None:
    assert W.gpu_outside_tree(container([WORKER, DAEMON], [501])) == []


def test_a_squatter_at_the_workers_pid_is_not_its_root() -> None:
    """Only the entrypoint's child at worker_pid roots the tree (worker.WorkerProcs.worker_alive): with
    no worker, nothing is said here (the dump step reports the missing worker)."""
    squatter = proc(501, 77, 10000)
    assert W.gpu_outside_tree(container([squatter, DAEMON], [501, 504])) == []


def test_the_preflight_refuses_it_before_any_change() -> None:
    ex = cast(Any, SimpleNamespace(proc=Path("/nonexistent-proc")))  # no descriptors: no io_uring found
    with pytest.raises(StepFailure) as e:
        CS.snapshot_preflight(ex, container([WORKER, DAEMON], [501, 504]))
    assert e.value.reason == Reason.GPU_PROCESS_OUTSIDE_TREE and e.value.changed is False
    assert e.value.reason in PERMANENT_REFUSALS, "it lasts as long as the daemon: the controller does not wait it out"
    assert "GPU processes outside the worker's tree (in-namespace pids): [10003]" in e.value.message
    assert "tier suspend" in e.value.message


def test_the_seal_rejects_a_dump_missing_a_recorded_gpu_process(tmp_path: Path) -> None:
    images = ImageStore(tmp_path / "images", budget_bytes=1 << 30)
    staging = images.staging("ns", "pod", PodUID("u"), "c1")
    (staging / PIDS_FILE).write_text(json.dumps({"root": 10000, "started": "t", "pids": [
        {"host": 501, "ns": 10000, "gpu": True}, {"host": 502, "ns": 10001, "gpu": True},
        {"host": 505, "ns": 10004, "gpu": False}]}))
    (staging / "core-10000.img").write_bytes(b"x")  # 10001 left out of the dump
    call = StepCall(subject=cast(Any, SimpleNamespace(uid="u", namespace="ns", pod="pod")),
                    obs=cast(Any, SimpleNamespace(staging=staging)), tier=Tier.SNAPSHOT)
    with pytest.raises(StepFailure) as e:
        asyncio.run(CS.seal(cast(Any, SimpleNamespace(images=images)), call))
    assert e.value.reason == Reason.INCOMPLETE_CAPTURE
    assert "GPU processes missing from the images (in-namespace pids): [10001]" in e.value.message
    assert ImageStore.rejected(staging) is not None and staging.is_dir(), "rejected, never sealed"
    assert images.captures(PodUID("u")) == []
