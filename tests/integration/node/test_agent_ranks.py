"""Several GPU processes on NCCL in one worker, on the real node (kubelet, containerd, runc; dynsnap
installed by ``helm install``: realnodeenv.py), moved from the sandbox suite test_agent_refusals.py.

The worker of examples/dgd/agg.yaml is started by a launcher (a shell that starts a second process as
its child, then execs the mocker in its own place: a second rank spawned by an engine), and both map
the stub driver and ``libnccl.so.2`` (fake_nccl, refusalenv.build_fake_nccl: an empty library of that
name, from a read-only hostPath volume of the test's, preloaded; the agent tells a rank only by what
it maps). Asked to sleep by the override on its pod (as ``dynsnap suspend``):

- without the settings the driver needs to restore ranks on NCCL (``NCCL_P2P_DISABLE=1``,
  ``NCCL_SHM_DISABLE=1``, ``NCCL_CUMEM_ENABLE=0``) the capture is refused before any lock
  (``UnsafeMultiGpu``, at the quiesce step, each setting named with its value and the one needed),
  no driver call changes a state, no image is written, and the controller puts the worker back into
  serving at once (a permanent refusal: remembered, ``CaptureRefused``), answering pinned requests,
  the same container;
- with the settings, both ranks are checkpointed by the one save, and the worker is woken in place
  (both running in the driver again), verified, the same two processes in the same container.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from controllerenv import asleep, cond, events_for, verified_after
from realnodecycle import back_after_refusal, override, pinned, proven, same_pod, wait_ws
from realnodeenv import TWO_GPU_PROCESSES, WORKER_COMPONENT, Env, deployed, host_dir_mounted, launched_by
from realnodefacts import KubeletFacts, container_procs, kubelet_facts, stub_state
from refusalenv import NCCL_SAFE, build_fake_nccl, maps, refused_or_capturing, state_changes_since

from dynsnap.k8s.client import Obj
from dynsnap.testenv import chart_node
from dynsnap.testenv.real_graph import NodePod

pytestmark = pytest.mark.cluster

RUNNING, CHECKPOINTED = 0, 2  # the stub driver's states of a process
NCCL_VOLUME = "fake-nccl"


@pytest.fixture(scope="module")
def nccl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    lib = build_fake_nccl(tmp_path_factory.mktemp("fake-nccl"))
    lib.parent.chmod(0o755)  # the worker runs as the image's user: the directory must be readable
    return lib


def ranks_graph(env: Env, name: str, nccl: Path, *, safe: bool) -> Obj:
    """examples/dgd/agg.yaml (two workers, tier suspend, idle-after as shipped: only the override acts)
    whose worker is started by the launcher with fake_nccl preloaded, with the NCCL settings or without."""
    body = launched_by(chart_node.example_body(env, name=name, worker_replicas=2,
                                               policy={"dynsnap.io/tier": "suspend"}), TWO_GPU_PROCESSES)
    main = host_dir_mounted(body, NCCL_VOLUME, nccl.parent)
    env_vars: list[Obj] = main.setdefault("env", [])
    preload = next(e for e in env_vars if e["name"] == "LD_PRELOAD")  # the stub driver's (stub_gpu_stack)
    preload["value"] = f"{preload['value']} {nccl}"
    if safe:
        env_vars.extend({"name": k, "value": v} for k, v in NCCL_SAFE.items())
    return body


def ranks(w: NodePod, container_id: str) -> list[int]:
    """The worker tree's root and its child, both mapping the driver and NCCL (precondition): host pids."""
    procs = container_procs(w.uid, container_id)
    both = sorted(p for p in procs.tree if {"libcuda.so.1", "libnccl.so.2"} <= maps(p))
    assert len(both) == 2 and procs.root in both, (both, procs)
    child = next(p for p in both if p != procs.root)
    ppid = next(int(line.split()[1]) for line in Path(f"/proc/{child}/status").read_text().splitlines()
                if line.startswith("PPid:"))
    assert ppid == procs.root, "the second GPU process is the worker's child"
    return both


def images_of(env: Env, w: NodePod) -> list[str]:
    images = env.paths.images
    return [p.name for p in images.iterdir() if w.uid in p.name] if images.is_dir() else []


@dataclass
class Ranked:
    w: NodePod  # the worker asked to sleep (its peer serves)
    first: KubeletFacts  # kubelet's facts of it at the start
    both: list[int]  # its two ranks' host pids
    mark: int  # the stub driver's calls before the override


@contextlib.asynccontextmanager
async def asked_to_sleep(env: Env, name: str, nccl: Path, *, safe: bool) -> AsyncIterator[Ranked]:
    """The graph deployed (torn down after), its second worker's ranks checked, then the override
    ``suspended`` on it."""
    async with deployed(env, ranks_graph(env, name, nccl, safe=safe)) as g:
        w = g.workers(WORKER_COMPONENT)[1]
        first = await kubelet_facts(env.api, w)
        r = Ranked(w, first, ranks(w, first.container_id), len(env.driver.calls()))
        await override(env, w, "suspended")
        yield r


async def test_ranks_on_nccl_without_the_settings_the_driver_needs_are_refused_before_any_lock(
        env: Env, nccl: Path) -> None:
    async with asked_to_sleep(env, "ranks", nccl, safe=False) as r:
        w, first, both, mark = r.w, r.first, r.both, r.mark
        # Refused, or past the point where it should have been (an agent that does not refuse fails here
        # at once, with its status, rather than at the wait's bound).
        ws = await wait_ws(env, w, "refused UnsafeMultiGpu (or capturing)",
                           lambda o: bool(o and refused_or_capturing("UnsafeMultiGpu")(o)), timeout=120)
        assert ws["status"].get("state") not in ("Capturing", "Suspended"), ws["status"]
        ws = await wait_ws(env, w, "back in serving, verified", back_after_refusal("UnsafeMultiGpu"), timeout=120)
        err = ws["status"].get("lastError") or {}
        assert err.get("reason") == "UnsafeMultiGpu" and err.get("step") == "quiesce", ws["status"]
        assert "2 GPU processes use NCCL" in err["message"], err
        for k, v in NCCL_SAFE.items():
            assert f"{k}=(unset)" in err["message"] and f"{k}={v}" in err["message"], err["message"]
        degraded = cond(ws, "Degraded")
        assert degraded is not None and degraded["reason"] == "UnsafeMultiGpu", degraded
        calls = env.driver.calls()[mark:]
        assert not [c for c in calls if c.startswith("cuCheckpointProcessLock")], calls
        assert state_changes_since(env.driver, mark) == []
        assert [stub_state(env.driver, p) for p in both] == [RUNNING, RUNNING]
        assert images_of(env, w) == []
        warned = [e for e in await events_for(env.api, w.namespace, w.name)
                  if e["type"] == "Warning" and e["reason"] == "CaptureRefused"]
        assert warned and "UnsafeMultiGpu" in warned[-1]["note"], warned
        await pinned(env, w, prompt="still yours")
        await same_pod(env, w, first)
        assert ranks(w, first.container_id) == both, "the same two processes"


async def test_ranks_on_nccl_with_the_settings_are_captured_and_woken_in_place(
        env: Env, nccl: Path) -> None:
    async with asked_to_sleep(env, "safe-ranks", nccl, safe=True) as r:
        w, first, both, mark = r.w, r.first, r.both, r.mark
        slept = await wait_ws(env, w, "asleep (suspend)", asleep, timeout=180)
        cap = slept["status"]["lastCapture"]
        assert cap["ok"] is True and [s["name"] for s in cap["steps"]] == ["quiesce", "save", "settle-suspended"]
        assert sorted(p["host"] for p in cap["pids"] if p["gpu"]) == both, cap["pids"]
        checkpointed = {c for c in env.driver.calls()[mark:]
                        if c.startswith("cuCheckpointProcessCheckpoint ") and c.endswith(" rc=0")}
        assert len(checkpointed) == 2, f"both ranks checkpointed by the one save: {checkpointed}"
        assert [stub_state(env.driver, p) for p in both] == [CHECKPOINTED, CHECKPOINTED]
        before = (slept["status"].get("lastWake") or {}).get("id")
        await override(env, w, "active")
        woken = await wait_ws(env, w, "woken and verified", verified_after(before), timeout=180)
        await proven(env, w, woken, "suspend")
        assert [s["name"] for s in woken["status"]["lastWake"]["steps"]] == ["wake", "resume", "settle-active"]
        assert [stub_state(env.driver, p) for p in both] == [RUNNING, RUNNING]
        await pinned(env, w, prompt="after the wake")
        await same_pod(env, w, first)
        assert ranks(w, first.container_id) == both, "the same two processes, woken in place"
